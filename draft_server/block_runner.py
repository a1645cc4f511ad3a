"""The draft's runner for a block drafter (DFlash, DFlash2 and DSpark, tandem.models.dflash and .dflash2): one forward
per round gives every request up to a block's drafts (DFlash, DFlash2: block_size - 1, from rows 1 ..; DSpark:
block_size, from row 0).

A request's draft KV holds the projected context of every verified position, [0, P] once the rows of a round end
at P. Each round its rows (features of positions s..P and the tokens after them) are written as context from s on
(a replay or a recompute starts at s = 0, rewriting what was there), its block [x[P + 1], MASK, ...] is appended
at P + 1 .. P + B and attends over all of it, and the cache is cut back to P + 1: the block's K/V never outlives the
forward. Example, B = 4: a round whose rows end at 9 (next token x10) drafts from [x10, M, M, M] at 10..13; the
target accepts two drafts and corrects the third, so the next rows are positions 10..12 (tokens x11, x12 and the
correction), and the next block sits at 13..16.

Drafts are greedy: the argmax of each drafting row's logits, which for DSpark add the Markov head's correction from
the token before (the anchor, then the drafts, left to right); DFlash2's selector picks among each row's top
candidates by their transition from the token before, left to right too (tandem.models.dflash2); a request's
penalties, bias and min_tokens shape its rows' logits left to right, each row seeing the drafts before it
(draft_server.shaping). DSpark's confidence head scores each draft given the token before it (DraftTree.scores): the
orchestrator may verify fewer of them (orchestrator.loop.confidence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from draft_server.prefixes import DraftNames, DraftPrefixes
from draft_server.runner import ProposeInput, check_batch_fits, check_continues, release_requests
from draft_server.shaping import shape_logits
from tandem.layers.kv_cache import PagedKVCache, SequenceKV
from tandem.layers.matmul import prepack
from tandem.models.dflash import BlockStep, DFlashDraft
from tandem.sampling.draft_tree import DraftTree
from tandem.settings import KVCacheSettings


@dataclass
class BlockRequest:
    kv: SequenceKV = field(default_factory=SequenceKV)  # projected context of positions [0, kv.length)
    names: DraftNames | None = None  # what names its context blocks (draft_server.prefixes)


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
        # The context of a position is its feature alone: the draft names match the target's (no shift).
        self.prefixes = DraftPrefixes(self.cache, self._request_for, shift=0) if cache.prefix_caching else None

    def _request_for(self, request_id: str) -> BlockRequest:
        return self.requests.setdefault(request_id, BlockRequest())

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposeInput]) -> list[DraftTree]:
        """Writes each request's new context, drafts its block, and returns its first num_steps drafts (at most a
        block's), a chain scored by the drafter's confidence where it has a confidence head."""
        # Every item is checked before any state changes, so that a refused batch leaves the cache as it was.
        for item in inputs:
            self._check(item)
        check_batch_fits(self.cache, [self._plan(item) for item in inputs])
        requests = [self._request_for(item.request_id) for item in inputs]
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
        first = self.model.config.first_draft_row
        rows = [i * self.block_size + first + j for i, item in enumerate(inputs) for j in range(self._steps(item))]
        features = torch.cat([item.rows.features for item in inputs]).to(device=device, dtype=self.cache.keys.dtype)
        try:
            hidden = self.model(block_ids, features, step, self.cache, torch.tensor(rows, device=device))
        finally:
            for request, item in zip(requests, inputs, strict=True):
                self.cache.truncate(request.kv, item.rows.start_position + len(item.rows.next_tokens))
        if self.prefixes is not None:
            for request, item in zip(requests, inputs, strict=True):
                self.prefixes.ingested(request, item.rows)
        return self._drafts(hidden, inputs)

    def _drafts(self, hidden: torch.Tensor, inputs: Sequence[ProposeInput]) -> list[DraftTree]:
        """Each request's drafts from its drafting rows' outputs ([sum of the steps, hidden], request by request),
        scored where the drafter has a confidence head."""
        counts = [self._steps(item) for item in inputs]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        anchors = [item.rows.next_tokens[-1] for item in inputs]
        model = self.model
        if not model.row_by_row and model.confidence_head is None and all(item.shaping is None for item in inputs):
            tokens = model.logits(hidden).argmax(dim=-1).tolist()
            return [DraftTree.chain(tokens[start : start + count]) for start, count in zip(starts, counts, strict=True)]
        head = model.head_logits(hidden)  # every drafting row's LM head at once; the Markov correction row by row
        proposals: list[list[int]] = [[] for _ in inputs]
        for step in range(max(counts, default=0)):
            # Row `step` of each request that drafts that far, given the token before it and shaped with the drafts.
            active = [i for i, count in enumerate(counts) if count > step]
            rows = [starts[i] + step for i in active]
            logits = head[rows]
            previous = torch.tensor([proposals[i][-1] if step else anchors[i] for i in active], device=hidden.device)
            if model.markov_head is not None:
                logits = logits + model.markov_head(hidden[rows], previous).float()
            shaped = shape_logits(logits, [inputs[i].shaping for i in active], [proposals[i] for i in active])
            for i, token in zip(active, model.choose(shaped, hidden[rows], previous).tolist(), strict=True):
                proposals[i].append(int(token))
        before = [token for i, tokens in enumerate(proposals) for token in (anchors[i], *tokens[:-1]) if tokens]
        confidence = model.confidence(hidden, torch.tensor(before, device=hidden.device))
        scores = confidence.tolist() if confidence is not None else []
        return [
            DraftTree.chain(tokens, scores[start : start + len(tokens)])
            for tokens, start in zip(proposals, starts, strict=True)
        ]

    def _check(self, item: ProposeInput) -> None:
        """Raises DraftRequestError unless the item's rows carry tokens and continue its request's context."""
        check_continues(self.requests, item)

    def _steps(self, item: ProposeInput) -> int:
        """The drafts the item gets: as many as it asks for, up to the block's."""
        return min(item.num_steps, self.model.config.drafts_per_block)

    def _plan(self, item: ProposeInput) -> tuple[SequenceKV | None, int, int]:
        request = self.requests.get(item.request_id)
        end = item.rows.start_position + len(item.rows.next_tokens) + self.block_size
        return (request.kv if request is not None else None, item.rows.start_position, end)

    def release(self, request_ids: Sequence[str]) -> None:
        release_requests(self.cache, self.requests, request_ids)
