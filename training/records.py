"""What the demo writes next to the models: metadata.json and the loss curves (loss_curve.json, loss_curve.md).

A run may retrain only some heads on the shipped target (`--only-heads`), so both files are merged, not rewritten:
the sections of what a run trained replace the old ones, and `runs` lists every run whose results the files still
hold. A run that trains the target starts both files afresh, since every head depends on the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from training.target import LossPoint

METADATA = "metadata.json"
CURVES = "loss_curve.json"


def read_metadata(out: Path) -> dict[str, Any]:
    path = out / METADATA
    metadata: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    return metadata


def merge_metadata(
    previous: dict[str, Any],
    run: dict[str, Any],  # command, settings, stage seconds of this run
    sections: dict[str, Any],  # top-level sections this run produced (corpus, target, ...)
    heads: dict[str, Any],  # per head trained by this run: training record and acceptance
    fresh: bool,  # the run trained the target: nothing of the previous files still holds
) -> dict[str, Any]:
    """The previous metadata with this run's sections and heads replacing theirs, and this run appended to runs."""
    base: dict[str, Any] = {} if fresh else dict(previous)
    merged = base | sections
    merged["runs"] = [*base.get("runs", []), run]
    merged["heads"] = base.get("heads", {}) | heads
    return merged


def read_curves(out: Path) -> dict[str, list[LossPoint]]:
    path = out / CURVES
    if not path.exists():
        return {}
    stored: dict[str, list[list[float]]] = json.loads(path.read_text())
    return {name: [LossPoint(int(step), time, loss) for step, time, loss in rows] for name, rows in stored.items()}


def write_curves(out: Path, curves: dict[str, list[LossPoint]], notes: dict[str, str], rows: int = 20) -> None:
    """The full curves as JSON, and about `rows` evenly spaced points per stage as a Markdown table."""
    (out / CURVES).write_text(
        json.dumps(
            {name: [[p.step, round(p.seconds, 2), round(p.loss, 4)] for p in points] for name, points in curves.items()}
        )
        + "\n"
    )
    lines = ["# Loss curves", ""]
    for name, points in curves.items():
        lines += [
            f"## {name}",
            "",
            notes[name],
            "",
            "| step | seconds | loss (mean of 10 steps) |",
            "|---:|---:|---:|",
        ]
        stride = max(1, len(points) // rows)
        for end in range(stride, len(points) + 1, stride):
            window = points[max(0, end - 10) : end]
            mean = sum(p.loss for p in window) / len(window)
            lines.append(f"| {points[end - 1].step} | {points[end - 1].seconds:.0f} | {mean:.3f} |")
        lines.append("")
    (out / "loss_curve.md").write_text("\n".join(lines))


def directory_megabytes(directory: Path) -> float:
    return round(sum(path.stat().st_size for path in directory.iterdir()) / 1e6, 2)
