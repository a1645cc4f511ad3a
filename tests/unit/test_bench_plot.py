"""`tandem bench`'s acceptance plot: a matplotlib figure with title, axis labels and annotated bars per setup, and
a report that says so, drawing nothing, where matplotlib (the `bench` extra) is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread
from matplotlib.patches import Rectangle

from bench.plot import TITLE, X_LABEL, Y_LABEL, Series, acceptance_figure
from bench.report import PLOT_NAME
from tests.helpers.bench_runs import write_sample_report
from tests.helpers.blocked_imports import environment_without

SERIES = [Series("split, concurrency 1", (0.79, 0.68, 0.6)), Series("colocated, concurrency 1", (0.81, 0.5, 0.25))]


def test_the_figure_has_a_title_axis_labels_a_legend_and_one_annotated_bar_per_setup_and_position() -> None:
    figure = acceptance_figure(SERIES, "draft eagle3, k = 3 draft steps")
    [axes] = figure.axes
    assert axes.get_title() == f"{TITLE}\ndraft eagle3, k = 3 draft steps"
    assert (axes.get_xlabel(), axes.get_ylabel()) == (X_LABEL, Y_LABEL)
    assert [tick for tick in axes.get_xticks()] == [0, 1, 2]
    legend = axes.get_legend()
    assert legend is not None and [text.get_text() for text in legend.get_texts()] == [one.label for one in SERIES]
    bars = [patch for patch in axes.patches if isinstance(patch, Rectangle)]
    assert sorted(round(bar.get_height(), 2) for bar in bars) == sorted(v for one in SERIES for v in one.acceptance)
    # Each group of bars is centred on its position, the setups side by side in legend order.
    by_position = sorted(bars, key=lambda bar: bar.get_x())
    centres = [bar.get_x() + bar.get_width() / 2 for bar in by_position]
    assert [round((centres[2 * i] + centres[2 * i + 1]) / 2, 6) for i in range(3)] == [0, 1, 2]
    assert [round(bar.get_height(), 2) for bar in by_position[:2]] == [0.79, 0.81]
    assert sorted(text.get_text() for text in axes.texts) == sorted(
        f"{value:.2f}" for one in SERIES for value in one.acceptance
    )


def test_a_figure_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="no series to plot"):
        acceptance_figure([], "draft eagle3")


def test_the_report_draws_the_png_and_names_it(tmp_path: Path) -> None:
    table = write_sample_report(tmp_path).read_text()
    image = imread(tmp_path / PLOT_NAME)  # [height, width, channels]
    assert image.shape[0] > 300 and image.shape[1] > 600 and image.shape[2] in (3, 4)
    assert table.endswith(f"\nAcceptance per draft position: {PLOT_NAME}.\n")
    # Both Tandem rows, each with 3 positions from the sample runs.
    assert table.count("| 0.80 0.60 0.30 |") == 2


def test_without_matplotlib_the_report_says_how_to_install_it_and_draws_nothing(tmp_path: Path) -> None:
    out = tmp_path / "results"
    script = "import sys; from pathlib import Path; from tests.helpers.bench_runs import write_sample_report; "
    script += "write_sample_report(Path(sys.argv[1])); import matplotlib"
    finished = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        env=environment_without(["matplotlib"], tmp_path / "hook"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
    )
    # The report was written; the import after it shows that matplotlib really was out of reach.
    assert finished.returncode == 1 and "No module named 'matplotlib'" in finished.stdout, finished.stdout
    assert sorted(path.name for path in out.iterdir()) == ["latest.json", "latest.md"]
    table = (out / "latest.md").read_text()
    expected = "No acceptance plot: the matplotlib package is not installed (pip install 'tandem[bench]')."
    assert table.endswith(f"\n{expected}\n")
