"""The draft's runner for a block drafter (DFlash, tandem.models.dflash): one forward per round gives every request
up to block_size - 1 drafts.

A request's draft KV holds the projected context of every verified position, [0, P] once the rows of a round end
at P. Each round its rows (features of positions s..P and the tokens after them) are written as context from s on
(a replay or a recompute starts at s = 0, rewriting what was there), its block [x[P + 1], MASK, ...] is appended
at P + 1 .. P + B and attends over all of it, and the cache is cut back to P + 1: the block's K/V never outlives the
forward. Example, B = 4: a round whose rows end at 9 (next token x10) drafts from [x10, M, M, M] at 10..13; the
target accepts two drafts and corrects the third, so the next rows are positions 10..12 (tokens x11, x12 and the
correction), and the next block sits at 13..16.

Drafts are greedy (argmax of the target's LM head over the block rows); a request's penalties, bias and min_tokens
shape its rows left to right, each row seeing the drafts before it (draft_server.shaping).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draft_server.runner import DraftRequestError, ProposeInput, check_batch_fits, release_requests
from draft_server.shaping import shape_logits
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.layers.matmul import prepack
from tandem.models.dflash import BlockStep, DFlashDraft
from tandem.settings import KVCacheSettings


@dataclass
class BlockRequest:
    kv: SequenceKV = field(default_factory=SequenceKV)  # projected context of positions [0, kv.length)


class BlockRunner:
    def __init__(self, model: DFlashDraft, cache: KVCacheSettings) -> None:
        parameter = next(model.parameters())
        config = model.config
        self.model = model
        self.block_size = config.block_size
        prepack(model)
        self.cache = PagedKVCache.for_layout(
            config.layer.num_layers, config.cache_layout, cache, parameter.dtype, parameter.device
        )
        self.requests: dict[str, BlockRequest] = {}

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        """Writes each request's new context, drafts its block, and returns its first num_steps drafts (at most
        block_size - 1)."""
        # Every item is checked before any state changes, so that a refused batch leaves the cache as it was.
        for item in inputs:
            self._check(item)
        check_batch_fits(self.cache, [self._plan(item) for item in inputs])
        requests = [self.requests.setdefault(item.request_id, BlockRequest()) for item in inputs]
        for request, item in zip(requests, inputs, strict=True):
            self.cache.truncate(request.kv, item.rows.start_position)
        contexts = self.cache.plan_table(
            [(request.kv, len(item.rows.next_tokens)) for request, item in zip(requests, inputs, strict=True)]
        )
        blocks = self.cache.plan([(request.kv, self.block_size) for request in requests], bidirectional=True)
        step = BlockStep(torch.cat([contexts.positions, blocks.positions]), contexts.write_slots, blocks)
        device, mask = self.cache.device, self.model.config.mask_token_id
        block_ids = torch.tensor(
            [t for item in inputs for t in (item.rows.next_tokens[-1], *[mask] * (self.block_size - 1))], device=device
        )
        rows = [i * self.block_size + j for i, item in enumerate(inputs) for j in range(1, self._steps(item) + 1)]
        features = torch.cat([item.rows.features for item in inputs]).to(device=device, dtype=self.cache.keys.dtype)
        try:
            logits = self.model(block_ids, features, step, self.cache, torch.tensor(rows, device=device))
        finally:
            for request, item in zip(requests, inputs, strict=True):
                self.cache.truncate(request.kv, item.rows.start_position + len(item.rows.next_tokens))
        return self._drafts(logits, inputs)

    def _drafts(self, logits: torch.Tensor, inputs: Sequence[ProposeInput]) -> list[list[int]]:
        """Each request's drafts from its block rows' logits ([sum of num_steps, vocab], request by request)."""
        counts = [self._steps(item) for item in inputs]
        if all(item.shaping is None for item in inputs):
            tokens = logits.argmax(dim=-1).tolist()
            starts = [sum(counts[:i]) for i in range(len(counts))]
            return [tokens[start : start + count] for start, count in zip(starts, counts, strict=True)]
        proposals: list[list[int]] = [[] for _ in inputs]
        for step in range(max(counts, default=0)):
            # Row `step` of each request that drafts that far, shaped with the drafts before it.
            active = [i for i, count in enumerate(counts) if count > step]
            row_of = [sum(counts[:i]) + step for i in active]
            shaped = shape_logits(logits[row_of], [inputs[i].shaping for i in active], [proposals[i] for i in active])
            for i, token in zip(active, shaped.argmax(dim=-1).tolist(), strict=True):
                proposals[i].append(int(token))
        return proposals

    def _check(self, item: ProposeInput) -> None:
        """Raises DraftRequestError unless the item's rows continue its request's context and fit its block."""
        held = self.requests[item.request_id].kv.length if item.request_id in self.requests else 0
        if held < item.rows.start_position:
            raise DraftRequestError(
                f"request {item.request_id!r}: rows start at position {item.rows.start_position} "
                f"but the draft holds positions up to {held}"
            )
        if not item.rows.next_tokens:
            raise DraftRequestError(f"request {item.request_id!r}: rows at {item.rows.start_position} carry no tokens")

    def _steps(self, item: ProposeInput) -> int:
        """The drafts the item gets: as many as it asks for, up to the block's B - 1."""
        return min(item.num_steps, self.block_size - 1)

    def _plan(self, item: ProposeInput) -> tuple[SequenceKV | None, int, int]:
        request = self.requests.get(item.request_id)
        end = item.rows.start_position + len(item.rows.next_tokens) + self.block_size
        return (request.kv if request is not None else None, item.rows.start_position, end)

    def release(self, request_ids: Sequence[str]) -> None:
        release_requests(self.cache, self.requests, request_ids)
