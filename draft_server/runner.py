"""The draft's model runner: ingest the target's hidden states, then propose a chain of k tokens.

Position alignment (REFERENCE.md): the draft row at position p takes (target feature of p, token x[p+1]).
For a request whose committed tokens are x[0..P+1] (x[P+1] has no target KV yet), the target sends
rows p = s..P. Ingesting them fills draft KV for s..P; row P predicts d_1 = x[P+2]. Step j (j >= 2) is
the row at position P + j - 1, taking (draft hidden of the previous step, d_{j-1}) and predicting d_j.
Example: prompt of 5 tokens, first token c -> rows 0..4 with tokens x1..x4, c; row 4 predicts d_1;
the row at position 5 takes (hidden of row 4, d_1) and predicts d_2.
Draft KV written by steps j >= 2 is speculative: the next ingest truncates back to its start position.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch import nn

from draft_server.prefixes import DraftNames, DraftPrefixes, RequestPrefix
from draft_server.shaping import shape_logits
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.cuda_graphs import GraphedForward, GraphsFactory, Tensors, recorded_graphs, run_step
from tandem.layers.kv_cache import CacheLayout, OutOfKVBlocks, PagedKVCache, SequenceKV
from tandem.layers.matmul import prepack
from tandem.layers.page_table import PageTable
from tandem.models.eagle3 import DraftStep
from tandem.models.stack import Embeddings
from tandem.sampling.processing import Shaping
from tandem.settings import KVCacheSettings
from tandem.wire import target_pb2
from tandem.wire.codec import tensor_from_proto


class DraftModelConfig(Protocol):
    @property
    def cache_layout(self) -> CacheLayout: ...  # what one token leaves in the draft's KV cache


class DraftModel(Protocol):
    """What the runner drives: an EAGLE3 head (tandem.models.eagle3.Eagle3Draft) or a NextN layer reused at every
    step (tandem.models.mtp.NextNDraft)."""

    @property
    def config(self) -> DraftModelConfig: ...
    @property
    def embed_tokens(self) -> nn.Embedding: ...  # the target's vocabulary
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
    def modules(self) -> Iterator[nn.Module]: ...
    def project_features(self, features: torch.Tensor) -> torch.Tensor: ...  # [n, feature width] -> [n, hidden]
    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] target vocabulary ids
        hidden: torch.Tensor,  # [num_tokens, hidden] projected target features or the previous step's hidden
        metadata: AttentionMetadata,
        cache: PagedKVCache,
        logit_rows: torch.Tensor | None = None,  # [rows] the rows whose logits are wanted; None: every row
        embeddings: Embeddings | None = None,  # rows embedded as given (the target's at an image's tokens)
    ) -> DraftStep: ...
    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...  # [n] -> [n]


class DraftRequestError(ValueError):
    """Rows that do not continue the request's draft KV; the message says where the gap is."""


@dataclass(frozen=True)
class TargetRows:
    """Committed rows from the target: features of positions [start, start + n) and the tokens after them."""

    start_position: int
    next_tokens: Sequence[int]  # [n]
    features: torch.Tensor  # [n, num_aux * target_hidden]
    prefix: RequestPrefix | None = None  # on rows that start the request over, from a target that names prefixes
    # Rows whose next token is an image's placeholder, and the target's embedding of it (SubscribeRequest's
    # image_embeddings); None: none
    image_embeddings: Embeddings | None = None

    @classmethod
    def of(cls, message: target_pb2.HiddenStates) -> TargetRows:
        """The rows of one message of the target's stream."""
        prefix = None
        if message.prefix_tokens:
            marks = tuple(zip(message.image_starts, message.image_digests, strict=True))
            prefix = RequestPrefix(tuple(message.prefix_tokens), message.cache_salt, marks)
        images = None
        if message.image_rows:
            images = (torch.tensor(message.image_rows), tensor_from_proto(message.image_embeddings))
        features = tensor_from_proto(message.features)
        return cls(message.start_position, list(message.next_tokens), features, prefix, images)

    def followed_by(self, later: TargetRows) -> TargetRows:
        """These rows and the ones the target sent next for the same round (a long prompt comes in chunks)."""
        end = self.start_position + len(self.next_tokens)
        if later.start_position != end:
            raise DraftRequestError(f"rows at position {later.start_position} do not continue rows ending at {end}")
        features = torch.cat([self.features, later.features])
        tokens = [*self.next_tokens, *later.next_tokens]
        images = joined_rows([self.image_embeddings, later.image_embeddings], [0, len(self.next_tokens)])
        return TargetRows(self.start_position, tokens, features, self.prefix, images)


