"""The web API, the viewer and the agent gateway answer only their own Host (a web page whose
name its author points at 127.0.0.1, DNS rebinding, is same-origin with a loopback server and
could read every answer): 421 for another Host, 403 for a state-changing request from another
Origin; `allowed_hosts` adds the names a proxy forwards. Real servers on loopback, a migrated
SQLite store. Also: two `Authorization` headers carry no token (gate and routes alike), an empty
`?cursor=` is the first page, and `serve` refuses a public gateway without `api.token` before
anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from agent_rl.app.api import create_app
from agent_rl.app.api.app import EmbeddedServer
from agent_rl.rollout.gateway import Gateway
from agent_rl.rollout.gateway_app import gateway_app
from agent_rl.rollout.gateway_relay import SANDBOX_PORT
from agent_rl.store.migrate import upgrade
from tests.api.conftest import TOKEN, api_config

AGENT_RL = str(Path(sys.executable).parent / "agent-rl")


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('hosts') / 'store.db'}"
    anyio.run(upgrade, api_config(url).store)
    return url


def live(app) -> Iterator[httpx.Client]:  # type: ignore[no-untyped-def]
    with (
        EmbeddedServer.in_thread(app) as server,
        httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def api(store_url: str) -> Iterator[httpx.Client]:
    app = create_app(api_config(store_url, allowed_hosts=["viewer.example.org"]))
    yield from live(app)


def port_of(client: httpx.Client) -> int:
    return client.base_url.port or 80


@pytest.mark.parametrize("path", ["/api/v1/runs", "/", "/runs", "/openapi.json"])
def test_the_api_and_viewer_answer_their_own_hosts_only(api: httpx.Client, path: str) -> None:
    port = port_of(api)
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        f"[::1]:{port}",
        "viewer.example.org",
        f"viewer.example.org:{port}",
    ):
        assert api.get(path, headers={"Host": host}).status_code == 200, host
    for host in ("rebound.example", f"rebound.example:{port}", "127.0.0.1:1", "localhost"):
        r = api.get(path, headers={"Host": host})
        assert r.status_code == 421, host
        assert "allowed_hosts" in r.json()["detail"]


def test_a_post_from_a_foreign_origin_is_refused(api: httpx.Client) -> None:
    path, auth = "/api/v1/episodes/1/replay", {"Authorization": f"Bearer {TOKEN}"}
    for origin in ("http://rebound.example", "null", f"http://127.0.0.1:{port_of(api) + 1}"):
        r = api.post(path, headers={**auth, "Origin": origin})
        assert r.status_code == 403 and "cross-origin" in r.json()["detail"], origin
    # Its own pages' Origin, or none (not a browser): on to the route (no episode 1: 404).
    for headers in ({"Origin": f"http://127.0.0.1:{port_of(api)}"}, {}):
        assert api.post(path, headers={**auth, **headers}).status_code == 404


def test_two_authorization_headers_carry_no_token(store_url: str, api: httpx.Client) -> None:
    path = "/api/v1/episodes/1/replay"
    pairs = ([f"Bearer {TOKEN}", "Bearer wrong"], ["Bearer wrong", f"Bearer {TOKEN}"])
    for pair in pairs:  # the route's check
        assert api.post(path, headers=[("Authorization", v) for v in pair]).status_code == 401
    assert api.post(path, headers={"Authorization": f"bearer {TOKEN}"}).status_code == 404
    # The gate in front of a public bind reads them the same way.
    public = create_app(api_config(store_url, host="0.0.0.0"))
    for client in live(public):
        for pair in pairs:
            r = client.get("/api/v1/runs", headers=[("Authorization", v) for v in pair])
            assert r.status_code == 401, pair
        assert (
            client.get("/api/v1/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code
            == 200
        )


def test_an_empty_cursor_is_the_first_page(api: httpx.Client) -> None:
    r = api.get("/api/v1/episodes", params={"cursor": ""})
    assert r.status_code == 200 and r.json() == {"items": [], "next_cursor": None}


def test_the_gateway_answers_its_own_hosts_only() -> None:
    app = gateway_app(Gateway("tiny"), "127.0.0.1", ["agents.example.org"])
    for client in live(app):
        port = port_of(client)
        path = "/agents/ep1-nokey/v1/models"
        # Past the Host check, an unknown episode is 404; the in-sandbox relay's Host passes.
        for host in (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            "agents.example.org",
            f"127.0.0.1:{SANDBOX_PORT}",
        ):
            assert client.get(path, headers={"Host": host}).status_code == 404, host
        for host in ("rebound.example", f"rebound.example:{port}", f"localhost:{port + 1}"):
            r = client.get(path, headers={"Host": host})
            assert r.status_code == 421, host
            assert "allowed_hosts" in r.json()["error"]["message"]  # OpenAI's error shape


def test_serve_refuses_a_public_gateway_without_a_token_before_anything_starts(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_RL_")}
    env.update(AGENT_RL_STORE__URL=f"sqlite:///{tmp_path / 'store.db'}",
               AGENT_RL_ROLLOUT__GATEWAY_HOST="0.0.0.0")  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run([AGENT_RL, "serve", "--env", "calculator-agent", "--no-api"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    elapsed = time.monotonic() - t0
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert "rollout.gateway_host" in lines[0] and "api.token" in lines[0]
    assert elapsed < 5, elapsed  # the engine alone takes 20-35 s to start
    assert not (tmp_path / "runs").exists() and not (tmp_path / "store.db").exists()


def test_serve_as_a_library_checks_the_binds_too(tmp_path: Path) -> None:
    from agent_rl.app.serve import serve
    from agent_rl.config import Config
    from agent_rl.kernel.errors import ConfigError

    url = f"sqlite:///{tmp_path / 'store.db'}"
    public = Config(store={"url": url}, rollout={"env": "calculator-agent", "gateway_host": "::"})
    with pytest.raises(ConfigError, match=r"rollout\.gateway_host is ::.*api\.token"):
        anyio.run(serve, public)
    with pytest.raises(ConfigError, match=r"api\.host is 0\.0\.0\.0.*api\.token"):
        anyio.run(lambda: serve(Config(store={"url": url}, api={"host": "0.0.0.0"}), with_api=True))
    assert not (tmp_path / "store.db").exists()  # nothing was started


def test_a_public_gateway_host_concerns_agent_envs_only(tmp_path: Path) -> None:
    """Only an agent env starts the gateway: with an SDK env a public `rollout.gateway_host`
    binds nothing, and neither the CLI's early check nor serve's refuses it; `--env` names the
    env the CLI checks (the config's default is an SDK env)."""
    from agent_rl.app.cli.serve import check_public_binds
    from agent_rl.app.serve import check_binds
    from agent_rl.config import Config
    from agent_rl.kernel.errors import ConfigError
    from agent_rl.sdk.registry import make

    url = f"sqlite:///{tmp_path / 'store.db'}"
    for env_id, agents in (("calculator", False), ("calculator-agent", True)):
        cfg = Config(store={"url": url}, rollout={"env": env_id, "gateway_host": "0.0.0.0"})
        env = make(env_id)
        for check in (lambda: check_public_binds(cfg, with_api=False),
                      lambda: check_binds(cfg, env, with_api=False)):  # fmt: skip
            if agents:
                with pytest.raises(ConfigError, match=r"rollout\.gateway_host is 0\.0\.0\.0"):
                    check()
            else:
                check()
        # A public API is refused whatever the env.
        public_api = cfg.model_copy(update={"api": cfg.api.model_copy(update={"host": "0.0.0.0"})})
        with pytest.raises(ConfigError, match=r"api\.host is 0\.0\.0\.0"):
            check_public_binds(public_api, with_api=True)
        if not agents:
            check_public_binds(public_api, with_api=False)
