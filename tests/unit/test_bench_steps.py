"""`python -m bench.steps` on tiny checkpoints: it times every phase of both variants and writes its summary.

No timing is asserted (speed lives in the recorded results); what is checked is that every phase ran for every
batch size with and without the weight copies, and that the runners' copies are back in place afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import steps
from tandem.layers import matmul
from tests.helpers.checkpoints import TinyEagle3Spec, write_tiny_eagle3, write_tiny_target


def test_it_times_each_phase_with_and_without_the_copies(tmp_path: Path) -> None:
    if not matmul.ONEDNN:
        pytest.skip("this PyTorch has no oneDNN: there are no copies to compare")
    target = write_tiny_target(tmp_path / "target")
    draft = write_tiny_eagle3(tmp_path / "draft", target, TinyEagle3Spec(include_embedding=True))
    out = tmp_path / "out"
    argv = ["--target", str(target), "--draft", str(draft), "--concurrency", "1", "3", "--trials", "2"]
    assert steps.main([*argv, "--rounds", "2", "--drafts", "3", "--out", str(out)]) == 0
    summary = json.loads((out / "latest.json").read_text())
    assert summary["linears_with_copies"] > 0
    assert [(row["phase"], row["concurrency"]) for row in summary["rows"]] == [
        (phase, batch) for phase in steps.PHASES for batch in (1, 3)
    ]
    for row in summary["rows"]:
        for variant in steps.VARIANTS:
            assert len(row[f"{variant}_trials_ms"]) == 2 and all(ms > 0 for ms in row[f"{variant}_trials_ms"])
    assert "| propose | 3 |" in (out / "latest.md").read_text()


def test_a_head_without_its_own_embedding_is_refused(tmp_path: Path) -> None:
    target = write_tiny_target(tmp_path / "target")
    draft = write_tiny_eagle3(tmp_path / "draft", target)
    with pytest.raises(SystemExit, match="has no embedding"):
        steps.main(["--target", str(target), "--draft", str(draft), "--out", str(tmp_path / "out")])
