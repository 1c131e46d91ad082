"""A Ray cluster on a Slurm allocation, then `agent-rl launch` on it: the sbatch script.

Slurm hands out nodes, not a Ray cluster, so the script builds one, as NeMo-RL's `ray.sub` and
verl's `ray_on_slurm.slurm` do: one task per node, the Ray head on the allocation's first node
(`srun -w $head ray start --head --block`), a worker on every other node once the head's port
answers, each with the node's GPUs (`--num-gpus`); it waits until every node has joined, then
runs `agent-rl launch --address <head:port>` with the user's arguments on the head node. The
launch follows the run and ends with it (the trainer done or failed), so the job lives as long
as the run and its exit status is the launch's. A SIGTERM to the batch shell (`scancel --batch
--signal=TERM`, or `--signal=B:TERM@300` before the time limit) goes on to the launch, which
stops the run as `agent-rl launch stop` does (serves drain, the trainer checkpoints); either
way Ray is stopped on every node as the job ends. The job finds `ray`, `agent-rl` and a
`python3` that imports ray on the PATH it inherits from sbatch (the submitting shell's, as
sbatch exports it by default, or what `setup` lines make it).

`render_sbatch` is a pure function of a validated `SlurmJob` and the launch's arguments (what
`agent-rl launch --slurm --dry-run` prints); `submit` hands the script to `sbatch --parsable`.
Every value that reaches the script is checked here (an `#SBATCH` line is split on whitespace,
a shell line is quoted), so a bad option fails at render time with one line, not in the queue.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from agent_rl.kernel.errors import ClusterError, ConfigError

# Slurm's --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds, or no limit.
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE")
# Directive values stay one word of plain characters: sbatch splits an #SBATCH line on blanks.
_WORD = re.compile(r"[^\s'\"\\#`$]+")
# A node's custom Ray resource: one per node of the allocation, so a role can be pinned to
# Slurm's nodes and the join count is the resource's total.
NODE_RESOURCE = "agent_rl_slurm_node"


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch asks Slurm for and how it starts Ray; checked when made."""

    nodes: int
    """Nodes in the allocation: the Ray head on the first, a Ray worker on each of the rest."""
    gpus_per_node: int = 0
    """GPUs per node (`#SBATCH --gpus-per-node`, Ray's `--num-gpus`); 0 for CPU nodes."""
    cpus_per_node: int | None = None
    """CPUs per node (`--cpus-per-task`, Ray's `--num-cpus`); None: what Slurm gives the job on
    the node (`$SLURM_CPUS_ON_NODE`: all of it with `exclusive`)."""
    partition: str | None = None
    """Slurm partition (`--partition`); None: the cluster's default."""
    account: str | None = None
    """Account charged (`--account`); None: the user's default."""
    time: str | None = None
    """Wall-clock limit in Slurm's format (`1:00:00`, `2-00:00:00`); None: the partition's."""
    job_name: str = "agent-rl"
    """The job's name in the queue (`--job-name`)."""
    output: str | None = None
    """Where the job's output goes (`--output`, `%j` is the job id); None: `slurm-%j.out`."""
    exclusive: bool = True
    """Whole nodes (`--exclusive`): all of a node's CPUs and GPUs are Ray's."""
    workdir: str | None = None
    """Directory the job runs in (`cd` first), where relative paths resolve; None: sbatch's."""
    sbatch_args: tuple[str, ...] = ()
    """More directives, one option each, as sbatch writes them (`--constraint=h100`)."""
    setup: tuple[str, ...] = ()
    """Shell lines run first on the batch node (`module load ...`, `source .venv/bin/activate`);
    the Ray and launch steps inherit their environment."""
    ray_port: int = 6379
    """The Ray head's GCS port."""
    join_timeout_s: int = 600
    """Seconds for the head to answer and every node to join before the job gives up."""

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError("invalid Slurm option: " + "; ".join(problems))


