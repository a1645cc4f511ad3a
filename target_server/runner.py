"""The target's model runner: prefill, batched verification, acceptance, KV commit, aux capture.

A request's committed tokens are `tokens`; KV exists for every committed token but the last
(`kv.length == len(tokens) - 1`), which is the input of the next forward pass.

One verification round for one request, with k draft tokens d_1..d_k:
    input      [t, d_1, ..., d_k] at positions [n, n + k], t = last committed token, n = kv.length
    logits     row i is the target's prediction for the token after input i
    accept     d_1..d_a (see tandem.sampling.verify), then one correction or bonus token c
    commit     tokens += [d_1..d_a, c]; KV is kept for positions [0, n + a] (t, d_1..d_a) and the
               rows written for rejected drafts are truncated away
    capture    rows 0..a (positions n..n+a) of the aux features go to the draft, each paired with the
               token that follows it: d_1..d_a, c
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.layers.kv_cache import OutOfKVBlocks, SequenceKV
from tandem.models.registry import TargetModel
from tandem.models.stack import TargetOutput
from tandem.parallel.group import SINGLE_PROCESS
from tandem.sampling.params import SamplingParams
from tandem.sampling.verify import make_generator, sample_token, verify
from tandem.settings import KVCacheSettings
from target_server.ranks import RankDriver, build_cache
from target_server.step import ForwardStep


class RequestError(ValueError):
    """A request the runner cannot serve (unknown id, duplicate id, too long); the message says why."""


@dataclass
class TargetRequest:
    request_id: str
    tokens: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    capture: tuple[int, ...]  # capture indices streamed to the request's draft; () for target-only
    kv: SequenceKV = field(default_factory=SequenceKV)


@dataclass(frozen=True)
class CapturedRows:
    """Aux features of committed positions [start_position, start_position + n) and their next tokens."""

    request_id: str
    start_position: int
    next_tokens: list[int]  # n tokens
    features: torch.Tensor  # [n, len(capture) * hidden]


@dataclass(frozen=True)
class PrefillInput:
    request_id: str
    input_ids: Sequence[int]
    sampling: SamplingParams
    capture: tuple[int, ...]


@dataclass(frozen=True)
class StepResult:
    request_id: str
    accepted: int  # draft tokens accepted
    new_tokens: list[int]  # accepted drafts + correction/bonus (prefill: the first token)
    captured: CapturedRows | None


class TargetRunner:
    """Rank 0 of the target: all request state lives here, and `ranks` runs every forward pass on all ranks
    (tensor parallelism, target_server.ranks); its default is the single-process target."""

    def __init__(
        self, model: TargetModel, cache: KVCacheSettings, max_context: int, ranks: RankDriver | None = None
    ) -> None:
        self.model = model
        self.max_context = max_context
        self.ranks = ranks if ranks is not None else RankDriver(SINGLE_PROCESS)
        self.cache = build_cache(model, cache)
        self.requests: dict[str, TargetRequest] = {}

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @torch.inference_mode()
    def prefill(self, inputs: Sequence[PrefillInput]) -> list[StepResult]:
        for item in inputs:
            if item.request_id in self.requests:
                raise RequestError(f"request_id: {item.request_id!r} is already running")
            if not 0 < len(item.input_ids) < self.max_context:
                raise RequestError(f"input_ids: {len(item.input_ids)} tokens, the context holds {self.max_context}")
        requests = [
            TargetRequest(
                item.request_id, list(item.input_ids), item.sampling, make_generator(item.sampling), item.capture
            )
            for item in inputs
        ]
        try:
            metadata = self.cache.plan([(request.kv, len(request.tokens)) for request in requests])
        except OutOfKVBlocks:
            for request in requests:
                self.cache.release(request.kv)
            raise
        input_ids = torch.tensor([t for request in requests for t in request.tokens], device=self.device)
        last_rows = torch.tensor([span.query_start + span.query_len - 1 for span in metadata.spans], device=self.device)
        step = ForwardStep(input_ids, metadata, tuple(self._capture_union(requests)), last_rows)
        output, logits = self.ranks.forward(self.model, self.cache, step)
        logits = logits.cpu()  # [num_requests, vocab]
        results = []
        for row, (request, span) in enumerate(zip(requests, metadata.spans, strict=True)):
            first = sample_token(logits[row], request.sampling, request.generator)
            next_tokens = [*request.tokens[1:], first]
            request.tokens.append(first)
            self.requests[request.request_id] = request
            rows = slice(span.query_start, span.query_start + span.query_len)
            captured = self._captured(request, output, rows, 0, next_tokens)
            results.append(StepResult(request.request_id, 0, [first], captured))
        return results

    @torch.inference_mode()
    def verify(self, drafts: Sequence[tuple[str, Sequence[int]]]) -> list[StepResult]:
        """Verifies (request_id, draft tokens) pairs in one forward pass; an empty draft is plain decoding."""
        pairs = [(self._get(request_id), list(draft)) for request_id, draft in drafts]
        for request, draft in pairs:
            if len(request.tokens) + len(draft) > self.max_context:
                raise RequestError(
                    f"draft_tokens: request {request.request_id!r} would reach {len(request.tokens) + len(draft)} "
                    f"tokens, the context holds {self.max_context}"
                )
        requests = [request for request, _ in pairs]
        start_lengths = [request.kv.length for request in requests]
        metadata = self.cache.plan([(request.kv, 1 + len(draft)) for request, draft in pairs])
        flat_inputs = [token for request, draft in pairs for token in (request.tokens[-1], *draft)]
        input_ids = torch.tensor(flat_inputs, device=self.device)
        every_row = torch.arange(len(flat_inputs), device=self.device)
        step = ForwardStep(input_ids, metadata, tuple(self._capture_union(requests)), every_row)
        output, logits = self.ranks.forward(self.model, self.cache, step)
        logits = logits.cpu()  # [num_tokens, vocab]
        results = []
        for (request, draft), span, start in zip(pairs, metadata.spans, start_lengths, strict=True):
            rows = slice(span.query_start, span.query_start + span.query_len)
            outcome = verify(logits[rows], draft, request.sampling, request.generator)
            # Keep KV for the last committed token and the accepted drafts; drop rows of rejected drafts.
            self.cache.truncate(request.kv, start + 1 + outcome.accepted)
            request.tokens.extend(outcome.tokens)
            committed = slice(span.query_start, span.query_start + 1 + outcome.accepted)
            captured = self._captured(request, output, committed, start, outcome.tokens)
            results.append(StepResult(request.request_id, outcome.accepted, outcome.tokens, captured))
        return results

    @torch.inference_mode()
    def reassign(self, request_id: str, capture: tuple[int, ...]) -> CapturedRows | None:
        """Points a request at another draft (capture () : none) and recomputes its committed rows for it.

        The rows are recomputed in a scratch sequence that is released at once: the request's own KV
        is never rewritten, so its outputs cannot change (a recomputed KV could differ in the last bits).
        """
        request = self._get(request_id)
        request.capture = capture
        if not capture:
            return None
        committed = request.kv.length
        scratch = SequenceKV()
        try:
            metadata = self.cache.plan([(scratch, committed)])
            input_ids = torch.tensor(request.tokens[:committed], device=self.device)
            no_logits = torch.empty(0, dtype=torch.long, device=self.device)
            output, _ = self.ranks.forward(self.model, self.cache, ForwardStep(input_ids, metadata, capture, no_logits))
        finally:
            self.cache.release(scratch)
        return self._captured(request, output, slice(0, committed), 0, request.tokens[1 : committed + 1])

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

    def _get(self, request_id: str) -> TargetRequest:
        request = self.requests.get(request_id)
        if request is None:
            raise RequestError(f"request_id: {request_id!r} is not running on the target")
        return request

    @staticmethod
    def _capture_union(requests: Sequence[TargetRequest]) -> list[int]:
        return sorted({index for request in requests for index in request.capture})

    @staticmethod
    def _captured(
        request: TargetRequest, output: TargetOutput, rows: slice, start_position: int, next_tokens: list[int]
    ) -> CapturedRows | None:
        if not request.capture:
            return None
        features = torch.cat([output.captured[index][rows] for index in request.capture], dim=-1)
        return CapturedRows(request.request_id, start_position, next_tokens, features)
