"""The draft's runner for a standalone draft model: a plain causal LM of a target family with the target's vocabulary.

It needs no hidden states, only the request's committed tokens: its replica subscribes with `tokens_only`, and the
target's rows carry tokens with zero-width features. Row p pairs with token x[p+1], which this runner keeps at its own
position p + 1; rows from scratch (a new request, a recompute after preemption, a replay) start at p = -1, token x[0].
A request holds KV for its tokens x[0..L) (the last ones may be drafts); per round:

    ingest   rows s..s+n-1 bring tokens x[s+1..s+n] for positions s+1..s+n; KV from s+1 on is rewritten, except
             where it already holds these very tokens (accepted drafts: same tokens after the same prefix, so their KV
             is right), and the last token is always computed, for its logits
    draft    the last token's logits give d_1 (greedy); step j >= 2 feeds d_{j-1} at the next position and gives d_j

Example, k = 3: prompt x0..x4, first new token x5 -> rows -1..4, tokens x0..x5 at positions 0..5; position 5
predicts d_1; d_1 is fed at 6 (predicts d_2), d_2 at 7 (predicts d_3). The target accepts d_1 and corrects d_2 to c:
rows 5..6 bring d_1, c for positions 6..7. Position 6 already holds d_1 and is kept; position 7 held d_2, so the KV
is truncated to 7 and c is computed there; its logits give the next d_1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draft_server.prefixes import DraftPrefixes
from draft_server.runner import DraftRequestError, ProposeInput, TargetRows, check_batch_fits, release_requests
from draft_server.shaping import shape_logits
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.cuda_graphs import GraphedForward, GraphsFactory, Tensors, recorded_graphs, run_step
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.layers.matmul import prepack
from tandem.models.registry import TargetModel
from tandem.sampling.processing import Shaping
from tandem.settings import KVCacheSettings


@dataclass
class StandaloneRequest:
    kv: SequenceKV = field(default_factory=SequenceKV)
    tokens: list[int] = field(default_factory=list)  # the tokens at positions [0, kv.length), drafts included
    committed: int = 0  # positions [0, committed) hold committed tokens (from rows); the rest are drafts


def _ingest_plan(request: StandaloneRequest | None, rows: TargetRows) -> tuple[int, int]:
    """(first, kept): the draft position of the rows' first token, and how many positions of KV stay (all below
    `first`, plus those that already hold the rows' tokens, never the last one)."""
    first = rows.start_position + 1
    held = request.tokens if request is not None else []
    committed = request.committed if request is not None else 0
    if not rows.next_tokens:
        raise DraftRequestError(f"rows at position {rows.start_position} carry no tokens")
    if not 0 <= first <= committed:
        # Positions from `committed` on hold drafts the target has not confirmed: rows must start at or before it.
        raise DraftRequestError(
            f"rows bring tokens from position {first} but the draft holds committed tokens up to position {committed}"
        )
    kept = first
    for token in rows.next_tokens[:-1]:
        if kept >= len(held) or held[kept] != token:
            break
        kept += 1
    return first, kept


