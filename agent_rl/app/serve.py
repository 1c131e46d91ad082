"""`agent-rl serve`: the store, the scheduler and its episode runners, and by default an embedded
router in front of one SGLang engine, in one process.

The embedded defaults need no configuration: SQLite under the working directory (created on
first use), a tiny model made locally when `engine.model` is unset, an engine and a router on
free loopback ports. `rollout.router_url` points serve at an external router (or engine)
instead. The embedded engine is supervised: if it dies, the episodes it was serving fail with
the cause, and it is started again while the scheduler keeps admitting.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from agent_rl.config import Config
from agent_rl.kernel.errors import ConfigError, EngineError, StoreError
from agent_rl.kernel.heap import long_lived_heap
from agent_rl.rollout.scheduler import Scheduler, SchedulerStats
from agent_rl.store import Endings, Ledger, Store

if TYPE_CHECKING:
    from agent_rl.sdk.env import Env
    from agent_rl.sdk.sandbox import SandboxSpec
    from agent_rl.sglang.client import EngineClient
    from agent_rl.rollout.gateway import Gateway
    from tools_sandbox.pool import PoolStats, SandboxPool

log = logging.getLogger(__name__)

LOOP = {"use_uvloop": True}
"""The event loop `agent-rl serve` runs on (anyio's asyncio backend options): uvloop. A gateway
call is two loopback HTTP exchanges (the agent's and the engine's) and the event loop with its
socket transports was a third of serve's CPU per call on asyncio's own loop (docs/benchmarks.md,
bench/gateway.py, which runs serve on this loop too)."""

DEFAULT_MODEL_DIR = Path("runs/model")


def default_model(model: Path | None) -> Path:
    """The configured model, or a tiny dense model made once under the working directory."""
    if model is not None:
        return model
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        from agent_rl.models import init_model

        log.info("no engine.model configured: making a tiny model in %s", DEFAULT_MODEL_DIR)
        init_model(DEFAULT_MODEL_DIR, "tiny-dense", seed=0)
    return DEFAULT_MODEL_DIR


@dataclass
class ServeSummary:
    """What one serve process did, as the store records it (never in-process counters)."""

    run_id: int
    owner: str
    ledger: Ledger
    """Where the episodes this process ran are now."""
    endings: Endings
    """How they ended, by reason."""
    run_ledger: Ledger
    """Where every episode of the run is (all serves')."""
    scheduler: SchedulerStats
    sandboxes: PoolStats | None = None
    """What the sandbox pool did (None when the env needs no sandbox)."""

    @property
    def admitted(self) -> int:
        return self.ledger.admitted

    @property
    def completed(self) -> int:
        """Episodes that ended with a reward (some may be trained or filtered since, or scored
        in an evaluation run)."""
        ledger = self.ledger
        return ledger.completed + ledger.trained + ledger.filtered + ledger.scored

    @property
    def failed(self) -> int:
        return self.ledger.failed


async def serve(cfg: Config, *, max_episodes: int | None = None, with_api: bool = False) -> ServeSummary:
    """Run the rollout side until `max_episodes` are admitted and finished (None: until
    cancelled); returns what the store says of the episodes this process ran. `with_api` also serves the web API and
    viewer (on `api.port` when configured, else a free port) for as long as serve runs."""
    from agent_rl.kernel import telemetry
    from agent_rl.sglang.client import EngineClient
    from agent_rl.sdk.registry import make
    from agent_rl.rollout.render import ChatRenderer
    from agent_rl.rollout.runner import RunnerContext

    # The environment and the binds first: an unknown id, a broken import, a bad kwarg or a
    # public bind without a token is a one-line error before anything (an engine takes half a
    # minute) starts.
    env = make(cfg.rollout.env, **cfg.rollout.env_kwargs)
    env.task_source(cfg.rollout.split)
    check_binds(cfg, env, with_api=with_api)
    telemetry.configure(cfg.telemetry.exporter)
    model = default_model(cfg.engine.model)
    store = await Store.open(cfg.store, create=True)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(store.close)
        await store.warm()
        tg = await stack.enter_async_context(anyio.create_task_group())
        # Its tasks (engine supervision, the API, the SIGTERM watch) are cancelled only once
        # everything entered after it has closed: cancelling earlier would cancel those closes
        # too (the router's client session was left unclosed that way).
        stack.callback(tg.cancel_scope.cancel)
        url = cfg.rollout.router_url or await _embedded(stack, tg, cfg, model)
        client = EngineClient(url)
        stack.push_async_callback(client.aclose)
        pool = await _sandbox_pool(stack, env, cfg) if env.needs_sandbox else None
        ctx = RunnerContext(
            store=store, client=client, renderer=ChatRenderer(model), cfg=cfg.rollout,
            owner=f"serve-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            run_name=cfg.run.name, model_name=model.name, sandboxes=pool,
            routed_experts=cfg.engine.moe_routing_replay,
        )
        gateway = await _agent_gateway(tg, env, cfg, model.name)
        if with_api:
            from agent_rl.app.api import create_app, serve_api

            api_cfg = cfg.api if "port" in cfg.api.model_fields_set else cfg.api.model_copy(update={"port": 0})
            app = create_app(cfg, store=store, sandboxes=pool, runner=ctx)
            port = await tg.start(serve_api, app, api_cfg)
            log.info("web API and viewer at http://%s:%d/", api_cfg.host, port)
        scheduler = Scheduler(
            ctx, env_id=cfg.rollout.env, env_kwargs=cfg.rollout.env_kwargs,
            max_staleness=cfg.trainer.max_staleness, max_queued_groups=queued_groups_bound(cfg),
            max_ready_groups=ready_groups_bound(cfg),
            protect_oldest_group=cfg.rollout.protect_oldest_group,
            groups_per_step=cfg.trainer.groups_per_step,
            staleness=(cfg.trainer.staleness_measure, cfg.trainer.stale_siblings),
            run_config=cfg.model_dump(mode="json"), gateway=gateway,
        )
        with anyio.CancelScope() as scope:
            tg.start_soon(_drain_on_sigterm, scheduler, scope)
            with long_lived_heap():  # everything is imported and started: see agent_rl/kernel/heap.py
                async with anyio.create_task_group() as sampling:
                    if cfg.rollout.engine_sample_s > 0:
                        run_id = await store.ensure_run(cfg.run.name, scheduler.run_config)
                        sampling.start_soon(sample_engines, store, client, url, run_id,
                                            cfg.rollout.engine_sample_s)
                    await scheduler.run(max_episodes)
                    sampling.cancel_scope.cancel()
        run_id = scheduler.run_id
        assert run_id is not None
        return ServeSummary(
            run_id=run_id, owner=ctx.owner, ledger=await store.ledger(run_id, owner=ctx.owner),
            endings=await store.endings(run_id, owner=ctx.owner),
            run_ledger=await store.ledger(run_id), scheduler=scheduler.stats,
            sandboxes=pool.stats if pool is not None else None,
        )  # fmt: skip


def check_binds(cfg: Config, env: Env, *, with_api: bool) -> None:
    """Refuse, naming the setting, a bind beyond loopback without `api.token`: the web API's
    (`api.host`) when serve mounts it, the agent gateway's (`rollout.gateway_host`) for an
    agent env."""
    from agent_rl.config.access import is_loopback, token_value
    from agent_rl.sdk.agent import AgentEnv

    if with_api:
        from agent_rl.app.api.app import check_exposure

        check_exposure(cfg.api)
    host = cfg.rollout.gateway_host
    if isinstance(env, AgentEnv) and not is_loopback(host) and token_value(cfg.api.token) is None:
        raise ConfigError(
            f"rollout.gateway_host is {host}, not loopback, and api.token is unset or blank: a "
            "public bind needs api.token set (AGENT_RL_API__TOKEN), or set "
            "rollout.gateway_host = 127.0.0.1"
        )


async def _sandbox_pool(stack: AsyncExitStack, env: Env, cfg: Config) -> SandboxPool:
    """The pool every episode's sandbox comes from, closed (every sandbox with it) when serve
    returns; its warm sandboxes of the env's spec started before the first episode asks."""
    from tools_sandbox.pool import SandboxPool

    pool = await stack.enter_async_context(SandboxPool.open(cfg.sandbox))
    spec = episode_spec(env)
    if cfg.sandbox.warm_pool and spec is not None:
        await pool.prewarm(spec)
        log.info("%d warm sandboxes started", pool.warm(spec))
    elif cfg.sandbox.warm_pool:
        log.warning("sandbox.warm_pool does nothing for %s: each episode's sandbox mounts its "
                    "own relay to the gateway, so none can be started ahead", env.env_id)
    return pool


def episode_spec(env: Env) -> SandboxSpec | None:
    """The spec every episode of `env` asks the pool for; None when each asks for its own (an
    agent's command run in its sandbox, which mounts the episode's relay)."""
    from agent_rl.sdk.agent import AgentEnv
    from agent_rl.sdk.sandbox import SandboxSpec

    if isinstance(env, AgentEnv) and env.command is not None and env.command_in_sandbox:
        return None
    return env.sandbox_spec or SandboxSpec()


async def _agent_gateway(tg: anyio.abc.TaskGroup, env: Any, cfg: Config, model_name: str) -> Gateway | None:
    """For an agent env, the OpenAI-compatible gateway its programs call, listening on
    `rollout.gateway_host`/`gateway_port` for as long as serve runs; None for an SDK env."""
    from agent_rl.sdk.agent import AgentEnv

    if not isinstance(env, AgentEnv):
        return None
    from agent_rl.app.api import serve_api
    from agent_rl.config import ApiConfig
    from agent_rl.rollout.gateway import Gateway
    from agent_rl.rollout.gateway_app import gateway_app

    gateway = Gateway(model_name)
    # The episode keys are the gateway's only credential: like the API, it binds loopback
    # unless told otherwise (and then needs api.token to be set: `check_binds`).
    where = ApiConfig(host=cfg.rollout.gateway_host, port=cfg.rollout.gateway_port, token=cfg.api.token)
    app = gateway_app(gateway, cfg.rollout.gateway_host, cfg.rollout.gateway_allowed_hosts)
    port = await tg.start(serve_api, app, where)
    host = cfg.rollout.gateway_host
    gateway.base_url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    log.info("agent gateway at %s/agents/{episode_key}/v1", gateway.base_url)
    return gateway


async def sample_engines(store: Store, client: EngineClient, url: str, run_id: int,
                         period_s: float) -> None:
    """Record every engine's load (SGLang's `/v1/loads`, through the router) each `period_s`
    for the compute audit; a failed sample is skipped (the engine may be restarting)."""
    while True:
        try:
            loads = await client.loads()
            t = time.time()
            await store.record_engine_samples(run_id, [_engine_load(x, url, t) for x in loads if isinstance(x, dict)])
        except (EngineError, StoreError, KeyError, TypeError, ValueError) as e:
            log.debug("engine load sample skipped: %s", e)
        await anyio.sleep(period_s)


def _engine_load(load: dict[str, Any], url: str, t: float) -> EngineLoad:
    from agent_rl.config.secrets import redact_url
    from agent_rl.store import EngineLoad

    engine = redact_url(str(load.get("worker") or url))  # shown by the audit: no credentials
    if load.get("dp_rank"):
        engine += f"#dp{load['dp_rank']}"
    usage, gen = load.get("token_usage"), load.get("gen_throughput")
    prefilled = load.get("total_prefill_uncached_tokens")
    return EngineLoad(
        engine=engine, sampled_at=t, running=int(load.get("num_running_reqs") or 0),
        waiting=int(load.get("num_waiting_reqs") or 0),
        token_usage=None if usage is None else float(usage),
        gen_tokens_per_s=None if gen is None else float(gen),
        prefill_tokens_total=None if prefilled is None else float(prefilled),
    )  # fmt: skip


def queued_groups_bound(cfg: Config) -> int:
    """`rollout.max_queued_groups`, its default worked out (0: no bound)."""
    bound = cfg.rollout.max_queued_groups
    if bound is None:
        return max(cfg.trainer.max_staleness, 1) * cfg.trainer.groups_per_step
    return bound


def ready_groups_bound(cfg: Config) -> int:
    """`rollout.max_ready_groups`, its default worked out (0: no bound)."""
    bound = cfg.rollout.max_ready_groups
    if bound is None:
        if queued_groups_bound(cfg) == 0:
            return 0
        return max(cfg.trainer.max_staleness, 1) * cfg.trainer.groups_per_step
    return bound


async def _drain_on_sigterm(scheduler: Scheduler, scope: anyio.CancelScope) -> None:
    """The first SIGTERM stops admission and lets running episodes finish (serve then returns);
    a second one, like Ctrl-C, interrupts them (each is recorded as failed: interrupted)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread (serve embedded in a test or bench)
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            if scheduler.stopping:
                scope.cancel()
                return
            log.warning("SIGTERM: admitting no new episodes; finishing the running ones "
                        "(send it again to interrupt them)")
            scheduler.stop_admitting()


async def _embedded(stack: AsyncExitStack, tg: anyio.abc.TaskGroup, cfg: Config, model: Path) -> str:
    """Start the embedded engine (supervised) and router; return the router's URL."""
    from agent_rl.engine.launcher import EngineServer
    from router.app import Router

    # Free ports unless the config names them, so several serves can share a machine.
    engine_port = cfg.engine.port if "port" in cfg.engine.model_fields_set else 0
    router_cfg = cfg.router
    if "port" not in router_cfg.model_fields_set:
        router_cfg = router_cfg.model_copy(update={"port": 0})
    engine = EngineServer.from_config(cfg.engine, model=model, port=engine_port)
    log.info("starting the embedded SGLang engine on %s (log: %s)", engine.url, engine.log_path)
    await engine.astart()
    stack.callback(engine.stop)
    tg.start_soon(_supervise, engine)
    router = await stack.enter_async_context(Router(router_cfg, workers=[engine.url]))
    return router.url


async def _supervise(engine) -> None:  # type: ignore[no-untyped-def]
    """Restart the embedded engine whenever it dies."""
    while True:
        try:
            await engine.watch()
        except EngineError as e:
            log.error("embedded engine died (%s); restarting it", e)
            engine.stop()  # its process group too: a surviving child would hold the port
            await engine.astart()
