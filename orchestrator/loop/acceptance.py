"""The acceptance watch: a log line per interval with the mean acceptance length and the acceptance of each draft
position, and a warning when acceptance collapses to about 1.0.

A collapse is the silent failure of speculative decoding: a draft that does not fit its target (a head trained for
another target, the wrong aux layer convention) still runs, answers and costs its time, but its tokens are almost
never accepted, and the output stays correct, so nothing else shows it. The orchestrator's /metrics exports the
verdict as `tandem:acceptance_collapsed` (orchestrator.loop.metrics).

Terms as vLLM's: a draft is one round of one request that verified at least one draft token; mean acceptance
length = 1 + accepted tokens / drafts.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from orchestrator.loop.output import Stats

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcceptanceWatch:
    """The periodic acceptance log line, and when to call acceptance collapsed."""

    interval_s: float = 60.0  # one log line per interval that saw drafts
    min_drafts: int = 32  # fewer drafts in an interval say too little to warn about
    # A mean acceptance length below this over an interval means the draft almost never matches.
    collapsed_below: float = 1.1


@dataclass
class AcceptanceWindow:
    drafts: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, stats: Stats) -> None:
        self.drafts += stats.draft_rounds
        self.accepted += stats.accepted_tokens
        for position, count in enumerate(stats.accepted_per_position):
            if position == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += count

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0


class AcceptanceMonitor:
    """Adds up the requests that end (`add`) and judges each interval (`close_window`, every interval by `run`)."""

    def __init__(self, watch: AcceptanceWatch) -> None:
        self.watch = watch
        self.window = AcceptanceWindow()
        self.collapsed = False  # the verdict of the last interval with enough drafts

    def add(self, stats: Stats) -> None:
        self.window.add(stats)

    def close_window(self) -> None:
        """Logs the acceptance of the interval that ends now and warns when it collapsed to about 1.0."""
        window, self.window = self.window, AcceptanceWindow()
        if window.drafts == 0:
            return
        rates = " ".join(f"{count / window.drafts:.2f}" for count in window.accepted_per_position)
        LOG.info(
            "acceptance: mean length %.2f over %d drafts, per position %s",
            window.mean_acceptance_length,
            window.drafts,
            rates,
        )
        if window.drafts < self.watch.min_drafts:
            return
        self.collapsed = window.mean_acceptance_length < self.watch.collapsed_below
        if self.collapsed:
            LOG.warning(
                "acceptance collapsed: mean acceptance length %.2f over %d drafts; the draft almost never matches "
                "the target (check that the head was trained for this target, and --aux-layer-convention)",
                window.mean_acceptance_length,
                window.drafts,
            )

    async def run(self) -> None:
        """Runs close_window every interval, for as long as the orchestrator serves."""
        while True:
            await asyncio.sleep(self.watch.interval_s)
            self.close_window()
