"""From the store's records to the API's schemas.

JSON has no NaN or infinity, and the store's JSON columns (reward details, metrics, configs)
may hold them (SQLite keeps what Python's json writes), so every free-form value is made
JSON-safe here: non-finite floats become null.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from agent_rl.app.api.schemas import (
    DraftAcceptanceOut,
    EpisodeOut,
    MessageOut,
    PolicyVersionOut,
    ToolCallOut,
    TurnOut,
)
from agent_rl.store import EpisodeDetail, EpisodeSummary


def json_safe(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def episode_out(e: EpisodeSummary) -> EpisodeOut:
    return EpisodeOut(**json_safe(asdict(e)))


def transcript(detail: EpisodeDetail) -> tuple[list[TurnOut], list[MessageOut], list[ToolCallOut]]:
    turns = [TurnOut(**asdict(t)) for t in detail.turns]
    messages = [MessageOut(**json_safe(m)) for m in detail.messages]
    calls = [ToolCallOut(**json_safe(c)) for c in detail.tool_calls]
    return turns, messages, calls


def policy_version_out(row: dict[str, Any]) -> PolicyVersionOut:
    return PolicyVersionOut(
        version=row["version"],
        trainer_step=row["trainer_step"],
        checkpoint=row["checkpoint"],
        metrics=json_safe(row["metrics"]),
        created_at=row["created_at"],
    )


def metric_series(versions: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Per numeric metric, its [trainer step, value] points in step order (nested dicts are
    flattened with dots; non-numeric and non-finite values are left out)."""
    series: dict[str, list[list[float]]] = {}
    for row in versions:
        step, metrics = row["trainer_step"], row["metrics"]
        if step is None or not isinstance(metrics, dict):
            continue
        for name, value in _flatten(metrics):
            if _finite(value):
                series.setdefault(name, []).append([float(step), float(value)])
    return dict(sorted(series.items()))


def draft_acceptance(versions: list[dict[str, Any]]) -> list[DraftAcceptanceOut]:
    """The MTP draft's acceptance per policy version, from the metrics the learner records
    (`mtp_acceptance_{j}` for depths 1, 2, ..., `mtp_accept_length`); versions without any are
    left out."""
    out = []
    for row in versions:
        metrics = row["metrics"] if isinstance(row["metrics"], dict) else {}
        depths: list[float] = []
        while _finite(value := metrics.get(f"mtp_acceptance_{len(depths) + 1}")):
            depths.append(float(value))
        if depths:
            length = metrics.get("mtp_accept_length")
            out.append(DraftAcceptanceOut(version=row["version"], acceptance=depths,
                                          accept_length=float(length) if _finite(length) else None))
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out
