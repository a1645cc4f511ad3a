"""A bar chart written as a PNG with zlib only (no plotting dependency): acceptance per draft position."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

WIDTH, HEIGHT, MARGIN = 480, 270, 30
BACKGROUND, AXIS, GRID = (255, 255, 255), (40, 40, 40), (220, 220, 220)
COLORS = ((52, 101, 164), (204, 121, 41), (78, 154, 6), (117, 80, 123))


def bar_chart(path: Path, series: Sequence[Sequence[float]]) -> None:
    """Grouped bars, one group per position, one color per series; values in [0, 1] (grid at 0.25 steps)."""
    pixels = [[BACKGROUND] * WIDTH for _ in range(HEIGHT)]
    plot_height = HEIGHT - 2 * MARGIN
    for quarter in range(5):
        y = HEIGHT - MARGIN - round(plot_height * quarter / 4)
        for x in range(MARGIN, WIDTH - MARGIN):
            pixels[y][x] = GRID
    groups = max((len(values) for values in series), default=0)
    if groups:
        group_width = (WIDTH - 2 * MARGIN) / groups
        bar_width = max(1, int(group_width * 0.8 / max(1, len(series))))
        for series_index, values in enumerate(series):
            color = COLORS[series_index % len(COLORS)]
            for position, value in enumerate(values):
                left = MARGIN + int(position * group_width + group_width * 0.1) + series_index * bar_width
                top = HEIGHT - MARGIN - round(plot_height * min(max(value, 0.0), 1.0))
                for y in range(top, HEIGHT - MARGIN):
                    for x in range(left, min(left + bar_width - 1, WIDTH - MARGIN)):
                        pixels[y][x] = color
    for y in range(MARGIN, HEIGHT - MARGIN + 1):
        pixels[y][MARGIN - 1] = AXIS
    for x in range(MARGIN - 1, WIDTH - MARGIN):
        pixels[HEIGHT - MARGIN][x] = AXIS
    raw = b"".join(b"\x00" + bytes(channel for pixel in row for channel in pixel) for row in pixels)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 2, 0, 0, 0))
        + _chunk(b"IDAT", zlib.compress(raw, 9))
        + _chunk(b"IEND", b"")
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
