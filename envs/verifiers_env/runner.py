"""The verifiers side of a verifiers-backed environment: run with the Python of a virtual
environment where `verifiers` (0.4.0, v1 API) is installed, never imported by agent-rl.

verifiers pins `openai<3` and agent-rl's `[agents]` extra another major version, so the two do
not share an environment: agent-rl starts this script as the episode's agent command, with the
episode's own OpenAI endpoint (`OPENAI_BASE_URL`, `OPENAI_API_KEY`) in its environment. It
imports only the standard library and verifiers.

    python -P runner.py tasks CONFIG_JSON     # one JSON task per line: {"id", "data"}
    python -P runner.py episode CONFIG_JSON   # the task's JSON on stdin; one episode, its
                                              # result as the last line of stdout
    python -P runner.py serve CONFIG_JSON unix:PATH|HOST:PORT
                                              # a long-lived env server (`EnvServer`): the
                                              # env loaded once, many episodes at once, each
                                              # with its own endpoint and key in its request

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
import itertools
import json
import os
import signal
import stat
import sys
import traceback
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


MAX_TASKS_VAR = "AGENT_RL_VERIFIERS_MAX_TASKS"
"""Rows listed of an endless taskset (agent-rl's env kwarg `max_tasks`)."""


class Refused(Exception):
    """A configuration the bridge cannot carry; its message is the one line printed."""


def _config(raw: str) -> Any:
    """The EnvConfig `raw` names, refused if it cannot be carried. Every agent seat of the env
    (`agent` for a plain taskset; `player` for TextArena's and OpenEnv's) runs on the
    `subprocess` runtime unless the config names another."""
    data = json.loads(raw)
    if not isinstance(data, dict) or not (data.get("taskset") or {}).get("id"):
        raise Refused("a verifiers env config needs a taskset id: {\"taskset\": {\"id\": ...}}")
    taskset = data["taskset"]["id"]
    if taskset == "harbor":
        _check_harbor()
    if taskset == "textarena":
        _nltk_offline()
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type

    for seat, field in env_config_type(taskset, data.get("id") or "").model_fields.items():
        if not isinstance(field.default, AgentConfig):
            continue
        agent = dict(data.get(seat) or {})
        agent.setdefault("runtime", {"type": "subprocess"})
        runtime = agent["runtime"].get("type") if isinstance(agent["runtime"], dict) else None
        if runtime in REMOTE_RUNTIMES:
            raise Refused(f"the verifiers runtime {runtime!r} runs off this host and needs a "
                          "tunnel and its provider's credentials: use subprocess, docker or podman")
        data[seat] = agent
    return vf.resolve_env_config(data)


def _nltk_offline() -> None:
    """TextArena's games call `nltk.download` when they load, which reaches the network (and,
    where it can, rewrites the data): here their data is read from `NLTK_DATA` (agent-rl's
    word lists, envs/verifiers_env/nltk_data, unless the environment names others) and a
    download is never attempted."""
    import nltk

    def download(info_or_id: Any = None, *args: Any, **kwargs: Any) -> bool:
        return True

    nltk.download = download


def _check_harbor() -> None:
    """verifiers' Harbor taskset downloads its tasks and runs them with the Harbor CLI (the
    `harbor` package, which needs Python >= 3.12) in task images a docker runtime pulls or
    builds: refused in one line where that CLI is missing, before verifiers raises deep in a
    load."""
    import shutil

    if shutil.which("harbor", path=os.path.dirname(sys.executable)) is None:
        raise Refused("the verifiers harbor taskset needs the Harbor CLI in this verifiers "
                      f"environment (verifiers[harbor]: harbor==0.24.0, Python >= 3.12; this is "
                      f"Python {sys.version_info[0]}.{sys.version_info[1]}), its task images "
                      "(a registry, or Dockerfiles) and a docker runtime to run them in")


def list_tasks(raw: str) -> None:
    for row in task_rows(load(raw)):
        print(json.dumps(row))


def task_rows(env: Any) -> list[dict[str, Any]]:
    """The taskset's rows as agent-rl tasks: `{"id", "data": {"verifiers_task", "key"}}`; of
    an endless taskset (TextArena's seeded games), the first `AGENT_RL_VERIFIERS_MAX_TASKS`."""
    rows = []
    limit = None if env.taskset.bounded else int(os.environ.get(MAX_TASKS_VAR, "256"))
    for task in itertools.islice(env.taskset, limit):
        data = task.data.model_dump(mode="json")  # a None may be required (OpenEnvData.env)
        ident = task.data.id or str(task.data.idx)
        rows.append({"id": ident, "data": {"verifiers_task": data, "key": task.key}})
    return rows


def load(raw: str) -> Any:
    """The verifiers `Env` the config names (verifiers imported here, once per process)."""
    config = _config(raw)
    import verifiers.v1 as vf

    return vf.load_environment(config)


async def episode(env: Any, payload: dict[str, Any], base_url: str, api_key: str) -> dict[str, Any]:
    """One episode of the task `payload` (a listed row's data) on a serving `env`, its model
    calls sent to `base_url` with `api_key`: the result line's object."""
    import verifiers.v1 as vf

    task_cls = type(env.taskset).task_type()
    task = task_cls(task_cls.data_type().model_validate(payload["verifiers_task"]),
                    env.taskset.config.task)
    if task.key != payload["key"]:
        raise Refused(f"task {payload['key'][:12]} is not this taskset's (its data changed since "
                      "the tasks were listed)")
    # verifiers' eval client reads its key from an environment variable only, when the
    # episode's trace registers: one variable per episode keeps concurrent episodes' keys apart.
    var = f"AGENT_RL_EPISODE_KEY_{next(_KEYS)}"
    os.environ[var] = api_key
    client_config = vf.EvalClientConfig(base_url=base_url, api_key_var=var)
    try:
        result = await env.run_episode(task, vf.ModelContext(model=MODEL, client=client_config))
    finally:
        del os.environ[var]
        await _drop_client(env, client_config)
    if len(result.traces) > 1:
        raise Refused(f"{len(result.traces)} agent traces in one episode (a multi-agent env): "
                      "only single-agent verifiers envs are carried")
    trace = result.traces[0] if result.traces else None
    errors = [f"{e.type}: {e.message}" for e in result.errors]
    if trace is not None:
        errors += [f"{e.type}: {e.message}" for e in trace.errors]
    return {
        "ok": bool(result.ok),
        "reward": trace.reward if trace is not None else None,
        "rewards": {k: (None if r is None else r.value) for k, r in trace.rewards.items()}
        if trace is not None else {},
        "truncated": bool(trace is not None and trace.is_truncated),
        "errors": errors,
    }


_KEYS = itertools.count()


async def _drop_client(env: Any, client_config: Any) -> None:
    """Drop the client verifiers' interception server made for this episode's endpoint: it
    keeps one per distinct endpoint until serving ends, and every episode has its own (in an
    env server, their connection pool is shared and stays: `_share_http`)."""
    interception = getattr(env, "_interception", None)
    client = getattr(interception, "clients", {}).pop(client_config.model_dump_json(), None)
    if client is not None:
        await client.close()


async def run_episode(raw: str, task_json: str) -> dict[str, Any]:
    base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY")
    if not base_url or not api_key:
        raise Refused("OPENAI_BASE_URL and OPENAI_API_KEY must name the episode's endpoint")
    env = load(raw)
    async with env.serving():
        return await episode(env, json.loads(task_json)["data"], base_url, api_key)


class EnvServer:
    """Many episodes of one loaded, serving verifiers env, each on a connection of its own.

    A connection sends one JSON line and gets one back: `{"op": "health"}` -> `{"running",
    "episodes", "cancelled", "pid"}`; `{"op": "tasks"}` -> `{"tasks": [...]}` (with `"config":
    CONFIG_JSON`, that config's rows: a split's, verifiers already imported); `{"op":
    "episode", "task", "base_url", "api_key"}` -> `{"result": {...}}`, `{"refused": line}` or
    `{"error": traceback}`. A client that closes its connection before the answer (its episode
    was cancelled, or ran past its deadline) cancels the episode here."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.running = self.episodes = self.cancelled = 0
        self.drained: asyncio.Event | None = None
        """Set when the last running episode ends (a SIGTERM is draining the server)."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            try:
                request = json.loads(line)
                op = request["op"]
            except (ValueError, TypeError, KeyError):
                return await _reply(writer, {"refused": "a request is one JSON line with an op"})
            if op == "health":
                await _reply(writer, {"running": self.running, "episodes": self.episodes,
                                      "cancelled": self.cancelled, "pid": os.getpid()})
            elif op == "tasks":
                await _reply(writer, self._tasks(request.get("config")))
            elif op == "episode":
                await self._episode(request, reader, writer)
            else:
                await _reply(writer, {"refused": f"unknown op {op!r}"})
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _tasks(self, config: str | None) -> dict[str, Any]:
        """The served env's rows, or another config's (a split's: verifiers already imported)."""
        try:
            return {"tasks": task_rows(load(config) if config else self.env)}
        except Refused as e:
            return {"refused": str(e)}
        except Exception:  # noqa: BLE001 - the listing's failure is its answer
            return {"error": traceback.format_exc()}

    async def _episode(self, request: dict[str, Any], reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:  # fmt: skip
        self.running += 1
        self.episodes += 1
        job = asyncio.create_task(episode(self.env, request["task"]["data"], request["base_url"],
                                          request["api_key"]))  # fmt: skip
        hangup = asyncio.create_task(reader.read(1))  # EOF: the client gave the episode up
        try:
            await asyncio.wait({job, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done():
                self.cancelled += 1
                job.cancel()
                await asyncio.gather(job, return_exceptions=True)
                return
            try:
                answer: dict[str, Any] = {"result": job.result()}
            except Refused as e:
                answer = {"refused": str(e)}
            except Exception:  # noqa: BLE001 - the episode's failure is its answer
                answer = {"error": traceback.format_exc()}
            await _reply(writer, answer)
        finally:
            hangup.cancel()
            self.running -= 1
            if self.running == 0 and self.drained is not None:
                self.drained.set()


async def _reply(writer: asyncio.StreamWriter, answer: dict[str, Any]) -> None:
    writer.write(json.dumps(answer).encode() + b"\n")
    await writer.drain()


def _share_http() -> None:
    """What each served episode's HTTP clients would build anew is built once per server: the
    default TLS context, which every httpx client loads the CA bundle into when it is made
    (~45 ms of CPU here, for plain loopback HTTP): the harness's own client, made per episode
    when the harness runs in this process, and the interception's client per endpoint, and
    every episode's endpoint is its own; and the interception's connection pool, since those
    endpoints are one gateway: an episode reuses the connections the ones before kept alive
    instead of opening its own. A client made with its own `verify` or `cert` is left alone.
    (A client with HTTP/2 on that connects over TLS sets its ALPN protocols on the context.)"""
    import ssl

    import httpx
    from httpx._transports import default as transport
    from verifiers.v1.clients import base, eval as eval_client

    made = transport.create_ssl_context
    contexts: dict[bool, ssl.SSLContext] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert:
            return made(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in contexts:
            contexts[trust_env] = made(verify=True, cert=None, trust_env=trust_env)
        return contexts[trust_env]

    class Kept(httpx.AsyncClient):
        """The interception's pool, shared by every endpoint: an episode's end keeps it."""

        async def aclose(self) -> None:
            pass

    pools: dict[str, httpx.AsyncClient] = {}

    def build_async_httpx(config: Any) -> httpx.AsyncClient:
        timeout = config.timeout.model_dump_json()
        if timeout not in pools:
            pools[timeout] = Kept(timeout=httpx.Timeout(**config.timeout.model_dump()),
                                  limits=base.DEFAULT_LIMITS)  # fmt: skip
        return pools[timeout]

    transport.create_ssl_context = create_ssl_context  # type: ignore[assignment]
    eval_client.build_async_httpx = build_async_httpx  # type: ignore[attr-defined]


def _cache_factory_signatures() -> None:
    """pydantic's `model_construct` inspects each default factory's signature again on every
    call (verifiers builds a served turn's records with it: ~8% of the server's CPU per call
    here); the answer is the factory's own, so it is kept per factory."""
    import functools

    from pydantic._internal import _fields

    inspect = _fields.takes_validated_data_argument
    kept = functools.lru_cache(maxsize=1024)(inspect)

    def takes_validated_data_argument(factory: Any) -> Any:
        try:
            return kept(factory)
        except TypeError:  # an unhashable factory
            return inspect(factory)

    _fields.takes_validated_data_argument = takes_validated_data_argument


async def serve(raw: str, address: str) -> None:
    """Serve the env at `address` (`unix:PATH` or `HOST:PORT`) until SIGTERM, or until stdin
    closes where it is a pipe (the parent that started it is gone). The first line of stdout
    is `{"listening": ADDRESS}`. A SIGTERM drains, as serve's does: the server stops listening
    and leaves when its running episodes have ended (a supervisor stopping serve signals every
    process under it, this one too, while serve lets its running episodes finish); a second
    SIGTERM, or stdin closing, ends it at once."""
    env = load(raw)
    _share_http()
    _cache_factory_signatures()
    server_of = EnvServer(env)
    async with env.serving():
        if address.startswith("unix:"):
            server = await asyncio.start_unix_server(server_of.handle, address[5:])
        else:
            host, _, port = address.rpartition(":")
            server = await asyncio.start_server(server_of.handle, host or "127.0.0.1", int(port))
            name = server.sockets[0].getsockname()
            address = f"{name[0]}:{name[1]}"
        print(json.dumps({"listening": address}), flush=True)
        # Nobody reads stdout after that line: what the env or its harnesses print goes to the
        # log (stderr) instead of filling a pipe and blocking the server.
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def drain() -> None:
            server.close()  # no new connections; the running episodes' stay open
            if server_of.drained is not None or server_of.running == 0:
                stop.set()
            else:
                server_of.drained = stop

        loop.add_signal_handler(signal.SIGTERM, drain)
        if stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode):  # a parent's pipe: its life
            loop.add_reader(sys.stdin.fileno(),
                            lambda: os.read(sys.stdin.fileno(), 4096) or stop.set())
        async with server:
            await stop.wait()


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    serving = len(argv) == 4 and argv[1] == "serve"
    if not serving and (len(argv) != 3 or argv[1] not in ("tasks", "episode")):
        print("usage: runner.py tasks|episode CONFIG_JSON | serve CONFIG_JSON ADDRESS",
              file=sys.stderr)
        return REFUSED
    from importlib.metadata import version

    try:
        if version("verifiers") != VERSION:
            raise Refused(f"verifiers {version('verifiers')} is installed; this bridge is "
                          f"written against verifiers=={VERSION}")
        if argv[1] == "tasks":
            list_tasks(argv[2])
            return 0
        if serving:
            asyncio.run(serve(argv[2], argv[3]))
            return 0
        result = asyncio.run(run_episode(argv[2], sys.stdin.read()))
    except Refused as e:
        print(f"refused: {e}", file=sys.stderr)
        return REFUSED
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
