"""The episode viewer: server-rendered pages over the same reads as the JSON API.

Pages read fully without JavaScript (filters are a GET form, tool calls are <details>, token
details are tooltips); the vendored `static/viewer.js` only adds a token inspector and the
replay button, which needs the bearer token.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates
from starlette.types import ASGIApp, Receive, Scope, Send

from agent_rl.app.api.convert import draft_acceptance, episode_out, json_safe, metric_series, transcript
from agent_rl.app.api.deps import ConfigDep, StoreDep
from agent_rl.app.api.filters import NO_NUL, EpisodeQueryDep, fetch_page
from agent_rl.app.api.stats import run_stats
from agent_rl.app.api.tokens import token_view
from agent_rl.app.api.viewer_data import MAX_STRIP_TOKENS, eval_curve, plot, stacked, token_strip
from agent_rl.config.secrets import redact
from agent_rl.store.models import ID_MAX

router = APIRouter(default_response_class=HTMLResponse)
templates = Jinja2Templates(directory=str(files("agent_rl.app.api") / "templates"))
templates.env.filters["pretty"] = lambda v: json.dumps(v, indent=2, ensure_ascii=False, default=str)

Id = Annotated[int, Path(ge=0, le=ID_MAX)]


def page(request: Request, name: str, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, context)


@router.get("/")
async def episodes_page(
    request: Request, store: StoreDep, cfg: ConfigDep, query: EpisodeQueryDep
) -> HTMLResponse:
    episodes, next_cursor = await fetch_page(store, query, cfg.api.max_page_size)
    next_params = query.params(cursor=next_cursor) if next_cursor else None
    return page(
        request,
        "episodes.html",
        query=query,
        episodes=[episode_out(e) for e in episodes],
        next_params=next_params,
        runs=await store.list_runs(),
    )


@router.get("/episodes/{episode_id}")
async def episode_page(
    request: Request, episode_id: Id, store: StoreDep, cfg: ConfigDep
) -> HTMLResponse:
    detail = await store.get_episode(episode_id)
    turns, messages, calls = transcript(detail)
    run = await store.get_run(detail.episode.run_id)
    view = await token_view(store, cfg, episode_id, run.get("config"))
    calls_by_turn: dict[int, list[Any]] = {}
    for c in calls:
        calls_by_turn.setdefault(c.turn_index, []).append(c)
    return page(
        request,
        "episode.html",
        e=episode_out(detail.episode),
        run=run,
        turns=turns,
        messages=messages,
        calls_by_turn=calls_by_turn,
        strip=token_strip(view, turns),
        view=view,
        truncated_strip=len(view.token_ids) > MAX_STRIP_TOKENS,
        task=json_safe((await store.get_task(detail.episode.task_id))["payload"]),
        mutations=cfg.api.token is not None,
    )


@router.get("/groups/{group_id}")
async def group_page(request: Request, group_id: Id, store: StoreDep) -> HTMLResponse:
    group = await store.get_group(group_id)
    episodes = [episode_out(e) for e in await store.group_episodes(group_id)]
    answers = {}
    for e in episodes:
        detail = await store.get_episode(e.id)
        final = [m for m in detail.messages if m["role"] == "assistant"]
        answers[e.id] = final[-1]["content"] if final else ""
    return page(request, "group.html", group=group, episodes=episodes, answers=answers)


@router.get("/runs")
async def runs_page(request: Request, store: StoreDep) -> HTMLResponse:
    return page(request, "runs.html", runs=await store.list_runs())


@router.get("/runs/{run_id}")
async def run_page(request: Request, run_id: Id, store: StoreDep) -> HTMLResponse:
    run = await store.get_run(run_id)
    versions = await store.policy_versions(run_id)
    plots = {name: plot(points) for name, points in metric_series(versions).items()}
    drafts = draft_acceptance(versions)
    draft_plot = plot([[d.version, d.acceptance[0]] for d in drafts]) if drafts else None
    ledger = await store.ledger(run_id)
    evaluated = score = None
    if run["kind"] == "eval":
        # No trainer consumes an evaluation: its ended episodes are scored, not awaiting one.
        shown = {"admitted": ledger.admitted, "scored": ledger.scored, "failed": ledger.failed,
                 "running": ledger.running, "waiting": ledger.waiting}
        if run["evaluates_run_id"] is not None:
            evaluated = await store.get_run(run["evaluates_run_id"])
            score = next((e for e in await store.evaluations(evaluated["id"])
                          if e["run_id"] == run_id), None)
        evaluations: list[dict[str, Any]] = []
    else:
        shown = ledger.as_dict()
        evaluations = await store.evaluations(run_id)
    return page(
        request,
        "run.html",
        run=run,
        config=redact(json_safe(run["config"] or {})),
        versions=versions,
        plots=plots,
        drafts=drafts,
        draft_plot=draft_plot,
        ledger=shown,
        evaluated=evaluated,
        score=score,
        evaluations=evaluations,
        curve=eval_curve(evaluations),
    )


@router.get("/stats")
async def stats_page(
    request: Request,
    store: StoreDep,
    run: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
) -> HTMLResponse:
    run_id = await store.run_id(run) if run else None
    return page(
        request,
        "stats.html",
        stats=await run_stats(store, run_id),
        run=run,
        runs=await store.list_runs(),
    )


@router.get("/audit")
async def audit_page(
    request: Request,
    store: StoreDep,
    cfg: ConfigDep,
    run: Annotated[str | None, Query(max_length=200, pattern=NO_NUL)] = None,
) -> HTMLResponse:
    """Where a run's compute went (`agent_rl.store.audit`), with server-drawn plots. Without
    `run`: the configured run, else the newest training run."""
    from agent_rl.store.audit import ROLLOUT_STATES, TRAINER_STATES, audit_run

    runs = await store.list_runs()
    if run is None:
        names = {r["name"] for r in runs}
        trains = [r["name"] for r in runs if r.get("kind", "train") == "train"]
        run = cfg.run.name if cfg.run.name in names else (trains[-1] if trains else None)
    audit = None if run is None else await audit_run(store, await store.run_id(run),
                                                      cfg.rollout.decode_table)
    bars: dict[str, Any] = {}
    if audit is not None:
        cells = audit.shares.cells
        bars["time"] = stacked([(f"{t} · rollout {r}", cells[f"{t}/{r}"])
                                for t in TRAINER_STATES for r in ROLLOUT_STATES])
        et = audit.episode_time
        bars["episode"] = stacked([(name, et.share(part)) for name, part in (
            ("generation", "generation_s"), ("tools", "tool_s"), ("queued", "queued_s"),
            ("other", "other_s"))])
        w = audit.waste
        total = w.generated_tokens or 1
        bars["waste"] = stacked(
            [("trained", w.trained_tokens / total), ("never trained", w.never_trained / total)]
            + [(f"filtered: {k}", v / total) for k, v in sorted(w.filtered.items())]
            + [(f"failed: {k}", v / total) for k, v in sorted(w.failed.items())])
        bars["engines"] = {e.engine: stacked([("decoding", e.decode_busy),
                                              ("idle", 1 - e.decode_busy)], 360)
                           for e in audit.throughput.engines}
    plots = {name: plot(points) for name, points in (audit.series if audit else {}).items()
             if len(points) > 1}
    return page(request, "audit.html", audit=audit, run=run, runs=runs, bars=bars, plots=plots)


class DropEmptyQueryParams:
    """A GET form submits its empty fields (`min_reward=`); on viewer pages they mean "no
    filter", so they are dropped before validation. The JSON API under /api is left as it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and not scope["path"].startswith("/api/")
            and scope["query_string"]
        ):
            pairs = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            scope = {
                **scope,
                "query_string": urlencode([(k, v) for k, v in pairs if v]).encode("latin-1"),
            }
        await self.app(scope, receive, send)
