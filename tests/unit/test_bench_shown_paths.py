"""launch.model_dirs.shown: a record names paths without anyone's home or temporary directories."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.model_dirs import shown


def test_a_directory_under_the_working_directory_is_shown_relative_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tandem" / "demo" / "target").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert shown(tmp_path / "tandem" / "demo" / "target") == "tandem/demo/target"
    assert shown(Path("tandem/demo/target")) == "tandem/demo/target"


def test_a_directory_elsewhere_is_shown_by_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert shown(tmp_path / "checkpoints" / "llama-tiny") == "llama-tiny"
