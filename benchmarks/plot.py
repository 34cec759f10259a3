"""The routing benchmark's results as one self-contained SVG: a panel per policy with its
requests and prefill tokens per group (bars, the mean dashed), titled with its hit rate,
max/mean and TTFT. Balance is what a person sees at a glance and reads slowly from a list of
sixteen numbers. No plotting library: a few rectangles and lines written as text.

    python -m benchmarks.routing --trace T.jsonl --groups 16 --plot routing.svg
"""

from __future__ import annotations

import math
from html import escape

PANEL_W, PANEL_H = 440, 150  # one chart
PAD, TITLE_H = 40, 34
SERIES = (  # (result field, chart title, bar colour)
    ("requests_per_group", "requests per group", "#4c78a8"),
    ("prefill_tokens_per_group", "prefill tokens per group", "#f58518"),
)


def routing_svg(results: list[dict]) -> str:
    """An SVG of `results` (one summary per policy, as benchmarks/routing.py prints them)."""
    width = PAD + len(SERIES) * (PANEL_W + PAD)
    height = PAD + len(results) * (PANEL_H + TITLE_H + PAD)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    tops = {field: max((max(r[field]["per_group"], default=0) for r in results), default=0) for field, _, _ in SERIES}
    for i, r in enumerate(results):
        y0 = PAD + i * (PANEL_H + TITLE_H + PAD)
        out.append(f'<text x="{PAD}" y="{y0 + 14}" font-weight="bold">{escape(_title(r))}</text>')
        for j, (field, name, colour) in enumerate(SERIES):
            x0 = PAD + j * (PANEL_W + PAD)
            out += _bars(r[field], name, colour, x0, y0 + TITLE_H, tops[field])
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _title(r: dict) -> str:
    parts = [r["policy"]]
    if r.get("hit_rate") is not None:
        parts.append(f"hit rate {r['hit_rate']:.4f}")
    parts.append(f"requests max/mean {r['requests_per_group']['max_over_mean']}")
    if r.get("ttft_s_p50") is not None:
        parts.append(f"TTFT p50 {1e3 * r['ttft_s_p50']:.1f} ms, p99 {1e3 * r['ttft_s_p99']:.1f} ms")
    if r.get("pulls"):
        parts.append(f"{r['pulls']} pulls, {r['blocks_pulled']} blocks")
    return " · ".join(parts)


def _bars(spread: dict, name: str, colour: str, x0: float, y0: float, top: float) -> list[str]:
    """One chart: a bar per group on a shared scale (`top`), the mean as a dashed line."""
    values, scale = spread["per_group"], (PANEL_H - 16) / top if top else 0.0
    base, step = y0 + PANEL_H, PANEL_W / max(1, len(values))
    out = [
        f'<text x="{x0}" y="{y0 + 10}" fill="#555">{escape(name)} (max/mean {spread["max_over_mean"]})</text>',
        f'<line x1="{x0}" y1="{base}" x2="{x0 + PANEL_W}" y2="{base}" stroke="#999"/>',
    ]
    for k, v in enumerate(values):
        h = v * scale
        out.append(
            f'<rect class="bar" x="{x0 + k * step + 1:.1f}" y="{base - h:.1f}" width="{max(1.0, step - 2):.1f}" '
            f'height="{h:.1f}" fill="{colour}"><title>group {k}: {v}</title></rect>'
        )
    if values:
        y = base - sum(values) / len(values) * scale
        out.append(
            f'<line class="mean" x1="{x0}" y1="{y:.1f}" x2="{x0 + PANEL_W}" y2="{y:.1f}" stroke="black" stroke-dasharray="4 3"/>'
        )
    return out


# ---- a load sweep (--rates) ---------------------------------------------------------------
CURVES = (  # (result field, chart title, log scale)
    ("hit_rate", "hit rate", False),
    ("ttft_s_p99", "TTFT p99 (s, log scale)", True),
    ("blocks_pulled", "KV blocks pulled between groups", False),  # (the hits above count them)
)
COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#9d755d", "#bab0ac")


def sweep_svg(results: list[dict]) -> str:
    """An SVG of a load sweep: per field of `CURVES`, a chart of it against the arrival rate
    with a line per policy (points titled with the run's utilisation), and a legend."""
    policies = list(dict.fromkeys(r["policy"] for r in results))
    rates = sorted({r["rate"] for r in results})
    legend_h = 18 * len(policies)
    width = PAD + len(CURVES) * (PANEL_W + PAD)
    height = PAD + TITLE_H + PANEL_H + PAD + legend_h + PAD
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for j, (field, name, log) in enumerate(CURVES):
        x0, y0 = PAD + j * (PANEL_W + PAD), PAD + TITLE_H
        values = [r[field] for r in results if r.get(field) is not None]
        out += _axes(name, x0, y0, rates, min(values, default=0), max(values, default=1), log)
        scale = _scale(min(values, default=0), max(values, default=1), log)
        for k, policy in enumerate(policies):
            points = [
                (_x(r["rate"], rates, x0), y0 + PANEL_H - scale(r[field]), r)
                for r in results
                if r["policy"] == policy and r.get(field) is not None
            ]
            colour = COLOURS[k % len(COLOURS)]
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
            out.append(f'<polyline class="curve" points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
            for x, y, r in points:
                tip = f"{policy} at {r['rate']:g}/s: {field} {r[field]}, utilisation {r.get('utilisation')}"
                if r.get("pulls") is not None:
                    tip += f", {r['pulls']} pulls of {r['blocks_pulled']} blocks"
                out.append(
                    f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"><title>{escape(tip)}</title></circle>'
                )
    y = PAD + TITLE_H + PANEL_H + PAD
    for k, policy in enumerate(policies):
        colour = COLOURS[k % len(COLOURS)]
        out.append(f'<rect x="{PAD}" y="{y + 18 * k}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{PAD + 18}" y="{y + 18 * k + 11}">{escape(policy)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _x(rate: float, rates: list[float], x0: float) -> float:
    """Rates at even steps along the axis (a sweep's rates are the reader's chosen points)."""
    return x0 + PANEL_W * (rates.index(rate) + 0.5) / len(rates)


def _scale(low: float, high: float, log: bool):
    """value -> pixels above the axis, the range [low, high] over the chart's height."""
    if log:
        low, high = math.log10(max(low, 1e-4)), math.log10(max(high, 1e-4))
    span = (high - low) or 1.0

    def f(v: float) -> float:
        v = math.log10(max(v, 1e-4)) if log else v
        return 8 + (PANEL_H - 24) * (v - low) / span

    return f


def _axes(name: str, x0: float, y0: float, rates: list[float], low: float, high: float, log: bool) -> list[str]:
    base, scale = y0 + PANEL_H, _scale(low, high, log)
    out = [
        f'<text x="{x0}" y="{y0 - 8}" font-weight="bold">{escape(name)} against arrival rate (requests/s)</text>',
        f'<line x1="{x0}" y1="{base}" x2="{x0 + PANEL_W}" y2="{base}" stroke="#999"/>',
        f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{base}" stroke="#999"/>',
    ]
    for rate in rates:
        out.append(
            f'<text x="{_x(rate, rates, x0):.1f}" y="{base + 14}" text-anchor="middle" fill="#555">{rate:g}</text>'
        )
    for v in (low, high):
        out.append(f'<text x="{x0 - 4}" y="{base - scale(v) + 4:.1f}" text-anchor="end" fill="#555">{v:.3g}</text>')
    return out
