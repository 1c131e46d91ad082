"""`agent-rl launch [status | logs ROLE | stop]`: a run's roles on a Ray cluster, kept alive
(agent_rl/cluster; docs/cluster.md)."""

from __future__ import annotations

import signal
from typing import Annotated, Any, Optional

import typer

from agent_rl.app.cli import launch_slurm as slurm_cli
from agent_rl.app.cli.common import console, plain_table, state

app = typer.Typer(
    help="Place the run's roles ([cluster]) on a Ray cluster and keep them alive.",
    invoke_without_command=True,
)

AddressOption = Annotated[
    Optional[str], typer.Option("--address", help="Ray cluster (default: cluster.address, `auto`).")
]


@app.callback()
def launch(
    ctx: typer.Context,
    address: AddressOption = None,
    until_version: Annotated[
        Optional[int],
        typer.Option(min=1, help="The trainer stops once the policy version reaches V."),
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="Return once every role runs; the run stays up.")
    ] = False,
    wait_s: Annotated[
        float, typer.Option("--wait", min=0, help="Seconds to wait for every role to run.")
    ] = 900.0,
    # the job of a Slurm allocation instead (agent_rl/app/cli/launch_slurm.py)
    slurm: slurm_cli.Slurm = False,
    nodes: slurm_cli.Nodes = 1,
    gpus_per_node: slurm_cli.GpusPerNode = 0,
    cpus_per_node: slurm_cli.CpusPerNode = None,
    partition: slurm_cli.Partition = None,
    account: slurm_cli.Account = None,
    time: slurm_cli.TimeLimit = None,
    job_name: slurm_cli.JobName = "agent-rl",
    output: slurm_cli.Output = None,
    exclusive: slurm_cli.Exclusive = True,
    sbatch: slurm_cli.Sbatch = None,
    setup: slurm_cli.Setup = None,
    ray_port: slurm_cli.RayPort = 6379,
    dry_run: slurm_cli.DryRun = False,
) -> None:
    """Start the engines, router, serves and trainer of [cluster] as Ray actors and keep them
    alive; follow the run until its trainer is done (then stop it), or Ctrl-C (stops it too).
    With --detach, return once the roles run: `agent-rl launch status | logs ROLE | stop`.
    With --slurm, an sbatch starts Ray on a Slurm allocation and runs this launch there."""
    if ctx.invoked_subcommand is not None:
        return
    if slurm_cli.launch_on_slurm(ctx):
        return
    from agent_rl.cluster.launch import follow, launch as start, stop

    cli = state(ctx)
    cfg = cli.config()
    say = lambda line: console.print(line, highlight=False)  # noqa: E731
    status = start(cfg, cli.config_path, address=address, until_version=until_version,
                   wait_s=wait_s, echo=say)
    _print_status(status)
    up = all(s["state"] in ("running", "done") for s in status)
    if detach:
        if not up:
            say("not every role is running yet: `agent-rl launch status`")
            raise typer.Exit(1)
        return
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's cancellation stops the run too
    try:
        final = follow(cfg, address, echo=say)
    except KeyboardInterrupt:
        say("stopping the run: serves drain, the trainer checkpoints")
        final = None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop below is not to be cut short
    stopped = stop(cfg, address)
    _print_status(stopped)
    if final is not None and any(s["state"] == "failed" for s in final):
        raise typer.Exit(1)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@app.command("status")
def status_cmd(ctx: typer.Context, address: AddressOption = None) -> None:
    """Every role's process: state, node, pid, starts, restarts and the last reason."""
    from agent_rl.cluster.launch import status

    _print_status(status(state(ctx).config(), address))


@app.command("logs")
def logs_cmd(
    ctx: typer.Context,
    role: Annotated[
        str, typer.Argument(help="router, engine-0, serve-1, train (train-R: a gang's rank R)...")
    ],
    lines: Annotated[int, typer.Option("--lines", "-n", min=1, help="How many lines.")] = 50,
    address: AddressOption = None,
) -> None:
    """The end of a role's log, read on the node it runs on."""
    from agent_rl.cluster.launch import logs

    typer.echo(logs(state(ctx).config(), role, lines, address), nl=False)


@app.command("stop")
def stop_cmd(ctx: typer.Context, address: AddressOption = None) -> None:
    """Stop the run: serves drain, the trainer checkpoints, then the engines and the router."""
    from agent_rl.cluster.launch import stop

    _print_status(stop(state(ctx).config(), address))


def _why(s: dict[str, Any]) -> str:
    if s["state"] == "pending" and s["waiting"]:
        return s["waiting"] + (f" (after: {s['reason']})" if s["reason"] else "")
    return s["reason"] or "-"


def _print_status(status: list[dict[str, Any]]) -> None:
    rows = [[s["name"], s["state"], s["node"] or "-", str(s["pid"] or "-"), str(s["starts"]),
             str(s["restarts"]), _why(s)] for s in status]  # fmt: skip
    header = ["role", "state", "node", "pid", "starts", "restarts", "reason"]
    table = plain_table(header, rows, right={"pid", "starts", "restarts"})
    console.out(table, end="", highlight=False)
