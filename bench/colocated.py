"""The colocated baseline: the same scheduler, target runner and draft runner in ONE process, no gRPC.

The benchmark runs this beside the three-process stack so that the cost of splitting the services
(serialization, transport, process hops) is measured as a ratio in the same run. Everything else is
the same code: Scheduler, TargetRunner, the draft's runner, validation, detokenization.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.harness import round_seconds_of
from draft_server.formats import prepare_draft
from draft_server.proposals import ProposalRunner, propose_what_fits
from draft_server.runner import ProposeInput, TargetRows, join_rounds, pop_rounds
from draft_server.settings import DraftSettings
from launch.devices import Placement
from orchestrator.api.service import response_message
from orchestrator.loop.batching import KVPool
from orchestrator.loop.generation import Generation
from orchestrator.loop.hybrid import with_hybrid
from orchestrator.loop.metrics import Metrics
from orchestrator.loop.ngram import add_ngram_replica
from orchestrator.loop.scheduler import Scheduler, TargetFacts
from orchestrator.loop.validation import Limits
from orchestrator.peers.backends import (
    BackendError,
    FailureKind,
    ProposedBatch,
    ProposeTask,
    StepItem,
    StepOutcome,
    StepResult,
)
from orchestrator.peers.grpc_backends import BLOCK_KINDS
from orchestrator.peers.replicas import ReplicaPool
from orchestrator.settings import HybridSettings, NgramSettings, SchedulerSettings
from tandem.models.registry import load_target
from tandem.models.tokenizer_digest import tokenizer_digest
from tandem.parallel.vocab import assemble_shards
from tandem.sampling.grammar import Grammars
from tandem.sampling.processing import Shaping
from tandem.settings import KVCacheSettings, TreeShape
from tandem.wire import orchestrator_pb2
from target_server import items as target_items
from target_server.items import MAX_DRAFT_TOKENS, TARGET_ONLY, CapturedRows, ItemStatus, RowStream, TargetRequest
from target_server.main import target_info
from target_server.runner import TargetRunner

REPLICA_ID = "colocated"


class LocalDraft:
    """A DraftBackend over an in-process draft runner; the target hands it rows directly."""

    def __init__(self, runner: ProposalRunner, stream: RowStream, kind: str = "") -> None:
        self.runner = runner
        self.one_forward = kind in BLOCK_KINDS
        self.stream = stream  # what the target sends it of each committed position
        self.rows: dict[tuple[str, int], TargetRows] = {}
        self.requests: Mapping[str, TargetRequest] = {}  # the target's, for their options (draft_server.shaping)

    def deliver(self, rows: CapturedRows, round_number: int) -> None:
        key = (rows.request_id, round_number)
        arrived = TargetRows(rows.start_position, rows.next_tokens, rows.features)
        earlier = self.rows.get(key)
        self.rows[key] = earlier.followed_by(arrived) if earlier is not None else arrived

    async def propose(self, tasks: Sequence[ProposeTask]) -> ProposedBatch:
        inputs = [self._input(t.request_id, self._take(t.request_id, t.round), t.num_steps) for t in tasks]
        started = time.perf_counter()
        proposals = propose_what_fits(self.runner, inputs)
        drafts, exhausted = proposals.drafts, proposals.exhausted
        return ProposedBatch(drafts, exhausted, time.perf_counter() - started, one_forward=self.one_forward)

    def _input(self, request_id: str, rows: TargetRows, num_steps: int) -> ProposeInput:
        """The rows with the request's options and its tokens up to them, as a replica hands them its runner."""
        request = self.requests.get(request_id)
        if request is None:
            return ProposeInput(request_id, rows, num_steps)
        tokens = request.tokens[: rows.start_position + len(rows.next_tokens) + 1]
        return ProposeInput(request_id, rows, num_steps, Shaping.of(request.sampling, request.prompt_length, tokens))

    def _take(self, request_id: str, round_number: int) -> TargetRows:
        """The request's rows of this round, after those of earlier rounds it drafted nothing for (k = 0), as a
        replica joins them (draft_server.runner.join_rounds)."""
        return join_rounds(pop_rounds(self.rows, request_id, round_number))

    async def release(self, request_ids: Sequence[str]) -> None:
        released = set(request_ids)
        for key in [key for key in self.rows if key[0] in released]:
            del self.rows[key]
        self.runner.release(request_ids)

    async def probe(self) -> None:
        return None


