"""Production code stays readable in one sitting: no file over 400 lines, no function over 60 (CONTRIBUTING.md).

Production code is the library and the services with what launches them; training, bench, scripts and tests are
apart, and generated gRPC stubs are not written by hand.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("tandem", "target_server", "draft_server", "orchestrator", "launch")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def production_files() -> Iterator[Path]:
    for package in PRODUCTION:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def long_functions(path: Path, limit: int) -> list[str]:
    """`name (lines)` of each function or method in the file longer than `limit` lines, decorators excluded."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{node.name} ({length})")
    return found


def test_the_function_reader_counts_a_long_function(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    body = "".join(f"        x{index} = {index}\n" for index in range(60))
    module.write_text(f"def short():\n    return 1\n\n\nclass A:\n    async def long(self):\n{body}")
    assert long_functions(module, MAX_FUNCTION_LINES) == ["long (61)"]


def test_no_production_file_is_over_the_limit() -> None:
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in production_files()}
    over = [f"{path.relative_to(ROOT)} ({lines})" for path, lines in sizes.items() if lines > MAX_FILE_LINES]
    assert over == []


def test_no_production_function_is_over_the_limit() -> None:
    over = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in production_files()
        for name in long_functions(path, MAX_FUNCTION_LINES)
    ]
    assert over == []
