"""The figure of `tandem bench`: acceptance per draft position, one group of bars per position, one bar per setup.

Drawn with matplotlib (the `bench` extra, tandem/extras.py) on its Agg canvas: a Figure of its own, no pyplot
and no global backend state, so it draws the same in a process without a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TITLE = "Acceptance per draft position"
X_LABEL = "draft position (0: the first drafted token, as in the metrics' position label)"
Y_LABEL = "fraction of rounds that accepted it"
BAR_GROUP_WIDTH = 0.8  # of the unit between two positions; the rest separates the groups
DPI = 120


@dataclass(frozen=True)
class Series:
    label: str  # the setup, as the legend names it: "split, concurrency 1"
    acceptance: tuple[float, ...]  # [position]: the fraction of rounds in which that draft token was accepted


def acceptance_figure(series: Sequence[Series], subtitle: str) -> Figure:
    """Grouped bars with each bar's value written above it; `subtitle` says what was measured (draft, steps)."""
    from matplotlib.figure import Figure

    if not series:
        raise ValueError("acceptance_figure: no series to plot")
    positions = max(len(one.acceptance) for one in series)
    figure = Figure(figsize=(max(6.4, 1.2 + positions * 0.45 * len(series)), 4.4), dpi=DPI, layout="constrained")
    axes = figure.add_subplot()
    width = BAR_GROUP_WIDTH / len(series)
    for index, one in enumerate(series):
        # Bar i of a group sits at its position plus an offset that centres the group on the position.
        offsets = [position + (index - (len(series) - 1) / 2) * width for position in range(len(one.acceptance))]
        bars = axes.bar(offsets, one.acceptance, width=width, label=one.label)
        axes.bar_label(bars, labels=[f"{value:.2f}" for value in one.acceptance], fontsize=7, padding=2)
    axes.set_title(f"{TITLE}\n{subtitle}", fontsize=11)
    axes.set_xlabel(X_LABEL)
    axes.set_ylabel(Y_LABEL)
    axes.set_xticks(range(positions))
    axes.set_ylim(0.0, 1.1)  # room above a bar of 1.0 for its value
    axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    axes.legend(fontsize=8, loc="upper right")
    return figure


def save_acceptance_plot(path: Path, series: Sequence[Series], subtitle: str) -> None:
    """Writes the figure as a PNG through the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = acceptance_figure(series, subtitle)
    FigureCanvasAgg(figure).print_png(path)
