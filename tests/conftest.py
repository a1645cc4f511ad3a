"""The whole suite: how pytest-xdist spreads it over workers (`-n 2` in pyproject.toml's addopts).

Each test module is one unit of work, run on one worker from its first test to its last, so that a module's fixtures
(a stack, a checkpoint) start once. A module in RUN_WITH joins the unit of the module it names: modules that use the
same shared stacks (tests/integration/stack.py, SharedStacks), so that those start once for all of them, and modules
that must not run beside each other. The units in LONGEST_FIRST start first, in its order, and the rest follow with
the most tests first: a long unit started last would leave the other worker idle while it ends (ordered by test
count alone, as pytest-xdist does, the one-test modules that wait on faults for a minute came last, and the cores
were half idle for the last 80 s of an 881 s run).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

INTEGRATION = "tests/integration"
RUN_WITH = {
    # The demo pair's stacks: HTTP (test_http_api, test_tool_calls), trees and hybrid trees.
    f"{INTEGRATION}/test_tool_calls.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_structured_kinds.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_tree_drafting.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_hybrid_drafting.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_prefix_caching.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_resume.py": f"{INTEGRATION}/test_http_api.py",
    # The tiny pair's stack at four steps.
    f"{INTEGRATION}/test_logprobs.py": f"{INTEGRATION}/test_greedy_equivalence.py",
    # Two Ray clusters at once: test_ray_tls looks for its actors' directories machine-wide.
    f"{INTEGRATION}/test_ray_tls.py": f"{INTEGRATION}/test_ray.py",
}
# Units that took 40 s or more on one worker in a full run (seconds, 2026-12-06, two workers on the 2-core machine;
# test_image_prompts.py estimated after it grew from 3 tests to 5; "about" marks an estimate after a change that made
# the unit faster, from its time run alone before and after). Those marked "waits" spend most of it waiting on
# faults they made; each is placed beside a unit that keeps a core busy (taken in this order, the first two go to the
# two workers, and so on). In longest-first order the fault units met on the two workers and the cores were a quarter
# idle for three minutes of a 908 s run.
LONGEST_FIRST = (
    f"{INTEGRATION}/test_fault_scenarios.py",  # about 70, waits
    f"{INTEGRATION}/test_http_api.py",  # 230 with the units run with it
    f"{INTEGRATION}/test_two_hosts.py",  # about 48, waits
    f"{INTEGRATION}/test_ray.py",  # 119 with test_ray_tls
    f"{INTEGRATION}/test_target_faults.py",  # 67, waits
    f"{INTEGRATION}/test_bench.py",  # about 99
    f"{INTEGRATION}/test_faults.py",  # 45, waits
    f"{INTEGRATION}/test_families_served.py",  # 104
    f"{INTEGRATION}/test_draft_kinds.py",  # 101
    f"{INTEGRATION}/test_startup_errors.py",  # 82
    f"{INTEGRATION}/test_block_drafts.py",  # 74
    f"{INTEGRATION}/test_image_prompts.py",  # about 65
    f"{INTEGRATION}/test_replicas.py",  # about 60
    f"{INTEGRATION}/test_greedy_equivalence.py",  # 55
    f"{INTEGRATION}/test_standalone_draft.py",  # 43
    f"{INTEGRATION}/test_adaptive_k.py",  # 21
    f"{INTEGRATION}/test_two_orchestrators.py",  # 21 (one test: started late, it would end the run alone)
)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's path, or the one RUN_WITH names."""
    module = nodeid.split("::", 1)[0]
    return RUN_WITH.get(module, module)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Units in the order workers should take them: LONGEST_FIRST, then by number of tests, most first; a unit's
    tests keep their order."""
    sizes = Counter(unit_of(item.nodeid) for item in items)

    def rank(item: pytest.Item) -> tuple[int, int, str]:
        unit = unit_of(item.nodeid)
        if unit in LONGEST_FIRST:
            return (LONGEST_FIRST.index(unit), 0, unit)
        return (len(LONGEST_FIRST), -sizes[unit], unit)

    items.sort(key=rank)  # stable: the tests of a unit stay in collection order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the GPU image does not have
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # take the units in the order pytest_collection_modifyitems left them

    class ModuleUnits(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scheduling by scope, with a scope per unit_of."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleUnits(config, log)
