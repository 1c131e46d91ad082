"""What the viewer's templates draw, computed on the server so pages read without JavaScript:
the token strip (tokens colored by rollout probability, prompt and observation tokens marked as
masked, turn, segment and policy-version boundaries shown) and the metric plots (SVG polylines)."""

from __future__ import annotations

import math
from typing import Any

from agent_rl.app.api.schemas import TokenView, TurnOut

MAX_STRIP_TOKENS = 20_000
"""Tokens drawn on an episode page; the JSON API has them all."""


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def token_strip(view: TokenView, turns: list[TurnOut]) -> list[dict[str, Any]]:
    """Items in stream order: {"mark": label} at turn and version boundaries, else a token
    {"text", "cls", "style", "title", "i"}."""
    starts = {t.span_start: t.index for t in turns}
    # Where a rewritten conversation begins (a gateway agent's new segment): a branch mark.
    branches = {t.span_start: t.segment for prev, t in zip(turns, turns[1:])
                if t.segment != prev.segment}
    items: list[dict[str, Any]] = []
    last_version: int | None = None
    n = min(len(view.token_ids), MAX_STRIP_TOKENS)
    for i in range(n):
        if i in branches:
            items.append({"mark": f"segment {branches[i]}: history rewritten", "cls": "segment"})
        if i in starts:
            items.append({"mark": f"turn {starts[i]}", "cls": "turn"})
        masked = view.loss_mask[i] == 0
        version = view.versions[i]
        if not masked and version != last_version:
            items.append({"mark": f"v{version}", "cls": "version"})
            last_version = version
        lp = view.logprobs[i]
        tlp = view.trainer_logprobs[i] if view.trainer_logprobs is not None else None
        text = view.pieces[i] if view.pieces is not None else f"[{view.token_ids[i]}]"
        if masked:
            style = ""
        else:
            p = math.exp(lp) if lp is not None else 0.0
            style = f"background:hsl({120 * p:.0f},70%,{82 - 10 * (1 - p):.0f}%)"
        title = (
            f"#{i} id={view.token_ids[i]} {'masked' if masked else 'model'} "
            f"logprob={_fmt(None if masked else lp)} trainer={_fmt(tlp)} v={version}"
        )
        items.append(
            {
                "i": i,
                "text": text.replace("\n", "\u21b5\n") if text else "\u2205",
                "cls": "tok m" if masked else "tok",
                "style": style,
                "title": title,
            }
        )
    return items


def plot(points: list[list[float]], width: int = 360, height: int = 120) -> dict[str, Any]:
    """An SVG polyline for [x, y] points, with its y range for the axis labels."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    dx, dy = (x1 - x0) or 1.0, (y1 - y0) or 1.0
    pad = 6
    coords = " ".join(
        f"{pad + (x - x0) / dx * (width - 2 * pad):.1f},{height - pad - (y - y0) / dy * (height - 2 * pad):.1f}"
        for x, y in points
    )
    return {
        "points": coords,
        "width": width,
        "height": height,
        "ymin": y0,
        "ymax": y1,
        "xmin": x0,
        "xmax": x1,
        "last": ys[-1],
        "n": len(points),
    }


def stacked(parts: list[tuple[str, float]], width: int = 720) -> list[dict[str, Any]]:
    """Segments of one horizontal bar for (label, share) parts that add up to at most 1:
    x offset and width in pixels, the share, and a color class by position (`seg0`..)."""
    out, x = [], 0.0
    for i, (label, share) in enumerate(parts):
        w = max(share, 0.0) * width
        out.append({"label": label, "share": share, "x": round(x, 1), "w": round(w, 1),
                    "cls": f"seg{i % 8}"})
        x += w
    return out


def eval_curve(evals: list[dict[str, Any]], width: int = 480, height: int = 160) -> dict[str, Any] | None:
    """The evaluations of a run as an SVG curve: mean reward by policy version, with a bar of
    +-1 standard error at each point (evaluations of weights that are no version are left
    out). None with no evaluation at a version."""
    pts = [e for e in evals if e["version"] is not None]
    if not pts:
        return None
    lo = min(e["mean"] - (e["stderr"] or 0) for e in pts)
    hi = max(e["mean"] + (e["stderr"] or 0) for e in pts)
    x0, x1 = min(e["version"] for e in pts), max(e["version"] for e in pts)
    dx, dy, pad = (x1 - x0) or 1.0, (hi - lo) or 1.0, 10

    def xy(v: float, r: float) -> tuple[float, float]:
        return (round(pad + (v - x0) / dx * (width - 2 * pad), 1),
                round(height - pad - (r - lo) / dy * (height - 2 * pad), 1))

    marks = []
    for e in pts:
        x, y = xy(e["version"], e["mean"])
        se = e["stderr"] or 0.0
        marks.append({"x": x, "y": y, "y_lo": xy(e["version"], e["mean"] - se)[1],
                      "y_hi": xy(e["version"], e["mean"] + se)[1],
                      "title": f"v{e['version']}: {e['mean']:.3f} +- {se:.3f} ({e['name']})"})
    return {"width": width, "height": height, "ymin": lo, "ymax": hi, "xmin": x0, "xmax": x1,
            "points": " ".join(f"{m['x']},{m['y']}" for m in marks), "marks": marks}
