"""Verifying fewer of a round's drafts where the drafter's own confidence says the rest will not pay.

A drafter that scores its drafts (tandem.sampling.draft_tree.DraftTree.scores; DSpark's calibrated confidence head)
says, once its Propose has answered, how far each chain is likely to survive: draft j (and every one before it) is
accepted with chance a_j = s_0 * ... * s_j. The Propose is paid by then (a block drafter's costs the same for any
k); what is left to choose is how many rows the target verifies. Each scored chain is a candidate of
orchestrator.loop.draft_length.allocate with survival a_j, capped at its drafts, and a round costs the target's step
alone: the prefix with the most expected tokens per second, slowing no request, is verified and the rest dropped.
Drafts without scores are verified whole, and their rows counted in every step's cost.

Example, one request: scores 0.9 0.8 0.3 0.2 give survival 0.9 0.72 0.22 0.04. With a step of 10 ms and 0.5 ms more
a verified row, three drafts are verified (expected 2.84 tokens in 11.5 ms: 0.247 a ms, against 0.240 with all
four); at 2 ms a row, two (2.62 tokens in 14 ms, 0.187 a ms). A draft pays for its row where its survival exceeds
the row's seconds times the tokens per second of the drafts before it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from itertools import accumulate
from operator import mul

from orchestrator.loop.draft_length import Candidate, DraftLengths, allocate
from tandem.sampling.draft_tree import DraftTree

LOG = logging.getLogger(__name__)


def survival(scores: tuple[float, ...]) -> tuple[float, ...]:
    """The chance that each draft of a chain is accepted with every one before it."""
    return tuple(accumulate(scores, mul))


def cut_by_confidence(drafts: Mapping[str, DraftTree], lengths: DraftLengths, batch: int) -> dict[str, DraftTree]:
    """The drafts to verify in a step of `batch` decoding requests: scored chains cut to the allocation's lengths
    (module docstring), the others as they are. Nothing is cut while adaptive k is off or the costs are unmeasured."""
    scored = {key: tree for key, tree in drafts.items() if tree.scores and tree.is_chain}
    if not scored or not lengths.adaptive or not lengths.costs.measured(batch):
        return dict(drafts)
    fixed = sum(len(tree) for key, tree in drafts.items() if key not in scored)

    def seconds(rows: int, drafting: int, depth: int) -> float:
        return lengths.costs.step_seconds(batch, rows + fixed, depth > 0 or fixed > 0)

    candidates = [Candidate(key, survival(tree.scores)) for key, tree in scored.items()]
    chosen, _ = allocate(candidates, batch, seconds)
    for key, tree in scored.items():
        if chosen[key] < len(tree):
            lengths.confidence_cuts += len(tree) - chosen[key]
            LOG.debug(
                "request %s: verifies %d of %d drafts; survival %s", key, chosen[key], len(tree), survival(tree.scores)
            )
    return {key: tree.first(chosen[key]) if key in scored else tree for key, tree in drafts.items()}
