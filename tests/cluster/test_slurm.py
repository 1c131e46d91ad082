"""The sbatch that `agent-rl launch --slurm` renders: its syntax (`bash -n`), its directives, the
Ray start commands, the launch command with the user's arguments, the options' checks; and the
script run as Slurm would run it.

There is no Slurm on the machines that run these tests, so the runs put stand-ins for Slurm's
commands first on PATH (`srun` records each step and runs it here, `scontrol` lists the
allocation's nodes, `sbatch` takes the script): fakes at the edge that cannot run here. Most runs
fake Ray and the launch too, to check which step runs where and when; the slow one starts a real
Ray cluster of 2 raylets on this machine through the script, and a stand-in launch connects to
it at the address the script passes. The CLI's `--slurm` branch is driven through a command
that declares the launch's Slurm options; the KubeRay example of docs/cluster.md is parsed.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Optional

import psutil
import pytest
import typer
from typer.testing import CliRunner

from agent_rl.app.cli import launch_slurm as cli
from agent_rl.app.cli.common import CliState
from agent_rl.cluster.slurm import NODE_RESOURCE, SlurmJob, render_sbatch, submit
from agent_rl.kernel.errors import ClusterError, ConfigError

FOUR = SlurmJob(
    nodes=4, gpus_per_node=8, cpus_per_node=64, partition="gpu", account="rl-team",
    time="12:00:00", job_name="agent-rl-run", output="logs/%j.out",
    sbatch_args=("--constraint=h100",), setup=("source .venv/bin/activate",),
)
USER_ARGS = ["--restarts", "3", "it's a name"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(tmp_path: Path, job: SlurmJob = FOUR, args: list[str] = USER_ARGS) -> Path:
    path = tmp_path / "job.sbatch"
    path.write_text(render_sbatch(job, args, config="runs/agent-rl.toml"))
    return path


def test_four_nodes_is_valid_bash(tmp_path: Path) -> None:
    checked = subprocess.run(["bash", "-n", str(_script(tmp_path))], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_four_nodes_directives() -> None:
    text = render_sbatch(FOUR, USER_ARGS)
    assert text.startswith("#!/bin/bash\n#SBATCH ")
    directives = re.findall(r"^#SBATCH (.+)$", text, re.M)
    assert directives == [
        "--job-name=agent-rl-run", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--cpus-per-task=64", "--exclusive", "--partition=gpu", "--account=rl-team",
        "--time=12:00:00", "--output=logs/%j.out", "--constraint=h100",
    ]
    # sbatch reads directives only before the first command
    first_command = next(i for i, line in enumerate(text.splitlines()[1:], 1)
                         if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(text.splitlines())
               if line.startswith("#SBATCH"))


def test_four_nodes_ray_and_launch_commands() -> None:
    text = render_sbatch(FOUR, USER_ARGS, config="runs/agent-rl.toml")
    joined = text.replace("\\\n", " ")  # continuation lines as one
    steps = [" ".join(step.split()) for step in re.findall(r"^\s*srun (.+)$", joined, re.M)]
    step = "--overlap --nodes=1 --ntasks=1 --cpus-per-task=64 --gpus-per-node=8"
    resources = f"--num-cpus=64 --num-gpus=8 --resources='{{\"{NODE_RESOURCE}\": 1}}'"
    head = [s for s in steps if "ray start --head" in s]
    workers = [s for s in steps if "ray start" in s and "--head" not in s]
    assert head == [
        f'{step} -w "$head" ray start --head --block --node-ip-address="$head_ip" '
        f'--port="$port" --disable-usage-stats {resources} &'
    ]
    assert workers == [
        f'{step} -w "$worker" ray start --block --address="$ip_head" {resources} &'
    ]
    assert 'for worker in "${node_list[@]:1}"; do' in text  # one worker per node but the head
    assert "if [[ ${#node_list[@]} -ne 4 ]]" in text
    assert "--overlap --nodes=4 --ntasks=4 --ntasks-per-node=1 ray stop --force " \
        ">/dev/null 2>&1 || true" in steps  # on every node
    assert steps[-1] == (
        '--overlap --nodes=1 --ntasks=1 -w "$head" agent-rl --config runs/agent-rl.toml launch '
        """--address "$ip_head" --restarts 3 'it'"'"'s a name' &"""
    )
    # a SIGTERM to the job, once the launch runs, goes on to it
    assert """trap 'stopping=yes; kill -TERM "$launch_step" 2>/dev/null || true' TERM INT\n""" \
        in text
    assert "source .venv/bin/activate\n" in text
    assert "port=6379\n" in text


def test_defaults_ask_for_little() -> None:
    text = render_sbatch(SlurmJob(nodes=1))
    assert re.findall(r"^#SBATCH (.+)$", text, re.M) == [
        "--job-name=agent-rl", "--nodes=1", "--ntasks-per-node=1", "--exclusive",
    ]
    # the node's CPUs are what Slurm gave the job there; no GPUs asked for or given to Ray
    assert text.count('--cpus-per-task="$SLURM_CPUS_ON_NODE"') == 2
    assert text.count('--num-cpus="$SLURM_CPUS_ON_NODE" --num-gpus=0 --resources=') == 2
    assert "--gpus-per-node" not in text
    assert '\n  agent-rl launch --address "$ip_head" &\n' in text


@pytest.mark.parametrize(("options", "message"), [
    ({"nodes": 0}, "--nodes must be at least 1 (got 0)"),
    ({"nodes": 2, "gpus_per_node": -1}, "--gpus-per-node must be 0 or more (got -1)"),
    ({"nodes": 2, "cpus_per_node": 0}, "--cpus-per-node must be at least 1 (got 0)"),
    ({"nodes": 2, "time": "1 hour"}, "--time '1 hour' is not a Slurm time"),
    ({"nodes": 2, "time": "1:00:00:00"}, "is not a Slurm time"),
    ({"nodes": 2, "partition": "gpu large"}, "--partition 'gpu large' must be one word"),
    ({"nodes": 2, "account": "a'b"}, "--account \"a'b\" must be one word"),
    ({"nodes": 2, "job_name": "x$(id)"}, "--job-name 'x$(id)' must be one word"),
    ({"nodes": 2, "output": ""}, "--output '' must be one word"),
    ({"nodes": 2, "sbatch_args": ("qos=high",)}, "--sbatch 'qos=high' must be one sbatch option"),
    ({"nodes": 2, "sbatch_args": ("--qos high",)}, "must be one sbatch option"),
    ({"nodes": 2, "setup": ("a\nb",)}, "--setup takes one shell line per use"),
    ({"nodes": 2, "ray_port": 80}, "the Ray port must be in 1024-65535 (got 80)"),
])
def test_bad_options_are_refused_in_one_line(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        SlurmJob(**options)
    assert str(caught.value).startswith("invalid Slurm option: ")
    assert "\n" not in str(caught.value)


def test_several_problems_are_named_together() -> None:
    with pytest.raises(ConfigError) as caught:
        SlurmJob(nodes=0, time="soon")
    assert "--nodes" in str(caught.value) and "--time" in str(caught.value)


def test_slurm_times_accepted() -> None:
    for limit in ("30", "30:00", "1:00:00", "2-00", "2-12:00", "2-12:00:00", "UNLIMITED"):
        assert f"#SBATCH --time={limit}\n" in render_sbatch(SlurmJob(nodes=1, time=limit))


def test_the_address_is_the_scripts_own_and_the_launch_follows() -> None:
    with pytest.raises(ConfigError, match="leave --address out"):
        render_sbatch(SlurmJob(nodes=2), ["--address", "10.0.0.1:6379"])
    with pytest.raises(ConfigError, match="leave --address out"):
        render_sbatch(SlurmJob(nodes=2), ["--address=auto"])
    with pytest.raises(ConfigError, match="a --slurm launch follows its run.*leave --detach out"):
        render_sbatch(SlurmJob(nodes=2), ["--detach"])


# --- submit: sbatch is not installed here ---


def _fake_bin(tmp_path: Path, scripts: dict[str, str]) -> Path:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (fake / name).write_text("#!/bin/bash\n" + body)
        (fake / name).chmod(0o755)
    return fake


def test_submit_without_sbatch_says_where_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ClusterError, match="sbatch is not on PATH.*--dry-run"):
        submit("#!/bin/bash\n")


def test_submit_reads_the_parsable_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in sbatch (no Slurm here): the script arrives on stdin, the id is parsed from
    `--parsable`'s "id;cluster", and a refusal is one line with sbatch's reason."""
    fake = _fake_bin(tmp_path, {"sbatch": (
        f'[[ $1 == --parsable ]] || exit 9\ncat > {tmp_path}/submitted\n'
        'if grep -q refuse "' + str(tmp_path) + '/submitted"; then\n'
        '  echo "sbatch: error: Batch job submission failed: Invalid partition name" >&2; exit 1\n'
        'fi\necho "4242;cluster-a"\n'
    )})
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    script = render_sbatch(SlurmJob(nodes=2))
    assert submit(script) == "4242"
    assert (tmp_path / "submitted").read_text() == script
    with pytest.raises(ClusterError, match="^sbatch refused the job: .*Invalid partition name$"):
        submit(script + "# refuse\n")


