"""The whole suite: how pytest-xdist spreads it over workers (`pytest -n 3 --dist loadgroup`, pyproject.toml).

Each test module is one unit of work, run on one worker from its first test to its last, so that a module's fixtures
(a stack, a checkpoint) start once. A module that names another in RUN_WITH joins that module's unit: modules that
use the same shared stacks (tests/integration/stack.py, SharedStacks), so that those start once for all of them, and
modules that must not run beside each other (two Ray clusters, which look for their actors' files machine-wide).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = getattr(item, "module", None)  # None for items that are not Python tests
        if module is not None:
            item.add_marker(pytest.mark.xdist_group(getattr(module, "RUN_WITH", module.__name__)))
