"""`agent-rl launch --slurm`: the sbatch that starts Ray on a Slurm allocation and runs the launch
there, printed (`--dry-run`) or submitted (agent_rl/cluster/slurm.py, docs/cluster.md).

The launch command declares the Slurm options with the `Annotated` types below, under the
parameter names of SLURM_PARAMS, and begins with `if launch_on_slurm(ctx): return`. The launch that
runs in the job gets the options the user gave this one, less the Slurm ones (an `--address`
is refused: the job's launch gets its own head's). `passed_options` reads them back from the
click context, so a new option of the launch reaches the job without a change here.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from agent_rl.app.cli.common import err_console, state
from agent_rl.cluster.slurm import SlurmJob, render_sbatch, submit
from agent_rl.kernel.errors import ConfigError

_PANEL = "Slurm (with --slurm)"

Slurm = Annotated[bool, typer.Option(
    "--slurm", help="Run on a Slurm allocation: an sbatch starts Ray on its nodes and runs this "
    "launch there (submitted with sbatch, or printed with --dry-run).", rich_help_panel=_PANEL)]
Nodes = Annotated[int, typer.Option(help="Nodes to allocate; Ray's head on the first.",
                                    rich_help_panel=_PANEL)]
GpusPerNode = Annotated[int, typer.Option(help="GPUs per node (0: CPU nodes).",
                                          rich_help_panel=_PANEL)]
CpusPerNode = Annotated[Optional[int], typer.Option(
    help="CPUs per node (default: the node's).", rich_help_panel=_PANEL)]
Partition = Annotated[Optional[str], typer.Option(help="Slurm partition.", rich_help_panel=_PANEL)]
Account = Annotated[Optional[str], typer.Option(help="Slurm account.", rich_help_panel=_PANEL)]
TimeLimit = Annotated[Optional[str], typer.Option(
    "--time", help="Time limit, as Slurm writes it (12:00:00, 2-00:00:00).",
    rich_help_panel=_PANEL)]
JobName = Annotated[str, typer.Option(help="The job's name in the queue.", rich_help_panel=_PANEL)]
Output = Annotated[Optional[str], typer.Option(
    help="The job's output file (%j: the job id; default slurm-%j.out).", rich_help_panel=_PANEL)]
Exclusive = Annotated[bool, typer.Option(help="Whole nodes for the job.", rich_help_panel=_PANEL)]
Sbatch = Annotated[Optional[list[str]], typer.Option(
    help="Another #SBATCH option, as one word (--sbatch=--qos=high); repeatable.",
    rich_help_panel=_PANEL)]
Setup = Annotated[Optional[list[str]], typer.Option(
    help="A shell line the job runs first (module load ..., source .venv/bin/activate); "
    "repeatable.", rich_help_panel=_PANEL)]
RayPort = Annotated[int, typer.Option(help="The Ray head's port.", rich_help_panel=_PANEL)]
DryRun = Annotated[bool, typer.Option(
    "--dry-run", help="With --slurm: print the sbatch, submit nothing.", rich_help_panel=_PANEL)]

# The launch's parameters that configure the job rather than the launch inside it.
SLURM_PARAMS = frozenset({
    "slurm", "nodes", "gpus_per_node", "cpus_per_node", "partition", "account", "time",
    "job_name", "output", "exclusive", "sbatch", "setup", "ray_port", "dry_run",
})


def launch_on_slurm(ctx: typer.Context) -> bool:
    """With `--slurm`: render the sbatch for this launch, print it (`--dry-run`) or submit it,
    and return True; without, return False (a Slurm option given without it is refused)."""
    params = ctx.params
    if not params.get("slurm"):
        given = [name for name in sorted(SLURM_PARAMS - {"slurm"})
                 if name in params and _given(ctx, name)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ConfigError(f"{flags}: Slurm options, for a launch with --slurm only")
        return False
    job = SlurmJob(
        nodes=params["nodes"], gpus_per_node=params["gpus_per_node"],
        cpus_per_node=params["cpus_per_node"], partition=params["partition"],
        account=params["account"], time=params["time"], job_name=params["job_name"],
        output=params["output"], exclusive=params["exclusive"], workdir=str(Path.cwd()),
        sbatch_args=tuple(params["sbatch"] or ()), setup=tuple(params["setup"] or ()),
        ray_port=params["ray_port"],
    )
    config = state(ctx).config_path
    # the job runs in this directory: a relative config path holds there too
    script = render_sbatch(job, passed_options(ctx, SLURM_PARAMS),
                           str(config) if config is not None else None)
    if params["dry_run"]:
        typer.echo(script, nl=False)
        return True
    job_id = submit(script)
    err_console.print(
        f"submitted Slurm job {job_id}: Ray on {job.nodes} node(s), then agent-rl launch on the "
        f"first (squeue -j {job_id}; output in {job.output or 'slurm-%j.out'})",
        highlight=False, markup=False, soft_wrap=True,
    )
    return True


def passed_options(ctx: typer.Context, leave_out: frozenset[str] = frozenset()) -> list[str]:
    """The command line that gives the command of `ctx` the parameters its user gave it (not
    their defaults, nor those in `leave_out`), options first, then arguments."""
    options: list[str] = []
    arguments: list[str] = []
    for param in ctx.command.params:
        name = param.name
        if name is None or name in leave_out or not _given(ctx, name):
            continue
        value = ctx.params[name]
        # attributes, not isinstance: Typer builds its parameters on its own copy of click
        if param.param_type_name == "argument":
            arguments += [_text(v) for v in (value if param.multiple or param.nargs != 1
                                             else [value])]
        elif getattr(param, "is_flag", False):
            if value:
                options.append(param.opts[0])
            elif param.secondary_opts:
                options.append(param.secondary_opts[0])
        elif param.multiple:
            for item in value:
                options += [param.opts[0], _text(item)]
        else:
            options += [param.opts[0], _text(value)]
    return options + arguments


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave the parameter on the command line (its source's name: Typer's
    ParameterSource is its own click's)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _text(value: Any) -> str:
    return str(value.value if isinstance(value, Enum) else value)