# --- the script run as Slurm runs it ---

SRUN = """\
# stand-in for Slurm's srun: records the step, then runs it on this machine
node=""; nodes=""
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    -w) node=$2; shift 2 ;;
    --nodes=*) nodes=${1#--nodes=}; shift ;;
    *) shift ;;
  esac
done
echo "srun nodes=$nodes node=$node $*" >> "$STEPS"
export SLURMD_NODENAME=$node
exec "$@"
"""
SCONTROL = '[[ "$1 $2" == "show hostnames" ]] || exit 9\nprintf "%s\\n" $FAKE_NODES\n'


def _run(script: Path, fake: Path, nodes: list[str], timeout: float = 60) -> tuple[int, str, str]:
    # Ray's token authentication off for the whole job, as the job's own shell would have it:
    # `ray.init` of an earlier test in this process (tests/cluster/test_launch.py) left
    # RAY_AUTH_MODE=token in os.environ and a token in ~/.ray, and the head and the launch's
    # client then disagreed (InvalidAuthToken).
    env = {
        **os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "nodes[1-4]",
        "SLURM_JOB_ID": "4242", "SLURM_CPUS_ON_NODE": "2",
        "FAKE_NODES": " ".join(nodes), "STEPS": str(script.parent / "steps"),
    }
    done = subprocess.run(["bash", str(script)], env=env, cwd=script.parent,
                          capture_output=True, text=True, timeout=timeout)
    steps = script.parent / "steps"
    return done.returncode, done.stdout + done.stderr, steps.read_text() if steps.exists() else ""


