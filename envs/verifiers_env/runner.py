"""The verifiers side of a verifiers-backed environment: run with the Python of a virtual
environment where `verifiers` (0.4.0, v1 API) is installed, never imported by agent-rl.

verifiers pins `openai<3` and agent-rl's `[agents]` extra another major version, so the two do
not share an environment: agent-rl starts this script as the episode's agent command, with the
episode's own OpenAI endpoint (`OPENAI_BASE_URL`, `OPENAI_API_KEY`) in its environment. It
imports only the standard library and verifiers.

    python -P runner.py tasks CONFIG_JSON     # one JSON task per line: {"id", "data"}
    python -P runner.py episode CONFIG_JSON   # the task's JSON on stdin; one episode, its
                                              # result as the last line of stdout

CONFIG_JSON is verifiers' `EnvConfig` as a JSON object (`{"taskset": {"id": ...}, ...}`).
What reaches the network by default in verifiers is set here, and said: the model endpoint
is the episode's (never Prime's inference), the agent's runtime is `subprocess` unless the
config names another, and `HF_HUB_OFFLINE` is on. Every model call of the episode goes
through verifiers' interception to the episode's endpoint, where agent-rl's gateway renders
it, generates token-in/token-out and records it as a turn. The result line is
`{"ok", "reward", "rewards", "errors", "traces"}`: the reward is the trace's, as verifiers'
taskset computed it. A refusal (what cannot be carried) exits 2 with one line on stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

VERSION = "0.4.0"
"""The verifiers release this bridge is written against (its v1 API changed before it)."""
REFUSED = 2
"""Exit status of a configuration this bridge refuses (one line on stderr says why)."""
MODEL = "policy"
"""The model name sent to the gateway (it serves one policy, whatever the name)."""
REMOTE_RUNTIMES = ("prime", "modal", "e2b")
"""Runtimes that run the harness off this host: they need a tunnel to the interception
server and the provider's credentials, which an offline trainer does not have."""


class Refused(Exception):
    """A configuration the bridge cannot carry; its message is the one line printed."""


def _config(raw: str) -> Any:
    """The EnvConfig `raw` names, refused before verifiers is imported if it cannot be carried."""
    data = json.loads(raw)
    if not isinstance(data, dict) or not (data.get("taskset") or {}).get("id"):
        raise Refused("a verifiers env config needs a taskset id: {\"taskset\": {\"id\": ...}}")
    agent = dict(data.get("agent") or {})
    agent.setdefault("runtime", {"type": "subprocess"})
    runtime = agent["runtime"].get("type") if isinstance(agent["runtime"], dict) else None
    if runtime in REMOTE_RUNTIMES:
        raise Refused(f"the verifiers runtime {runtime!r} runs off this host and needs a tunnel "
                      "and its provider's credentials: use subprocess, docker or podman")
    data["agent"] = agent
    import verifiers.v1 as vf

    return vf.resolve_env_config(data)


def list_tasks(raw: str) -> None:
    config = _config(raw)
    import verifiers.v1 as vf

    env = vf.load_environment(config)
    for task in env.taskset:
        data = task.data.model_dump(mode="json", exclude_none=True)
        ident = task.data.id or str(task.data.idx)
        print(json.dumps({"id": ident, "data": {"verifiers_task": data, "key": task.key}}))


async def run_episode(raw: str, task_json: str) -> dict[str, Any]:
    base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
    if not base_url or not api_key:
        raise Refused("OPENAI_BASE_URL and OPENAI_API_KEY must name the episode's endpoint")
    config = _config(raw)
    import verifiers.v1 as vf

    env = vf.load_environment(config)
    payload = json.loads(task_json)["data"]
    task_cls = type(env.taskset).task_type()
    task = task_cls(task_cls.data_type().model_validate(payload["verifiers_task"]),
                    env.taskset.config.task)
    if task.key != payload["key"]:
        raise Refused(f"task {payload['key'][:12]} is not this taskset's (its data changed since "
                      "the tasks were listed)")
    client = vf.EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY")
    ctx = vf.ModelContext(model=MODEL, client=client)
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    if len(episode.traces) > 1:
        raise Refused(f"{len(episode.traces)} agent traces in one episode (a multi-agent env): "
                      "only single-agent verifiers envs are carried")
    trace = episode.traces[0] if episode.traces else None
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    if trace is not None:
        errors += [f"{e.type}: {e.message}" for e in trace.errors]
    return {
        "ok": bool(episode.ok),
        "reward": trace.reward if trace is not None else None,
        "rewards": {k: (None if r is None else r.value) for k, r in trace.rewards.items()}
        if trace is not None else {},
        "truncated": bool(trace is not None and trace.is_truncated),
        "errors": errors,
    }


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if len(argv) != 3 or argv[1] not in ("tasks", "episode"):
        print("usage: runner.py tasks|episode CONFIG_JSON", file=sys.stderr)
        return REFUSED
    from importlib.metadata import version

    try:
        if version("verifiers") != VERSION:
            raise Refused(f"verifiers {version('verifiers')} is installed; this bridge is "
                          f"written against verifiers=={VERSION}")
        if argv[1] == "tasks":
            list_tasks(argv[2])
            return 0
        result = asyncio.run(run_episode(argv[2], sys.stdin.read()))
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return REFUSED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