def _problems(job: SlurmJob) -> list[str]:
    problems = []
    if job.nodes < 1:
        problems.append(f"--nodes must be at least 1 (got {job.nodes})")
    if job.gpus_per_node < 0:
        problems.append(f"--gpus-per-node must be 0 or more (got {job.gpus_per_node})")
    if job.cpus_per_node is not None and job.cpus_per_node < 1:
        problems.append(f"--cpus-per-node must be at least 1 (got {job.cpus_per_node})")
    if job.time is not None and not _TIME.fullmatch(job.time):
        problems.append(
            f"--time {job.time!r} is not a Slurm time (minutes, H:MM:SS or D-HH:MM:SS)"
        )
    for name, value in (("partition", job.partition), ("account", job.account),
                        ("job-name", job.job_name), ("output", job.output)):
        if value is not None and not _WORD.fullmatch(value):
            problems.append(
                f"--{name} {value!r} must be one word without quotes, '#', '$' or backslashes"
            )
    for arg in job.sbatch_args:
        if not arg.startswith("-") or not _WORD.fullmatch(arg):
            problems.append(
                f"--sbatch {arg!r} must be one sbatch option written as one word "
                "(--constraint=h100)"
            )
    if any("\n" in line for line in job.setup):
        problems.append("--setup takes one shell line per use")
    if job.workdir is not None and "\n" in job.workdir:
        problems.append(f"the working directory {job.workdir!r} has a line break")
    if not 1024 <= job.ray_port <= 65535:
        problems.append(f"the Ray port must be in 1024-65535 (got {job.ray_port})")
    if job.join_timeout_s < 1:
        problems.append(f"the join timeout must be at least 1 s (got {job.join_timeout_s})")
    return problems


def _directives(job: SlurmJob) -> list[str]:
    options: list[str] = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
    ]
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_node is not None:
        options.append(f"--cpus-per-task={job.cpus_per_node}")
    if job.exclusive:
        options.append("--exclusive")
    for name, value in (("partition", job.partition), ("account", job.account),
                        ("time", job.time), ("output", job.output)):
        if value is not None:
            options.append(f"--{name}={value}")
    options.extend(job.sbatch_args)
    return [f"#SBATCH {option}" for option in options]


def _cpus(job: SlurmJob) -> str:
    # Unset, a node's CPUs are those Slurm gave the job there (all of them, --exclusive).
    return str(job.cpus_per_node) if job.cpus_per_node is not None else '"$SLURM_CPUS_ON_NODE"'


def _ray_step(job: SlurmJob) -> str:
    """srun's options for a `ray start` step: one task holding the node's CPUs and GPUs (a
    step's default is one CPU, and cgroups would hold all of Ray to it)."""
    flags = ["--overlap", "--nodes=1", "--ntasks=1", f"--cpus-per-task={_cpus(job)}"]
    if job.gpus_per_node:
        flags.append(f"--gpus-per-node={job.gpus_per_node}")
    return " ".join(flags)


def _ray_resources(job: SlurmJob) -> str:
    """`ray start`'s per-node resources, the same on the head and the workers."""
    return " ".join([
        f"--num-cpus={_cpus(job)}", f"--num-gpus={job.gpus_per_node}",
        "--resources=" + shlex.quote(f'{{"{NODE_RESOURCE}": 1}}'),
    ])


def render_sbatch(
    job: SlurmJob, launch_args: Sequence[str] = (), config: str | None = None
) -> str:
    """The sbatch script that starts Ray on `job`'s allocation and runs `agent-rl launch` on it.

    `launch_args` are the launch's own arguments, passed on quoted (the script adds
    `--address`); `config` is the config file for `agent-rl --config`, as the job will see it.
    """
    if any(a == "--address" or a.startswith("--address=") for a in launch_args):
        raise ConfigError(
            "the sbatch gives the launch the address of the Ray head it starts: "
            "leave --address out of a --slurm launch"
        )
    if "--detach" in launch_args:
        raise ConfigError(
            "a --slurm launch follows its run (the job, and Ray, end when the launch does): "
            "leave --detach out"
        )
    root = ["agent-rl"] + (["--config", config] if config is not None else [])
    launch = " ".join(map(shlex.quote, [*root, "launch"]))
    user = "".join(f" {shlex.quote(a)}" for a in launch_args)
    first = [f"cd {shlex.quote(job.workdir)}"] if job.workdir is not None else []
    first += job.setup
    setup = "".join(line + "\n" for line in first)
    return _SCRIPT.format(
        directives="\n".join(_directives(job)),
        setup=setup,
        port=job.ray_port,
        nodes=job.nodes,
        timeout=job.join_timeout_s,
        resource=NODE_RESOURCE,
        ray_step=_ray_step(job),
        resources=_ray_resources(job),
        launch=launch,
        user_args=user,
    )


