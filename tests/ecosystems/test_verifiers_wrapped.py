"""The ecosystems verifiers 0.4.0 wraps, trained through its tasksets (`verifiers:textarena`,
`verifiers:openenv`, `verifiers:harbor`), on the session's real SGLang engine through a
recording tap, the env played by verifiers in its env server and the model's seat run by
agent-rl's `vf_chat` harness (envs/verifiers_env/tasksets: one chat call a user turn,
in-process; verifiers' own `null` harness installs a program with `uv` at run time).

- TextArena's Hangman (`verifiers[ta]`: textarena 0.7.4 and nltk), its word list read offline
  from agent-rl's `nltk_data` (a game's `nltk.download` is never attempted): each game's moves
  are turns of the engine's own tokens, one segment, and the reward is the game's.
- OpenEnv (openenv 0.4.1, fastmcp 4.1.0 beside verifiers' mcp 2.0.0): an environment written
  against OpenEnv's API (`verifiers_modules/openenv_repeat.py`) served locally by OpenEnv's
  own server, reached by `base_url` (no container, no registry): the same checks, and the
  reward is the sum of OpenEnv's step rewards, recomputed here from the stored conversation.
- Training: one trainer step consumes OpenEnv episodes served through the taskset (the ledger
  balances, the audit is clean). bench/wrapped_train.py serves and trains both envs together
  for several policy versions (docs/ecosystems.md).
- Harbor: refused in one line where its CLI is missing (tests/ecosystems/test_verifiers.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_rl.app.serve import serve
from agent_rl.config import TrainerConfig
from agent_rl.engine.launcher import free_port
from agent_rl.rollout.render import ChatRenderer
from agent_rl.sdk.registry import make
from agent_rl.store import Store
from tests.rollout.conftest import serve_config
from tests.rollout.gateway_helpers import Tap, check_agent_episode
from trainer.learner import learner
from trainer.loop import TrainLoop

MODULES = Path(__file__).with_name("verifiers_modules")
HANGMAN = {"taskset": {"game": "Hangman-v0"},
           "player": {"harness": {"id": "vf_chat"}, "max_turns": 3}}  # fmt: skip
"""Three moves at most: a tiny random model does not win, and the test stays short."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def textarena_python(verifiers_python: str) -> str:
    """The verifiers environment, with its `ta` extra (CI installs `verifiers[ta]==0.4.0`)."""
    if subprocess.run([verifiers_python, "-c", "import textarena, nltk"], capture_output=True,
                      check=False).returncode != 0:  # fmt: skip
        pytest.fail(f"{verifiers_python} has no textarena: pip install 'verifiers[ta]==0.4.0'")
    return verifiers_python


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_textarena_game_is_played_token_for_token(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path, textarena_python: str
) -> None:
    kwargs = {"python": textarena_python, "config": HANGMAN, "max_tasks": 4}
    rows = make("verifiers:textarena", **kwargs).task_source().tasks  # type: ignore[attr-defined]
    assert [r.id for r in rows] == ["0", "1", "2", "3"]
    boards = {r["verifiers_task"]["info"]["seed"]: r["verifiers_task"]["prompt"] for r in rows}
    assert all("You are playing Hangman" in b for b in boards.values())
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg = serve_config(f"sqlite:///{tmp_path / 'ta.db'}", tap.url, tiny_moe_model,
                           env="verifiers:textarena", env_kwargs=kwargs, max_new_tokens=12)  # fmt: skip
        summary = await serve(cfg, max_episodes=2)
    assert summary.admitted == 2 and summary.run_ledger.balances()
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=summary.run_id)
        assert len(episodes) == 2
        for e in episodes:
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [])
            detail = await store.get_episode(e.id)
            assert 1 <= e.num_turns <= 3 and e.reward_details["segments"] == 1
            # The seeded board is the first user turn, after TextArena's system prompt.
            assert detail.messages[0]["role"] == "system" and "competitive game" in detail.messages[0]["content"]
            assert detail.messages[1]["content"] in boards.values()
            # Every later user turn is the game's answer to the move before it.
            assert [m["role"] for m in detail.messages[1:]] == ["user", "assistant"] * e.num_turns
            assert e.reward == e.reward_details["reward"]["components"]["game_reward"]