def test_four_nodes_run_head_workers_launch_then_stop(tmp_path: Path) -> None:
    """Ray and the launch are stand-ins too: which step runs where, in which order, and the
    launch's exit status becomes the job's."""
    port = _free_port()
    fake = _fake_slurm_and_ray(tmp_path, port, launch="exit 7\n")
    job = SlurmJob(nodes=4, gpus_per_node=8, ray_port=port, join_timeout_s=30)
    status, output, steps = _run(_script(tmp_path, job), fake, ["n1", "n2", "n3", "n4"])
    assert status == 7, output
    lines = steps.splitlines()
    heads = [line for line in lines if line.startswith("ray start --head")]
    workers = [line for line in lines if line.startswith("ray start --block --address")]
    assert len(heads) == 1 and heads[0].endswith(" on n1"), lines
    assert sorted(w.rsplit(" on ", 1)[1] for w in workers) == ["n2", "n3", "n4"], lines
    assert all(f"--address=127.0.0.1:{port}" in w and "--num-gpus=8" in w for w in workers)
    assert f"join check - 127.0.0.1:{port} 4 " in steps
    launch = [line for line in lines if line.startswith("agent-rl")]
    assert launch == [
        f"agent-rl --config runs/agent-rl.toml launch --address 127.0.0.1:{port} "
        "--restarts 3 it's a name on n1"
    ]
    kinds = [" ".join(line.split()[:2]) for line in lines if not line.startswith("srun")]
    assert kinds[0] == "ray start" and kinds[-3:] == ["join check", "agent-rl --config",
                                                     "ray stop"], kinds
    assert "srun nodes=4 node= ray stop --force" in steps  # Ray stopped on every node