def submit(script: str) -> str:
    """Submit `script` with `sbatch --parsable` (read from stdin); return the job id.

    Not exercised by the tests: there is no Slurm controller on the machines that run them.
    """
    if shutil.which("sbatch") is None:
        raise ClusterError(
            "sbatch is not on PATH: run this on a Slurm login node, or print the script with "
            "--dry-run and submit it there with `sbatch FILE`"
        )
    try:
        done = subprocess.run(
            ["sbatch", "--parsable"], input=script, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as e:
        raise ClusterError("sbatch did not answer within 120 s; is the controller up?") from e
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise ClusterError(f"sbatch refused the job: {reason[0]}")
    # --parsable prints "jobid" or "jobid;cluster"
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise ClusterError(f"sbatch answered {done.stdout.strip()!r}, not a job id")
    return job_id


# The script's own shell, with {placeholders} filled by render_sbatch (braces doubled).
_SCRIPT = """\
#!/bin/bash
{directives}

# Rendered by `agent-rl launch --slurm`: starts a Ray cluster on this allocation (the head on
# its first node, a worker on each other node), runs `agent-rl launch` on the head node until
# the run ends, then stops Ray on every node. A SIGTERM to this shell (scancel --batch
# --signal=TERM) stops the run as `agent-rl launch stop` does: serves drain, the trainer
# checkpoints.
set -euo pipefail
{setup}
port={port}
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
mapfile -t node_list <<<"$nodes"
if [[ ${{#node_list[@]}} -ne {nodes} ]]; then
  echo "error: ${{#node_list[@]}} node(s) allocated, the script is for {nodes}" >&2
  exit 1
fi
head=${{node_list[0]}}
# The head's address as the other nodes reach it: its name's IPv4 address (not loopback, which
# /etc/hosts may give a host's own name), else the first address the head itself reports.
head_ip=$(getent ahostsv4 "$head" | awk '$1 !~ /^127\\./ {{ print $1; exit }}' || true)
if [[ -z "$head_ip" ]]; then
  head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname -I | awk '{{ print $1 }}')
fi
ip_head=$head_ip:$port
echo "Ray head: $head ($ip_head), {nodes} node(s)"

ray_steps=()
stop_ray() {{
  # `ray stop` on every node, then the `ray start --block` steps themselves.
  srun --overlap --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 ray stop --force \\
    >/dev/null 2>&1 || true
  if [[ ${{#ray_steps[@]}} -gt 0 ]]; then
    kill "${{ray_steps[@]}}" 2>/dev/null || true
  fi
  wait || true
}}
trap stop_ray EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

srun {ray_step} -w "$head" \\
  ray start --head --block --node-ip-address="$head_ip" --port="$port" --disable-usage-stats \\
  {resources} &
ray_steps+=($!)

# The workers join once the head's port answers.
deadline=$((SECONDS + {timeout}))
until (exec 3<>"/dev/tcp/$head_ip/$port") 2>/dev/null; do
  if ! kill -0 "${{ray_steps[0]}}" 2>/dev/null; then
    echo "error: the Ray head's step ended before its port answered (its output is above)" >&2
    exit 1
  fi
  if ((SECONDS > deadline)); then
    echo "error: the Ray head did not answer on $ip_head within {timeout} s" >&2
    exit 1
  fi
  sleep 2
done

for worker in "${{node_list[@]:1}}"; do
  srun {ray_step} -w "$worker" \\
    ray start --block --address="$ip_head" \\
    {resources} &
  ray_steps+=($!)
done

# Every node has joined when the cluster holds {nodes} of the per-node resource.
python3 - "$ip_head" {nodes} "$((deadline - SECONDS))" <<'PY'
import sys, time

import ray

address, want, budget = sys.argv[1], int(sys.argv[2]), max(int(sys.argv[3]), 1)
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + budget
while (joined := int(ray.cluster_resources().get("{resource}", 0))) < want:
    if time.monotonic() > deadline:
        sys.exit(f"error: {{joined}} of {{want}} nodes joined the Ray cluster in time")
    time.sleep(2)
print(f"Ray cluster up: {{joined}} node(s)")
PY

# The launch follows the run and ends with it: the job's exit status is the launch's. A SIGTERM
# from here on goes to the launch, which stops the run as `agent-rl launch stop` does (serves
# drain, the trainer checkpoints) and exits; Ray is stopped after it.
srun --overlap --nodes=1 --ntasks=1 -w "$head" \\
  {launch} --address "$ip_head"{user_args} &
launch_step=$!
stopping=""
trap 'stopping=yes; kill -TERM "$launch_step" 2>/dev/null || true' TERM INT
status=0
wait "$launch_step" || status=$?
# A signal ends `wait` early: wait again, for the launch's own status once it has stopped the
# run (127: that wait had already returned it).
while [[ -n "$stopping" ]]; do
  stopping=""
  wait "$launch_step" && status=0 || {{ code=$?; ((code == 127)) || status=$code; }}
done
exit "$status"
"""
