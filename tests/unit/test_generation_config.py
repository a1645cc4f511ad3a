"""A target's end-of-sequence ids: config.json's and generation_config.json's together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.models.config import ConfigError, eos_token_ids, read_target_config
from tandem.models.registry import load_target
from tests.helpers.checkpoints import EOS_TOKEN_ID, TinyTargetSpec, write_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("target"), TinyTargetSpec())


def with_generation_config(target_dir: Path, tmp_path: Path, text: str | None) -> Path:
    """A copy of the target (weights linked) whose generation_config.json is `text` (None: no such file)."""
    copy = tmp_path / "target"
    copy.mkdir()
    for path in target_dir.iterdir():
        if path.name != "generation_config.json":
            (copy / path.name).symlink_to(path)
    if text is not None:
        (copy / "generation_config.json").write_text(text)
    return copy


def test_generation_config_adds_its_eos_ids(target_dir: Path, tmp_path: Path) -> None:
    assert json.loads((target_dir / "generation_config.json").read_text())["eos_token_id"] == EOS_TOKEN_ID
    copy = with_generation_config(target_dir, tmp_path, json.dumps({"eos_token_id": [EOS_TOKEN_ID, 77, 78, 77]}))
    assert read_target_config(copy)["eos_token_id"] == [EOS_TOKEN_ID, 77, 78]
    assert load_target(copy).config.eos_token_ids == (EOS_TOKEN_ID, 77, 78)


@pytest.mark.parametrize(
    ("text", "expected"), [(None, (EOS_TOKEN_ID,)), ("{}", (EOS_TOKEN_ID,)), ('{"eos_token_id": 9}', (EOS_TOKEN_ID, 9))]
)
def test_generation_config_is_optional_and_may_name_one_id(
    target_dir: Path, tmp_path: Path, text: str | None, expected: tuple[int, ...]
) -> None:
    copy = with_generation_config(target_dir, tmp_path, text)
    assert eos_token_ids(read_target_config(copy)) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"eos_token_id": "</s>"}', "generation_config.json: eos_token_id must be a token id or a list of them"),
        ('{"eos_token_id": [1, -2]}', "generation_config.json: eos_token_id must be a token id or a list of them"),
        ("{not json", "generation_config.json: not valid JSON"),
    ],
)
def test_a_bad_generation_config_is_refused_naming_it(
    target_dir: Path, tmp_path: Path, text: str, message: str
) -> None:
    copy = with_generation_config(target_dir, tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        read_target_config(copy)
