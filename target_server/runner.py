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

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from tandem.devices import pinned_host_copies
from tandem.layers.attention_backend import AttentionMetadata
from tandem.layers.cuda_graphs import GraphedForward, GraphsFactory, Tensors, recorded_graphs
from tandem.layers.kv_cache import OutOfKVBlocks, SequenceKV
from tandem.layers.matmul import prepack
from tandem.layers.page_table import PageTable, check_tree
from tandem.models.registry import TargetModel
from tandem.models.stack import TargetOutput
from tandem.parallel.group import SINGLE_PROCESS
from tandem.sampling.batched import verify_items
from tandem.sampling.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from tandem.sampling.params import SamplingParams
from tandem.sampling.scored_rows import mask_stop_tokens, token_logprobs
from tandem.sampling.tree_verify import mask_tree_stop_tokens, verify_tree
from tandem.sampling.verify import VerifyOutcome, make_generator, verify
from tandem.settings import KVCacheSettings
from target_server.ranks import RankDriver, build_cache
from target_server.step import ForwardStep

# Draft tokens one item may carry: far above any useful chain, low enough that a faulty draft cannot make one
# request's verification the size of a prefill.
MAX_DRAFT_TOKENS = 64


class RequestError(ValueError):
    """An item the runner cannot serve (unknown id, duplicate id, too long); the message says why."""


class ItemStatus(enum.Enum):
    OK = "ok"
    INVALID = "invalid"  # the item is wrong; nothing changed
    EXHAUSTED = "exhausted"  # the KV pool cannot hold the item now; nothing changed


@dataclass
class TargetRequest:
    request_id: str
    tokens: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    capture: tuple[int, ...]  # capture indices streamed to the request's draft; () for target-only
    kv: SequenceKV = field(default_factory=SequenceKV)
    prompt_length: int = 0  # tokens[prompt_length:] are the request's new tokens
    tokens_only: bool = False  # the draft takes committed tokens only (rows with zero-width features)
    end_token_ids: frozenset[int] = frozenset()  # a multi-token decode stops after one of these


@dataclass(frozen=True)
class CapturedRows:
    """Aux features of committed positions [start_position, start_position + n) and their next tokens."""

    request_id: str
    start_position: int  # -1 for token-only rows from scratch (position -1 has no feature; its next token is x[0])
    next_tokens: list[int]  # n tokens
    features: torch.Tensor  # [n, len(capture) * hidden]; [n, 0] for a token-only draft


@dataclass(frozen=True)
class OpenRequest:
    """What a request's first item carries: its prompt and how to sample."""

    prompt: Sequence[int]
    sampling: SamplingParams
    end_token_ids: frozenset[int] = frozenset()  # tokens that end the request (EOS, stop ids)


@dataclass(frozen=True)
class StepItem:
    request_id: str
    num_tokens: int  # committed tokens to compute, from where the request's KV ends
    draft_tokens: Sequence[int] = ()  # only when the item reaches the last committed token
    open: OpenRequest | None = None  # on the request's first item
    capture: tuple[int, ...] | None = None  # a new capture set (open, or a move to another draft); None: unchanged
    tokens_only: bool = False  # with a new capture set (then ()): the draft takes committed tokens only
    # Recompute the aux rows of every position the request's KV holds, for a draft that starts from scratch; the
    # request's own KV is not rewritten (a recomputed KV could differ in the last bits, and with it the outputs).
    replay: bool = False
    top_logprobs: int | None = None  # report each new token's logprob and this many best tokens; None: no logprobs
    # A tree of drafts (tandem.sampling.tree_verify): per draft its parent among them, -1 the last committed token;
    # (): the drafts are a chain.
    draft_parents: Sequence[int] = ()
    # Without drafts, at the last committed token: decode up to this many tokens in this step, one forward pass
    # each, stopping after an end token or when the KV pool has no room for the next one.
    decode_steps: int = 1


@dataclass(frozen=True)
class ItemResult:
    request_id: str
    status: ItemStatus
    message: str = ""  # why, when not OK
    accepted: int = 0  # draft tokens accepted
    new_tokens: list[int] = field(default_factory=list)  # accepted drafts + correction/bonus; [] for a prompt chunk
    captured: CapturedRows | None = None  # replayed rows, then the rows this item committed
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per new token when the item asked


