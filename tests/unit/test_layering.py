"""Layers point one way: the library imports no service, the services import neither the launchers nor the bench.

tandem/ (library) <- target_server/, draft_server/, orchestrator/ (services) <- launch/ (command line, launchers,
security wiring); training/ and bench/ sit beside launch/. Inside the orchestrator, its rooms point one way too:
peers/ (backends, replicas, discovery, recovery) <- loop/ (the step loop) <- api/ (Generate, HTTP, tools). Read from
the source (every import statement, also those
inside functions), so a lazy import cannot hide an arrow pointing up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("target_server", "draft_server", "orchestrator")
ABOVE_SERVICES = ("launch", "training", "bench")
# What each package may not import (top-level package names).
FORBIDDEN = {
    "tandem": (*SERVICES, *ABOVE_SERVICES),
    **{service: ABOVE_SERVICES for service in SERVICES},
}


# The orchestrator's rooms, lowest first: each imports only the rooms before it.
ROOMS = ("peers", "loop", "api")


def imported_modules(path: Path) -> set[str]:
    """The dotted module names that a module's import statements name (relative imports stay in the package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imported_packages(path: Path) -> set[str]:
    """The top-level package names that a module's import statements name."""
    return {name.split(".")[0] for name in imported_modules(path)}


def test_the_reader_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text(
        "import os\n\ndef late():\n    from orchestrator.loop.scheduler import Scheduler\n    import bench.main\n"
    )
    assert imported_packages(module) == {"os", "orchestrator", "bench"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_up(package: str) -> None:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imported_packages(path) & set(FORBIDDEN[package])):
            wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("room", ROOMS)
def test_the_orchestrators_rooms_point_one_way(room: str) -> None:
    above = {f"orchestrator.{name}" for name in ROOMS[ROOMS.index(room) + 1 :]}
    wrong = []
    for path in sorted((ROOT / "orchestrator" / room).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if ".".join(name.split(".")[:2]) in above:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)
    assert sorted(path.name for path in (ROOT / "orchestrator").glob("*.py")) == [
        "__init__.py",
        "main.py",
        "settings.py",
    ]
