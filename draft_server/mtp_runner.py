"""The draft's runner for chained multi-layer MTP (Step-3.5's): N MTP layers, one per draft step.

Terms. A request's committed tokens are x[0..n]; the target has sent its hidden rows h_T[p] for the n committed
positions p < n (P = n - 1 is the last one; x[n] has no target KV yet). h_k[p] is what MTP layer k hands on at
position p, its stream (pre_norm flow) or its shared_head.norm output (post_norm flow; tandem.models.mtp), and
h_{-1} = h_T, captured before or after the target's final norm to match.

    layer k at position p consumes (h_{k-1}[p], token x[p+k+1]) and predicts x[p+k+2]     chain mode
                                   (h_T[p],     token x[p+k+1])                          non-chain mode

So layer k runs on committed tokens only up to position n - 1 - k: its committed extent is c_k = max(0, n - k)
positions, and the KV it holds beyond c_k was built from guessed tokens. Draft step j (1-based) is produced by
layer j - 1 at position P:
- ingest: layer 0 runs the new rows; d_1 = argmax of its row P. Every layer k >= 1 truncates its KV back to its
  old committed extent (the KV written at its last k committed positions was built from guesses: the boundary
  pitfall) and runs up to its new extent, fed the rows of layer k - 1 (chain) or of the target (non-chain);
- step j + 1: layer j runs positions c_j..P, whose tokens x[c_j+j+1..n+j] are guesses (the last of d_1..d_j), on
  the hidden rows of layer j - 1 there: its committed rows, then the rows layer j - 1 produced in step j (UPDATED
  between steps: never the stale target state). Its row P predicts d_{j+1}.

Worked example, 3 layers, prompt x0..x4, first token x5 from prefill: rows 0..4, n = 5, P = 4.
    ingest   layer 0 runs 0..4 on (h_T, x1..x5); row 4 predicts d1 = x6
             layer 1 runs 0..3 on (h_0, x2..x5)                       keeps h_0[4] for later (its backlog)
             layer 2 runs 0..2 on (h_1, x3..x5)                       keeps h_1[3]
    step 2   layer 1 runs 4 on (h_0[4], d1); predicts d2 = x7
    step 3   layer 2 runs 3..4 on ([h_1[3], h_1[4] from step 2], [d1, d2]); predicts d3 = x8
The target accepts d1 and corrects d2 to c: x6 = d1, x7 = c; rows 5..6 arrive, n = 7.
    ingest   layer 0 runs 5..6 on (h_T, x6, x7)
             layer 1 truncates to 4 and runs 4..5 on ([h_0[4] kept, h_0[5]], x6, x7)     keeps h_0[6]
             layer 2 truncates to 3 (its KV at 3..4 held the guess d2) and runs 3..4 on ([h_1[3] kept, h_1[4]],
             x6, x7)                                                                     keeps h_1[5]
Each request keeps per layer k a backlog: the committed input rows of layer k it has not consumed yet, positions
c_k up to c_{k-1} (chain) or up to n (non-chain). That is all the next round needs, so rows must continue at
position n (or restart at 0); resending earlier rows is refused.

transformers' MTPCandidateGenerator (`generate(use_mtp=True)`, one round per verification, k = N) runs every layer
over the same rows with the same tokens, keeping the KV of the guessed ones and recomputing the last N rows of
every layer when fewer than N - 1 drafts were accepted: KV of the same inputs, so the same drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draft_server.prefixes import DraftPrefixes
from draft_server.runner import DraftRequestError, ProposeInput
from draft_server.shaping import shape_logits
from tandem.layers.kv_cache import OutOfKVBlocks, PagedKVCache, SequenceKV
from tandem.layers.matmul import prepack
from tandem.models.mtp import HiddenFlow, MTPModel
from tandem.sampling.processing import Shaping
from tandem.settings import KVCacheSettings


@dataclass
class MTPRequest:
    layers: list[SequenceKV]  # one KV sequence per MTP layer, all in the runner's one pool
    backlog: list[torch.Tensor]  # per layer k: [rows, hidden] committed input rows from position c_k on, not consumed
    committed: int = 0  # n: positions with target rows

    def extent(self, layer: int) -> int:
        """c_k: positions of this layer whose tokens are all committed."""
        return max(0, self.committed - layer)


@dataclass(frozen=True)
class LayerWork:
    """One request's share of one packed forward of an MTP layer: rows appended at the sequence's end."""

    kv: SequenceKV
    token_ids: Sequence[int]  # [rows]
    hidden: torch.Tensor  # [rows, hidden]


class MTPRunner:
    def __init__(self, model: MTPModel, cache: KVCacheSettings, *, chain: bool, flow: HiddenFlow | None = None) -> None:
        """chain: layer k >= 1 consumes layer k - 1's output (Step-3.5); otherwise every layer the target's hidden.
        flow: what a layer hands on, its stream or its normed output; None: the family's default (its authors')."""
        parameter = next(model.parameters())
        layout = model.config.cache_layout
        self.model = model
        prepack(model)
        self.chain = chain
        self.flow = model.config.family.default_flow if flow is None else flow
        self.cache = PagedKVCache.for_layout(1, layout, cache, parameter.dtype, parameter.device)
        self.requests: dict[str, MTPRequest] = {}
        self.prefixes: DraftPrefixes | None = None  # keeps no prefix cache (draft_server.prefixes)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_mtp_layers

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        """Ingests each request's rows, then drafts num_steps tokens per request; batched across requests."""
        # Check every item before changing any state, so that a refused batch leaves the runner as it was.
        for item in inputs:
            self._check(item)
        self._check_blocks(inputs)
        requests = [self._start(item) for item in inputs]
        first_tokens = self._ingest(requests, inputs)
        return self._draft(requests, inputs, first_tokens)

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                for kv in request.layers:
                    self.cache.release(kv)

    def _check(self, item: ProposeInput) -> None:
        name = f"request {item.request_id!r}"
        if item.num_steps > self.num_layers:
            raise DraftRequestError(
                f"{name}: {item.num_steps} draft steps asked, but the MTP draft has {self.num_layers} layers "
                f"(one step per layer)"
            )
        rows = item.rows
        if not rows.next_tokens:
            raise DraftRequestError(f"{name}: no target rows (each round commits at least one position)")
        if rows.features.shape[-1] != self.model.config.hidden_size:
            raise DraftRequestError(
                f"{name}: target rows are {rows.features.shape[-1]} wide, the MTP layers take one hidden state of "
                f"{self.model.config.hidden_size}"
            )
        held = self.requests[item.request_id].committed if item.request_id in self.requests else 0
        if rows.start_position > held:
            raise DraftRequestError(
                f"{name}: rows start at position {rows.start_position} but the draft holds positions up to {held}"
            )
        if 0 < rows.start_position < held:
            raise DraftRequestError(
                f"{name}: rows start at position {rows.start_position}, but the MTP draft continues at position "
                f"{held} or restarts at 0 (it keeps no hidden rows before its layers' boundaries)"
            )

    def _check_blocks(self, inputs: Sequence[ProposeInput]) -> None:
        """Raises OutOfKVBlocks before any change if the batch's KV, ingest and draft steps, does not fit the pool:
        a failure halfway would leave layers and backlogs of a request out of step."""
        block_size = self.cache.block_size
        available, needed = self.cache.num_free_blocks, 0
        for item in inputs:
            request = self.requests.get(item.request_id)
            committed = 0 if request is None or item.rows.start_position == 0 else request.committed
            new_committed = committed + len(item.rows.next_tokens)
            for layer in range(self.num_layers):
                kept = -(-max(0, committed - layer) // block_size)  # blocks left after the truncation in _start
                if request is not None:
                    available += len(request.layers[layer].block_ids) - kept
                # A layer that drafts (1 <= layer < num_steps) writes up to position P; the others stop at c_k.
                final = new_committed if 0 < layer < item.num_steps else max(0, new_committed - layer)
                needed += -(-final // block_size) - kept
        if needed > available:
            raise OutOfKVBlocks(f"KV cache: this batch needs {needed} more blocks, {available} free")

    def _start(self, item: ProposeInput) -> MTPRequest:
        """The request's state with every layer's KV truncated to its committed extent (0 on a restart)."""
        request = self.requests.get(item.request_id)
        if request is None or item.rows.start_position == 0:
            self.release([item.request_id])
            empty = torch.empty(0, self.model.config.hidden_size, dtype=self._dtype, device=self.cache.device)
            layers = [SequenceKV() for _ in range(self.num_layers)]
            request = MTPRequest(layers=layers, backlog=[empty] * self.num_layers)
            self.requests[item.request_id] = request
        for layer, kv in enumerate(request.layers):
            self.cache.truncate(kv, request.extent(layer))
        return request

    def _ingest(self, requests: Sequence[MTPRequest], inputs: Sequence[ProposeInput]) -> list[int]:
        """Runs every layer up to its new committed extent; returns d_1 per request (layer 0's row P)."""
        target_rows = [item.rows.features.to(device=self.cache.device, dtype=self._dtype) for item in inputs]
        produced = target_rows  # per request: the rows the previous layer produced in this ingest
        first_tokens: list[int] = []
        for layer in range(self.num_layers):
            sources = produced if self.chain else target_rows
            work: list[LayerWork] = []
            working: list[int] = []
            for index, (request, item) in enumerate(zip(requests, inputs, strict=True)):
                # Example (layer 2, n = 5 -> 7): positions 3..4 run, with tokens x[p+3] = x6, x7 =
                # next_tokens[0..1], on backlog h_1[3] and the new h_1[4]; the new h_1[5] goes to the backlog.
                n, new_n = request.committed, request.committed + len(item.rows.next_tokens)
                start, end = request.extent(layer), max(0, new_n - layer)
                available = torch.cat([request.backlog[layer], sources[index]])
                request.backlog[layer] = available[end - start :].clone()  # not a view keeping all rows alive
                if end > start:
                    # Token x[p+layer+1] is next_tokens[p + layer - n]: the rows carry x[n+1..new_n].
                    token_ids = item.rows.next_tokens[start + layer - n : end + layer - n]
                    work.append(LayerWork(request.layers[layer], token_ids, available[: end - start]))
                    working.append(index)
            streams, last_normed = self._run(layer, work)
            produced = [torch.empty_like(request.backlog[layer][:0]) for request in requests]
            for index, stream in zip(working, streams, strict=True):
                produced[index] = stream
            if layer == 0:  # every request has new rows, so every request ran layer 0
                shapings = [item.shaping for item in inputs]
                first_tokens = self._choose(last_normed, 0, shapings, [[] for _ in inputs])
        for request, item in zip(requests, inputs, strict=True):
            request.committed += len(item.rows.next_tokens)
        return first_tokens

    def _draft(
        self, requests: Sequence[MTPRequest], inputs: Sequence[ProposeInput], first_tokens: Sequence[int]
    ) -> list[list[int]]:
        """Step j + 1 runs layer j over positions c_j..P, each request with its own guesses d_1..d_j."""
        proposals = [[token] if item.num_steps > 0 else [] for token, item in zip(first_tokens, inputs, strict=True)]
        # Per request, the rows the previous step's layer produced at positions c_{j-1}..P: none after the ingest,
        # since layer 0's committed extent is n.
        carried = [request.backlog[0][:0] for request in requests]
        for layer in range(1, max((item.num_steps for item in inputs), default=0)):
            active = [index for index, item in enumerate(inputs) if item.num_steps > layer]
            work = []
            for index in active:
                request, guesses = requests[index], proposals[index]
                start = request.extent(layer)
                # Example (layer 2, n = 5): positions 3..4 with tokens x[p+3] = d1, d2 = guesses[0..1].
                token_ids = guesses[start + layer - request.committed : layer]
                backlog = request.backlog[layer]
                hidden = torch.cat([backlog, carried[index]]) if self.chain else backlog
                assert hidden.shape[0] == len(token_ids), "backlog and carried rows must cover positions c_j..P"
                work.append(LayerWork(request.layers[layer], token_ids, hidden))
            streams, last_normed = self._run(layer, work)
            shapings = [inputs[index].shaping for index in active]
            tokens = self._choose(last_normed, layer, shapings, [proposals[index] for index in active])
            for index, stream, token in zip(active, streams, tokens, strict=True):
                carried[index] = stream  # the update: the next layer consumes this layer's output, not its input
                proposals[index].append(token)
        return proposals

    def _choose(
        self,
        normed: torch.Tensor,  # [rows, hidden] the rows that draft
        layer: int,
        shapings: Sequence[Shaping | None],  # per row, its request's options (draft_server.shaping)
        paths: Sequence[Sequence[int]],  # per row, the drafts before its choice
    ) -> list[int]:
        """Each row's draft: the argmax of the layer's logits, shaped by the request's options."""
        logits = self.model.compute_logits(normed, layer)  # over the target's vocabulary
        return shape_logits(logits, shapings, paths).argmax(dim=-1).tolist()

    def _run(self, layer: int, work: Sequence[LayerWork]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One packed forward of MTP layer `layer`; returns each item's rows to hand on (self.flow) and the normed last
        rows [len(work), hidden]."""
        if not work:
            return [], torch.empty(0, self.model.config.hidden_size, dtype=self._dtype, device=self.cache.device)
        device = self.cache.device
        metadata = self.cache.plan([(item.kv, len(item.token_ids)) for item in work])
        input_ids = torch.tensor([token for item in work for token in item.token_ids], device=device)
        hidden = torch.cat([item.hidden for item in work])
        output = self.model.run_layer(layer, input_ids, hidden, metadata, self.cache)
        handed_on = output.normed if self.flow == "post_norm" else output.stream
        streams = [handed_on[rows] for rows in metadata.page_table.query_slices()]
        last_rows = metadata.page_table.last_rows()  # [len(work)]
        return streams, output.normed[last_rows]

    @property
    def _dtype(self) -> torch.dtype:
        return self.cache.keys.dtype
