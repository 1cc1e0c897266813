"""Line charts as inline SVG, drawn on the server: no JavaScript library, no CDN."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563",
           "#ca8a04")
WIDTH, HEIGHT, LEFT, BOTTOM, TOP, RIGHT = 720, 240, 64, 28, 34, 40


def _fmt(value: float) -> str:
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.1f}{suffix}"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def _segments(values: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    """Runs of consecutive known values: a gap (None, e.g. no requests that hour) breaks the line
    instead of drawing a misleading zero."""
    runs: list[list[tuple[int, float]]] = [[]]
    for i, value in enumerate(values):
        if value is None:
            runs.append([])
        else:
            runs[-1].append((i, value))
    return [run for run in runs if run]


def line_chart(
    title: str, buckets: Sequence[datetime], series: Mapping[str, Sequence[float | None]],
    *, time_format: str = "%m-%d %H:00", unit: str = "", totals: bool = True,
) -> SafeString:
    """One line per series over the shared ``buckets`` (x), with a title, axes and a legend."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    known = [v for values in series.values() for v in values if v is not None]
    top = max(known, default=0) or 1
    n = max(len(buckets) - 1, 1)

    def x(i: int) -> float:
        return LEFT + plot_w * i / n

    def y(v: float) -> float:
        return TOP + plot_h * (1 - v / top)

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT + 20 * len(series)}" '
        f'xmlns="http://www.w3.org/2000/svg" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<text x="{LEFT}" y="18" font-size="14" font-weight="600">{escape(title)}</text>',
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{WIDTH - RIGHT}" y2="{TOP + plot_h}" '
        'stroke="#999"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="#999"/>',
    ]
    for frac in (0, 0.5, 1):
        parts.append(f'<text x="{LEFT - 6}" y="{y(top * frac) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{_fmt(top * frac)}{escape(unit)}</text>')
    if buckets:
        last = len(buckets) - 1
        for i in sorted({0, last // 2, last}):
            anchor = "start" if i == 0 else "end" if i == last else "middle"
            parts.append(f'<text x="{x(i):.1f}" y="{HEIGHT - 8}" text-anchor="{anchor}" '
                         f'font-size="11">{buckets[i].strftime(time_format)}</text>')
    for index, (name, values) in enumerate(series.items()):
        color = PALETTE[index % len(PALETTE)]
        for run in _segments(values):
            points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in run)
            if len(run) == 1:  # a lone hour: a dot, since a one-point line is invisible
                parts.append(f'<circle cx="{x(run[0][0]):.1f}" cy="{y(run[0][1]):.1f}" r="3" '
                             f'fill="{color}"/>')
            parts.append(f'<polyline class="series" data-series="{escape(name)}" fill="none" '
                         f'stroke="{color}" stroke-width="2" points="{points}"/>')
        legend_y = HEIGHT + 14 + 20 * index
        total = sum(v for v in values if v is not None)
        label = f"{name} (total {_fmt(total)}{unit})" if totals else name
        parts.append(f'<rect x="{LEFT}" y="{legend_y - 9}" width="12" height="12" '
                     f'fill="{color}"/><text x="{LEFT + 18}" y="{legend_y + 1}" font-size="12">'
                     f"{escape(label)}</text>")
    if not series:
        parts.append(f'<text x="{LEFT + plot_w / 2}" y="{TOP + plot_h / 2}" '
                     'text-anchor="middle" fill="#666">No usage in this range</text>')
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every interpolated string above is escaped