def joined_rows(parts: Sequence[Embeddings | None], offsets: Sequence[int]) -> Embeddings | None:
    """Embedded rows of consecutive row ranges, each range's rows moved by its offset, as one."""
    rows, values = [], []
    for part, offset in zip(parts, offsets, strict=True):
        if part is not None:
            rows.append(part[0] + offset)
            values.append(part[1])
    return (torch.cat(rows), torch.cat(values)) if rows else None


Kept = TypeVar("Kept")


def pop_rounds(kept: dict[tuple[str, int], Kept], request_id: str, round_number: int) -> list[Kept]:
    """Takes out of `kept` (keyed by request id and round) the request's entry of `round_number` and those of its
    earlier rounds, oldest first: the rounds join_rounds joins."""
    earlier = sorted(key for key in kept if key[0] == request_id and key[1] < round_number)
    return [kept.pop(key) for key in (*earlier, (request_id, round_number))]


def join_rounds(parts: Sequence[TargetRows]) -> TargetRows:
    """One request's rows of several rounds, oldest first, as the rows of the last: a request the orchestrator asked
    no drafts of for some rounds (k = 0) gets their rows joined to the round it is asked about. Rows that start where
    the earlier ones start, or before, restart the request (a recompute after preemption, a replay): the earlier
    ones are stale, e.g. rows in flight when the request was released."""
    rows = parts[0]
    for later in parts[1:]:
        rows = later if later.start_position <= rows.start_position else rows.followed_by(later)
    return rows


@dataclass(frozen=True)
class ProposeInput:
    request_id: str
    rows: TargetRows
    num_steps: int
    shaping: Shaping | None = None  # the request's penalties, logit_bias, min_tokens (draft_server.shaping)


@dataclass
class DraftRequest:
    kv: SequenceKV = field(default_factory=SequenceKV)
    names: DraftNames | None = None  # what names its draft blocks (draft_server.prefixes)