class LocalTarget:
    """A TargetBackend over an in-process TargetRunner."""

    def __init__(self, runner: TargetRunner, draft: LocalDraft | None) -> None:
        self.runner = runner
        self.draft = draft
        if draft is not None:
            draft.requests = runner.requests

    async def step(self, items: Sequence[StepItem], preempt: Sequence[str]) -> StepOutcome:
        started = time.perf_counter()
        results = self.runner.step([self._runner_item(item) for item in items], preempt)
        compute = time.perf_counter() - started
        answers = []
        for item, result in zip(items, results, strict=True):
            if result.status is not ItemStatus.OK:
                kind = FailureKind.INVALID if result.status is ItemStatus.INVALID else FailureKind.EXHAUSTED
                answers.append(StepResult(item.request_id, BackendError(kind, result.message)))
                continue
            if self.draft is not None and result.captured is not None:
                self.draft.deliver(result.captured, item.round)
            streaming = self.draft is not None and self.runner.requests[item.request_id].stream.streams
            answers.append(
                StepResult(
                    item.request_id,
                    None,
                    result.accepted,
                    result.new_tokens,
                    streaming,
                    result.logprobs,
                    result.cached_tokens,
                )
            )
        return StepOutcome(answers, compute)

    def _runner_item(self, item: StepItem) -> target_items.StepItem:
        """The runner's item, as the target service makes it of the wire's (its replica resolved to a row stream)."""
        opened = item.open
        stream = self.draft.stream if self.draft is not None and item.replica is not None else TARGET_ONLY
        return target_items.StepItem(
            item.request_id,
            item.num_tokens,
            item.drafts,
            None
            if opened is None
            else target_items.OpenRequest(
                opened.prompt, opened.sampling, opened.end_token_ids, opened.generated, opened.cache_salt
            ),
            stream if opened is not None or item.move else None,
            replay=item.replay,
            top_logprobs=item.top_logprobs,
            decode_steps=item.decode_steps,
        )

    async def release(self, request_ids: Sequence[str]) -> None:
        self.runner.release(request_ids)

    async def answer(self) -> bool:
        return False  # the runner lives in this process: it is never replaced


@dataclass(frozen=True)
class ColocatedSettings:
    target_dir: Path
    draft_dir: Path | None
    ngram: NgramSettings | None = None  # prompt lookup instead of a draft model (draft_dir None)
    hybrid: HybridSettings | None = None  # prompt lookup merged into the draft model's proposals
    # Where both models compute: the split stack's resolution of the same device flags (launch.devices).
    placement: Placement = field(default_factory=lambda: Placement("cpu", "float32", "torch"))
    num_steps: int = 5
    tree: TreeShape = field(default_factory=TreeShape)  # resolved; topk 1: chains
    adaptive_k: bool = SchedulerSettings.adaptive_k
    cache: KVCacheSettings = field(default_factory=KVCacheSettings)
    default_max_new_tokens: int = 128


class ColocatedEngine:
    """Generate in-process: the three roles of `tandem serve` without processes or gRPC."""

    def __init__(self, settings: ColocatedSettings) -> None:
        placement = settings.placement
        cache = placement.cache(settings.cache)
        model = load_target(settings.target_dir, dtype=getattr(torch, placement.dtype), device=placement.device)
        max_context = model.config.max_position_embeddings
        grammars = Grammars(settings.target_dir, model.config.vocab_size)
        target_runner = TargetRunner(model, cache, max_context, grammars=grammars)
        replicas = ReplicaPool()
        scheduler_settings = SchedulerSettings(
            num_steps=settings.num_steps, tree=settings.tree, adaptive_k=settings.adaptive_k, hybrid=settings.hybrid
        )
        draft = None
        if settings.draft_dir is not None:
            draft_settings = DraftSettings(
                model_dir=settings.draft_dir,
                target_address="",
                replica_id=REPLICA_ID,
                num_steps=settings.num_steps,
                cache=cache,
                dtype=placement.dtype,
                device=placement.device,
            )
            info = target_info(target_runner, placement.dtype)
            info.tokenizer_digest = tokenizer_digest(settings.target_dir)  # as serve_target publishes it
            prepared = prepare_draft(draft_settings, info)
            # The same shards the target would stream, handed over in memory.
            for name in prepared.missing_tables:
                table = assemble_shards(target_runner.weight_shards(name), model.config.vocab_size)
                prepared.fill_table(name, table)
            runner = prepared.build_proposer(cache, settings.tree)
            draft = LocalDraft(runner, RowStream(prepared.capture.indices, prepared.tokens_only), prepared.kind)
            replicas.add(REPLICA_ID, "in-process", with_hybrid(draft, scheduler_settings))
        if settings.ngram is not None:
            add_ngram_replica(replicas, settings.ngram)
        self.tokenizer = AutoTokenizer.from_pretrained(str(settings.target_dir))
        eos_ids = set(model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(int(self.tokenizer.eos_token_id))
        target = LocalTarget(target_runner, draft)
        pool = KVPool(target_runner.cache.num_blocks, target_runner.cache.block_size)
        facts = TargetFacts(model.config.vocab_size, pool, MAX_DRAFT_TOKENS)
        self.scheduler = Scheduler(target, replicas, self.tokenizer, eos_ids, scheduler_settings, facts)
        self.metrics = Metrics(self.scheduler, REPLICA_ID)
        limits = Limits(model.config.vocab_size, max_context, settings.default_max_new_tokens)
        self.generation = Generation(self.scheduler, limits, self.metrics)
        self._loop_task: asyncio.Task[None] | None = None

    async def generate(
        self, request: orchestrator_pb2.GenerateRequest
    ) -> AsyncIterator[orchestrator_pb2.GenerateResponse]:
        """The same messages Orchestrator.Generate streams (the same Generation path), without gRPC."""
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self.scheduler.run())
        async with aclosing(self.generation.stream(request, "bench")) as outputs:
            async for output in outputs:
                yield response_message(output)

    def round_seconds(self) -> dict[str, float]:
        """The engine's tandem:round_seconds counters by part, as the split stack's /metrics shows them."""
        return round_seconds_of(self.metrics.render().decode())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
