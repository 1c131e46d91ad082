"""The episode runner: one episode from reset to exactly one recorded terminal state.

Token-in, token-out: the conversation is carried as token ids (`render.Conversation`), each
generation is a `/generate` call with `input_ids` through the router, and every turn is
persisted as it completes with its span of tokens (new prompt/observation tokens with loss mask
0, then the completion with mask 1, its logprobs, the policy version of every token, and MoE
routed experts when asked). Tool calls run through the environment, in the episode's sandbox.

Outcomes: the env terminates or truncates -> `completed` with its reward; the runner's own
limits (turns, tokens, deadline, a completion cut at max_new_tokens) -> `completed` with reward
0 and the reason in the reward details, since running out of budget is the policy's doing; an
infrastructure or user-code error -> `failed` with its cause, never a reward.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from agent_rl import telemetry
from agent_rl.config import RolloutConfig
from agent_rl.engine.client import EngineClient, Generation
from agent_rl.env import Env, EnvCodeError, StepResult
from agent_rl.errors import EngineError, EngineUnavailableError, EnvError, SandboxError, StoreError
from agent_rl.messages import AssistantTurn, Message
from agent_rl.registry import make
from agent_rl.rollout.episode_env import episode_sandbox
from agent_rl.rollout.render import ChatRenderer, Conversation
from agent_rl.store import MessageRecord, Store, TokenArrays, ToolCallRecord, TurnRecord
from agent_rl.tasks import Task
from agent_rl.tool_calls import parse_completion

log = logging.getLogger(__name__)


@dataclass
class RunnerContext:
    """What every episode of a serve process shares."""

    store: Store
    client: EngineClient
    renderer: ChatRenderer
    cfg: RolloutConfig
    owner: str
    run_name: str
    model_name: str = "policy"
    sandbox_backend: Any = None
    """A tools_sandbox backend, for environments that need a sandbox."""
    routed_experts: bool = False
    """Ask the engine for MoE routed experts (routing replay)."""


@dataclass
class EpisodeResult:
    status: str
    """completed | failed."""
    reward: float | None = None
    cause: str | None = None


class _Finished(Exception):
    """Ends the turn loop with the episode's reward (raised from inside it)."""

    def __init__(self, reward: float, details: dict[str, Any]) -> None:
        self.reward, self.details = reward, details


def policy_version(label: str | None) -> int:
    """SGLang labels weights with strings; ours are integers ("default" is the initial 0)."""
    try:
        return int(label) if label is not None else 0
    except ValueError:
        return 0