class DraftRunner:
    def __init__(
        self,
        model: DraftModel,
        cache: KVCacheSettings,
        graphs: GraphsFactory = recorded_graphs,  # how draft steps are replayed when `cache.cuda_graphs` asks for it
    ) -> None:
        parameter = next(model.parameters())
        layout = model.config.cache_layout
        self.model = model
        prepack(model)
        self.cache = PagedKVCache.for_layout(1, layout, cache, parameter.dtype, parameter.device)
        self.requests: dict[str, DraftRequest] = {}
        self.graphs: GraphedForward | None = graphs(self.cache) if cache.cuda_graphs else None
        self.prefixes = DraftPrefixes(self.cache, self._request_for, shift=1) if cache.prefix_caching else None

    def _request_for(self, request_id: str) -> DraftRequest:
        return self.requests.setdefault(request_id, DraftRequest())

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        """Ingests each request's rows, then drafts num_steps tokens per request; batched across requests."""
        # Check every item before changing any state, so that a refused batch leaves the cache as it was.
        self.check_rows(inputs)
        self.check_blocks(inputs)
        requests, hidden, logits = self.ingest(inputs)
        logits = self.shaped(logits, [item.shaping for item in inputs], [[] for _ in inputs])
        tokens = self.model.to_target_ids(logits.argmax(dim=-1))  # [num_requests]
        proposals: list[list[int]] = [[int(t)] for t in tokens.tolist()]
        device = self.cache.device
        active = list(range(len(inputs)))
        for step_index in range(1, max(item.num_steps for item in inputs)):
            # hidden and tokens hold one row per request of the previous step's `active`, so rows are selected by
            # their place in that list, not by request index.
            kept = [row for row, i in enumerate(active) if inputs[i].num_steps > step_index]
            if not kept:
                break
            if len(kept) < len(active):
                active = [active[row] for row in kept]
                selector = torch.tensor(kept, device=device)
                hidden, tokens = hidden[selector], tokens[selector]
            table = self.cache.plan_table([(requests[i].kv, 1) for i in active])
            hidden, tokens = self._step(table, tokens, hidden, [inputs[i].shaping for i in active], proposals, active)
            for i, token in zip(active, tokens.tolist(), strict=True):
                proposals[i].append(int(token))
        return proposals

    def _step(
        self,
        table: PageTable,
        tokens: torch.Tensor,  # [b] the previous step's drafts, target vocabulary
        hidden: torch.Tensor,  # [b, hidden] the previous step's hidden rows
        shapings: Sequence[Shaping | None],  # [b]
        proposals: Sequence[Sequence[int]],  # every request's drafts so far
        active: Sequence[int],  # [b] the requests of the rows
    ) -> tuple[torch.Tensor, torch.Tensor]:  # -> hidden [b, hidden], drafts [b]
        """One draft step of one row per request: from a recorded shape when CUDA graphs are on
        (tandem.layers.cuda_graphs), else as planned."""
        inputs = {"tokens": tokens, "hidden": hidden}
        outputs = run_step(self.graphs, self.cache, table, inputs, "step", self._step_outputs)
        if all(shaping is None for shaping in shapings):
            return outputs["hidden"], outputs["tokens"]
        logits = self.shaped(outputs["logits"], shapings, [proposals[i] for i in active])
        return outputs["hidden"], self.model.to_target_ids(logits.argmax(dim=-1))

    def _step_outputs(self, inputs: Tensors, metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
        step = self.model(inputs["tokens"], inputs["hidden"], metadata, self.cache)
        tokens = self.model.to_target_ids(step.logits.argmax(dim=-1))
        return {"hidden": step.hidden, "tokens": tokens, "logits": step.logits}

    def shaped(
        self, logits: torch.Tensor, shapings: Sequence[Shaping | None], paths: Sequence[Sequence[int]]
    ) -> torch.Tensor:  # [rows, draft vocab] -> the same
        """Draft logits shaped by their requests' options (draft_server.shaping)."""
        vocab, draft_vocab = self.model.embed_tokens.num_embeddings, logits.shape[1]
        if draft_vocab == vocab or all(shaping is None for shaping in shapings):
            return shape_logits(logits, shapings, paths)
        target_ids = self.model.to_target_ids(torch.arange(draft_vocab, device=logits.device))  # [draft vocab]
        return shape_logits(logits, shapings, paths, (target_ids, vocab))

    def check_rows(self, inputs: Sequence[ProposeInput]) -> None:
        """Raises DraftRequestError unless every item's rows continue the KV its request holds."""
        for item in inputs:
            held = self.requests[item.request_id].kv.length if item.request_id in self.requests else 0
            if held < item.rows.start_position:
                raise DraftRequestError(
                    f"request {item.request_id!r}: rows start at position {item.rows.start_position} "
                    f"but the draft holds positions up to {held}"
                )

    def ingest(
        self, inputs: Sequence[ProposeInput]
    ) -> tuple[list[DraftRequest], torch.Tensor, torch.Tensor]:  # -> requests, hidden [b, hidden], logits [b, vocab]
        """Truncates each request's draft KV to its rows' start (dropping the last round's speculative rows) and runs
        the rows; returns the requests, and the hidden state and draft logits of each one's last row."""
        requests = []
        for item in inputs:
            request = self.requests.setdefault(item.request_id, DraftRequest())
            self.cache.truncate(request.kv, item.rows.start_position)
            requests.append(request)
        device = self.cache.device
        metadata = self.cache.plan(
            [(request.kv, len(item.rows.next_tokens)) for request, item in zip(requests, inputs, strict=True)]
        )
        features = torch.cat([item.rows.features for item in inputs]).to(device=device, dtype=self._dtype)
        input_ids = torch.tensor([t for item in inputs for t in item.rows.next_tokens], device=device)
        last_rows = metadata.page_table.last_rows()  # [num_requests]
        offsets = itertools.accumulate((len(item.rows.next_tokens) for item in inputs[:-1]), initial=0)
        images = joined_rows([item.rows.image_embeddings for item in inputs], list(offsets))
        if images is not None:
            images = (images[0].to(device), images[1].to(device=device, dtype=self._dtype))
        # Only each request's last row drafts: the LM head runs on those rows alone.
        hidden = self.model.project_features(features)
        step = self.model(input_ids, hidden, metadata, self.cache, last_rows, embeddings=images)
        if self.prefixes is not None:
            for request, item in zip(requests, inputs, strict=True):
                self.prefixes.ingested(request, item.rows)
        return requests, step.hidden[last_rows], step.logits

    def check_blocks(self, inputs: Sequence[ProposeInput], rows_per_step: int = 1) -> None:
        """Raises OutOfKVBlocks before any change if the batch, its ingest and every draft step, does not fit.
        `rows_per_step`: what each draft step after the first adds to a request's KV at most (a chain's one
        position; a tree's expansion step, draft_server.tree_draft, K)."""
        plans = []
        for item in inputs:
            request = self.requests.get(item.request_id)
            # Ingest writes the rows; every draft step after the first writes rows_per_step more positions.
            end = item.rows.start_position + len(item.rows.next_tokens) + rows_per_step * max(0, item.num_steps - 1)
            plans.append((request.kv if request is not None else None, item.rows.start_position, end))
        check_batch_fits(self.cache, plans)

    def release(self, request_ids: Sequence[str]) -> None:
        release_requests(self.cache, self.requests, request_ids)

    @property
    def _dtype(self) -> torch.dtype:
        return self.cache.keys.dtype


class HoldsKV(Protocol):
    kv: SequenceKV  # the request's draft KV in the runner's pool


Request = TypeVar("Request", bound=HoldsKV)


def release_requests(cache: PagedKVCache, requests: dict[str, Request], request_ids: Sequence[str]) -> None:
    """Forgets the requests and gives their KV back to the pool; ids the runner does not hold are skipped."""
    for request_id in request_ids:
        request = requests.pop(request_id, None)
        if request is not None:
            cache.release(request.kv)


def check_continues(requests: Mapping[str, HoldsKV], item: ProposeInput) -> None:
    """Raises DraftRequestError unless the item's rows carry tokens and continue what its request holds."""
    held = requests[item.request_id].kv.length if item.request_id in requests else 0
    if held < item.rows.start_position:
        raise DraftRequestError(
            f"request {item.request_id!r}: rows start at position {item.rows.start_position} "
            f"but the draft holds positions up to {held}"
        )
    if not item.rows.next_tokens:
        raise DraftRequestError(f"request {item.request_id!r}: rows at {item.rows.start_position} carry no tokens")


def check_batch_fits(cache: PagedKVCache, plans: Sequence[tuple[SequenceKV | None, int, int]]) -> None:
    """Raises OutOfKVBlocks, changing nothing, unless the batch fits the pool: each (sequence held, or None, positions
    it keeps, positions it reaches) is first truncated to the positions it keeps, which frees blocks, then grows."""
    block_size = cache.block_size
    available, needed = cache.num_free_blocks, 0
    for sequence, keep, end in plans:
        held = len(sequence.block_ids) if sequence is not None else 0
        kept = min(-(-keep // block_size), held)  # blocks left after truncating
        available += held - kept
        needed += -(-end // block_size) - kept
    if needed > available:
        raise OutOfKVBlocks(f"KV cache: this batch needs {needed} more blocks, {available} free")
