"""`agent-rl quickstart`: the whole system on one machine, with a reward that goes up.

A tiny model is made, warm-started by SFT on an imperfect teacher's demonstrations, then trained
with asynchronous RL: `agent-rl serve` generates episodes through the router into the store while
`agent-rl train` consumes them and syncs its weights back to the engines after every step. The
model is evaluated before SFT, after SFT and after RL on the same fixed tasks, each at a pinned
weight version; the report prints the curve, the RL-vs-SFT test, the ledger and the viewer's URL.

Every process is an ordinary `agent-rl` command under a supervisor (`processes.py`), and
everything lives in one working directory (`recipe.py`); `--cluster` runs the RL stage with two
engines, two serves and a PostgreSQL store on a local Ray cluster through `agent-rl launch`
(`on_ray.py`). Stages are recorded (`pipeline.py`): a second run resumes where the first stopped.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from agent_rl.app.quickstart.recipe import Options

__all__ = ["Options", "run_quickstart"]


async def run_quickstart(
    opts: Options, workdir: Path, *, console: Console, serve_after: bool = False
) -> dict[str, Any]:
    """Run (or resume) the quickstart in `workdir`; returns the summary it reports."""
    from agent_rl.app.quickstart.pipeline import Quickstart, export_path
    from agent_rl.app.quickstart.recipe import BASE_MODEL, SFT_MODEL, check_agent_client
    from agent_rl.app.quickstart.report import (
        PLOT_FILE,
        RESULTS_FILE,
        print_report,
        summarize,
        write_plot,
        write_results,
    )
    from agent_rl.store import Store

    check_agent_client(opts)
    qs = Quickstart(opts, workdir, console)
    async with qs.running():
        evals = {"base": await qs.eval_stage("base", BASE_MODEL, None)}
        await qs.sft_stage()
        evals["sft"] = await qs.eval_stage("sft", SFT_MODEL, 0)
        version = await qs.rl_stage()
        if version > 0:
            evals["rl"] = await qs.eval_stage("rl", export_path(qs.cfg, version), version)
    async with await Store.open(qs.cfg.store) as store:
        run_id = await store.ensure_run(qs.cfg.run.name)
        training = await store.policy_versions(run_id)
        audit = await store.audit(run_id)
    summary = summarize(evals, training, audit)
    summary["wall_s"] = time.monotonic() - qs.started
    plot = write_plot(summary, qs.workdir / PLOT_FILE)
    write_results(summary, qs.workdir / RESULTS_FILE)
    print_report(console, summary, plot)
    console.print(f"this run took {summary['wall_s'] / 60:.1f} min; results in {qs.workdir / RESULTS_FILE}")
    if serve_after:
        await _serve_viewer(qs, console)
    else:
        console.print(f"browse the episodes: cd {qs.workdir} && {command_name()} api  "
                      f"(viewer at http://{qs.cfg.api.host}:{qs.cfg.api.port}/)")
    return summary


def command_name() -> str:
    """How to type `agent-rl` in the user's shell: the bare name when PATH finds this install's
    script (an activated venv, a global install), else that script's path, as a quickstart run
    with `.venv/bin/agent-rl` would need it."""
    script = Path(sys.executable).parent / "agent-rl"
    found = shutil.which("agent-rl")
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return "agent-rl"
    return str(script)


async def _serve_viewer(qs: Any, console: Console) -> None:
    from agent_rl.app.api import create_app, serve_api

    api_cfg = qs.cfg.api
    app = create_app(qs.cfg)
    url = f"http://{api_cfg.host}:{api_cfg.port}/"
    console.print(f"viewer: {url}  (episodes, transcripts, token views; Ctrl-C to stop)")
    await serve_api(app, api_cfg)