class EpisodeRunner:
    def __init__(self, ctx: RunnerContext, episode_id: int, env_id: str, task: Task,
                 seed: int | None, env_kwargs: dict[str, Any] | None = None) -> None:
        self.ctx, self.episode_id, self.env_id = ctx, episode_id, env_id
        self.task, self.seed, self.env_kwargs = task, seed, env_kwargs or {}

    async def run(self) -> EpisodeResult:
        """Run the episode; returns how it ended (the store already says so)."""
        store = self.ctx.store
        await store.start_episode(self.episode_id, self.ctx.owner)
        with telemetry.invoke_agent(self.env_id, self.episode_id, self.ctx.run_name) as span:
            try:
                with anyio.fail_after(self.ctx.cfg.episode_timeout_s):
                    result = await self._run()
            except TimeoutError:
                result = await self._finish_truncated("deadline")
            except (EnvError, SandboxError, EngineError) as e:
                result = await self._fail(e)
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await self._record_failure("Interrupted", "interrupted: serve shut down")
                raise
            except StoreError:
                raise
            except Exception as e:  # a bug of ours: still one recorded state, with the traceback
                result = await self._fail(e)
            span.set_attribute("agent_rl.episode.status", result.status)
            return result

    async def _run(self) -> EpisodeResult:
        env: Env = make(self.env_id, **self.env_kwargs)
        async with episode_sandbox(env, self.ctx.sandbox_backend) as sandbox:
            first = await env.reset(self.task, self.seed, sandbox=sandbox)
            try:
                return await self._loop(env, list(first.messages), first.tools)
            except _Finished as done:
                return EpisodeResult("completed", done.reward)

    async def _loop(self, env: Env, messages: list[Message], tools: list[dict[str, Any]]) -> EpisodeResult:
        cfg = self.ctx.cfg
        conv = Conversation(self.ctx.renderer, tools)
        pending = conv.start(messages)  # ids not yet persisted (mask 0)
        new_messages: list[Message] = list(messages)
        drift = False
        for t in range(cfg.max_turns):
            budget = cfg.max_tokens - len(conv.ids)
            if budget <= 0:
                await self._persist_tail(pending, new_messages)
                raise _Finished(0.0, {"truncated": "max_tokens"})
            started = time.time()
            gen = await self._generate(conv.ids, min(cfg.max_new_tokens, budget), t, len(conv.ids) - len(pending))
            ids = gen.output_ids
            text = self.ctx.renderer.decode(ids)
            content = text[: -len(self.ctx.renderer.eos_text)] if text.endswith(self.ctx.renderer.eos_text) else text
            turn = parse_completion(content, id_prefix=f"call_{t}_")
            cut = gen.finish_reason is not None and gen.finish_reason.type == "length"
            result: StepResult | None = None
            if not cut:
                result = await env.step(turn)
            step_messages = [turn.to_message(), *(result.observations if result else [])]
            messages.extend(step_messages)
            new_messages.extend(step_messages)
            span = self._span(pending, gen)
            records = _tool_records(turn, result)
            finished = cut or (result is not None and (result.terminated or result.truncated))
            turn_record = TurnRecord(
                tokens=span, num_prompt_tokens=len(pending), started_at=started, finished_at=time.time(),
                messages=[_record(m) for m in new_messages], tool_calls=records,
                finish_reason=gen.finish_reason.type if gen.finish_reason else None, drift=drift,
            )
            if finished:
                reward = 0.0 if cut or result is None else result.reward
                details = {"truncated": "max_new_tokens"} if cut else _details(result)
                await self.ctx.store.append_turn(self.episode_id, turn_record, final_reward=reward,
                                                 reward_details=details)
                return EpisodeResult("completed", reward)
            await self.ctx.store.append_turn(self.episode_id, turn_record)
            new_messages = []
            pending, drift = conv.add_turn(ids, messages)
            if drift:
                log.warning("episode %d turn %d: carried tokens drifted from the chat template",
                            self.episode_id, t)
        await self._persist_tail(pending, new_messages)
        raise _Finished(0.0, {"truncated": "max_turns"})

    async def _generate(self, input_ids: list[int], max_new: int, turn: int, persisted: int) -> Generation:
        cfg = self.ctx.cfg
        # A 503 means no engine took the request (e.g. one restarting after a crash): nothing
        # was generated, so waiting and sending it again is safe; the episode deadline bounds it.
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(EngineUnavailableError),
            wait=wait_exponential_jitter(initial=0.5, max=5.0),
            stop=stop_after_delay(cfg.episode_timeout_s),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._generate_once(input_ids, max_new, turn, persisted)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _generate_once(self, input_ids: list[int], max_new: int, turn: int, persisted: int) -> Generation:
        cfg = self.ctx.cfg
        with telemetry.chat(self.ctx.model_name, max_new, cfg.temperature) as span:
            gen = await self.ctx.client.generate(
                input_ids,
                {"max_new_tokens": max_new, "temperature": cfg.temperature, "top_p": cfg.top_p,
                 **({"stop": cfg.stop} if cfg.stop else {})},
                rid=f"episode-{self.episode_id}-turn-{turn}-{time.monotonic_ns()}",
                return_logprob=True,
                return_routed_experts=self.ctx.routed_experts,
                routed_experts_start_len=persisted if self.ctx.routed_experts else 0,
            )
            reason = gen.finish_reason.type if gen.finish_reason else None
            telemetry.record_usage(span, len(input_ids), len(gen.output_ids), reason)
        if gen.aborted:
            raise EngineError(f"generation aborted by the engine: {gen.finish_reason}")
        if gen.logprobs is None or len(gen.logprobs) != len(gen.output_ids):
            raise EngineError("the engine returned no logprob for some generated tokens")
        return gen

    def _span(self, pending: list[int], gen: Generation) -> TokenArrays:
        """The turn's tokens: pending prompt ids (mask 0), then the completion (mask 1)."""
        n_prompt, n_out = len(pending), len(gen.output_ids)
        versions = np.full(n_out, policy_version(gen.weight_version), dtype=np.int32)
        for s in gen.weight_spans:
            versions[s.start : s.end] = policy_version(s.version)
        experts = None
        if gen.routed_experts is not None and gen.routed_experts.ndim == 3:
            rows = gen.routed_experts
            # SGLang returns experts for every position that was fed as input; the completion's
            # last token never was, so its row is unknown (-1) and replay leaves it free.
            missing = n_prompt + n_out - rows.shape[0]
            if missing > 0:
                rows = np.concatenate([rows, np.full((missing, *rows.shape[1:]), -1, np.int32)])
            experts = rows[: n_prompt + n_out]
        return TokenArrays.build(
            token_ids=[*pending, *gen.output_ids],
            logprobs=np.r_[np.zeros(n_prompt), np.asarray(gen.logprobs, dtype=np.float64)],
            loss_mask=np.r_[np.zeros(n_prompt), np.ones(n_out)],
            versions=np.r_[np.full(n_prompt, -1), versions],
            routed_experts=experts,
        )

    async def _persist_tail(self, pending: list[int], new_messages: list[Message]) -> None:
        """Nothing to persist as tokens past the last turn; observations stay as messages."""
        if new_messages:
            await self.ctx.store.add_messages(self.episode_id, [_record(m) for m in new_messages])

    async def _finish_truncated(self, why: str) -> EpisodeResult:
        with anyio.CancelScope(shield=True):
            await self.ctx.store.finish_episode(self.episode_id, 0.0, {"truncated": why})
        return EpisodeResult("completed", 0.0)

    async def _fail(self, e: BaseException) -> EpisodeResult:
        kind = next((b.__name__ for b in (EnvError, SandboxError, EngineError) if isinstance(e, b)),
                    type(e).__name__)
        if isinstance(e, EnvCodeError):
            cause = f"{e}\n{e.traceback}"
        elif isinstance(e, (EnvError, SandboxError, EngineError)):
            cause = str(e)
        else:
            cause = "".join(traceback.format_exception(e))
        log.warning("episode %d failed: %s: %s", self.episode_id, kind, cause.splitlines()[0] if cause else "")
        await self._record_failure(kind, cause)
        return EpisodeResult("failed", cause=cause)

    async def _record_failure(self, kind: str, cause: str) -> None:
        try:
            await self.ctx.store.fail_episode(self.episode_id, kind, cause)
        except StoreError as e:  # already terminal (e.g. completed just before a cancel)
            log.info("episode %d: %s", self.episode_id, e)


def _record(m: Message) -> MessageRecord:
    calls = m.get("tool_calls")
    return MessageRecord(role=m["role"], content=m.get("content", ""),
                         tool_calls=list(calls) if calls else None, name=m.get("name"))


def _tool_records(turn: AssistantTurn, result: StepResult | None) -> list[ToolCallRecord]:
    if result is None:
        return []
    records = [
        ToolCallRecord(
            name=r.name, arguments=json.dumps(r.arguments),
            status="ok" if r.error is None else ("timeout" if r.error == "timeout" else "error"),
            output=r.output, duration_s=r.duration_s, sandbox_error=r.traceback,
        )
        for r in result.info.tool_results
    ]
    for r in result.info.tool_results:
        telemetry.execute_tool(r.name, r.call_id, r.started_at, r.duration_s, r.error)
    records += [
        ToolCallRecord(name="", arguments=m.raw, status="malformed", output=m.reason)
        for m in result.info.malformed
    ]
    return records


def _details(result: StepResult | None) -> dict[str, Any]:
    if result is None:
        return {}
    details: dict[str, Any] = {"terminated": result.terminated, "truncated": result.truncated}
    if result.info.reward is not None:
        details["reward"] = result.info.reward.model_dump(mode="json")
    return details