def _fake_slurm_and_ray(tmp_path: Path, port: int, launch: str) -> Path:
    """Stand-ins for Slurm's commands, Ray (a head that listens on `port`, workers that sleep)
    and the launch (records its arguments, then runs the shell lines `launch`)."""
    return _fake_bin(tmp_path, {
        "srun": SRUN, "scontrol": SCONTROL,
        "getent": "exit 2\n",  # the node names resolve nowhere: the script asks the head
        "hostname": '[[ $1 == -I ]] && echo "127.0.0.1 ::1"\n',
        "ray": (
            'echo "ray $* on $SLURMD_NODENAME" >> "$STEPS"\n'
            'if [[ $1 == start && $2 == --head ]]; then\n'
            f'  exec {sys.executable} -c "import socket, time; s = socket.create_server('
            f"('127.0.0.1', {port})); time.sleep(60)\"\n"
            'elif [[ $1 == start ]]; then exec sleep 60; fi\n'
        ),
        # the join check: the snippet arrives on stdin; the nodes "join" as their steps start
        "python3": (
            'grep -q cluster_resources || exit 9\n'
            'until (( $(grep -c "^ray start --block" "$STEPS") >= $3 - 1 )); do sleep 0.1; done\n'
            'echo "join check $*" >> "$STEPS"\n'
        ),
        "agent-rl": 'echo "agent-rl $* on $SLURMD_NODENAME" >> "$STEPS"\n' + launch,
    })


@pytest.mark.parametrize("launch_status", [0, 1])
def test_sigterm_goes_on_to_the_launch_then_ray_stops(tmp_path: Path, launch_status: int) -> None:
    """The launch follows the run, so the job lives as long as it does. Slurm's SIGTERM to the
    batch shell (scancel --batch --signal=TERM, --signal=B:TERM@N) goes on to the launch, which
    stops the run and exits (the stand-in records it) with the job's status (1: a role had
    failed); then Ray is stopped on every node."""
    port = _free_port()
    fake = _fake_slurm_and_ray(tmp_path, port, launch=(
        "trap 'echo \"agent-rl stopped the run\" >> \"$STEPS\"; kill $!; "
        f"exit {launch_status}' TERM\n"
        "sleep 60 >/dev/null 2>&1 & wait\n"
    ))
    script = _script(tmp_path, SlurmJob(nodes=2, ray_port=port, join_timeout_s=30))
    steps = tmp_path / "steps"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_JOB_ID": "4242", "SLURM_CPUS_ON_NODE": "2", "FAKE_NODES": "n1 n2",
           "STEPS": str(steps)}
    job = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while "agent-rl" not in (steps.read_text() if steps.exists() else ""):
            assert job.poll() is None and time.monotonic() < deadline, "the launch never ran"
            time.sleep(0.1)
        time.sleep(1)
        assert job.poll() is None, "the job ended before the launch did"
        assert "ray stop" not in steps.read_text()
        job.terminate()  # what Slurm sends the batch shell
        output = job.communicate(timeout=30)[0]
    finally:
        job.kill()
    assert job.returncode == launch_status, output  # the launch's, after it stopped the run
    last = [line for line in steps.read_text().splitlines() if not line.startswith("srun")][-2:]
    assert last[0] == "agent-rl stopped the run", last
    assert last[1].startswith("ray stop --force"), last


def test_an_allocation_of_another_size_is_refused(tmp_path: Path) -> None:
    fake = _fake_bin(tmp_path, {"srun": SRUN, "scontrol": SCONTROL})
    status, output, steps = _run(_script(tmp_path, SlurmJob(nodes=4)), fake, ["n1", "n2", "n3"])
    assert status == 1
    assert "error: 3 node(s) allocated, the script is for 4" in output
    assert "ray start" not in steps


