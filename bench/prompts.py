"""Benchmark prompts: code from the stdlib packages held out of the demo pair's training."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from training.data import HELD_OUT_PACKAGES, split_corpus, stdlib_root

_DEFINITION = re.compile(r"^\s*def \w+\(.*\).*:\s*$")


def held_out_prompts(
    count: int = 32, context_lines: int = 12, packages: Sequence[str] = HELD_OUT_PACKAGES
) -> list[str]:
    """`count` prompts, each ending with a one-line `def` signature and the lines before it.

    Files are taken round-robin across the held-out packages so every package contributes; within a
    file the definitions are spread evenly. Deterministic for a given Python installation.
    """
    split = split_corpus(stdlib_root(), packages)
    by_package: dict[str, list[Path]] = {}
    for path in split.held_out:
        by_package.setdefault(split.package_of(path), []).append(path)
    candidates: dict[str, list[str]] = {package: [] for package in by_package}
    for package, paths in by_package.items():
        for path in paths:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            definitions = [i for i, line in enumerate(lines) if _DEFINITION.match(line)]
            for index in definitions[:: max(1, len(definitions) // 3)][:3]:
                window = lines[max(0, index - context_lines) : index + 1]
                candidates[package].append("\n".join(window) + "\n")
    prompts: list[str] = []
    while len(prompts) < count and any(candidates.values()):
        for package in sorted(candidates):
            if candidates[package] and len(prompts) < count:
                prompts.append(candidates[package].pop(0))
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} prompts found in the held-out packages {list(packages)}")
    return prompts
