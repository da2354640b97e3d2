"""Charts as inline SVG (no JavaScript): bar charts of count differences and lengths, stacked
verdict bars, and summary statistics."""

from __future__ import annotations

import html
import math
from collections import Counter
from typing import Any, Mapping, Sequence

from markupsafe import Markup

from eagledata.tokens.checks import VERDICTS

VERDICT_COLOURS = {"exact": "#2e9d57", "repaired": "#3b7dd8", "mismatch": "#e0892b", "error": "#c93c3c"}


def _nice(x: float) -> float:
    """The smallest of 1, 2, 5 x 10^k (k >= 0) at least ``x``: whole-number steps and bin widths."""
    if x <= 1:
        return 1.0
    e = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 5, 10):
        if x <= m * e:
            return m * e
    return 10 * e


def _fmt_int(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def svg_bars(bars: Sequence[tuple[str, int, str, str]], *, width: int = 600, height: int = 210,
             x_title: str = "", y_title: str = "samples") -> Markup:
    """Vertical bar chart. ``bars``: (x label, count, fill colour, tooltip)."""
    if not bars:
        return Markup('<p class="muted">no data</p>')
    left, right, top, bottom = 46, 10, 16, 56
    pw, ph = width - left - right, height - top - bottom
    ymax = max(c for _, c, _, _ in bars) or 1
    step = _nice(ymax / 4)
    ytop = step * math.ceil(ymax / step)
    n = len(bars)
    bw = min(pw / n, 56.0)
    left += (pw - bw * n) / 2  # few bars: centred, not stretched
    gap = min(3.0, bw * 0.15)
    label_every = max(1, math.ceil(max(len(b[0]) for b in bars) * 6.2 / bw)) if bw < 60 else 1
    stagger = label_every == 2  # two rows of labels instead of dropping every other one
    if stagger:
        label_every = 1
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'xmlns="http://www.w3.org/2000/svg">']
    gx0, gx1 = 46, width - right
    y = 0.0
    while y <= ytop + 1e-9:
        py = top + ph - ph * y / ytop
        out.append(f'<line x1="{gx0}" x2="{gx1}" y1="{py:.1f}" y2="{py:.1f}" class="grid"/>'
                   f'<text x="{gx0 - 6}" y="{py + 4:.1f}" class="ax" text-anchor="end">{_fmt_int(y)}</text>')
        y += step
    for i, (label, count, colour, tip) in enumerate(bars):
        x = left + i * bw + gap / 2
        h = ph * count / ytop
        out.append(f'<g><title>{html.escape(tip)}</title>'
                   f'<rect x="{x:.1f}" y="{top + ph - h:.1f}" width="{max(bw - gap, 1):.1f}" height="{h:.1f}" fill="{colour}"/>')
        if count and bw >= 14:
            out.append(f'<text x="{x + (bw - gap) / 2:.1f}" y="{top + ph - h - 3:.1f}" class="val" text-anchor="middle">{count}</text>')
        out.append("</g>")
        if i % label_every == 0:
            ly = top + ph + 14 + (12 if stagger and i % 2 else 0)
            out.append(f'<text x="{x + (bw - gap) / 2:.1f}" y="{ly}" class="ax" text-anchor="middle">{html.escape(label)}</text>')
    out.append(f'<line x1="{gx0}" x2="{gx1}" y1="{top + ph}" y2="{top + ph}" class="axis"/>')
    if x_title:
        out.append(f'<text x="{(gx0 + gx1) / 2:.1f}" y="{height - 6}" class="axt" text-anchor="middle">{html.escape(x_title)}</text>')
    if y_title:
        out.append(f'<text x="12" y="{top + ph / 2:.1f}" class="axt" text-anchor="middle" transform="rotate(-90 12 {top + ph / 2:.1f})">{html.escape(y_title)}</text>')
    out.append("</svg>")
    return Markup("".join(out))