def test_a_head_that_never_answers_ends_the_job(tmp_path: Path) -> None:
    fake = _fake_bin(tmp_path, {
        "srun": SRUN, "scontrol": SCONTROL, "getent": "exit 2\n",
        "hostname": "echo 127.0.0.1\n", "ray": '[[ $1 == start ]] && exec sleep 60\n',
    })
    job = SlurmJob(nodes=2, ray_port=_free_port(), join_timeout_s=3)
    status, output, steps = _run(_script(tmp_path, job), fake, ["n1", "n2"])
    assert status == 1 and "did not answer" in output and "agent-rl" not in steps


def test_a_head_that_fails_to_start_ends_the_job_at_once(tmp_path: Path) -> None:
    fake = _fake_bin(tmp_path, {
        "srun": SRUN, "scontrol": SCONTROL, "getent": "exit 2\n",
        "hostname": "echo 127.0.0.1\n", "ray": 'echo "ray: bad flag" >&2; exit 2\n',
    })
    job = SlurmJob(nodes=2, ray_port=_free_port(), join_timeout_s=120)
    started = time.monotonic()
    status, output, steps = _run(_script(tmp_path, job), fake, ["n1", "n2"])
    assert status == 1 and "the Ray head's step ended before its port answered" in output
    assert "ray: bad flag" in output and time.monotonic() - started < 30


def _stop_our_ray(port: int) -> None:
    """Kill the processes of the Ray cluster this test started, found by its GCS port (free
    when the test began): the raylets' and workers' GCS address, the GCS server's port."""
    ours = re.compile(rf"(:|--gcs_server_port=){port}\b")
    procs = [p for p in psutil.process_iter(["cmdline"])
             if ours.search(" ".join(p.info["cmdline"] or []))]
    for proc in procs:
        proc.kill()
    psutil.wait_procs(procs, timeout=10)


@pytest.mark.slow
@pytest.mark.one_at_a_time("fleet")  # one Ray cluster at a time (tests/conftest.py)
def test_real_ray_cluster_of_two_nodes(tmp_path: Path) -> None:
    """The script starts a real Ray head and worker (two raylets on this machine), waits for
    both to join, and the launch connects at the address it is given and sees both nodes'
    resources. `ray stop` is a stand-in that records (the real one stops every Ray cluster of
    this user on the machine, others' included), so the test stops its own cluster's processes
    by their GCS address, as the end of a Slurm job would."""
    real_ray = shutil.which("ray", path=str(Path(sys.executable).parent))
    assert real_ray, "ray[default] is not installed in this environment"
    port = _free_port()
    seen = tmp_path / "seen"
    fake = _fake_bin(tmp_path, {
        "srun": SRUN, "scontrol": SCONTROL,
        # several raylets share this machine (and others' clusters may run on it): each start
        # gets free ports for what listens on a fixed one by default, and a small object store
        "ray": (
            'if [[ $1 == stop ]]; then echo "ray stop" >> "$STEPS"; exit 0; fi\n'
            'if [[ $1 == start ]]; then\n'
            f'  free() {{ {sys.executable} -c "import socket; s = socket.socket(); '
            "s.bind(('', 0)); print(s.getsockname()[1])\"; }\n"
            '  set -- "$@" --object-store-memory=100000000 \\\n'
            '    --dashboard-agent-listen-port="$(free)" --dashboard-agent-grpc-port="$(free)"\n'
            '  [[ " $* " == *" --head "* ]] && set -- "$@" --include-dashboard=false\n'
            'fi\n'
            f'exec {real_ray} "$@"\n'
        ),
        "agent-rl": (
            f"exec {sys.executable} - \"$@\" <<'PY'\n"
            "import sys, ray\n"
            "address = sys.argv[sys.argv.index('--address') + 1]\n"
            "ray.init(address=address, logging_level='ERROR')\n"
            f"open({str(seen)!r}, 'w').write(repr(ray.cluster_resources()))\n"
            "sys.exit(3)\n"
            "PY\n"
        ),
    })
    _fake_bin(tmp_path, {"python3": f'exec {sys.executable} "$@"\n'})  # the one with ray
    host = socket.gethostname()
    job = SlurmJob(nodes=2, cpus_per_node=1, ray_port=port, join_timeout_s=240)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(job, ["--restarts", "1"]))
    started = time.monotonic()
    try:
        status, output, steps = _run(script, fake, [host, "second-node"], timeout=300)
        assert status == 3, output[-4000:]
        resources = ast.literal_eval(seen.read_text())
        assert resources[NODE_RESOURCE] == 2.0 and resources["CPU"] == 2.0, resources
        assert "Ray cluster up: 2 node(s)" in output
        assert "ray stop" in steps
    finally:
        _stop_our_ray(port)
    print(f"script to launch: {time.monotonic() - started:.1f} s")


