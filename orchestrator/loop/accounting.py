"""Accounting of a step: its events in; the adaptive k's cost model and each request's statistics out.

Terms: a round is one decoding request's verification in a step; it drafted `draft tokens` (a chain, or a tree of
some depth), of which the target `accepted` some; the acceptance length of a round is accepted + 1 (the correction or
bonus token the target adds).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.loop.batching import ActiveRequest
from orchestrator.loop.draft_length import DraftLengths, request_class
from orchestrator.loop.proposing import ReplicaTiming
from orchestrator.loop.speculation import RoundCosts
from orchestrator.peers.backends import StepItem, StepOutcome, StepResult


@dataclass(frozen=True)
class StepTimes:
    started: float  # time.perf_counter() when the step began
    propose_seconds: float  # asking the replicas for drafts and building the items
    target_seconds: float  # the target's step call

    def scheduling_seconds(self) -> float:
        """What the step spent outside both calls, so far."""
        return (time.perf_counter() - self.started) - self.propose_seconds - self.target_seconds


def observe_target_cost(
    costs: RoundCosts,
    items: Sequence[StepItem],
    outcome: StepOutcome,
    has_chunks: bool,
    target_seconds: float,
) -> None:
    """Feeds the cost line one decoding step: its rows and the time of one forward pass."""
    # A multi-token decode ran one forward pass per token, but for the tokens a grammar forced (accepted, verified
    # in one pass): the cost model is of one pass.
    passes = max(
        [
            1,
            *(
                len(result.new_tokens) - result.accepted
                for item, result in zip(items, outcome.results, strict=True)
                if item.decode_steps > 1
            ),
        ]
    )
    # A paused batch's passes beside its probe's verification (batching._multi_step): the first pass computed more
    # than the others, so the step is no sample of one pass of its size.
    mixed = passes > 1 and any(item.drafts.tokens for item in items)
    if has_chunks or mixed or not items:  # (no items: a step that only frees the KV of preempted requests)
        # The cost line models decoding steps, which k is chosen for: a step with prompt chunks computes hundreds of
        # tokens at a cost per token (attention over the prompt) that says nothing about a few more rows to verify,
        # and fitted in, it made drafts look dear at 8 requests (docs/architecture.md, "Adaptive k").
        return
    rows = sum(item.num_tokens + len(item.drafts) for item in items)
    costs.observe_target(rows, target_seconds / passes)


def count_round(
    speculation: DraftLengths,
    request: ActiveRequest,
    item: StepItem,
    result: StepResult,
    timing: ReplicaTiming | None,  # of the Propose that drafted for the request's replica; None: none asked
    outcome: StepOutcome,
    times: StepTimes,
) -> None:
    """Counts a decoding request's round in its statistics and in the acceptance the cost model keeps."""
    stats = request.output.stats
    depth = item.drafts.depth
    stats.count_round(len(item.drafts), depth, result.accepted)
    # What k is chosen by is the drafter's acceptance: tokens a grammar forced come at any k, k = 0 included.
    matched = item.drafts.matched(result.new_tokens[: result.accepted])
    speculation.observe_round(request_class(request.params.sampling), request.acceptance, depth, matched)
    draft_compute = timing.compute_seconds if timing else 0.0
    stats.draft_seconds += draft_compute
    stats.draft_ahead_seconds += timing.ahead_seconds if timing else 0.0
    stats.verify_seconds += outcome.compute_seconds
    stats.wire_seconds += (timing.call_seconds - draft_compute if timing else 0.0) + (
        times.target_seconds - outcome.compute_seconds
    )
    stats.scheduling_seconds += times.scheduling_seconds()