@pytest.fixture(scope="module")
def openenv_url(verifiers_python: str) -> Iterator[str]:
    """`openenv_repeat.py` served by OpenEnv's server on loopback (CI installs openenv==0.4.1
    and fastmcp==4.1.0 into the verifiers environment)."""
    if subprocess.run([verifiers_python, "-c", "import openenv"], capture_output=True,
                      check=False).returncode != 0:  # fmt: skip
        pytest.fail(f"{verifiers_python} has no openenv: pip install openenv==0.4.1 fastmcp==4.1.0")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with subprocess.Popen([verifiers_python, str(MODULES / "openenv_repeat.py"), str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as server:  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not _answers(f"{url}/health"):
                assert server.poll() is None, server.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the OpenEnv server did not answer in 120 s"
                time.sleep(0.5)
            yield url
        finally:
            server.terminate()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.anyio
@pytest.mark.slow
async def test_an_openenv_environment_served_locally_is_played_token_for_token(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path, verifiers_python: str, openenv_url: str
) -> None:
    config = {"taskset": {"base_url": openenv_url, "resets": [{"seed": 0}, {"seed": 1}]},
              "player": {"harness": {"id": "vf_chat"}, "max_turns": 2}}  # fmt: skip
    kwargs = {"python": verifiers_python, "config": config}
    async with Tap(sglang_moe_server.url).running() as tap:
        cfg = serve_config(f"sqlite:///{tmp_path / 'oe.db'}", tap.url, tiny_moe_model,
                           env="verifiers:openenv", env_kwargs=kwargs, max_new_tokens=8,
                           temperature=0.0)  # fmt: skip
        summary = await serve(cfg, max_episodes=2)
    assert summary.admitted == 2 and summary.run_ledger.balances()
    renderer = ChatRenderer(tiny_moe_model)
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=summary.run_id)
        assert len(episodes) == 2
        for e in episodes:
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [])
            detail = await store.get_episode(e.id)
            assert 1 <= e.num_turns <= 2 and e.reward_details["segments"] == 1
            # Each user turn is OpenEnv's observation (and action schema) as verifiers sends it;
            # each reply that says the word asked earned 1.
            asked = [re.search(r"Say the word (\w+)", json.loads(m["content"])["observation"]["prompt"])
                     for m in detail.messages if m["role"] == "user"]  # fmt: skip
            replies = [m["content"] for m in detail.messages if m["role"] == "assistant"]
            assert len(asked) == len(replies) == e.num_turns and all(asked)
            earned = sum(float(a.group(1) in r.lower()) for a, r in zip(asked, replies))  # type: ignore[union-attr]
            assert e.reward == earned == e.reward_details["reward"]["components"]["openenv_reward"]


@pytest.mark.slow
def test_a_training_step_consumes_openenv_episodes(
    tmp_path: Path, sglang_moe_server: Any, tiny_moe_model: Path, verifiers_python: str, openenv_url: str
) -> None:
    """The episodes of an env verifiers wraps are training data like any other: served through
    the OpenEnv taskset (two groups of two), then consumed by one real trainer step."""
    config = {"taskset": {"base_url": openenv_url, "resets": [{"seed": 0}, {"seed": 1}]},
              "player": {"harness": {"id": "vf_chat"}, "max_turns": 2}}  # fmt: skip
    cfg = serve_config(f"sqlite:///{tmp_path / 'train.db'}", sglang_moe_server.url, tiny_moe_model,
                       env="verifiers:openenv", env_kwargs={"python": verifiers_python, "config": config},
                       max_new_tokens=8, filter_zero_variance=False)  # fmt: skip
    summary = anyio.run(lambda: serve(cfg, max_episodes=4))
    assert summary.admitted == 4 and summary.completed == 4, summary
    # No weight sync (no router: the session's engine keeps its weights for the other tests).
    cfg = cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update={"router_url": None}),
        "trainer": TrainerConfig(groups_per_step=2, micro_batch_size=4, optim={"lr": 3e-5},
                                 checkpoint_dir=tmp_path / "ckpt", export_dir=tmp_path / "exports",
                                 tensorboard_dir=tmp_path / "tb", data_poll_s=0.2)})  # fmt: skip
    with learner(tiny_moe_model, cfg.trainer) as engine:
        stats = TrainLoop(cfg, engine).run(max_steps=1)
    assert stats.steps == 1 and stats.version == 1

    async def read() -> tuple[list[Any], list[str]]:
        async with await Store.open(cfg.store) as store:
            run_id = await store.run_id(cfg.run.name)
            return (await store.list_episodes(run_id=run_id),
                    (await store.audit(run_id)).problems())  # fmt: skip

    episodes, problems = anyio.run(read)
    assert sorted((e.status, e.trained_step) for e in episodes) == [("trained", 1)] * 4
    assert all(e.num_turns >= 1 for e in episodes)
    assert problems == []
