"""Batch selection: which requests a step carries, under a token budget, a sequence limit and the target's KV pool.

A request's phase follows from two numbers: its tokens (prompt + generated) and how many of them have KV on the
target (`kv_length`, mirrored here exactly: the target keeps KV for every computed token and every accepted draft,
and truncates the rest). `uncomputed = tokens - kv_length`:

    uncomputed > 1, or no token generated yet   prefill: the next chunk of at most the budget's tokens
    uncomputed == 1 after the first token        decoding: 1 token (the last committed one) plus drafts

A step takes the decoding requests first, oldest first, each with room for its drafts; when the pool cannot hold
one, the newest running request is preempted (its KV freed on target and draft, its tokens kept) and recomputed
later from its tokens, as a prefill. The rest of the budget goes to prompt chunks: running prefills (which may preempt
newer requests not yet in the step), then waiting requests in arrival order, admitted only when their first chunk
fits with a block of headroom per running request.

Worked example, budget 8 tokens, block size 4, 6 free blocks, 3 draft steps: A decodes (kv 9 of 10 tokens: 1 + 3
rows -> positions 9..12, blocks 3 -> 4: needs 1), B waits with a 20-token prompt. A takes 4 tokens and 1 block;
B's first chunk is the remaining 4 tokens (1 block, leaving 4 >= 1 running request of headroom): admitted.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.loop.draft_length import REQUEST_DECAY, Survival
from orchestrator.loop.output import RequestOutput
from orchestrator.loop.validation import ValidatedRequest
from orchestrator.settings import SchedulerSettings


@dataclass(frozen=True)
class KVPool:
    """The target's KV pool as the scheduler accounts for it."""

    num_blocks: int
    block_size: int

    def blocks(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def fits_alone(self, positions: int) -> bool:
        return self.blocks(positions) <= self.num_blocks


class Drafting(enum.Enum):
    """Where a request's drafts come from; its replica, when it has one, is ActiveRequest.replica."""

    TARGET_ONLY = "target-only"  # no replica: it asked for none, or none served (one that serves brings it back)
    PAUSED = "paused"  # adaptive k settled at 0 took it off its replica: target-only to its end
    JOINING = "joining"  # the replica has not drafted for it yet: its first Propose ingests every committed row
    DRAFTING = "drafting"  # the replica drafted for it: a Propose ingests the rows of the last round only


class OnTarget(enum.Enum):
    """What the target holds of a request."""

    NOTHING = "nothing"  # not opened yet: its next item carries `open`
    OPEN = "open"  # its tokens (even while preempted), its rows going to `replica`
    MOVING = "moving"  # its tokens, but its next item must point its rows at `replica` and resend every committed row


@dataclass
class ActiveRequest:
    request_id: str
    params: ValidatedRequest
    output: RequestOutput
    replica: str | None  # None: target-only decoding
    round: int = 0  # the draft proposes from the rows published under this round
    kv_length: int = 0  # tokens with KV on the target
    # MOVING when the replica starts the request from scratch (it is new to the request, or it dropped its state).
    on_target: OnTarget = OnTarget.NOTHING
    cancelled: bool = False
    # Set from `replica` when the request is made; the adaptive k's cost model keeps a first Propose's ingest of
    # every row (JOINING) apart from a draft step's.
    drafting: Drafting = field(init=False)
    # This step's k (orchestrator.loop.draft_length); None: --speculative-num-steps (not chosen yet).
    draft_length: int | None = None
    settled_length: int | None = None  # the k chosen apart from exploration: what the next round most likely drafts
    acceptance: Survival = field(default_factory=lambda: Survival(REQUEST_DECAY))  # its own rounds

    def __post_init__(self) -> None:
        self.drafting = Drafting.TARGET_ONLY if self.replica is None else Drafting.JOINING

    def start_over(self, replica: str | None) -> None:
        """Points the request at `replica` (None: target-only), which holds none of its state: the target resends
        every committed row there (if it holds the request), and the replica's next Propose ingests them all."""
        self.replica = replica
        if self.opened:
            self.on_target = OnTarget.MOVING
        self.drafting = Drafting.TARGET_ONLY if replica is None else Drafting.JOINING

    def pause(self) -> None:
        """Takes the request off its replica for good (adaptive k settled at 0 for its batch): it decodes target-only,
        with no hidden rows and several tokens a step, to its end."""
        self.start_over(None)  # the target stops capturing its rows
        self.drafting = Drafting.PAUSED

    def took_cached(self, tokens: int) -> None:
        """Counts prompt tokens the target took from its prefix cache for the prefill that gives the first token (a
        preemption before that token starts the count again)."""
        if len(self.output.generated) == len(self.params.resumed):
            stats = self.output.stats
            stats.cached_tokens = (stats.cached_tokens if self.kv_length else 0) + tokens

    @property
    def opened(self) -> bool:
        return self.on_target is not OnTarget.NOTHING

    @property
    def needs_move(self) -> bool:
        return self.on_target is OnTarget.MOVING

    def held(self) -> None:
        """The target holds the request now (a step opened it, or may have)."""
        if self.on_target is OnTarget.NOTHING:
            self.on_target = OnTarget.OPEN

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def num_tokens(self) -> int:
        return len(self.params.input_ids) + len(self.output.generated)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Its committed tokens: the prompt, then what it generated."""
        return (*self.params.input_ids, *self.output.generated)

    @property
    def uncomputed(self) -> int:
        return self.num_tokens - self.kv_length

    @property
    def decoding(self) -> bool:
        return self.uncomputed == 1 and bool(self.output.generated)

    @property
    def wants_speculation(self) -> bool:
        return not self.params.disable_speculation

    def max_drafts(self, num_steps: int) -> int:
        """Draft tokens this request's next round may verify, asked for `num_steps`: a round yields up to k + 1
        tokens, and never more than max_new_tokens."""
        if self.replica is None or self.needs_move:
            return 0
        return max(0, min(num_steps, self.output.remaining - 1))


@dataclass(frozen=True)
class PlannedItem:
    request: ActiveRequest
    num_tokens: int  # committed tokens to compute
    max_drafts: int  # room reserved for drafts (decoding requests only)
    decode_steps: int = 1  # without drafts: tokens the step may decode for the request, a forward pass each


@dataclass
class StepPlan:
    decode: list[PlannedItem] = field(default_factory=list)  # oldest first
    chunks: list[PlannedItem] = field(default_factory=list)  # running prefills, then admitted requests
    admitted: list[ActiveRequest] = field(default_factory=list)  # taken from the waiting queue
    preempted: list[ActiveRequest] = field(default_factory=list)

    def entries(self) -> list[PlannedItem]:
        """Every item of the step, in the order the target gets them: decoding requests, then prompt chunks."""
        return [*self.decode, *self.chunks]


def plan_step(
    running: Sequence[ActiveRequest],  # oldest first
    waiting: deque[ActiveRequest],
    pool: KVPool,
    settings: SchedulerSettings,
    held_elsewhere: int = 0,
) -> StepPlan:
    """Chooses the step; preempted requests are listed, not moved (the scheduler frees and requeues them).

    Decoding requests get room for as many drafts as they may verify (their draft_length, else settings.num_steps);
    what is proposed can only be fewer. `held_elsewhere` blocks of the pool are taken by other orchestrators' requests.
    """
    plan = StepPlan()
    budget = _Budget(
        pool,
        pool.num_blocks - held_elsewhere - sum(pool.blocks(request.kv_length) for request in running),
        settings.max_num_batched_tokens,
        settings.max_num_batched_tokens,
    )
    _plan_decodes(plan, running, budget, settings)
    _plan_prefills(plan, running, budget)
    _plan_admissions(plan, running, waiting, budget, settings.max_num_seqs)
    if not plan.chunks and not waiting and not plan.preempted:
        plan.decode = _multi_step(plan.decode, pool, budget.free, settings.num_scheduler_steps)
    return plan


@dataclass
class _Budget:
    """What is left of the step as it is planned: free KV blocks and tokens of --max-num-batched-tokens."""

    pool: KVPool
    free: int
    tokens: int
    step_tokens: int  # the whole step's (--max-num-batched-tokens)

    def growth(self, request: ActiveRequest, new_positions: int) -> int:
        """The blocks `new_positions` more positions of the request take."""
        pool = self.pool
        grown = pool.blocks(request.kv_length + new_positions) - pool.blocks(request.kv_length)
        # A replay recomputes the request's rows in a scratch sequence as long as its KV, for the step.
        return grown + (pool.blocks(request.kv_length) if request.needs_move else 0)

    def take(self, blocks: int, tokens: int) -> None:
        self.free -= blocks
        self.tokens -= tokens


def _plan_decodes(
    plan: StepPlan, running: Sequence[ActiveRequest], budget: _Budget, settings: SchedulerSettings
) -> None:
    """Decoding requests, oldest first, each with room for its drafts; the newest running request is preempted while
    one does not fit."""
    victims = list(running)  # the newest is preempted first
    for request in running:
        if not request.decoding or request in plan.preempted:
            continue
        drafts = request.max_drafts(settings.num_steps if request.draft_length is None else request.draft_length)
        rows = 1 + draft_rows(drafts, settings)
        if rows > budget.tokens:
            break
        need = budget.growth(request, rows)
        while need > budget.free:
            victim = victims.pop()
            plan.preempted.append(victim)
            budget.free += budget.pool.blocks(victim.kv_length)
            if victim is request:
                break
        if request in plan.preempted:
            break
        budget.take(need, rows)
        plan.decode.append(PlannedItem(request, 1, drafts))


def _plan_prefills(plan: StepPlan, running: Sequence[ActiveRequest], budget: _Budget) -> None:
    """The next prompt chunk of each running prefill, oldest first, in the tokens left."""
    scheduled = {id(entry.request) for entry in plan.decode}
    for index, request in enumerate(running):
        if request.decoding or request in plan.preempted:
            continue
        chunk = _chunk(request, budget)
        if chunk <= 0:
            break
        need = budget.growth(request, chunk)
        # Only a newer request that is not in this step yet may make room, so that the oldest prefill always
        # progresses (running requests that all prefill and fill the pool would otherwise wait on each other).
        while need > budget.free:
            newer = [r for r in running[index + 1 :] if id(r) not in scheduled and r not in plan.preempted]
            if not newer:
                break
            plan.preempted.append(newer[-1])
            budget.free += budget.pool.blocks(newer[-1].kv_length)
        if need > budget.free:
            continue
        budget.take(need, chunk)
        scheduled.add(id(request))
        plan.chunks.append(PlannedItem(request, chunk, 0))


def _plan_admissions(
    plan: StepPlan, running: Sequence[ActiveRequest], waiting: deque[ActiveRequest], budget: _Budget, max_seqs: int
) -> None:
    """Waiting requests in arrival order, while their first chunk fits with a block of headroom per running one."""
    num_running = len(running) - len(plan.preempted)
    for request in waiting:
        if num_running + len(plan.admitted) >= max_seqs or budget.tokens <= 0:
            break
        chunk = _chunk(request, budget)
        if chunk <= 0:
            break
        need = budget.growth(request, chunk)
        if need + num_running + len(plan.admitted) > budget.free:
            break  # arrival order: no later request overtakes this one
        budget.take(need, chunk)
        plan.admitted.append(request)
        plan.chunks.append(PlannedItem(request, chunk, 0))


def _chunk(request: ActiveRequest, budget: _Budget) -> int:
    """The request's next prompt chunk within the step's tokens left: the rest of its prompt, or, when that does not
    fit, a chunk ending at a block boundary, so that its next chunk starts where the target's prefix cache can go on
    reusing whole blocks (target_server.admission). 0 (it waits for the next step) when no boundary fits and its KV
    ends at one now, unless a step's whole budget is less than a block. Never a chunk ending inside an image."""
    block_size = budget.pool.block_size
    chunk = min(request.uncomputed, budget.tokens)
    aligned = chunk - (request.kv_length + chunk) % block_size
    if chunk == request.uncomputed:
        return chunk
    if aligned > 0:
        return _whole_images(request, aligned, budget)
    waits = request.kv_length % block_size == 0 and budget.step_tokens >= block_size
    return 0 if waits else _whole_images(request, chunk, budget)


def _whole_images(request: ActiveRequest, chunk: int, budget: _Budget) -> int:
    """`chunk`, or less, so that it does not end inside an image (an image's tokens see each other both ways: the
    target computes one in a single chunk). An image at the chunk's start that the tokens left do not hold waits for
    the next step, or, when no step's budget would hold it, is taken whole beyond the budget."""
    begin, end = request.kv_length, request.kv_length + chunk
    for image in request.params.images:
        if not image.start < end < image.end:
            continue
        if image.start > begin:
            return image.start - begin
        return 0 if budget.step_tokens >= image.end - begin else image.end - begin
    return chunk


def draft_rows(max_drafts: int, settings: SchedulerSettings) -> int:
    """Rows a round of up to `max_drafts` drafts (its depth) may verify: a chain has one per draft; a tree, or a
    chain with n-gram branches merged in (--hybrid-ngram), up to settings.max_tree_drafts nodes."""
    if max_drafts == 0 or (settings.tree.topk == 1 and settings.hybrid is None):
        return max_drafts
    return max(max_drafts, settings.max_tree_drafts)


def _multi_step(decode: list[PlannedItem], pool: KVPool, free: int, steps: int) -> list[PlannedItem]:
    """Lets a step of decoding requests without drafts run several forward passes (each request at most to its
    max_new_tokens) when the pool holds all of their tokens; `decode` unchanged otherwise.

    Only when nothing else waits for the target (no prompt chunk, no queued request), so that a multi-token step
    never delays a new request's first token by more than the step it arrived in. A step with drafts to verify is
    one pass for every request, except for requests that adaptive k paused: they decode target-only to their end,
    and the probe left speculating beside them (Placement.pause_speculation) must not cut their steps to one pass
    each time it drafts; it waits for their extra passes instead.
    """
    drafting = any(entry.max_drafts for entry in decode)
    many = [
        entry
        for entry in decode
        if not entry.max_drafts and (entry.request.drafting is Drafting.PAUSED or not drafting)
    ]
    if steps <= 1 or not many:
        return decode
    planned = {id(entry): min(steps, entry.request.output.remaining) for entry in many}
    # Blocks for the extra tokens beyond the one each entry has room for already.
    need = sum(
        pool.blocks(entry.request.kv_length + planned[id(entry)]) - pool.blocks(entry.request.kv_length + 1)
        for entry in many
    )
    if need > free:
        return decode
    return [
        PlannedItem(entry.request, entry.num_tokens, 0, max(1, planned[id(entry)])) if id(entry) in planned else entry
        for entry in decode
    ]
