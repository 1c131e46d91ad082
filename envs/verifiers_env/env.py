"""`verifiers:<taskset or config>`: a verifiers v1 environment trained as an agent-rl env.

verifiers (Prime Intellect's, 0.4.0, its v1 API) composes a taskset (rows and rewards), a
harness (the program the model runs in) and a runtime. It pins `openai<3`, which agent-rl's
`[agents]` extra does not share, so it runs out of process, in a virtual environment of its
own. By default a long-lived env server (`runner.py serve`, started here with that
environment's Python; `servers=N` of them, or `addresses` of ones started elsewhere, the least
loaded taking each episode: pool.py) loads the env once and runs many episodes at once;
`servers=0` runs each episode as the agent command `runner.py episode` instead (a fresh
process per episode, for an env that keeps state between episodes). Either way the episode's
own OpenAI endpoint and key travel to verifiers' eval client, which sends each of the
harness's chat calls there, where the gateway renders it with the chat template,
generates token-in/token-out through the router and records it as a turn with the engine's
ids, logprobs and versions, as for any agent (docs/agents.md). The reward is the one
verifiers' taskset computed for the episode's trace.

    agent-rl serve --env verifiers:my_taskset            # a taskset id (an importable module)
    agent-rl serve --env verifiers:path/to/env.json      # or a verifiers EnvConfig as JSON

`python` (or `AGENT_RL_VERIFIERS_PYTHON`) names the Python of the verifiers environment;
`paths` are put on its `PYTHONPATH` (where a taskset of one's own lives), before `tasksets/`
(the tasksets that come with agent-rl, e.g. `vf_calculator`); `config` is merged into the
EnvConfig. The task rows are listed once, by the first server (or `runner.py tasks`); a split
named in `splits` lists the rows of its own EnvConfig overrides (another seed, another file)
and runs them on the same servers. verifiers tasksets carry no teacher: `demonstrations` names
the SDK env (made with `demonstration_kwargs`) whose teacher's transcripts are what this
taskset's harness shows the model, token for token, for `agent-rl train --sft`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent_rl.kernel.errors import EnvError
from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.rewards import Reward
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from envs.verifiers_env.pool import Pool, pool
from envs.verifiers_env.runner import MAX_TASKS_VAR

RUNNER = Path(__file__).with_name("runner.py")
TASKSETS = Path(__file__).with_name("tasksets")
NLTK_DATA = Path(__file__).with_name("nltk_data")
"""Word lists for TextArena's word games (nltk's `words` corpus), read offline unless the
environment names an `NLTK_DATA` of its own."""
"""Tasksets that come with agent-rl (verifiers modules, never imported here): always on the
verifiers environment's `PYTHONPATH`, after the env's own `paths`."""
PYTHON_VAR = "AGENT_RL_VERIFIERS_PYTHON"
"""Where the verifiers environment's Python is named when the env is not given `python`."""
LIST_TIMEOUT_S = 300.0
"""Listing the task rows imports verifiers and loads the taskset (seconds on a busy CPU)."""


