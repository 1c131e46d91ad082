"""Fill a store the way the episode runner does, from text-level episodes of real envs.

Each episode is played through `agent_rl.sdk.demonstrations.run_text_episode` (the env's demonstration
policy, or a scripted one), then written with the store's lifecycle calls exactly as the
runner writes it: one `append_turn` per assistant turn, whose messages are the new prompt
messages, the assistant message (raw completion text) and the observations; its tokens are
the rendered new messages (loss mask 0) then the completion (mask 1, with a logprob and a
policy version). The last turn carries the reward. Tokens come from the tiny models' real
tokenizer, so the token view decodes them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent_rl.sdk.demonstrations import Transcript, render_chatml, run_demonstration, run_text_episode
from agent_rl.sdk.registry import make
from agent_rl.store import MessageRecord, Store, TokenArrays, ToolCallRecord, TurnRecord
from agent_rl.store.staleness import staleness as stale

GEN_PROMPT = "<|im_start|>assistant\n"


@dataclass
class Filled:
    url: str
    run_id: int
    calculator: list[int] = field(default_factory=list)
    """Demonstrated calculator episodes (reward 1), the first group trained."""
    bad: int = 0
    """A calculator episode with malformed tool calls (tool errors) and reward 0."""
    running: int = 0
    """An episode still running (one turn so far)."""
    failed: int = 0
    groups: list[int] = field(default_factory=list)


def _turn_records(transcript: Transcript) -> list[tuple[list[dict[str, Any]], int]]:
    """Split the transcript per assistant turn: (messages of the turn, its step index)."""
    out: list[tuple[list[dict[str, Any]], int]] = []
    pending: list[dict[str, Any]] = []
    for m in transcript.messages:
        if m["role"] == "assistant":
            out.append(([*pending, m], len(out)))
            pending = []
        elif out:
            out[-1][0].append(m)
        else:
            pending.append(m)
    return out


def _tool_records(transcript: Transcript, step: int) -> list[ToolCallRecord]:
    if step >= len(transcript.steps):
        return []
    info = transcript.steps[step]
    records = [
        ToolCallRecord(
            name=r.name,
            arguments=r.raw_arguments if r.raw_arguments is not None else json.dumps(r.arguments),
            status="ok" if r.error is None else "error",
            output=r.output,
            duration_s=r.duration_s,
        )
        for r in info.tool_results
    ]
    records += [
        ToolCallRecord(name="", arguments=m.raw, status="malformed", output=m.reason)
        for m in info.malformed
    ]
    return records


async def write_transcript(
    store: Store,
    episode_id: int,
    transcript: Transcript,
    tokenizer: Any,
    *,
    version: int = 0,
    finish: bool = True,
    seed: int = 0,
) -> None:
    """Start the (admitted) episode and append its turns as the runner would."""
    rng = np.random.default_rng(seed)
    await store.start_episode(episode_id, "test-runner")
    turns = _turn_records(transcript)
    observations: list[dict[str, Any]] = []  # the previous turn's, rendered in this turn's span
    for k, (messages, step) in enumerate(turns):
        assistant = messages.index(next(m for m in messages if m["role"] == "assistant"))
        before, completion, after = (
            messages[:assistant],
            messages[assistant],
            messages[assistant + 1 :],
        )
        prompt_text = ("\n" if k else "") + render_chatml([*observations, *before]) + GEN_PROMPT
        observations = after
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        completion_ids = tokenizer.encode(
            completion["content"] + "<|im_end|>", add_special_tokens=False
        )
        n_p, n_c = len(prompt_ids), len(completion_ids)
        tokens = TokenArrays.build(
            token_ids=[*prompt_ids, *completion_ids],
            logprobs=np.r_[np.zeros(n_p), -rng.exponential(0.7, n_c)],
            loss_mask=np.r_[np.zeros(n_p), np.ones(n_c)],
            versions=np.r_[np.full(n_p, -1), np.full(n_c, version + (k > 0))],
        )
        t = time.time()
        record = TurnRecord(
            tokens=tokens,
            num_prompt_tokens=n_p,
            started_at=t - 0.05,
            finished_at=t,
            messages=[
                MessageRecord(m["role"], m.get("content", ""), m.get("tool_calls"), m.get("name"))
                for m in [*before, completion, *after]
            ],
            tool_calls=_tool_records(transcript, step),
            finish_reason="stop",
        )
        last = k == len(turns) - 1
        if last and finish:
            details = {"terminated": transcript.terminated, "truncated": transcript.truncated}
            if transcript.steps and transcript.steps[-1].reward is not None:
                details["reward"] = transcript.steps[-1].reward.model_dump(mode="json")
            await store.append_turn(
                episode_id, record, final_reward=transcript.reward, reward_details=details
            )
        else:
            await store.append_turn(episode_id, record)


async def play(
    env_id: str, task_index: int, *, policy: Any = None, sandbox: Any = None, seed: int = 0
) -> tuple[Any, Transcript]:
    """A text-level episode of `env_id` on its task `task_index`: (task, transcript)."""
    env = make(env_id)
    task = env.task_source().take(task_index + 1, 0)[task_index]
    if policy is None:
        return task, await run_demonstration(env, task, seed=seed, sandbox=sandbox)
    return task, await run_text_episode(env, task, policy, seed=seed, sandbox=sandbox)


async def add_episode(
    store: Store,
    run_id: int,
    env_id: str,
    task: Any,
    transcript: Transcript,
    tokenizer: Any,
    **kwargs: Any,
) -> tuple[int, int]:
    """A one-episode group on its own task; returns (group id, episode id)."""
    task_id = await store.add_task(run_id, env_id, task.id, task.data)
    group, (episode,) = await store.admit_group(run_id, task_id, env_id, 1, seeds=[transcript.seed])
    await write_transcript(store, episode, transcript, tokenizer, **kwargs)
    return group, episode


async def fill(store: Store, tokenizer: Any, tokenizer_dir: str) -> Filled:
    """Two calculator groups of two demonstrated episodes (the first trained by two steps with
    metrics, advantages and trainer logprobs), a bad episode, a running and a failed one."""
    run_id = await store.ensure_run(
        "demo",
        {"engine": {"model": tokenizer_dir}, "rollout": {"env": "calculator", "env_kwargs": {}}},
    )
    filled = Filled(url="", run_id=run_id)
    for g in range(2):
        task, _ = await play("calculator", g)
        task_id = await store.add_task(run_id, "calculator", task.id, task.data)
        group, episodes = await store.admit_group(
            run_id, task_id, "calculator", 2, seeds=[10 * g, 10 * g + 1]
        )
        for i, episode in enumerate(episodes):
            _, transcript = await play("calculator", g, seed=10 * g + i)
            await write_transcript(store, episode, transcript, tokenizer, version=0, seed=episode)
        assert await store.complete_group(group, filter_reason=None) == "ready"
        filled.groups.append(group)
        filled.calculator += episodes
    script = iter(
        [
            '<tool_call>{"name": "calc"',
            '<tool_call>{"name":"calc","arguments":{"expression":"2**9"}}</tool_call>',
            "I think 7",
        ]
    )

    async def bad_policy(messages: list) -> str:
        return next(script)

    task, transcript = await play("calculator", 5, policy=bad_policy)
    _, filled.bad = await add_episode(store, run_id, "calculator", task, transcript, tokenizer)
    task, transcript = await play("calculator", 6)
    _, filled.running = await add_episode(
        store, run_id, "calculator", task, transcript, tokenizer, finish=False
    )
    task_id = await store.add_task(run_id, "calculator", "broken", {"question": "?"})
    _, (filled.failed,) = await store.admit_group(run_id, task_id, "calculator", 1)
    await store.start_episode(filled.failed, "test-runner")
    await store.fail_episode(
        filled.failed, "EngineError", "the engine at 127.0.0.1:1 refused the connection"
    )
    # Two trainer steps: the first trains the first group (advantages, trainer logprobs).
    claim = await store.claim(run_id, "trainer", 1)
    assert claim.group_ids == [filled.groups[0]]
    staleness = {}
    for e in claim.episode_ids:
        stream = await store.episode_tokens(e)
        await store.record_trainer_logprobs(e, stream.logprobs - 0.01 * stream.loss_mask)
        # As the trainer records it: the step trains from version 0.
        staleness[e] = stale(0, stream.versions[stream.versions >= 0])
    await store.commit(
        claim,
        run_id,
        step=1,
        version=1,
        metrics={"loss": 0.5, "reward": {"mean": 1.0}},
        advantages={e: 0.0 for e in claim.episode_ids},
        staleness=staleness,
    )
    empty = await store.claim(run_id, "trainer", 0)
    await store.commit(
        empty,
        run_id,
        step=2,
        version=2,
        metrics={"loss": 0.25, "reward": {"mean": 0.5}, "phase": "warmup"},
    )
    return filled
