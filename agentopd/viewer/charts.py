"""Server-side SVG chart geometry from metrics.jsonl rows (drawn by templates/_charts.html).

    chart = line_chart(rows, ["success_rate", "eval/success_rate"], title="success")
    heat = kl_heatmap(rows)         # steps x turns of kl/turn_<k>, or None without such metrics

Charts are plain numbers here (coordinates, tick labels, colours); the template writes the
SVG, so every label passes through jinja2's autoescaping. Long runs are bucketed to at most
MAX_POINTS points per line (bucket means) and MAX_COLUMNS heatmap columns.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from agentopd.viewer.runs import finite

W, H = 560, 200  # viewBox of a line chart
PAD_L, PAD_R, PAD_T, PAD_B = 52, 12, 12, 26
MAX_POINTS = 400
MAX_COLUMNS = 120
PALETTE = ("#1f6fb4", "#d9480f", "#2b8a3e", "#7048e8", "#c2255c", "#5c940d")
_TURN_KEY = re.compile(r"^kl/turn_(\d+)$")


@dataclass
class Series:
    name: str
    color: str
    points: str  # "x,y x,y ..." for <polyline>
    dots: list[tuple[float, float, str]]  # (x, y, title) when few enough to mark
    last: float | None


@dataclass
class LineChart:
    title: str
    series: list[Series]
    x_ticks: list[tuple[float, str]]
    y_ticks: list[tuple[float, str]]
    width: int = W
    height: int = H

    @property
    def empty(self) -> bool:
        return not self.series


@dataclass
class Cell:
    x: float
    y: float
    w: float
    h: float
    fill: str
    title: str


@dataclass
class Heatmap:
    title: str
    cells: list[Cell]
    rows: list[tuple[float, str]]  # (y centre, "turn k")
    x_ticks: list[tuple[float, str]]
    vmax: float
    width: int = W
    height: int = H
    legend: list[tuple[str, str]] = field(default_factory=list)  # (fill, label)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000 or a < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def _nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step + 1e-9) + 1)]


def _bucket(xs: list[float], ys: list[float], limit: int) -> tuple[list[float], list[float]]:
    if len(xs) <= limit:
        return xs, ys
    size = math.ceil(len(xs) / limit)
    bx, by = [], []
    for i in range(0, len(xs), size):
        bx.append(sum(xs[i : i + size]) / len(xs[i : i + size]))
        by.append(sum(ys[i : i + size]) / len(ys[i : i + size]))
    return bx, by


def line_chart(rows: list[dict[str, Any]], names: list[str], title: str) -> LineChart:
    data = {}
    for name in names:
        pts = [(r["step"], v) for r in rows if (v := finite(r.get(name))) is not None]
        if pts:
            data[name] = _bucket([float(p[0]) for p in pts], [p[1] for p in pts], MAX_POINTS)
    if not data:
        return LineChart(title, [], [], [])
    x_lo = min(min(xs) for xs, _ in data.values())
    x_hi = max(max(xs) for xs, _ in data.values())
    y_lo = min(min(ys) for _, ys in data.values())
    y_hi = max(max(ys) for _, ys in data.values())
    if y_hi - y_lo < 1e-12:
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    margin = (y_hi - y_lo) * 0.05
    y_lo, y_hi = y_lo - margin, y_hi + margin
    x_span = (x_hi - x_lo) or 1.0

    def sx(x: float) -> float:
        return round(PAD_L + (x - x_lo) / x_span * (W - PAD_L - PAD_R), 1)

    def sy(y: float) -> float:
        return round(H - PAD_B - (y - y_lo) / (y_hi - y_lo) * (H - PAD_T - PAD_B), 1)

    series = []
    for i, (name, (xs, ys)) in enumerate(data.items()):
        color = PALETTE[i % len(PALETTE)]
        points = " ".join(f"{sx(x)},{sy(y)}" for x, y in zip(xs, ys))
        dots = [(sx(x), sy(y), f"{name} @ step {x:g}: {y:.6g}") for x, y in zip(xs, ys)] if len(xs) <= 60 else []
        series.append(Series(name, color, points, dots, ys[-1]))
    x_ticks = [(sx(t), f"{t:g}") for t in _nice_ticks(x_lo, x_hi, 5) if x_lo <= t <= x_hi]
    y_ticks = [(sy(t), _fmt(t)) for t in _nice_ticks(y_lo, y_hi, 4) if y_lo <= t <= y_hi]
    return LineChart(title, series, x_ticks, y_ticks)


def _diverging(v: float, vmax: float) -> str:
    """White at 0, red for positive, blue for negative (same hues as the token shading)."""
    t = max(-1.0, min(1.0, v / vmax)) if vmax > 0 else 0.0
    end = (192, 57, 43) if t > 0 else (33, 102, 172)
    a = abs(t) ** 0.75
    r, g, b = (round(255 + (e - 255) * a) for e in end)
    return f"#{r:02x}{g:02x}{b:02x}"


def kl_heatmap(rows: list[dict[str, Any]], width: int = 1100, height: int = 240) -> Heatmap | None:
    turns = sorted({int(m.group(1)) for r in rows for k in r if (m := _TURN_KEY.match(k))})
    if not turns:
        return None
    steps = [r for r in rows if any(f"kl/turn_{t}" in r for t in turns)]
    size = max(1, math.ceil(len(steps) / MAX_COLUMNS))
    buckets = [steps[i : i + size] for i in range(0, len(steps), size)]
    grid_w = width - PAD_L - PAD_R
    grid_h = height - PAD_T - PAD_B
    cw, ch = grid_w / len(buckets), grid_h / len(turns)
    values: list[tuple[int, int, float, str]] = []
    for ci, bucket in enumerate(buckets):
        first, last = bucket[0]["step"], bucket[-1]["step"]
        label = f"step {first}" if first == last else f"steps {first}-{last}"
        for ri, turn in enumerate(turns):
            vs = [v for r in bucket if (v := finite(r.get(f"kl/turn_{turn}"))) is not None]
            if vs:
                values.append((ci, ri, sum(vs) / len(vs), label))
    vmax = max((abs(v) for *_, v, _ in values), default=0.0)
    cells = [
        Cell(
            round(PAD_L + ci * cw, 2),
            round(PAD_T + ri * ch, 2),
            round(cw + 0.3, 2),  # a hair of overlap: no white seams between cells
            round(ch + 0.3, 2),
            _diverging(v, vmax),
            f"turn {turns[ri]}, {label}: kl {v:.5g}",
        )
        for ci, ri, v, label in values
    ]
    row_labels = [(round(PAD_T + (ri + 0.5) * ch, 1), f"turn {t}") for ri, t in enumerate(turns)]
    if len(turns) > 12:  # label every other row when crowded
        row_labels = row_labels[:: math.ceil(len(turns) / 12)]
    x_ticks = []
    for ci in sorted({0, len(buckets) // 2, len(buckets) - 1}):
        x_ticks.append((round(PAD_L + (ci + 0.5) * cw, 1), f"{buckets[ci][0]['step']}"))
    legend = [(_diverging(f * vmax, vmax), _fmt(f * vmax)) for f in (-1, -0.5, 0, 0.5, 1)] if vmax else []
    title = "per-turn KL (kl/turn_k): steps x turns"
    return Heatmap(title, cells, row_labels, x_ticks, vmax, width=width, height=height, legend=legend)


@dataclass
class Bar:
    x: float
    y: float
    w: float
    h: float
    fill: str
    title: str
    href: str


def turn_bars(kls: list[float | None], width: int = 560, height: int = 56) -> list[Bar]:
    """Per-turn KL of one episode as bars (one per turn, linking to #turn-k); zero line in the middle
    when any value is negative."""
    vals = [v for v in kls if v is not None]
    vmax = max((abs(v) for v in vals), default=0.0)
    if not kls:
        return []
    neg = any(v < 0 for v in vals)
    base = height / 2 if neg else height - 1
    span = (height / 2 - 2) if neg else height - 3
    slot = width / len(kls)
    bars = []
    for k, v in enumerate(kls):
        if v is None:
            bars.append(Bar(round(k * slot + 1, 1), base - 1, round(max(slot - 2, 1), 1), 2, "#bbbbbb", f"turn {k}: not scored", f"#turn-{k}"))
            continue
        h = max(abs(v) / vmax * span if vmax else 0.0, 1.5)
        y = base - h if v >= 0 else base
        bars.append(Bar(round(k * slot + 1, 1), round(y, 1), round(max(slot - 2, 1), 1), round(h, 1), _diverging(v, vmax or 1.0), f"turn {k}: kl {v:.5g}", f"#turn-{k}"))
    return bars