# --- the CLI: `agent-rl launch --slurm` ---


def _launch_app() -> typer.Typer:
    """A command that declares the Slurm options as `agent-rl launch` does: the launch's own
    options (stand-ins here) and the Slurm ones, the `--slurm` branch first."""
    app = typer.Typer(add_completion=False)

    @app.callback()
    def root(ctx: typer.Context, config: Annotated[Optional[Path], typer.Option("--config", "-c")]
             = None) -> None:
        ctx.obj = CliState(config_path=config)

    @app.command()
    def launch(
        ctx: typer.Context,
        address: Annotated[Optional[str], typer.Option()] = None,
        restarts: Annotated[int, typer.Option()] = 5,
        follow: Annotated[bool, typer.Option("--follow/--detach")] = False,
        role: Annotated[Optional[list[str]], typer.Option()] = None,
        slurm: cli.Slurm = False, nodes: cli.Nodes = 1, gpus_per_node: cli.GpusPerNode = 0,
        cpus_per_node: cli.CpusPerNode = None, partition: cli.Partition = None,
        account: cli.Account = None, time: cli.TimeLimit = None,
        job_name: cli.JobName = "agent-rl", output: cli.Output = None,
        exclusive: cli.Exclusive = True, sbatch: cli.Sbatch = None, setup: cli.Setup = None,
        ray_port: cli.RayPort = 6379, dry_run: cli.DryRun = False,
    ) -> None:
        if cli.launch_on_slurm(ctx):
            return
        typer.echo(f"launched on {address}")

    @app.command()
    def other() -> None:
        """(a second command, so that `launch` is a subcommand as in agent-rl)"""

    return app


def test_cli_dry_run_prints_the_script_with_the_launchs_own_options(tmp_path: Path) -> None:
    result = CliRunner().invoke(_launch_app(), [
        "-c", "run.toml", "launch", "--slurm", "--nodes", "4", "--gpus-per-node", "8",
        "--partition", "gpu", "--time", "4:00:00", "--sbatch=--qos=high", "--restarts", "2",
        "--follow", "--role", "engine", "--role", "trainer", "--no-exclusive", "--dry-run",
    ])
    assert result.exit_code == 0, result.output
    text = result.output
    assert re.findall(r"^#SBATCH (.+)$", text, re.M) == [
        "--job-name=agent-rl", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
        "--partition=gpu", "--time=4:00:00", "--qos=high",
    ]
    assert f"set -euo pipefail\ncd {shlex.quote(str(Path.cwd()))}\n" in text
    assert (
        '\n  agent-rl --config run.toml launch --address "$ip_head" --restarts 2 --follow '
        "--role engine --role trainer &\n"
    ) in text
    checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_cli_refuses_bad_options_and_a_given_address(tmp_path: Path) -> None:
    app = _launch_app()
    result = CliRunner().invoke(app, ["launch", "--slurm", "--nodes", "0", "--dry-run"])
    assert isinstance(result.exception, ConfigError), result.output
    assert "--nodes must be at least 1 (got 0)" in str(result.exception)
    # the job's launch gets the address of the head the job starts
    result = CliRunner().invoke(app, ["launch", "--slurm", "--address", "10.1.1.1:6379",
                                      "--dry-run"])
    assert isinstance(result.exception, ConfigError), result.output
    assert "leave --address out" in str(result.exception)
    # a Slurm option without --slurm would be ignored: it is refused; without any, a launch
    result = CliRunner().invoke(app, ["launch", "--nodes", "4", "--time", "1:00:00"])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == "--nodes, --time: Slurm options, for a launch with --slurm only"
    result = CliRunner().invoke(app, ["launch", "--address", "auto"])
    assert result.exit_code == 0 and result.output == "launched on auto\n", result.output