def diff_bars(counts: Mapping[int, int]) -> list[tuple[str, int, str, str]]:
    """Bars of a distribution of count differences: one per value when they are few and close,
    else signed power-of-two bins (0, ±1, ±2, ±3..4, ±5..8, ...)."""
    counts = {int(k): int(v) for k, v in counts.items() if v}
    if not counts:
        return []
    lo, hi = min(min(counts), 0), max(max(counts), 0)
    ok, bad = VERDICT_COLOURS["exact"], VERDICT_COLOURS["mismatch"]
    total = sum(counts.values())
    if hi - lo <= 40:
        return [(f"{d:+d}" if d else "0", counts.get(d, 0), ok if d == 0 else bad,
                 f"diff {d:+d}: {counts.get(d, 0)} samples ({counts.get(d, 0) / total:.1%})") for d in range(lo, hi + 1)]

    def bin_of(d: int) -> tuple[int, int]:
        a = abs(d)
        if a <= 2:
            return (a, a)
        k = math.ceil(math.log2(a))
        return (2 ** (k - 1) + 1, 2 ** k)

    binned: Counter = Counter()
    for d, c in counts.items():
        a, b = bin_of(d)
        binned[(a, b) if d >= 0 else (-b, -a)] += c
    keys = sorted(binned)
    bars = []
    for a, b in keys:
        label = (f"{a:+d}" if a else "0") if a == b else f"{a:+d}..{b:+d}"
        bars.append((label, binned[(a, b)], ok if a == b == 0 else bad,
                     f"diff {label}: {binned[(a, b)]} samples ({binned[(a, b)] / total:.1%})"))
    return bars


def length_bars(values: Sequence[int], target_bins: int = 24, colour: str = "#5b6fa8") -> list[tuple[str, int, str, str]]:
    """Histogram bars of token lengths with 'nice' bin widths."""
    values = [int(v) for v in values if v is not None]
    if not values:
        return []
    lo, hi = min(values), max(values)
    width = max(1, int(_nice(max(hi - lo, 1) / target_bins)))
    start = (lo // width) * width
    nbins = (hi - start) // width + 1
    counts = Counter((v - start) // width for v in values)
    return [(_fmt_int(start + i * width), counts.get(i, 0), colour,
             f"{start + i * width}..{start + (i + 1) * width - 1} tokens: {counts.get(i, 0)} samples") for i in range(nbins)]


def svg_stacked(parts: Sequence[tuple[str, int, str]], *, width: int = 600, height: int = 26,
                labels: bool = True) -> Markup:
    """One horizontal bar split into (name, count, colour) parts."""
    total = sum(c for _, c, _ in parts)
    out = [f'<svg class="stack" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'preserveAspectRatio="none" xmlns="http://www.w3.org/2000/svg">']
    if not total:
        out.append(f'<rect x="0" y="0" width="{width}" height="{height}" fill="#e5e7eb"/></svg>')
        return Markup("".join(out))
    x = 0.0
    for name, count, colour in parts:
        if not count:
            continue
        w = width * count / total
        out.append(f'<g><title>{html.escape(name)}: {count} ({count / total:.1%})</title>'
                   f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="{height}" fill="{colour}"/>')
        text = f"{name} {count}"
        if labels and w > len(text) * 7 + 8:
            out.append(f'<text x="{x + 6:.2f}" y="{height / 2 + 4:.1f}" class="stk">{html.escape(text)}</text>')
        out.append("</g>")
        x += w
    out.append("</svg>")
    return Markup("".join(out))


def verdict_stack(c: Mapping[str, int], **kw) -> Markup:
    return svg_stacked([(v, int(c.get(v, 0)), VERDICT_COLOURS[v]) for v in VERDICTS], **kw)


def summary_stats(values: Sequence[int]) -> dict[str, Any]:
    v = sorted(int(x) for x in values if x is not None)
    if not v:
        return {}
    q = lambda f: v[min(len(v) - 1, int(f * (len(v) - 1) + 0.5))]  # noqa: E731
    return {"n": len(v), "min": v[0], "median": q(0.5), "p90": q(0.9), "max": v[-1], "mean": sum(v) / len(v)}
