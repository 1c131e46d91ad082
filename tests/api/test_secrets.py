"""Secrets never leave the process: a password planted everywhere the configuration can hold
one (the PostgreSQL store URL's password, `api.token`, `router.admin_token`, a router URL's
credentials, an env kwarg named like a secret, one named in `rollout.secret_env_kwargs`, the
value of a secret option in `engine.extra_args`) is
found in no output of a real `serve` run: not in the run's stored config, the API, the viewer,
the CLI (`config show`, `db upgrade`, `runs`, an error quoting the URL), the log, or the
episodes' traces. On SQLite and PostgreSQL.

The same run checks the gateway's credentials as an agent program sends them: `bearer` in any
case passes, two `Authorization` headers are no key. The engine is the stand-in
(`agent_rl.testing.stand_in_engine`, scripted, fault-free); serve, the gateway, the store and
HTTP on loopback are real."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from agent_rl.app.api import create_app
from agent_rl.app.cli import app as cli
from agent_rl.app.serve import serve
from agent_rl.config import Config
from agent_rl.config.secrets import MASK
from agent_rl.kernel import telemetry
from agent_rl.rollout.render import ChatRenderer
from agent_rl.sdk.agent import AgentEnv
from agent_rl.sdk.registry import register
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from agent_rl.store import Store
from agent_rl.store.migrate import upgrade
from agent_rl.testing.stand_in_engine import StandInEngine
from tests.api.conftest import LOOPBACK, in_thread

PLANTED = "pl4nted-S3cret"


class PlantedAgent(AgentEnv):
    """Holds secrets in its kwargs; its agent calls the gateway with crafted credentials and
    keeps each answer's status."""

    statuses: ClassVar[dict[str, int]] = {}

    def __init__(self, *, api_key: str = "", license_code: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_key, self.license_code = api_key, license_code

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        return ListTasks([Task(id="t0", data={"q": "hello"})])

    async def run(self, base_url: str, api_key: str, task: Task) -> str:
        assert self.api_key == PLANTED and self.license_code == PLANTED  # the process keeps them
        crafted = {
            "Bearer": [("Authorization", f"Bearer {api_key}")],
            "bearer": [("Authorization", f"bearer {api_key}")],
            "BEARER": [("Authorization", f"BEARER {api_key}")],
            "two headers": [("Authorization", f"Bearer {api_key}"), ("Authorization", "Bearer x")],
            "two, right second": [
                ("Authorization", "Bearer x"),
                ("Authorization", f"Bearer {api_key}"),
            ],
        }
        async with httpx.AsyncClient() as client:
            for name, headers in crafted.items():
                r = await client.get(f"{base_url}/models", headers=headers)
                PlantedAgent.statuses[name] = r.status_code
        return "done"

    async def score(self, task: Task, result: Any, transcript: list[dict[str, Any]]) -> float:
        return 1.0


def planted_config(db_url: str, tmp_path: Path, engine_url: str, model: Path) -> Config:
    url = make_url(db_url)
    if url.drivername.startswith("postgresql"):  # the test server trusts loopback: unused
        db_url = url.set(password=PLANTED).render_as_string(hide_password=False)
    # The stand-in engine ignores the credentials; the client sends them as basic auth.
    router_url = engine_url.replace("http://", f"http://agent:{PLANTED}@")
    return Config(
        store={"url": db_url},
        # Free-form: options of the engine's command line (unused: the engine is the stand-in).
        engine={"model": model, "extra_args": ["--api-key", PLANTED, f"--admin-api-key={PLANTED}"]},
        rollout={"env": "test-planted-agent", "router_url": router_url, "group_size": 1,
                 "env_kwargs": {"api_key": PLANTED, "license_code": PLANTED},
                 "secret_env_kwargs": ["license_code"], "max_turns": 2, "engine_sample_s": 0.2},
        api={"token": PLANTED},
        router={"admin_token": PLANTED},
    )  # fmt: skip


def test_a_planted_password_appears_in_no_output(
    db_url: str, tmp_path: Path, tiny_dense_model: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    register("test-planted-agent", PlantedAgent)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer(telemetry.TRACER_NAME))
    renderer = ChatRenderer(tiny_dense_model)
    caplog.set_level(logging.DEBUG)

    async def run() -> tuple[Config, int]:
        async with StandInEngine([renderer.encode("hi")], renderer.eos_id) as engine:
            cfg = planted_config(db_url, tmp_path, engine.url, tiny_dense_model)
            await upgrade(cfg.store)
            summary = await serve(cfg, max_episodes=1, with_api=True)
        return cfg, summary.run_id

    cfg, run_id = in_thread(run)
    outputs: dict[str, str] = {"log": caplog.text}
    assert PlantedAgent.statuses == {"Bearer": 200, "bearer": 200, "BEARER": 200,
                                     "two headers": 401, "two, right second": 401}  # fmt: skip

    async def stored() -> dict[str, Any]:
        async with await Store.open(cfg.store) as store:
            return (await store.get_run(run_id))["config"]

    recorded = in_thread(stored)
    outputs["stored config"] = json.dumps(recorded)
    assert recorded["rollout"]["env_kwargs"] == {"api_key": MASK, "license_code": MASK}
    assert recorded["api"]["token"] == MASK
    assert recorded["engine"]["extra_args"] == ["--api-key", MASK, f"--admin-api-key={MASK}"]
    with TestClient(create_app(cfg), base_url=LOOPBACK) as c:
        for path in (
            f"/api/v1/runs/{run_id}",
            "/api/v1/runs",
            f"/runs/{run_id}",
            "/",
            "/audit",
            "/api/v1/episodes",
            "/api/v1/stats",
        ):
            r = c.get(path)
            assert r.status_code == 200, (path, r.text)
            outputs[path] = r.text
        outputs["audit"] = c.get("/api/v1/audit", params={"run": "default"}).text
    spans = exporter.get_finished_spans()
    assert spans
    outputs["traces"] = "\n".join(s.to_json() for s in spans)

    env = {"AGENT_RL_STORE__URL": cfg.store.url, "AGENT_RL_API__TOKEN": PLANTED,
           "AGENT_RL_ROUTER__ADMIN_TOKEN": PLANTED,
           "AGENT_RL_ROLLOUT__ROUTER_URL": cfg.rollout.router_url or "",
           "AGENT_RL_ROLLOUT__ENV_KWARGS": json.dumps(cfg.rollout.env_kwargs),
           "AGENT_RL_ROLLOUT__SECRET_ENV_KWARGS": '["license_code"]',
           "AGENT_RL_ENGINE__EXTRA_ARGS": json.dumps(cfg.engine.extra_args)}  # fmt: skip
    runner = CliRunner()
    for args in (
        ["config", "show"],
        ["config", "show", "--json"],
        ["db", "upgrade"],
        ["db", "current"],
        ["episodes", "list"],
        ["audit"],
    ):
        result = runner.invoke(cli, args, env=env)
        assert result.exit_code == 0, (args, result.output)
        outputs[" ".join(args)] = result.output
    assert "url = " in outputs["config show"] and MASK in outputs["config show"]
    # An error that quotes the store URL (a PostgreSQL server that is not there).
    dead = {**env, "AGENT_RL_STORE__URL": f"postgresql://agent:{PLANTED}@127.0.0.1:1/none"}
    result = runner.invoke(cli, ["db", "current"], env=dead)
    assert result.exit_code != 0
    outputs["store error"] = f"{result.output}{result.exception}"
    assert "127.0.0.1:1" in outputs["store error"]

    leaked = [where for where, text in outputs.items() if PLANTED in text]
    assert leaked == [], leaked