@dataclass
class _Planned:
    """An item admitted to the forward pass: where its rows are and what it reserved."""

    item: StepItem
    request: TargetRequest
    start_length: int  # kv.length before the step
    opened: bool
    previous_stream: tuple[tuple[int, ...], bool]  # the request's (capture, tokens_only) before the item
    scratch: SequenceKV | None  # the replay's sequence
    rows: slice = field(default_factory=lambda: slice(0))  # the item's rows in the packed batch
    scratch_rows: slice = field(default_factory=lambda: slice(0))  # the replay's rows
    logit_start: int = 0  # the item's first row among the scored rows
    outcome: VerifyOutcome | None = None  # decided with the step's batch on the device (_verify_batched)

    @property
    def reaches_end(self) -> bool:
        """Whether the item computes the last committed token, so that its logits decide the next tokens."""
        return self.start_length + self.item.num_tokens == len(self.request.tokens)

    @property
    def has_work(self) -> bool:
        return self.item.num_tokens > 0 or self.scratch is not None


class TargetRunner:
    """Rank 0 of the target: all request state lives here, and `ranks` runs every forward pass on all ranks
    (tensor parallelism, target_server.ranks); its default is the single-process target."""

    def __init__(
        self,
        model: TargetModel,
        cache: KVCacheSettings,
        max_context: int,
        ranks: RankDriver | None = None,
        batched_verify: bool | None = None,  # None: on CUDA (see _verify_batched); the CPU verifies item by item
        # How decode-shaped steps are replayed when `cache.cuda_graphs` asks for it.
        graphs: GraphsFactory = recorded_graphs,
    ) -> None:
        self.model = model
        prepack(model)
        self.max_context = max_context
        self.ranks = ranks if ranks is not None else RankDriver(SINGLE_PROCESS)
        self.cache = build_cache(model, cache)
        self.requests: dict[str, TargetRequest] = {}
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
    def step(self, items: Sequence[StepItem], preempt: Sequence[str] = ()) -> list[ItemResult]:
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
                    results[index] = _joined(results[index], extra)
                else:  # no KV room (or a sampling failure): the tokens so far stand, the decode ends here
                    del going[index]
        return results

    def _decodes_on(self, item: StepItem, result: ItemResult, done_steps: int) -> bool:
        """Whether a multi-token decode item takes another token after `done_steps` forward passes."""
        if result.status is not ItemStatus.OK or item.draft_tokens or done_steps >= item.decode_steps:
            return False
        request = self.requests.get(item.request_id)
        return (
            request is not None
            and bool(result.new_tokens)
            and result.new_tokens[-1] not in request.end_token_ids
            and len(request.tokens) < self.max_context
        )

    def _forward_items(self, items: Sequence[StepItem]) -> list[ItemResult]:
        """Runs the items in one forward pass, one result per item; an item that cannot run fails alone."""
        results: dict[int, ItemResult] = {}
        planned: list[tuple[int, _Planned]] = []
        seen: set[str] = set()
        for index, item in enumerate(items):
            try:
                if item.request_id in seen:
                    raise RequestError(f"request_id: {item.request_id!r} appears twice in one step")
                seen.add(item.request_id)
                planned.append((index, self._admit(item)))
            except RequestError as error:
                results[index] = ItemResult(item.request_id, ItemStatus.INVALID, str(error))
            except OutOfKVBlocks as error:
                results[index] = ItemResult(item.request_id, ItemStatus.EXHAUSTED, str(error))
        working = [entry for _, entry in planned if entry.has_work]
        try:
            output, logits = self._forward(working) if working else (None, None)
        except BaseException:
            for _, entry in planned:
                self._undo(entry)
            raise
        if logits is not None and self.batched_verify:
            self._verify_batched([entry for _, entry in planned if entry.has_work], logits)
        for index, entry in planned:
            if output is None or logits is None or not entry.has_work:
                # Nothing to compute: the item only changed where the request's rows go (a move to no draft).
                results[index] = ItemResult(entry.item.request_id, ItemStatus.OK)
            else:
                results[index] = self._commit(entry, output, logits)
        return [results[index] for index in range(len(items))]

    def prefill(
        self, request_id: str, prompt: Sequence[int], sampling: SamplingParams, capture: tuple[int, ...] = ()
    ) -> ItemResult:
        """Opens a request and computes its whole prompt in one step; raises RequestError unless it succeeds."""
        item = StepItem(request_id, len(prompt), open=OpenRequest(prompt, sampling), capture=capture)
        return self._only(item)

    def verify(self, request_id: str, draft_tokens: Sequence[int] = ()) -> ItemResult:
        """Verifies drafts after the last committed token (none: plain decoding); raises unless it succeeds."""
        return self._only(StepItem(request_id, 1, draft_tokens))

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

    def _only(self, item: StepItem) -> ItemResult:
        (result,) = self.step([item])
        if result.status is not ItemStatus.OK:
            raise RequestError(result.message)
        return result

    def _admit(self, item: StepItem) -> _Planned:
        """Checks an item and reserves its KV blocks; raises (changing nothing) when it cannot run."""
        opened = item.open is not None
        if item.open is not None:
            if item.request_id in self.requests:
                raise RequestError(f"request_id: {item.request_id!r} is already running")
            prompt = list(item.open.prompt)
            if not 0 < len(prompt) < self.max_context:
                raise RequestError(f"prompt: {len(prompt)} tokens, the context holds {self.max_context}")
            self._check_ids("prompt", prompt)
            sampling = item.open.sampling
            self._check_ids("sampling.stop_token_ids", sampling.stop_token_ids)
            generator = make_generator(sampling)
            request = TargetRequest(
                item.request_id,
                prompt,
                sampling,
                generator,
                (),
                prompt_length=len(prompt),
                end_token_ids=item.open.end_token_ids,
            )
        else:
            found = self.requests.get(item.request_id)
            if found is None:
                raise RequestError(f"request_id: {item.request_id!r} is not running on the target")
            request = found
        start = request.kv.length
        uncomputed = len(request.tokens) - start
        if not 0 <= item.num_tokens <= uncomputed:
            raise RequestError(
                f"num_tokens: {item.num_tokens}, request {item.request_id!r} has {uncomputed} tokens without KV"
            )
        drafts = list(item.draft_tokens)
        if drafts and item.num_tokens != uncomputed:
            raise RequestError("draft_tokens: only an item that reaches the last committed token can verify drafts")
        if len(drafts) > MAX_DRAFT_TOKENS:
            raise RequestError(f"draft_tokens: {len(drafts)}, at most {MAX_DRAFT_TOKENS} per item")
        self._check_ids("draft_tokens", drafts)
        if item.draft_parents:
            try:
                check_tree(item.draft_parents, len(drafts), "draft_parents")
            except ValueError as error:
                raise RequestError(str(error)) from error
        top = item.top_logprobs
        if top is not None and not 0 <= top <= min(MAX_TOP_LOGPROBS, self.model.config.vocab_size):
            raise RequestError(f"top_logprobs: {top}, at most {MAX_TOP_LOGPROBS}")
        if len(request.tokens) + len(drafts) > self.max_context:
            raise RequestError(
                f"draft_tokens: request {item.request_id!r} would reach {len(request.tokens) + len(drafts)} "
                f"tokens, the context holds {self.max_context}"
            )
        replay = item.replay and bool(item.capture) and start > 0
        scratch = SequenceKV() if replay else None
        needed = self.cache.blocks_needed(request.kv, start + item.num_tokens + len(drafts))
        needed += self.cache.blocks_needed(scratch, start) if scratch is not None else 0
        if needed > self.cache.num_free_blocks:
            raise OutOfKVBlocks(
                f"KV cache: request {item.request_id!r} needs {needed} more blocks, {self.cache.num_free_blocks} free"
            )
        self.cache.reserve(request.kv, start + item.num_tokens + len(drafts))
        if scratch is not None:
            self.cache.reserve(scratch, start)
        if opened:
            self.requests[item.request_id] = request
        previous_stream = (request.capture, request.tokens_only)
        if item.capture is not None:
            request.capture, request.tokens_only = item.capture, item.tokens_only
        return _Planned(item, request, start, opened, previous_stream, scratch)

    def _check_ids(self, name: str, tokens: Sequence[int]) -> None:
        vocab_size = self.model.config.vocab_size
        for index, token in enumerate(tokens):
            if not 0 <= token < vocab_size:
                raise RequestError(f"{name}[{index}]: {token} is outside the vocabulary [0, {vocab_size})")

    def _forward(self, planned: Sequence[_Planned]) -> tuple[TargetOutput, torch.Tensor]:
        """One packed forward over every admitted item (replays as spans of their own); fills in the row slices."""
        sequences: list[tuple[SequenceKV, int]] = []
        trees: list[list[int] | None] = []
        inputs: list[int] = []
        logit_rows: list[int] = []
        for entry in planned:
            request, item, start = entry.request, entry.item, entry.start_length
            if entry.scratch is not None:
                entry.scratch_rows = slice(len(inputs), len(inputs) + start)
                sequences.append((entry.scratch, start))
                trees.append(None)
                inputs += request.tokens[:start]
            new = [*request.tokens[start : start + item.num_tokens], *item.draft_tokens]
            entry.rows = slice(len(inputs), len(inputs) + len(new))
            sequences.append((request.kv, len(new)))
            trees.append(_tree_of(item) if item.draft_parents else None)
            inputs += new
            if entry.reaches_end:
                # The last committed token's row and every draft's row are scored.
                entry.logit_start = len(logit_rows)
                logit_rows += range(entry.rows.stop - 1 - len(item.draft_tokens), entry.rows.stop)
        table = self.cache.plan_table(sequences, parents=trees)
        capture = tuple(sorted({index for entry in planned for index in entry.request.capture}))
        input_ids = torch.tensor(inputs, dtype=torch.long, device=self.device)
        graphed = self._graphed(table, input_ids, capture) if len(logit_rows) == len(inputs) else None
        if graphed is not None:
            output, logits = graphed
        else:
            metadata = AttentionMetadata.planned(table, self.cache.backend)
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            output, logits = self.ranks.forward(self.model, self.cache, ForwardStep(input_ids, metadata, capture, rows))
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

    def _verify_batched(self, planned: Sequence[_Planned], logits: torch.Tensor) -> None:
        """Decides, in one batch on the logits' device (tandem.sampling.batched), every item that needs no request's
        own generator: greedy ones and sampled ones without a seed. Seeded ones keep their CPU generator (_commit),
        so that a seed gives the same tokens on every device."""
        chosen = [
            entry
            for entry in planned
            if entry.reaches_end
            and not entry.item.draft_parents  # trees are verified item by item (_commit)
            and (entry.request.sampling.is_greedy or entry.request.sampling.seed is None)
        ]
        if not chosen:
            return
        scored = []
        for entry in chosen:
            rows = logits[entry.logit_start : entry.logit_start + 1 + len(entry.item.draft_tokens)]  # [1 + k, vocab]
            generated = len(entry.request.tokens) - entry.request.prompt_length
            scored.append(mask_stop_tokens(rows, entry.request.sampling, generated))
        drafts = [list(entry.item.draft_tokens) for entry in chosen]
        outcomes = verify_items(scored, drafts, [entry.request.sampling for entry in chosen])
        for entry, outcome in zip(chosen, outcomes, strict=True):
            entry.outcome = outcome

    def _commit(self, entry: _Planned, output: TargetOutput, logits: torch.Tensor) -> ItemResult:
        """Acceptance and KV commit of one item after the forward pass; a failure here undoes this item only."""
        request, item = entry.request, entry.item
        if item.draft_parents:
            return self._commit_tree(entry, output, logits)
        try:
            accepted, new_tokens, logprobs = 0, [], []
            if entry.reaches_end:
                drafts = list(item.draft_tokens)
                scored = logits[entry.logit_start : entry.logit_start + 1 + len(drafts)]  # [1 + k, vocab]
                generated = len(request.tokens) - request.prompt_length
                masked = mask_stop_tokens(scored, request.sampling, generated)
                outcome = entry.outcome or verify(masked, drafts, request.sampling, request.generator)
                accepted, new_tokens = outcome.accepted, outcome.tokens
                if item.top_logprobs is not None:
                    logprobs = token_logprobs(scored, new_tokens, item.top_logprobs)
        except (ValueError, RuntimeError) as error:
            self._undo(entry)
            return ItemResult(item.request_id, ItemStatus.INVALID, f"sampling: {error}")
        start = entry.start_length
        computed = item.num_tokens + accepted
        # Keep KV for the computed tokens and the accepted drafts; drop rows of rejected drafts.
        self.cache.truncate(request.kv, start + computed)
        request.tokens.extend(new_tokens)
        captured = self._captured(entry, output, start + computed)
        return ItemResult(item.request_id, ItemStatus.OK, "", accepted, new_tokens, captured, logprobs)

    def _commit_tree(self, entry: _Planned, output: TargetOutput, logits: torch.Tensor) -> ItemResult:
        """_commit for a tree of drafts: verify the tree, keep the accepted path's KV (moved down to consecutive
        positions) and free the rest; the draft gets the path's rows as a chain.

        Example: KV of 10 positions, verification of t (position 10) and a tree of 5 drafts at KV rows 11..15;
        the accepted path [1, 4] keeps rows [10, 12, 15], moved to positions 10, 11, 12.
        """
        request, item = entry.request, entry.item
        parents, drafts = list(item.draft_parents), list(item.draft_tokens)
        try:
            scored = logits[entry.logit_start : entry.logit_start + 1 + len(drafts)]  # [1 + n, vocab]
            generated = len(request.tokens) - request.prompt_length
            masked = mask_tree_stop_tokens(scored, parents, request.sampling, generated)
            outcome = verify_tree(masked, drafts, parents, request.sampling, request.generator)
            path_rows = [0, *(1 + node for node in outcome.path)]  # the scored rows that chose the new tokens
            logprobs = []
            if item.top_logprobs is not None:
                logprobs = token_logprobs(scored[path_rows], outcome.tokens, item.top_logprobs)
        except (ValueError, RuntimeError) as error:
            self._undo(entry)
            return ItemResult(item.request_id, ItemStatus.INVALID, f"sampling: {error}")
        start = entry.start_length
        root = start + item.num_tokens - 1  # the last committed token's position
        self.cache.keep(request.kv, [root, *(root + 1 + node for node in outcome.path)])
        request.tokens.extend(outcome.tokens)
        first_draft_row = entry.rows.start + item.num_tokens
        rows = [*range(entry.rows.start, first_draft_row), *(first_draft_row + node for node in outcome.path)]
        captured = self._captured(entry, output, request.kv.length, rows)
        return ItemResult(item.request_id, ItemStatus.OK, "", outcome.accepted, outcome.tokens, captured, logprobs)

    def _undo(self, entry: _Planned) -> None:
        """Returns what an item reserved: its KV back to the start length (an item that opened the request: all)."""
        if entry.scratch is not None:
            self.cache.release(entry.scratch)
        entry.request.capture, entry.request.tokens_only = entry.previous_stream
        if entry.opened:
            self.requests.pop(entry.item.request_id, None)
            self.cache.release(entry.request.kv)
        else:
            self.cache.truncate(entry.request.kv, entry.start_length)

    def _captured(
        self, entry: _Planned, output: TargetOutput, end: int, rows: Sequence[int] | None = None
    ) -> CapturedRows | None:
        """Rows of positions [first, end) for the request's draft: the replayed ones, then the committed ones
        (`rows` of the packed batch after a tree; None: the item's first end - start rows)."""
        request = entry.request
        start = entry.start_length
        if request.tokens_only:
            # A token-only draft needs x[0] too: rows from scratch start at position -1, which pairs with x[0].
            first = -1 if start == 0 or entry.item.replay else start
            empty = torch.empty((end - first, 0), device=self.device)  # [end - first, 0]
            return CapturedRows(request.request_id, first, request.tokens[first + 1 : end + 1], empty)
        if not request.capture:
            return None
        parts: list[slice | torch.Tensor] = [entry.scratch_rows] if entry.scratch is not None else []
        if rows is None:
            parts.append(slice(entry.rows.start, entry.rows.start + end - start))
        else:
            parts.append(torch.tensor(rows, dtype=torch.long, device=self.device))
        features = torch.cat(
            [torch.cat([output.captured[index][rows] for index in request.capture], dim=-1) for rows in parts]
        )  # [end - first, len(capture) * hidden]
        first = 0 if entry.scratch is not None else start
        return CapturedRows(request.request_id, first, request.tokens[first + 1 : end + 1], features)


def _joined(first: ItemResult, then: ItemResult) -> ItemResult:
    """One result for two consecutive forward passes of a decoding request (no drafts, so nothing accepted)."""
    captured = first.captured
    if captured is not None and then.captured is not None:
        captured = CapturedRows(
            captured.request_id,
            captured.start_position,
            [*captured.next_tokens, *then.captured.next_tokens],
            torch.cat([captured.features, then.captured.features]),  # rows of consecutive positions
        )
    return replace(
        first,
        new_tokens=[*first.new_tokens, *then.new_tokens],
        captured=captured,
        logprobs=[*first.logprobs, *then.logprobs],
    )


def _tree_of(item: StepItem) -> list[int]:
    """The parents of an item's new tokens: its committed tokens as a chain, then its draft tree under the last one.

    Example: num_tokens 1 and draft_parents [-1, -1, 0] give [-1, 0, 0, 1].
    """
    chain = list(range(-1, item.num_tokens - 1))
    last = item.num_tokens - 1
    return [*chain, *(last if parent < 0 else item.num_tokens + parent for parent in item.draft_parents)]
