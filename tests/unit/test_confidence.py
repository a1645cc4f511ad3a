"""orchestrator.loop.confidence: scored chains verified only as far as their survival pays for the rows, by the
measured step costs; unscored drafts, unmeasured costs and a fixed k leave every draft as it came."""

from __future__ import annotations

import pytest

from orchestrator.loop.confidence import cut_by_confidence, survival
from orchestrator.loop.draft_length import DraftLengths
from orchestrator.loop.speculation import MIN_PROPOSES, RoundCosts
from tandem.sampling.draft_tree import DraftTree
from tandem.wire import common_pb2
from tandem.wire.drafts import tree_from_proto, tree_to_proto

SCORES = (0.9, 0.8, 0.3, 0.2)  # survival 0.9 0.72 0.216 0.0432 (the module docstring's example)
STEP_S = 0.010


def measured(row_seconds: float, rows: int = 9, batch: int = 1) -> DraftLengths:
    """A policy whose target steps cost STEP_S plus row_seconds per row beyond one a request, measured at every size
    up to `rows`, and whose Proposes at this batch are measured too."""
    costs = RoundCosts()
    for size in range(batch, rows + 1):
        for _ in range(3):
            costs.observe_target(size, STEP_S + row_seconds * (size - batch))
    for _ in range(MIN_PROPOSES):
        costs.observe_propose(batch, 4, 0.003, 0.002)
    return DraftLengths(max_k=4, costs=costs)


def test_survival_is_the_running_product() -> None:
    assert survival(SCORES) == pytest.approx((0.9, 0.72, 0.216, 0.0432))


@pytest.mark.parametrize(("row_seconds", "kept"), [(0.0005, 3), (0.002, 2), (0.0, 4)])
def test_a_chain_is_cut_where_its_rows_stop_paying(row_seconds: float, kept: int) -> None:
    drafts = {"a": DraftTree.chain([5, 6, 7, 8], SCORES)}
    policy = measured(row_seconds)
    (cut,) = cut_by_confidence(drafts, policy, batch=1).values()
    assert cut == DraftTree.chain([5, 6, 7, 8][:kept], SCORES[:kept])
    assert policy.confidence_cuts == 4 - kept  # counted for /metrics


def test_unscored_drafts_count_but_stay_whole() -> None:
    """An unscored chain beside a scored one is verified whole, and its rows make the step dearer for the other."""
    drafts = {"plain": DraftTree.chain([1, 2, 3]), "scored": DraftTree.chain([5, 6, 7, 8], SCORES)}
    cut = cut_by_confidence(drafts, measured(0.0005, batch=2), batch=2)
    assert cut["plain"] == drafts["plain"]
    assert len(cut["scored"]) == 3


def test_nothing_is_cut_unmeasured_or_at_a_fixed_k() -> None:
    drafts = {"a": DraftTree.chain([5, 6, 7, 8], SCORES)}
    assert cut_by_confidence(drafts, DraftLengths(max_k=4), batch=1) == drafts  # no step measured yet
    fixed = measured(0.002)
    fixed.adaptive = False
    assert cut_by_confidence(drafts, fixed, batch=1) == drafts


def test_scores_are_checked_as_another_process_sent_them() -> None:
    assert DraftTree.chain([5, 6], (0.5,)).fault(4) == "scores: 1 entries for 2 nodes"
    assert DraftTree.chain([5, 6], (0.5, 1.5)).fault(4) == "scores[1]: 1.5 is not a probability"
    assert DraftTree.chain([5, 6], (0.5, float("nan"))).fault(4) == "scores[1]: nan is not a probability"
    assert DraftTree.chain([5, 6], (0.5, 0.25)).first(1) == DraftTree.chain([5], (0.5,))


def test_scores_cross_the_wire() -> None:
    for tree in (DraftTree.chain([5, 6], (0.5, 0.25)), DraftTree.chain([5, 6]), DraftTree.of([5, 6, 7], [-1, -1, 0])):
        assert tree_from_proto(common_pb2.DraftTree.FromString(tree_to_proto(tree).SerializeToString())) == tree
