"""The routing benchmark's results as one self-contained SVG: a panel per policy with its
requests and prefill tokens per group (bars, the mean dashed), titled with its hit rate,
max/mean and TTFT. Balance is what a person sees at a glance and reads slowly from a list of
sixteen numbers. No plotting library: a few rectangles and lines written as text.

    python -m benchmarks.routing --trace T.jsonl --groups 16 --plot routing.svg
"""

from __future__ import annotations

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
    tops = {field: max((max(r[field]["per_group"], default=0) for r in results), default=0) for field, _, _ in SERIES}  # fmt: skip
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
    return " · ".join(parts)


def _bars(spread: dict, name: str, colour: str, x0: float, y0: float, top: float) -> list[str]:
    """One chart: a bar per group on a shared scale (`top`), the mean as a dashed line."""
    values, scale = spread["per_group"], (PANEL_H - 16) / top if top else 0.0
    base, step = y0 + PANEL_H, PANEL_W / max(1, len(values))
    out = [
        f'<text x="{x0}" y="{y0 + 10}" fill="#555">{escape(name)} (max/mean {spread["max_over_mean"]})</text>',  # fmt: skip
        f'<line x1="{x0}" y1="{base}" x2="{x0 + PANEL_W}" y2="{base}" stroke="#999"/>',
    ]
    for k, v in enumerate(values):
        h = v * scale
        out.append(
            f'<rect class="bar" x="{x0 + k * step + 1:.1f}" y="{base - h:.1f}" width="{max(1.0, step - 2):.1f}" '
            f'height="{h:.1f}" fill="{colour}"><title>group {k}: {v}</title></rect>'
        )  # fmt: skip
    if values:
        y = base - sum(values) / len(values) * scale
        out.append(f'<line class="mean" x1="{x0}" y1="{y:.1f}" x2="{x0 + PANEL_W}" y2="{y:.1f}" stroke="black" stroke-dasharray="4 3"/>')  # fmt: skip
    return out
