"""`agent-rl quickstart`: SFT warm start, then asynchronous RL, on one machine (agent_rl.app.quickstart)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import anyio
import typer

from agent_rl.app.cli.common import console
from agent_rl.app.quickstart.recipe import Options

DEFAULT = Options()  # the recipe's defaults are the options' defaults


def quickstart(
    workdir: Annotated[Path, typer.Option(help="Working directory of the run (a second run resumes it).")] = Path("quickstart"),
    seed: Annotated[int, typer.Option(help="Seed of the model, the data and the sampling.")] = DEFAULT.seed,
    sft_steps: Annotated[int, typer.Option(min=1, help="SFT warm-start steps.")] = DEFAULT.sft_steps,
    rl_steps: Annotated[int, typer.Option(min=1, help="RL steps (policy versions) in total.")] = DEFAULT.rl_steps,
    rl_minutes: Annotated[float, typer.Option(min=0.1, help="Time bound of the RL stage in this run.")] = DEFAULT.rl_minutes,
    eval_tasks: Annotated[int, typer.Option(min=2, help="Fixed evaluation tasks.")] = DEFAULT.eval_tasks,
    eval_samples: Annotated[int, typer.Option(min=1, help="Samples per evaluation task.")] = DEFAULT.eval_samples,
    cluster: Annotated[
        bool, typer.Option("--cluster", help="Cluster mode (needs agent-rl[cluster] and --store-url postgresql://...): the RL stage's 2 engines, router, 2 serves and trainer placed on a local Ray cluster through `agent-rl launch`.")
    ] = False,
    store_url: Annotated[
        Optional[str], typer.Option(help="Store URL (--cluster needs postgresql://...); default SQLite in the working directory.")
    ] = None,
    agent: Annotated[
        bool, typer.Option("--agent", help="Train the calculator agent written with the openai client, through serve's gateway.")
    ] = False,
    dialect: Annotated[
        str, typer.Option("--dialect", help="With --agent: the API the agent is written against: chat (completions), responses, messages (Anthropic).")
    ] = "chat",
    env: Annotated[
        Optional[str], typer.Option("--env", help="Train an environment of another ecosystem: verifiers:vf_calculator (the calculator as a verifiers v1 taskset; needs AGENT_RL_VERIFIERS_PYTHON or .venv-verifiers).")
    ] = None,
    family: Annotated[
        Optional[str], typer.Option("--family", help="The tiny model's family (an HF model_type with a tiny preset; `agent-rl model init --help` lists them): its preset at the quickstart model's size, an MoE with routing replay; default the quickstart preset.")
    ] = None,
    serve_after: Annotated[
        bool, typer.Option("--serve-after/--no-serve-after", help="Keep the viewer up after the report, until Ctrl-C.")
    ] = True,
) -> None:
    """Make a tiny model, warm-start it with SFT, train it with asynchronous RL, report the curve."""
    from agent_rl.app.quickstart import run_quickstart

    opts = Options(seed=seed, sft_steps=sft_steps, rl_steps=rl_steps, rl_minutes=rl_minutes,
                   eval_tasks=eval_tasks, eval_samples=eval_samples, cluster=cluster,
                   store_url=store_url, agent=agent, dialect=dialect, env=env, family=family)
    try:
        anyio.run(lambda: run_quickstart(opts, workdir, console=console, serve_after=serve_after))
    except KeyboardInterrupt:
        console.print("stopped; run the same command again to resume")
