"""The model flags of `tandem serve`, `bench` and `bench-load`: --target and --draft, and the bundled demo pair.

They are no settings fields: a command resolves them (a missing --target is the demo target, with the demo head
unless --draft names another) into the directories its settings hold.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.models.block_format import drafts_per_round
from tandem.settings import DEMO_DRAFTS

NGRAM = (
    "ngram"  # --draft ngram: prompt-lookup drafting in the orchestrator, no draft model (orchestrator/loop/ngram.py)
)


def draft_dir_option(given: str) -> Path:
    """A draft directory, or `demo:<name>` for one of the bundled demo heads (which fit the demo target only)."""
    if not given.startswith("demo:"):
        return Path(given)
    name = given.removeprefix("demo:")
    if name not in DEMO_DRAFTS:
        raise argparse.ArgumentTypeError(f"{given!r}: the demo heads are {', '.join('demo:' + n for n in DEMO_DRAFTS)}")
    return DEMO_DRAFTS[name]


def draft_option(given: str) -> Path | str:
    """`--draft`: a directory or `demo:<name>` (draft_dir_option), or NGRAM (a directory of that name: ./ngram)."""
    return NGRAM if given == NGRAM else draft_dir_option(given)


def model_dir(given: Path | None, demo: Path, flag: str) -> Path:
    """The directory given, else the bundled demo model `demo`; SystemExit when that is not installed."""
    if given is not None:
        return given
    if not (demo / "config.json").is_file():
        raise SystemExit(f"tandem: no {flag} given and the bundled demo pair is not installed at {demo}")
    return demo


def shown(path: Path) -> str:
    """A path as a benchmark's record names it: relative to the working directory when under it (the demo pair,
    bench/results), else by its name, so that a record carries no one's home or temporary directories."""
    resolved = path.resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else resolved.name


def block_drafts(draft_dir: Path | None) -> int | None:
    """The drafts a round of the block drafter in `draft_dir` makes in one forward (tandem.models.block_format);
    None for any other directory."""
    config_path = draft_dir / "config.json" if draft_dir is not None else None
    if config_path is None or not config_path.is_file():
        return None
    return drafts_per_round(json.loads(config_path.read_text()))
