"""`agent-rl eval`: score one policy version of a run on fixed tasks (see agent_rl.app.evaluation).

The result printed is read back from the store: the evaluation run's per-task mean rewards.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import anyio
import typer

from agent_rl.app.cli.common import console, state

if TYPE_CHECKING:
    from agent_rl.config import Config


def eval_cmd(
    ctx: typer.Context,
    version: Annotated[str, typer.Option(
        help="Policy version of the run to evaluate, 'latest', or 'none' for --weights that are "
             "no version of the run.")] = "latest",
    env: Annotated[Optional[str], typer.Option(help="Environment id (default: rollout.env).")] = None,
    split: Annotated[str, typer.Option(help="Task split.")] = "eval",
    tasks: Annotated[int, typer.Option(min=1, help="The split's first N tasks.")] = 64,
    samples: Annotated[int, typer.Option(min=1, help="Episodes per task.")] = 4,
    seed: Annotated[int, typer.Option(
        help="Seed of the task order and of every request's sampling seed.")] = 1234,
    run: Annotated[Optional[str], typer.Option(
        help="The training run whose policy is evaluated (default: run.name).")] = None,
    name: Annotated[Optional[str], typer.Option(
        help="Name of the evaluation run (default: RUN-eval-vV, made unique).")] = None,
    weights: Annotated[Optional[Path], typer.Option(
        help="Weights to serve as that version (default: the trainer's export of it).")] = None,
    router_url: Annotated[Optional[str], typer.Option(
        help="Load the weights on this router's engines (default: start an engine of its own)."
    )] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The result as one JSON object.")] = False,
    from_stdin: Annotated[bool, typer.Option(
        "--from-stdin",
        help='Evaluate each request read from standard input, one JSON object per line '
             '({"version": V, "weights": DIR}), writing each result as one JSON line; one process '
             '(and without --router-url one engine) serves them all. What trainer.eval.every '
             'runs.')] = False,
) -> None:
    """Evaluate the weights of one policy version into a run of its own that no trainer
    consumes, every request sampled with its own seed (a rerun gives the same rewards)."""
    from agent_rl.app.evaluation import evaluate, resolve_version, weights_of

    if version not in ("latest", "none") and not version.isdigit():
        raise typer.BadParameter(f"--version must be a number, 'latest' or 'none', not {version!r}")
    if version == "none" and weights is None:
        raise typer.BadParameter("--version none evaluates --weights DIR: pass them")
    cfg = state(ctx).config()
    of_run = run or cfg.run.name
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = cfg.router.admin_token.get_secret_value() if cfg.router.admin_token else None
    if from_stdin:
        if weights is not None or name is not None:
            raise typer.BadParameter("--from-stdin takes each request's version and weights "
                                     "from standard input: drop --weights and --name")
        _serve_requests(cfg, of_run=of_run, env=env, split=split, tasks=tasks, samples=samples,
                        seed=seed, router_url=router_url, token=token)
        return

    async def go():  # type: ignore[no-untyped-def]
        v = None if version == "none" else (await resolve_version(cfg, of_run, version))[1]
        return await evaluate(
            cfg, version=v, weights=weights or weights_of(cfg, v),  # type: ignore[arg-type]
            tasks=tasks, samples=samples,
            of_run=of_run, env=env, split=split, seed=seed, router_url=router_url, token=token,
            name=name,
        )  # fmt: skip

    result = anyio.run(go)
    if as_json:
        print(json.dumps(dict(result.as_dict(), mean=result.mean, stderr=result.stderr)))
        return
    console.print(
        f"evaluation run {result.run}: policy version {result.version} of run {of_run} "
        f"({result.weights}), {len(result.task_rewards)} tasks x {samples} samples, seed {seed}: "
        f"mean reward {result.mean:.3f} +- {result.stderr:.3f} (standard error over tasks), "
        f"{result.failed} failed, tool use {result.tool_use:.0%}",
        highlight=False, markup=False, soft_wrap=True,
    )


def _serve_requests(cfg: Config, **options: Any) -> None:
    """`--from-stdin`: replies on standard output, one JSON line each, and nothing else there:
    what anything in this process prints goes to standard error instead."""
    from agent_rl.app.evaluation import evaluate_each

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def reply(answer: dict[str, Any]) -> None:
        replies.write(json.dumps(answer) + "\n")

    try:
        evaluate_each(cfg, sys.stdin, reply, **options)
    finally:
        replies.close()
