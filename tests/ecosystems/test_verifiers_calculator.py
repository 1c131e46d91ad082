"""`verifiers:vf_calculator` (envs/verifiers_env/tasksets): the calculator written as a verifiers
v1 taskset, what `agent-rl quickstart --env verifiers:vf_calculator` warm-starts with the
calculator's demonstrations and trains. What makes that sound is tested here:

- a verifiers episode with a real tool call (weights memorized to answer one question with a
  `calc` call, `memorize_calculator`: a random tiny model never writes one) is stored as the
  engine's own tokens in one segment, and those tokens are, to the id, the calculator's
  demonstration of that question encoded for SFT: what SFT trains on is what RL samples;
- `train --sft` on the verifiers id collects the demonstrations of the env it names
  (`demonstrations`), and an agent env that names none is refused in one line;
- `agent-rl eval` on the verifiers id scores its own eval split (`splits`), every reward the
  one verifiers computed from the stored reply.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from agent_rl.app.evaluation import evaluate
from agent_rl.app.serve import serve
from agent_rl.config import Config, RolloutConfig, TrainerConfig
from agent_rl.kernel.errors import ConfigError
from agent_rl.rollout.render import ChatRenderer, encode_transcript
from agent_rl.rollout.sft_data import sft_sequences
from agent_rl.sdk.registry import make
from agent_rl.sdk.rewards import number_match
from agent_rl.sglang.client import EngineClient
from agent_rl.store import Store
from tests.rollout.conftest import serve_config
from tests.rollout.gateway_helpers import (
    CALL_TEXT,
    FINAL_TEXT,
    QUESTION,
    Tap,
    check_agent_episode,
    memorize_calculator,
)

MODULES = Path(__file__).with_name("verifiers_modules")
TEACHER = {"teacher_tool_rate": 1.0, "tools_in_prompt": False, "min_terms": 3, "max_terms": 3,
           "max_digits": 1, "max_turns": 3}  # fmt: skip
"""The calculator's kwargs the demonstrations are made with (the quickstart's, a perfect teacher)."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def memorized(sglang_moe_server, tiny_moe_model: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The session engine on weights that answer QUESTION, asked with no tool schemas (as the
    verifiers calculator's harness asks it), with CALL_TEXT and then FINAL_TEXT."""
    weights = memorize_calculator(tiny_moe_model, tmp_path_factory.mktemp("vf-memorized") / "model", [[]])
    async with EngineClient(sglang_moe_server.url) as client:
        await client.update_weights_from_disk(weights, weight_version="default")
        try:
            yield sglang_moe_server
        finally:
            await client.update_weights_from_disk(tiny_moe_model, weight_version="default")


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_verifiers_tool_call_is_the_calculators_demonstration_token_for_token(
    tmp_path: Path, memorized, tiny_moe_model: Path, verifiers_python: str  # type: ignore[no-untyped-def]
) -> None:
    kwargs = {"python": verifiers_python, "paths": [str(MODULES)]}
    async with Tap(memorized.url).running() as tap:
        cfg = serve_config(f"sqlite:///{tmp_path / 'vf.db'}", tap.url, tiny_moe_model,
                           env="verifiers:vf_one_sum", env_kwargs=kwargs, temperature=0.0)  # fmt: skip
        summary = await serve(cfg, max_episodes=2)
    assert summary.admitted == 2 and summary.run_ledger.balances()
    renderer = ChatRenderer(tiny_moe_model)
    demonstration = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL_TEXT},
                     {"role": "tool", "content": "5", "name": "calc", "tool_call_id": "call_0_0"},
                     {"role": "assistant", "content": FINAL_TEXT}]  # fmt: skip
    encoded = encode_transcript(renderer, demonstration, [])  # type: ignore[arg-type]
    assert encoded is not None
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=summary.run_id)
        assert len(episodes) == 2
        for e in episodes:
            assert e.status in ("completed", "filtered"), e.error_cause
            await check_agent_episode(store, renderer, tap, e.id, [])
            # The call went through verifiers' interception and back as a tool message: one
            # segment, the reward verifiers computed from the model's last reply.
            assert e.num_turns == 2 and e.reward_details["segments"] == 1
            assert e.reward == 1.0 and e.reward_details["reward"]["components"] == {"correct": 1.0}
            # The SFT sequence goes on past the last end-of-turn (the template's newline after
            # it), untrained; up to there it is the episode, id for id and mask for mask.
            tokens = await store.episode_tokens(e.id)
            n = len(tokens.token_ids)
            assert tokens.token_ids.tolist() == encoded[0][:n] and not any(encoded[1][n:])
            assert tokens.loss_mask.tolist() == encoded[1][:n]


@pytest.mark.anyio
async def test_train_sft_on_a_verifiers_id_trains_on_the_demonstrations_it_names(tiny_dense_model: Path) -> None:
    """No verifiers process runs: the demonstrations are the named SDK env's."""

    async def sequences(env: str, kwargs: dict[str, Any]) -> Any:
        cfg = Config(rollout=RolloutConfig(env=env, env_kwargs=kwargs), trainer=TrainerConfig(seed=3))
        return await sft_sequences(cfg, tiny_dense_model, env, 4)

    named = {"python": sys.executable, "demonstrations": "calculator", "demonstration_kwargs": TEACHER}
    ours = await sequences("verifiers:vf_calculator", named)
    theirs = await sequences("calculator", TEACHER)
    assert len(ours.sequences) == 4 and ours.sequences == theirs.sequences
    with pytest.raises(ConfigError, match=r"verifiers:vf_calculator is an agent environment: .* "
                                          r"the env kwarg demonstrations=<id>\)$"):  # fmt: skip
        await sequences("verifiers:vf_calculator", {"python": sys.executable})


@pytest.mark.anyio
@pytest.mark.slow
async def test_eval_of_a_verifiers_env_scores_its_own_eval_split(
    tmp_path: Path, sglang_moe_server, tiny_moe_model: Path, verifiers_python: str  # type: ignore[no-untyped-def]
) -> None:
    kwargs = {"python": verifiers_python, "splits": {"eval": {"taskset": {"seed": 1}}}}
    cfg = serve_config(f"sqlite:///{tmp_path / 'eval.db'}", sglang_moe_server.url, tiny_moe_model,
                       env="verifiers:vf_calculator", env_kwargs=kwargs, max_new_tokens=16)  # fmt: skip
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"tensorboard_dir": None})})
    result = await evaluate(cfg, version=0, weights=tiny_moe_model, tasks=3, samples=2,
                            router_url=sglang_moe_server.url)  # fmt: skip
    assert result.episodes == 6 and result.failed == 0 and len(result.task_rewards) == 3
    rows = make("verifiers:vf_calculator", **kwargs).task_source("eval").tasks  # type: ignore[attr-defined]
    assert {r.id for r in rows} == {f"calc-1-{i}" for i in range(2048)}
    answers = {r["verifiers_task"]["prompt"]: r["verifiers_task"]["answer"] for r in rows}
    async with await Store.open(cfg.store) as store:
        episodes = await store.list_episodes(run_id=await store.run_id(result.run))
        assert len({e.task_id for e in episodes}) == 3
        for e in episodes:
            detail = await store.get_episode(e.id)
            question = detail.messages[0]["content"]
            reply = [m["content"] for m in detail.messages if m["role"] == "assistant"][-1]
            # A question of the eval rows, scored by verifiers as the calculator scores it.
            assert e.reward == number_match(reply, answers[question])