class VerifiersEnv(AgentEnv):
    """A verifiers v1 environment run out of process (see the module docstring)."""

    def __init__(self, *, env: str, python: str | None = None, paths: Sequence[str] = (),
                 config: dict[str, Any] | None = None, servers: int = 1,
                 addresses: Sequence[str] = (), tasks: str | Path | None = None,
                 splits: dict[str, dict[str, Any]] | None = None, demonstrations: str | None = None,
                 demonstration_kwargs: dict[str, Any] | None = None, max_tasks: int = 256) -> None:  # fmt: skip
        """`env`: a verifiers taskset id, or a `.json` file holding a verifiers EnvConfig;
        `python`: the Python of a virtual environment with verifiers installed; `paths`:
        folders put on its `PYTHONPATH`; `config`: EnvConfig fields merged over `env`'s;
        `servers`: long-lived env servers this serve starts (0, with no `addresses`: a
        process per episode); `addresses`: env servers started elsewhere (`runner.py serve`),
        `unix:PATH` or `HOST:PORT`; `splits`: EnvConfig fields merged over the config for the
        rows of a split (a split not named lists the config's own rows); `demonstrations`:
        the SDK env id (made with `demonstration_kwargs`) whose teacher demonstrates this
        taskset's episodes for `train --sft`; `max_tasks`: rows listed of an endless taskset
        (TextArena's seeded games)."""
        super().__init__(tasks=tasks)
        self.python = python or os.environ.get(PYTHON_VAR)
        if not self.python:
            raise EnvError(f"verifiers:{env} needs the Python of a virtual environment with "
                           f"verifiers==0.4.0 installed: pass python=... or set {PYTHON_VAR}")
        if servers < 0:
            raise EnvError(f"verifiers:{env}: servers={servers}: write 0 or more")
        self.env_config = _merged(_env_config(env), config or {})
        self.paths = (*(str(Path(p).resolve()) for p in paths), str(TASKSETS))
        self.splits = dict(splits or {})
        self.demonstrations = demonstrations
        self.demonstration_kwargs = dict(demonstration_kwargs or {})
        self.config_json = json.dumps(self.env_config, sort_keys=True)
        self.command_env = {"PYTHONPATH": os.pathsep.join(self.paths), "HF_HUB_OFFLINE": "1",
                            "NLTK_DATA": os.environ.get("NLTK_DATA", str(NLTK_DATA)),
                            MAX_TASKS_VAR: str(max_tasks)}  # fmt: skip
        self.pool: Pool | None = None
        if servers or addresses:
            self.command = None
            key = (self.python, self.config_json, self._environ(), servers, tuple(addresses))
            self.pool = pool(key, [self.python, "-P", str(RUNNER), "serve", self.config_json],
                             {**os.environ, **self.command_env}, servers, addresses)  # fmt: skip
        else:
            self.command = [self.python, "-P", str(RUNNER), "episode", self.config_json]

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        config = self.config_json
        if split in self.splits:
            config = json.dumps(_merged(self.env_config, self.splits[split]), sort_keys=True)
        if self.pool is None:
            rows = _list_tasks(self.python, config, self._environ())
        else:  # by the first server, which the episodes need anyway (no second verifiers import)
            request = {"op": "tasks", **({"config": config} if config != self.config_json else {})}
            rows = self._answer(self.pool.servers[0].request(request))["tasks"]
        return ListTasks([Task(id=r["id"], data=r["data"]) for r in rows])

    def _environ(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self.command_env.items()))

    def demonstrations_from(self) -> tuple[str, dict[str, Any]] | None:
        return (self.demonstrations, self.demonstration_kwargs) if self.demonstrations else None

    async def run(self, base_url: str, api_key: str, task: Task) -> Any:
        """The episode on the least loaded env server (the server mode)."""
        assert self.pool is not None
        request = {"op": "episode", "task": {"id": task.id, "data": task.data},
                   "base_url": base_url, "api_key": api_key}  # fmt: skip
        result = self._answer(await self.pool.pick().episode(request))["result"]
        if not result["ok"] or result["reward"] is None:
            # What verifiers recorded (a harness that raised, a call its client could not
            # make) is the episode's cause, also where no call reached the gateway.
            raise EnvError(f"{self.env_id}: verifiers ended task {task.id} with errors: "
                           + "; ".join(result["errors"] or ["no trace"]))
        return result

    def _answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        if "refused" in answer:
            raise EnvError(f"{self.env_id}: refused: {answer['refused']}")
        if "error" in answer:
            raise EnvError(f"{self.env_id}: the verifiers env server's episode raised:\n"
                           f"{answer['error']}")
        return answer

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> Reward:
        lines = result if isinstance(result, dict) else str(result).strip().splitlines()
        try:
            out = lines if isinstance(lines, dict) else json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError) as e:
            raise EnvError(f"{self.env_id}: the verifiers runner ended without its result line; "
                           f"it wrote: {str(result)[-2000:]!r}") from e
        if not out["ok"] or out["reward"] is None:
            raise EnvError(f"{self.env_id}: verifiers ended task {task.id} with errors: "
                           + "; ".join(out["errors"] or ["no trace"]))
        parts = {k: float(v) for k, v in out["rewards"].items() if v is not None}
        detail = "truncated by verifiers" if out["truncated"] else ""
        return Reward(value=float(out["reward"]), components=parts, detail=detail)


def _env_config(env: str) -> dict[str, Any]:
    """The EnvConfig `env` names: a JSON file's object, or a taskset id."""
    if env.endswith(".json"):
        path = Path(env)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EnvError(f"verifiers:{env}: cannot read it as a verifiers EnvConfig: {e}") from e
        if not isinstance(data, dict):
            raise EnvError(f"verifiers:{env}: a verifiers EnvConfig is a JSON object")
        return data
    return {"taskset": {"id": env}}


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into `base`, tables key by key (as verifiers merges its CLI overrides)."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


@functools.cache
def _list_tasks(python: str, config_json: str, command_env: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    """The taskset's rows as the runner lists them, once per process and configuration."""
    environ = {**os.environ, **dict(command_env)}
    try:
        done = subprocess.run([python, "-P", str(RUNNER), "tasks", config_json], env=environ,
                              capture_output=True, text=True, timeout=LIST_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EnvError(f"cannot list the verifiers tasks with {python}: {e}") from e
    if done.returncode != 0:
        raise EnvError(f"listing the verifiers tasks with {python} failed (status "
                       f"{done.returncode}): {done.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
