"""Running Tandem needs none of its extras: the real CLI, in processes where ray and matplotlib cannot be imported
(tests/helpers/blocked_imports.py), serves a stack, and refuses `--launcher ray` in one line naming the extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.blocked_imports import environment_without
from tests.integration.stack import generate, serve, tandem_command

OPTIONAL = ["ray", "matplotlib"]


def test_serve_with_the_ray_launcher_stops_at_start_up_in_one_line_naming_the_ray_extra(tmp_path: Path) -> None:
    finished = subprocess.run(
        tandem_command("serve", "--launcher", "ray", "--port", "0"),
        env=environment_without(OPTIONAL, tmp_path / "hook"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    assert finished.returncode == 2, finished.stdout
    assert finished.stdout.splitlines() == [
        "tandem serve cannot start: --launcher ray: the ray package is not installed (pip install 'tandem[ray]')"
    ]


def test_the_process_launcher_serves_without_the_extras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, llama_target: Path, random_draft: Path
) -> None:
    environment = environment_without(OPTIONAL, tmp_path / "hook")
    # The stack's processes (serve, target, draft, orchestrator) inherit this environment from the test process.
    monkeypatch.setenv("PYTHONPATH", environment["PYTHONPATH"])
    blocked = subprocess.run([sys.executable, "-c", "import ray"], capture_output=True, text=True, timeout=60)
    assert blocked.returncode == 1 and "No module named 'ray'" in blocked.stderr
    with serve(llama_target, random_draft) as stack:
        completion = generate(stack.address, prompt="def fibonacci(n):", max_new_tokens=6, ignore_eos=True)
    assert len(completion.token_ids) == 6 and completion.finish_reason == "length"
    assert completion.stats.draft_tokens > 0  # the draft replica ran, too
    assert "ModuleNotFoundError" not in "".join(stack.log)
