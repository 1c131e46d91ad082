"""The episode runner: one episode from reset to exactly one recorded terminal state.

Token-in, token-out: the conversation is carried as token ids (`render.Conversation`), each
generation is a `/generate` call with `input_ids` through the router, and every turn is
persisted as it completes with its span of tokens (new prompt/observation tokens with loss mask
0, then the completion with mask 1, its logprobs, the policy version of every token, and MoE
routed experts when asked). Tool calls run through the environment, in the episode's sandbox.
The episode's start (waiting -> running, owned by this process) and each turn's write commit
while the next generation runs: the engine does not wait through the store's commits. Each
write is durable before anything that follows that generation (the next write, the episode's
end, a failure's record), so an episode's writes land in order, a crash loses at most the turn
being generated, and an episode another process started first is never generated on past its
first turn nor ended by this one.

Outcomes, every one written by `_end` (the episode's last turn and its terminal state in ONE
store transaction, `Store.end_episode`): the env terminates or truncates -> `completed` with its
reward; the runner's own limits (`max_turns`, `max_tokens`, a completion cut at
`max_new_tokens`, the deadline) -> `completed` with reward 0 and `truncated: <limit>` in the
reward details, since running out of budget is the policy's doing; an infrastructure or
user-code error -> `failed` with its cause, never a reward; cancellation -> `failed` as
interrupted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
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

from agent_rl.kernel import telemetry
from agent_rl.kernel.encoding import NO_EXPERT, NO_VERSION, policy_version
from agent_rl.config import RolloutConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.sglang.generation import Generation
from agent_rl.sdk.env import Env, EnvCodeError, StepResult
from agent_rl.kernel.errors import EngineError, EngineUnavailableError, EnvError, SandboxError, StoreError
from agent_rl.sdk.messages import AssistantTurn, Message
from agent_rl.sdk.registry import make
from agent_rl.rollout.episode_env import SandboxSource, episode_sandbox
from agent_rl.rollout.recorded import RecordedTurn, recorded_generation
from agent_rl.rollout.render import ChatRenderer, Conversation
from agent_rl.store import (
    EpisodeEnd,
    MessageRecord,
    Store,
    TokenArrays,
    ToolCallRecord,
    TurnRecord,
)
from agent_rl.sdk.tasks import Task
from agent_rl.sdk.tool_calls import parse_completion
from agent_rl.sdk.tools import ToolErrorKind

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
    sandboxes: SandboxSource | None = None
    """Where episodes of environments that need a sandbox get it (serve's `SandboxPool`)."""
    routed_experts: bool = False
    """Ask the engine for MoE routed experts (routing replay)."""


@dataclass
class EpisodeResult:
    status: str
    """completed | failed."""
    reward: float | None = None
    cause: str | None = None


class NotResumable(Exception):
    """Re-running a resumed episode's persisted turns did not reproduce what the store holds."""


class EpisodeRunner:
    """Runs one episode to exactly one recorded end (see the module docstring).

    `prefix` turns are answered from their records instead of the engine, exactly as the engine
    produced them: a fork copies its parent's first turns (and persists them as its own); a
    resumed episode (`resume=True`) re-runs the turns it already persisted before its serve
    died, checking that the environment gives back the stored observations and the chat
    template the stored prompt tokens, and then generates on from where it stopped.
    """

    def __init__(self, ctx: RunnerContext, episode_id: int, env_id: str, task: Task,
                 seed: int | None, env_kwargs: dict[str, Any] | None = None, *,
                 prefix: list[RecordedTurn] | None = None, resume: bool = False) -> None:  # fmt: skip
        self.ctx, self.episode_id, self.env_id = ctx, episode_id, env_id
        self.task, self.seed, self.env_kwargs = task, seed, env_kwargs or {}
        self.prefix, self.resume = prefix or [], resume
        self._next_write: Callable[[], Awaitable[Any]] | None = None
        """The episode's next write, not yet submitted (its start, or its last completed
        turn): it commits during the next generation, or before the end."""
        self.started = False
        """Started in the store by this process: by `run` (`_start`), or already at its
        admission (`Store.admit_task(start=...)`, the scheduler sets it), when `run` does not
        start it again."""
        self.decide_group: int | None = None
        """The episode's group, to be decided with the episode's end, in its transaction, if no
        other episode of it is in flight then (set by the scheduler when nothing needs the
        group's episodes before its decision: `Store.end_episode_and_group`)."""
        self.group_status: str | None = None
        """The group's status once decided with the end; None if it was left open."""

    async def run(self) -> EpisodeResult:
        """Run the episode; returns how it ended (the store already says so)."""
        self._next_write = None if self.started else self._start
        with telemetry.invoke_agent(self.env_id, self.episode_id, self.ctx.run_name) as span:
            try:
                with anyio.fail_after(self.ctx.cfg.episode_timeout_s):
                    end = await self._run()
            except TimeoutError:
                end = _truncated("deadline")
            except NotResumable as e:
                end = EpisodeEnd("failed", error_type="Interrupted",
                                 error_cause=f"Interrupted: not resumable ({e})")
            except anyio.get_cancelled_exc_class():
                await self._end(EpisodeEnd("failed", error_type="Interrupted",
                                           error_cause="interrupted: serve shut down"))
                raise
            except StoreError:
                raise
            except Exception as e:  # env, sandbox, engine, or a bug of ours: with its cause
                end = _failure(e, self.episode_id)
            result = await self._end(end)
            span.set_attribute("agent_rl.episode.status", result.status)
            return result

    async def _end(self, end: EpisodeEnd) -> EpisodeResult:
        """Write the episode's end: the one place every exit goes through (shielded, so a
        cancellation cannot leave the episode without its terminal state)."""
        with anyio.CancelScope(shield=True):
            if self._next_write is not None:  # ended before the next generation: written first
                write, self._next_write = self._next_write, None
                try:
                    await write()
                except StoreError as e:
                    # Not started here (another process runs it): never ended here either.
                    if not self.started or end.error_type != "Interrupted":
                        raise
                    log.info("episode %d: %s", self.episode_id, e)
            try:
                if self.decide_group is None:
                    await self.ctx.store.end_episode(self.episode_id, end)
                else:
                    _, self.group_status = await self.ctx.store.end_episode_and_group(
                        self.episode_id, end, self.decide_group)
            except StoreError as e:
                if end.error_type != "Interrupted":
                    raise
                log.info("episode %d: %s", self.episode_id, e)  # already ended before a cancel
        if end.status == "completed":
            return EpisodeResult("completed", end.reward)
        return EpisodeResult("failed", cause=end.error_cause)

    async def _run(self) -> EpisodeEnd:
        env: Env = make(self.env_id, **self.env_kwargs)
        async with episode_sandbox(env, self.ctx.sandboxes) as sandbox:
            first = await env.reset(self.task, self.seed, sandbox=sandbox)
            return await self._loop(env, list(first.messages), first.tools)

    async def _loop(self, env: Env, messages: list[Message], tools: list[dict[str, Any]]) -> EpisodeEnd:
        cfg = self.ctx.cfg
        conv = Conversation(self.ctx.renderer, tools)
        pending = conv.start(messages)  # ids not yet persisted (mask 0)
        new_messages: list[Message] = list(messages)
        drift = False
        for t in range(cfg.max_turns):
            budget = cfg.max_tokens - len(conv.ids)
            if budget <= 0:  # the prompt alone fills the budget
                return _truncated("max_tokens", messages=[_record(m) for m in new_messages])
            started = time.time()
            params, asked = self._sampling(env, budget, t)
            gen = await self._while_writing(self._generate(conv.ids, params, t, pending))
            ids = gen.output_ids
            text = self.ctx.renderer.decode(ids)
            content = text[: -len(self.ctx.renderer.eos_text)] if text.endswith(self.ctx.renderer.eos_text) else text
            turn = parse_completion(content, id_prefix=f"call_{t}_")
            # Ending at a length the env asked for is the env's to judge; at a runner limit, a cut.
            cut = (gen.finish_reason is not None and gen.finish_reason.type == "length"
                   and not (asked is not None and params["max_new_tokens"] == asked))
            result = None if cut else await env.step(turn)
            step_messages = [turn.to_message(), *(result.observations if result else [])]
            messages.extend(step_messages)
            new_messages.extend(step_messages)
            record = TurnRecord(
                tokens=self._span(pending, gen), num_prompt_tokens=len(pending),
                started_at=started, finished_at=time.time(),
                messages=[_record(m) for m in new_messages], tool_calls=_tool_records(turn, result),
                finish_reason=gen.finish_reason.type if gen.finish_reason else None, drift=drift,
            )
            if self.resume and t < len(self.prefix):
                _check_observations(t, self.prefix[t], result)
                unwritten = None  # re-run: the store holds this turn already
            else:
                unwritten = record
            if result is None:  # cut at the token limit: never stepped
                cap = min(asked or cfg.max_new_tokens, cfg.max_new_tokens)
                why = "max_tokens" if params["max_new_tokens"] < cap else "max_new_tokens"
                return _truncated(why, turn=unwritten)
            if result.terminated or result.truncated:
                return EpisodeEnd("completed", reward=result.reward,
                                  reward_details=_details(result), turn=unwritten)
            if t + 1 == cfg.max_turns:
                return _truncated("max_turns", turn=unwritten, result=result)
            pending, drift = conv.add_turn(ids, messages, text=text)
            if drift:
                log.warning("episode %d turn %d: carried tokens drifted from the chat template",
                            self.episode_id, t)
            if len(conv.ids) >= cfg.max_tokens:
                return _truncated("max_tokens", turn=unwritten, result=result)
            if unwritten is not None:
                self._next_write = functools.partial(self.ctx.store.append_turn, self.episode_id, unwritten)
            new_messages = []
        raise AssertionError("unreachable: the last turn always ends the episode")  # pragma: no cover

    async def _start(self) -> None:
        await self.ctx.store.start_episode(self.episode_id, self.ctx.owner)
        self.started = True

    async def _while_writing(self, generation: Awaitable[Generation]) -> Generation:
        """`generation` while the episode's pending write commits (`while_writing`)."""
        pending, self._next_write = self._next_write, None
        if pending is None:
            return await generation
        return await while_writing(pending, generation)

    def _sampling(self, env: Env, budget: int, turn: int) -> tuple[dict[str, Any], int | None]:
        """The turn's sampling parameters (the rollout's, then the env's overrides) with
        `max_new_tokens` bounded by the rollout's limit and what remains of the episode's
        budget, and its seed when sampling is seeded; and the length the env asked for."""
        cfg = self.ctx.cfg
        params: dict[str, Any] = {"temperature": cfg.temperature, "top_p": cfg.top_p,
                                  **({"stop": cfg.stop} if cfg.stop else {}), **env.sampling_params()}
        asked = params.pop("max_new_tokens", None)
        asked = None if asked is None else int(asked)
        params["max_new_tokens"] = min(asked or cfg.max_new_tokens, cfg.max_new_tokens, budget)
        if cfg.seeded_sampling and self.seed is not None:
            params["sampling_seed"] = request_seed(self.seed, turn)
        return params, asked

    async def _generate(self, input_ids: list[int], params: dict[str, Any], turn: int,
                        pending: list[int]) -> Generation:  # fmt: skip
        """The turn's completion: from the engine, or from its record (a prefix turn)."""
        if turn < len(self.prefix):
            return self._recorded(turn, pending)
        persisted = len(input_ids) - len(pending)  # routed experts already known for these
        cfg = self.ctx.cfg
        try:  # the retry machinery costs a turn more CPU than the request: only after a refusal
            return await self._generate_once(input_ids, params, turn, persisted)
        except EngineUnavailableError as e:
            log.info("episode %d turn %d: no engine received the generation, sending it again "
                     "until one does: %s", self.episode_id, turn, e)
        # No engine received the request (the router's 503: none registered yet, say after the
        # router restarted, or one restarting after a crash; or the router itself could not be
        # connected to): nothing was generated, so waiting and sending it again is safe; the
        # episode deadline bounds it. A 502, a reset or a timeout is not retried: an engine may
        # have sampled tokens for it.
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(EngineUnavailableError),
            wait=wait_exponential_jitter(initial=0.5, max=5.0),
            stop=stop_after_delay(cfg.episode_timeout_s),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._generate_once(input_ids, params, turn, persisted)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _generate_once(self, input_ids: list[int], params: dict[str, Any], turn: int,
                             persisted: int) -> Generation:  # fmt: skip
        with telemetry.chat(self.ctx.model_name, params["max_new_tokens"], params["temperature"]) as span:
            gen = await self.ctx.client.generate(
                input_ids,
                params,
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
            # last token never was, so its row is NO_EXPERT and routing replay leaves it free.
            missing = n_prompt + n_out - rows.shape[0]
            if missing > 0:
                rows = np.concatenate([rows, np.full((missing, *rows.shape[1:]), NO_EXPERT, np.int32)])
            experts = rows[: n_prompt + n_out]
        logprobs = np.zeros(n_prompt + n_out)
        logprobs[n_prompt:] = gen.logprobs
        mask = np.zeros(n_prompt + n_out)
        mask[n_prompt:] = 1
        return TokenArrays.build(
            token_ids=[*pending, *gen.output_ids], logprobs=logprobs, loss_mask=mask,
            versions=np.concatenate([np.full(n_prompt, NO_VERSION, dtype=np.int32), versions]),
            routed_experts=experts,
        )

    def _recorded(self, turn: int, pending: list[int]) -> Generation:
        """Turn `turn` of the prefix, as the engine returned it when it was generated."""
        recorded = self.prefix[turn]
        if self.resume and pending != recorded.span.token_ids[: recorded.num_prompt].tolist():
            raise NotResumable(f"turn {turn} differs: its prompt tokens render differently")
        gen = recorded_generation(recorded, f"recorded-{self.episode_id}-{turn}")
        if len(pending) == recorded.num_prompt and self.ctx.routed_experts:
            gen.routed_experts = recorded.span.routed_experts  # same span: routing row for row
        return gen


async def while_writing(write: Callable[[], Awaitable[Any]], generation: Awaitable[Generation]) -> Generation:
    """`generation` while `write` commits; returns once both are done. The write is shielded (a
    write that began is finished, whatever cancels the generation); a failed write cancels the
    generation and is raised, as a write made before it would have been.

    The write runs as a bare asyncio task, which no cancel scope of the caller's reaches, and
    the generation in a cancel scope of its own that a failed write cancels, rather than both
    in an anyio task group, whose spawn and scopes cost CPU on every turn of every episode."""
    scope = anyio.CancelScope()
    done = anyio.Event()
    write_error: BaseException | None = None
    generating = True

    async def commit() -> None:
        nonlocal write_error
        try:
            await write()
        except Exception as e:
            write_error = e
            if generating:
                scope.cancel()
        finally:
            done.set()

    task = asyncio.get_running_loop().create_task(commit())
    gen_error: Exception | None = None
    gen: Generation | None = None
    try:
        with scope:
            gen = await generation
    except Exception as e:
        gen_error = e
    finally:
        generating = False
        if not task.done():
            with anyio.CancelScope(shield=True):
                await done.wait()
    if write_error is not None:
        raise write_error
    if gen_error is not None:
        raise gen_error
    assert gen is not None
    return gen


def request_seed(episode_seed: int, turn: int) -> int:
    """The sampling seed of one turn of a seeded episode (`rollout.seeded_sampling`)."""
    return (episode_seed * 1_000_003 + turn) % 2**62


def _check_observations(turn: int, recorded: RecordedTurn, result: StepResult | None) -> None:
    """Resume: the re-run step must give back the observations the store holds."""
    if recorded.observations is None:
        return
    observed = [] if result is None else list(result.observations)
    key = lambda m: (m["role"], m.get("content") or "", m.get("name"))  # noqa: E731
    if [key(m) for m in observed] != [key(m) for m in recorded.observations]:
        raise NotResumable(f"turn {turn} differs: the environment observed something else")


def _truncated(why: str, *, turn: TurnRecord | None = None, result: StepResult | None = None,
               messages: list[MessageRecord] | None = None) -> EpisodeEnd:  # fmt: skip
    """Ended by a budget (the policy's doing): completed with reward 0 and the reason."""
    details = {**_details(result), "truncated": why}
    return EpisodeEnd("completed", reward=0.0, reward_details=details, turn=turn,
                      messages=messages or [])


def _failure(e: BaseException, episode_id: int) -> EpisodeEnd:
    kind = next((b.__name__ for b in (EnvError, SandboxError, EngineError) if isinstance(e, b)),
                type(e).__name__)
    if isinstance(e, EnvCodeError):
        cause = f"{e}\n{e.traceback}"
    elif isinstance(e, (EnvError, SandboxError, EngineError)):
        cause = str(e)
    else:
        cause = "".join(traceback.format_exception(e))
    log.warning("episode %d failed: %s: %s", episode_id, kind, cause.splitlines()[0] if cause else "")
    return EpisodeEnd("failed", error_type=kind, error_cause=cause)


def _record(m: Message) -> MessageRecord:
    calls = m.get("tool_calls")
    return MessageRecord(role=m["role"], content=m.get("content", ""),
                         tool_calls=list(calls) if calls else None, name=m.get("name"))


def _tool_records(turn: AssistantTurn, result: StepResult | None) -> list[ToolCallRecord]:
    if result is None:
        return []
    records = [
        ToolCallRecord(
            # As the model wrote them; JSON of the parsed ones only when it wrote none.
            name=r.name, arguments=r.raw_arguments if r.raw_arguments is not None
            else json.dumps(r.arguments),
            status="ok" if r.error is None else ("timeout" if r.error == ToolErrorKind.TIMEOUT else "error"),
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
    details: dict[str, Any] = {"terminated": result.terminated,
                               "truncated": "env" if result.truncated else False}
    if result.info.reward is not None:
        details["reward"] = result.info.reward.model_dump(mode="json")
    return details