class StandaloneRunner:
    """Ingests committed tokens and drafts greedy chains with a target-family model, batched across requests."""

    def __init__(
        self,
        model: TargetModel,
        cache: KVCacheSettings,
        graphs: GraphsFactory = recorded_graphs,  # how draft steps are replayed when `cache.cuda_graphs` asks for it
    ) -> None:
        parameter = next(model.parameters())
        self.model = model
        prepack(model)
        self.cache = PagedKVCache.for_layout(
            model.config.num_layers, model.cache_layout, cache, parameter.dtype, parameter.device
        )
        self.requests: dict[str, StandaloneRequest] = {}
        self.prefixes: DraftPrefixes | None = None  # keeps no prefix cache (draft_server.prefixes)
        self.graphs: GraphedForward | None = graphs(self.cache) if cache.cuda_graphs else None

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        """Ingests each request's tokens, then drafts num_steps tokens per request; batched across requests."""
        # Plan and check every item before changing any state, so that a refused batch leaves the cache as it was.
        plans = []
        for item in inputs:
            try:
                plans.append(_ingest_plan(self.requests.get(item.request_id), item.rows))
            except DraftRequestError as error:
                raise DraftRequestError(f"request {item.request_id!r}: {error}") from None
        self._check_blocks(inputs, [kept for _, kept in plans])
        requests, feeds = [], []
        for item, (first, kept) in zip(inputs, plans, strict=True):
            request = self.requests.setdefault(item.request_id, StandaloneRequest())
            self.cache.truncate(request.kv, kept)
            del request.tokens[kept:]
            feed = list(item.rows.next_tokens[kept - first :])
            request.tokens += feed
            request.committed = len(request.tokens)
            requests.append(request)
            feeds.append(feed)
        metadata = self.cache.plan([(request.kv, len(feed)) for request, feed in zip(requests, feeds, strict=True)])
        device = self.cache.device
        input_ids = torch.tensor([token for feed in feeds for token in feed], dtype=torch.long, device=device)
        output = self.model(input_ids, metadata, self.cache)
        logits = self.model.compute_logits(output.normed[metadata.page_table.last_rows()])  # [num_requests, vocab]
        shapings = [item.shaping for item in inputs]
        tokens = shape_logits(logits, shapings, [[] for _ in inputs]).argmax(dim=-1).cpu()  # [num_requests]
        proposals: list[list[int]] = [[token] for token in tokens.tolist()]
        active = list(range(len(inputs)))
        for step_index in range(1, max((item.num_steps for item in inputs), default=0)):
            # `tokens` holds one draft per request of the previous step's `active`, in that order.
            kept_rows = [row for row, i in enumerate(active) if inputs[i].num_steps > step_index]
            if not kept_rows:
                break
            active = [active[row] for row in kept_rows]
            tokens = tokens[torch.tensor(kept_rows, device=tokens.device)]
            for i, token in zip(active, tokens.tolist(), strict=True):
                requests[i].tokens.append(token)
            shapings, paths = [inputs[i].shaping for i in active], [proposals[i] for i in active]
            tokens = self._step([requests[i] for i in active], tokens.to(device), shapings, paths)
            for i, token in zip(active, tokens.tolist(), strict=True):
                proposals[i].append(token)
        return proposals

    def _step(
        self,
        requests: Sequence[StandaloneRequest],
        tokens: torch.Tensor,  # [b] the previous step's drafts
        shapings: Sequence[Shaping | None],  # [b] the requests' options (draft_server.shaping)
        paths: Sequence[Sequence[int]],  # [b] their drafts so far
    ) -> torch.Tensor:  # -> [b] on the CPU
        """One draft step of one token per request: from a recorded shape when CUDA graphs are on
        (tandem.layers.cuda_graphs), else as planned."""
        table = self.cache.plan_table([(request.kv, 1) for request in requests])
        outputs = run_step(self.graphs, self.cache, table, {"tokens": tokens}, "step", self._next)
        if all(shaping is None for shaping in shapings):
            return outputs["tokens"].cpu()
        return shape_logits(outputs["logits"], shapings, paths).argmax(dim=-1).cpu()

    def _next(self, inputs: Tensors, metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
        output = self.model(inputs["tokens"], metadata, self.cache)
        logits = self.model.compute_logits(output.normed)
        return {"tokens": logits.argmax(dim=-1), "logits": logits}

    def _check_blocks(self, inputs: Sequence[ProposeInput], kept: Sequence[int]) -> None:
        """Raises OutOfKVBlocks before any change if the batch, its ingest and every draft step, does not fit."""
        plans = []
        for item, positions in zip(inputs, kept, strict=True):
            request = self.requests.get(item.request_id)
            # Ingest writes up to the rows' last token; every draft step after the first writes one more position.
            end = item.rows.start_position + 1 + len(item.rows.next_tokens) + max(0, item.num_steps - 1)
            plans.append((request.kv if request is not None else None, positions, end))
        check_batch_fits(self.cache, plans)

    def release(self, request_ids: Sequence[str]) -> None:
        release_requests(self.cache, self.requests, request_ids)
