"""The whole suite: how pytest-xdist spreads it over workers (`-n 2` in pyproject.toml's addopts).

Each test module is one unit of work, run on one worker from its first test to its last, so that a module's fixtures
(a stack, a checkpoint) start once. A module in RUN_WITH joins the unit of the module it names: modules that use the
same shared stacks (tests/integration/stack.py, SharedStacks), so that those start once for all of them, and modules
that must not run beside each other.
"""

from __future__ import annotations

from typing import Any

import pytest

INTEGRATION = "tests/integration"
RUN_WITH = {
    # The demo pair's stacks: HTTP (test_http_api, test_tool_calls), trees and hybrid trees.
    f"{INTEGRATION}/test_tool_calls.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_structured_kinds.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_tree_drafting.py": f"{INTEGRATION}/test_http_api.py",
    f"{INTEGRATION}/test_hybrid_drafting.py": f"{INTEGRATION}/test_http_api.py",
    # The tiny pair's stack at four steps.
    f"{INTEGRATION}/test_logprobs.py": f"{INTEGRATION}/test_greedy_equivalence.py",
    # Two Ray clusters at once: test_ray_tls looks for its actors' directories machine-wide.
    f"{INTEGRATION}/test_ray_tls.py": f"{INTEGRATION}/test_ray.py",
}


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module's path, or the one RUN_WITH names."""
    module = nodeid.split("::", 1)[0]
    return RUN_WITH.get(module, module)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which the GPU image does not have
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's scheduling by scope, with a scope per unit_of."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleUnits(config, log)
