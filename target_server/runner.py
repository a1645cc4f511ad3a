"""The target's model runner: one kind of step, a batch of items run in one packed forward pass.

A request's committed tokens are `tokens`; KV exists for its first `kv.length` of them. Every item of a step
computes the next `num_tokens` committed tokens from where the request's KV ends; an item that reaches the last
committed token also scores the draft tokens after it, and its logits decide what is committed next:

    prompt chunk   num_tokens < tokens left without KV: KV only, no logits (chunked prefill)
    final chunk    the chunk reaches the last prompt token: its row's logits give the first new token
    verification   num_tokens 1 (the last committed token t) plus drafts d_1..d_k at positions [n, n + k]
    recompute      after preemption (KV freed, tokens kept) the same chunks rebuild the KV; the final one
                   gives the next token

One verification with k drafts, n = kv.length:
    input      [t, d_1, ..., d_k] at positions [n, n + k]
    logits     row i is the target's prediction for the token after input i
    accept     d_1..d_a (see tandem.sampling.verify), then one correction or bonus token c
    commit     tokens += [d_1..d_a, c]; KV is kept for positions [0, n + a] (t, d_1..d_a) and the
               rows written for rejected drafts are truncated away
    capture    rows 0..a (positions n..n+a) of the aux features go to the draft, each paired with the
               token that follows it: d_1..d_a, c

Failures are per item: an item that is wrong (INVALID) or does not fit the KV pool (EXHAUSTED) changes nothing and
the rest of the step runs. An exception of the forward pass itself undoes what the step reserved and propagates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from tandem.devices import pinned_host_copies
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.cuda_graphs import GraphedForward, GraphsFactory, Tensors, recorded_graphs
from tandem.layers.kv_cache import OutOfKVBlocks, SequenceKV
from tandem.layers.matmul import prepack
from tandem.layers.page_table import PageTable
from tandem.models.image_encoder import ImageEncoder
from tandem.models.registry import TargetModel
from tandem.models.stack import TargetOutput
from tandem.parallel.group import SINGLE_PROCESS
from tandem.sampling.draft_tree import DraftTree
from tandem.sampling.grammar import Grammars
from tandem.sampling.params import SamplingParams
from tandem.sampling.scored_rows import token_logprobs
from tandem.sampling.tree_verify import verify_tree
from tandem.sampling.verify import verify
from tandem.settings import KVCacheSettings
from target_server.admission import Admission, AdmittedItem
from target_server.commit import captured_rows, joined, tree_of, verify_batched
from target_server.images import StepImages
from target_server.items import (
    ItemStatus,
    OpenRequest,
    RequestError,
    RowStream,
    StepItem,
    StepResult,
    TargetRequest,
)
from target_server.ranks import RankDriver, build_cache
from target_server.step import ForwardStep


class TargetRunner:
    """Rank 0 of the target: all request state lives here, and `ranks` runs every forward pass on all ranks
    (tensor parallelism, target_server.ranks); its default is the single-process target."""

    def __init__(
        self,
        model: TargetModel,
        cache: KVCacheSettings,
        max_context: int,
        ranks: RankDriver | None = None,
        batched_verify: bool | None = None,  # None: on CUDA (commit.verify_batched); the CPU verifies item by item
        # How decode-shaped steps are replayed when `cache.cuda_graphs` asks for it.
        graphs: GraphsFactory = recorded_graphs,
        grammars: Grammars | None = None,  # structured output's matchers; None: refused
        images: ImageEncoder | None = None,  # encodes the images requests bring; None: refused
        image_limit: int = 0,  # images one prompt may hold
    ) -> None:
        self.model = model
        prepack(model)
        self.max_context = max_context
        self.ranks = ranks if ranks is not None else RankDriver(SINGLE_PROCESS)
        self.cache = build_cache(model, cache)
        self.requests: dict[str, TargetRequest] = {}
        config = model.config
        self.admission = Admission(
            self.cache, self.requests, max_context, config.vocab_size, grammars, config.hidden_size, images, image_limit
        )
        self.batched_verify = self.device.type == "cuda" if batched_verify is None else batched_verify
        self.graphs: GraphedForward | None = None
        if cache.cuda_graphs:
            if self.ranks.group.world_size > 1:
                raise ValueError(f"CUDA graphs run with tp 1, not {self.ranks.group.world_size}")
            self.graphs = graphs(self.cache)

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @torch.inference_mode()
    def step(self, items: Sequence[StepItem], preempt: Sequence[str] = ()) -> list[StepResult]:
        """Frees the KV of `preempt` (tokens kept), then runs the items in one forward pass, one result per item;
        items with decode_steps > 1 then go on decoding, one more forward pass of all of them per token.

        Items get KV blocks in order: the caller puts the items it cares most about first.
        """
        for request_id in preempt:
            request = self.requests.get(request_id)
            if request is not None:
                self.cache.release(request.kv)
        results = self._forward_items(items)
        going = dict(enumerate(items))
        for done_steps in range(1, max((item.decode_steps for item in items), default=1)):
            going = {i: item for i, item in going.items() if self._decodes_on(item, results[i], done_steps)}
            if not going:
                break
            more = self._forward_items(
                [StepItem(item.request_id, 1, top_logprobs=item.top_logprobs) for item in going.values()]
            )
            for index, extra in zip(list(going), more, strict=True):
                if extra.status is ItemStatus.OK:
                    results[index] = joined(results[index], extra)
                else:  # no KV room (or a sampling failure): the tokens so far stand, the decode ends here
                    del going[index]
        return results

    def _decodes_on(self, item: StepItem, result: StepResult, done_steps: int) -> bool:
        """Whether a multi-token decode item takes another token after `done_steps` forward passes."""
        if result.status is not ItemStatus.OK or item.drafts.tokens or done_steps >= item.decode_steps:
            return False
        if result.accepted:  # its grammar forced tokens (admission's shaping): as many as its KV room took
            return False
        request = self.requests.get(item.request_id)
        return (
            request is not None
            and bool(result.new_tokens)
            and result.new_tokens[-1] not in request.end_token_ids
            and len(request.tokens) < self.max_context
        )

    def _forward_items(self, items: Sequence[StepItem]) -> list[StepResult]:
        """Runs the items in one forward pass, one result per item; an item that cannot run fails alone."""
        results: dict[int, StepResult] = {}
        planned: list[tuple[int, AdmittedItem]] = []
        seen: set[str] = set()
        for index, item in enumerate(items):
            try:
                if item.request_id in seen:
                    raise RequestError(f"request_id: {item.request_id!r} appears twice in one step")
                seen.add(item.request_id)
                planned.append((index, self.admission.admit(item)))
            except RequestError as error:
                results[index] = StepResult(item.request_id, ItemStatus.INVALID, str(error))
            except OutOfKVBlocks as error:
                results[index] = StepResult(item.request_id, ItemStatus.EXHAUSTED, str(error))
        working = [entry for _, entry in planned if entry.has_work]
        try:
            output, logits = self._forward(working) if working else (None, None)
        except BaseException:
            for _, entry in planned:
                self.admission.undo(entry)
            raise
        if logits is not None and self.batched_verify:
            verify_batched([entry for _, entry in planned if entry.has_work], logits)
        for index, entry in planned:
            if output is None or logits is None or not entry.has_work:
                # Nothing to compute: the item moved where the request's rows go, or its chunk was all cached.
                results[index] = StepResult(entry.item.request_id, ItemStatus.OK)
            else:
                results[index] = self._commit(entry, output, logits)
            if entry.reused:
                results[index] = replace(results[index], cached_tokens=entry.reused)
        return [results[index] for index in range(len(items))]

    def prefill(
        self, request_id: str, prompt: Sequence[int], sampling: SamplingParams, capture: tuple[int, ...] = ()
    ) -> StepResult:
        """Opens a request and computes its whole prompt in one step; raises RequestError unless it succeeds."""
        item = StepItem(request_id, len(prompt), open=OpenRequest(prompt, sampling), stream=RowStream(capture))
        return self._only(item)

    def verify(self, request_id: str, draft_tokens: Sequence[int] = ()) -> StepResult:
        """Verifies drafts after the last committed token (none: plain decoding); raises unless it succeeds."""
        return self._only(StepItem(request_id, 1, DraftTree.chain(draft_tokens)))

    def weight_shards(self, name: str) -> list[torch.Tensor]:  # -> tp tensors [s, hidden], padding rows zero
        """The vocab-parallel shards of a shared table ("embed_tokens" or "lm_head") as each rank holds it, by the
        rule of tandem.parallel.vocab; tandem.parallel.vocab.assemble_shards gives the checkpoint's table back.

        Safe from any thread (RankDriver's lock); with tp > 1 it gathers the shards over torch.distributed and so
        blocks like a forward pass: keep it off the event loop.
        """
        return self.ranks.weight_shards(self.model, name)

    def release(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                self.cache.release(request.kv)

    def _only(self, item: StepItem) -> StepResult:
        (result,) = self.step([item])
        if result.status is not ItemStatus.OK:
            raise RequestError(result.message)
        return result

    def _forward(self, planned: Sequence[AdmittedItem]) -> tuple[TargetOutput, torch.Tensor]:
        """One packed forward over every admitted item (replays as spans of their own); fills in the row slices."""
        sequences: list[tuple[SequenceKV, int]] = []
        trees: list[list[int] | None] = []
        images = StepImages()
        inputs: list[int] = []
        logit_rows: list[int] = []
        for entry in planned:
            request, item, start = entry.request, entry.item, entry.start_length
            if entry.scratch is not None:
                entry.scratch_rows = slice(len(inputs), len(inputs) + start)
                sequences.append((entry.scratch, start))
                trees.append(None)
                images.add(request.images, 0, start, len(inputs))
                inputs += request.tokens[:start]
            new = [*request.tokens[start : start + item.num_tokens], *item.drafts.tokens]
            entry.rows = slice(len(inputs), len(inputs) + len(new))
            sequences.append((request.kv, len(new)))
            trees.append(None if item.drafts.is_chain else tree_of(item))
            images.add(request.images, start, start + item.num_tokens, len(inputs))
            inputs += new
            if entry.reaches_end:
                # The last committed token's row and every draft's row are scored.
                entry.logit_start = len(logit_rows)
                logit_rows += range(entry.rows.stop - 1 - len(item.drafts), entry.rows.stop)
        table = self.cache.plan_table(sequences, parents=trees, spans=images.spans)
        capture = tuple(sorted({index for entry in planned for index in entry.request.stream.capture}))
        input_ids = torch.tensor(inputs, dtype=torch.long, device=self.device)
        graphed = (
            self._graphed(table, input_ids, capture)
            if len(logit_rows) == len(inputs) and not any(images.spans)
            else None
        )
        if graphed is not None:
            output, logits = graphed
        else:
            metadata = AttentionMetadata.planned(table, self.cache.backend)
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            step = ForwardStep(input_ids, metadata, capture, rows, images.embeddings(self.device))
            output, logits = self.ranks.forward(self.model, self.cache, step)
        for entry in planned:  # release the replays' scratch sequences: their rows are in `output`
            if entry.scratch is not None:
                self.cache.release(entry.scratch)
        if output.captured and self.device.type == "cuda":  # rows go on the wire from the host: one copy a step
            indices = list(output.captured)
            host = pinned_host_copies([output.captured[index] for index in indices])
            output = TargetOutput(output.normed, dict(zip(indices, host, strict=True)))
        return output, logits  # logits [len(logit_rows), vocab], on the device: acceptance is decided there

    def _graphed(
        self, table: PageTable, input_ids: torch.Tensor, capture: tuple[int, ...]
    ) -> tuple[TargetOutput, torch.Tensor] | None:
        """A step whose every row is scored (decodes, chain verifications) from a recorded shape, when CUDA graphs
        are on and the step has that shape (tandem.layers.cuda_graphs); None: it runs as planned."""
        if self.graphs is None:
            return None

        def forward(inputs: Tensors, metadata: AttentionMetadata) -> dict[str, torch.Tensor]:
            output = self.model(inputs["input_ids"], metadata, self.cache, capture)
            captured = {f"captured.{index}": rows for index, rows in output.captured.items()}
            return {"normed": output.normed, "logits": self.model.compute_logits(output.normed), **captured}

        outputs = self.graphs.run(table, {"input_ids": input_ids}, capture, forward)
        if outputs is None:
            return None
        captured = {index: outputs[f"captured.{index}"] for index in capture}
        return TargetOutput(outputs["normed"], captured), outputs["logits"]

    def _commit(self, entry: AdmittedItem, output: TargetOutput, logits: torch.Tensor) -> StepResult:
        """Acceptance and KV commit of one item after the forward pass; a failure here undoes this item only."""
        request, item = entry.request, entry.item
        if not item.drafts.is_chain:
            return self._commit_tree(entry, output, logits)
        try:
            accepted, new_tokens, logprobs = 0, [], []
            if entry.reaches_end:
                drafts = list(item.drafts.tokens)
                scored = logits[entry.logit_start : entry.logit_start + 1 + len(drafts)]  # [1 + k, vocab]
                masked = request.processed(scored, item.drafts)
                position = len(request.tokens)  # of the token row 0 decides (a seed's noise is keyed by it)
                outcome = entry.outcome or verify(masked, drafts, request.sampling, request.generator, None, position)
                accepted, new_tokens = outcome.accepted, outcome.tokens
                if item.top_logprobs is not None:
                    logprobs = token_logprobs(scored, new_tokens, item.top_logprobs)
        except (ValueError, RuntimeError) as error:
            self.admission.undo(entry)
            return StepResult(item.request_id, ItemStatus.INVALID, f"sampling: {error}")
        start = entry.start_length
        computed = item.num_tokens + accepted
        # Keep KV for the computed tokens and the accepted drafts; drop rows of rejected drafts.
        self.cache.truncate(request.kv, start + computed)
        request.commit(new_tokens)
        self.cache.publish(request.kv, request.tokens, request.cache_salt, request.marks)
        captured = captured_rows(entry, output, start + computed, self.device)
        return StepResult(item.request_id, ItemStatus.OK, "", accepted, new_tokens, captured, logprobs)

    def _commit_tree(self, entry: AdmittedItem, output: TargetOutput, logits: torch.Tensor) -> StepResult:
        """_commit for a tree of drafts: verify the tree, keep the accepted path's KV (moved down to consecutive
        positions) and free the rest; the draft gets the path's rows as a chain.

        Example: KV of 10 positions, verification of t (position 10) and a tree of 5 drafts at KV rows 11..15;
        the accepted path [1, 4] keeps rows [10, 12, 15], moved to positions 10, 11, 12.
        """
        request, item = entry.request, entry.item
        tree = item.drafts
        try:
            scored = logits[entry.logit_start : entry.logit_start + 1 + len(tree)]  # [1 + n, vocab]
            masked = request.processed(scored, tree)
            outcome = verify_tree(masked, tree, request.sampling, request.generator, len(request.tokens))
            path_rows = [0, *(1 + node for node in outcome.path)]  # the scored rows that chose the new tokens
            logprobs = []
            if item.top_logprobs is not None:
                logprobs = token_logprobs(scored[path_rows], outcome.tokens, item.top_logprobs)
        except (ValueError, RuntimeError) as error:
            self.admission.undo(entry)
            return StepResult(item.request_id, ItemStatus.INVALID, f"sampling: {error}")
        start = entry.start_length
        root = start + item.num_tokens - 1  # the last committed token's position
        self.cache.keep(request.kv, [root, *(root + 1 + node for node in outcome.path)])
        request.commit(outcome.tokens)
        self.cache.publish(request.kv, request.tokens, request.cache_salt, request.marks)
        first_draft_row = entry.rows.start + item.num_tokens
        rows = [*range(entry.rows.start, first_draft_row), *(first_draft_row + node for node in outcome.path)]
        captured = captured_rows(entry, output, request.kv.length, self.device, rows)
        return StepResult(item.request_id, ItemStatus.OK, "", outcome.accepted, outcome.tokens, captured, logprobs)