def test_cli_without_dry_run_submits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in sbatch (no Slurm here) receives the same script that --dry-run prints."""
    fake = _fake_bin(tmp_path, {"sbatch": f'cat > {tmp_path}/submitted; echo 77\n'})
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    app = _launch_app()
    printed = CliRunner().invoke(app, ["launch", "--slurm", "--nodes", "2", "--dry-run"])
    result = CliRunner().invoke(app, ["launch", "--slurm", "--nodes", "2"])
    assert result.exit_code == 0, result.output
    assert "submitted Slurm job 77" in result.output
    assert (tmp_path / "submitted").read_text() == printed.output


# --- the KubeRay example (docs/cluster.md): not applied anywhere, parsed here ---


def test_kuberay_rayjob_example_is_a_rayjob_that_launches() -> None:
    yaml = pytest.importorskip("yaml")
    path = Path(__file__).resolve().parents[2] / "docs" / "cluster" / "kuberay-rayjob.yaml"
    manifest = yaml.safe_load(path.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayJob")
    spec = manifest["spec"]
    # the launch follows the run: when it ends, so does the job, and the cluster after it
    assert re.search(r"(^|&& )agent-rl (--config \S+ )?launch --address auto$", spec["entrypoint"])
    assert spec["shutdownAfterJobFinishes"] is True
    cluster = spec["rayClusterSpec"]
    try:
        assert cluster["rayVersion"] == version("ray"), "the example names another Ray"
    except PackageNotFoundError:
        pass
    pods = [cluster["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["workerGroupSpecs"]
    ]
    workdir = re.match(r"cd (\S+) && ", spec["entrypoint"]).group(1)
    for pod in pods:  # every pod has the working directory and the store's URL
        (container,) = pod["spec"]["containers"]
        assert {"name": "work", "mountPath": workdir} in container["volumeMounts"]
        assert {"secretRef": {"name": "agent-rl-env"}} in container["envFrom"]
        assert {"name": "work", "persistentVolumeClaim": {"claimName": "agent-rl-work"}} \
            in pod["spec"]["volumes"]
    assert all(isinstance(v, str) for group in [cluster["headGroupSpec"],
                                                *cluster["workerGroupSpecs"]]
               for v in group["rayStartParams"].values())  # KubeRay takes strings only


def test_agent_rl_launch_slurm_dry_run() -> None:
    """The real command: `agent-rl launch --slurm ... --dry-run` prints the script, with the
    launch's own options passed on to the launch in the job."""
    from agent_rl.app.cli import app

    result = CliRunner().invoke(app, [
        "-c", "run.toml", "launch", "--slurm", "--nodes", "4", "--gpus-per-node", "8",
        "--partition", "gpu", "--until-version", "5", "--wait", "600", "--dry-run",
    ])
    assert result.exit_code == 0, result.output
    assert re.findall(r"^#SBATCH (.+)$", result.output, re.M)[:4] == [
        "--job-name=agent-rl", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8",
    ]
    assert ('\n  agent-rl --config run.toml launch --address "$ip_head" --until-version 5 '
            "--wait 600.0 &\n") in result.output
    checked = subprocess.run(["bash", "-n"], input=result.output, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    result = CliRunner().invoke(app, ["launch", "--nodes", "2"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == "--nodes: Slurm options, for a launch with --slurm only"
    result = CliRunner().invoke(app, ["launch", "--slurm", "--detach", "--dry-run"])
    assert "leave --detach out" in str(result.exception)
