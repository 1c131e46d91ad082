"""The agent gateway's episodes: each OpenAI chat-completions call becomes one recorded turn.

One `AgentSession` per running agent episode, reachable only under its own key
(`/agents/{key}/v1`, the key being the API key too). A call is rendered, generated and
persisted exactly as the episode runner does it for an SDK env (token-in/token-out through the
router with the episode as the session key, logprobs, the policy version of every token,
routed experts for MoE), and answered in OpenAI's shape with the tool calls parsed by
`agent_rl.sdk.tool_calls`:

- **Extension** (the usual case): the request's messages are the previous call's messages, its
  answer (as the gateway returned it), then new ones (tool results, user messages). The carried
  token ids are reused exactly, the answer's ids included, and only the new messages and the
  generation prompt are rendered and tokenized (`Conversation.add_turn`, with its drift check).
- **Rewrite**: anything else (history summarised, dropped or edited, other tools). The episode
  starts a new segment: the whole request is rendered as a fresh prompt, recorded on the turn
  (`num_prompt_tokens` covers it, `Turn.segment` numbers it), and the trainer trains each
  segment as a sequence of its own. Earlier answers the request keeps are rendered as the model
  wrote them. Segments and rewrites are counted in the episode's reward details.

Budgets are the rollout's: `max_turns` calls, `max_tokens` carried tokens, `max_new_tokens`
per call (a cut is an OpenAI `length` finish), the deadline. Once the turn or token budget is
spent a call is refused with a 400 saying so and the episode ends as that truncation (reward
0), whatever the agent does next. Calls after the episode ended get 409. One call runs at a
time per episode (concurrent ones wait their turn).

A call's turn is answered first and committed while the episode's next call generates (as the
runner does for an SDK env's turns), so no call waits for the store; writes land in order, the
last one when the episode closes, before its end. A write that fails fails the next call.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from agent_rl.kernel import telemetry
from agent_rl.sglang.generation import Generation
from agent_rl.kernel.errors import EngineError, EngineUnavailableError
from agent_rl.sdk.messages import AssistantTurn, Message
from agent_rl.rollout.openai_wire import (
    ChatRequest,
    FinishReason,
    GatewayError,
    chunk,
    completion_body,
    reply_message,
    same_message,
    to_message,
    tool_call,
)
from agent_rl.rollout.render import Conversation
from agent_rl.store import MessageRecord, ToolCallRecord, TurnRecord
from agent_rl.sdk.tool_calls import CLOSE, OPEN, parse_completion

from agent_rl.rollout.runner import request_seed, while_writing

if TYPE_CHECKING:
    from agent_rl.rollout.runner import EpisodeRunner

log = logging.getLogger(__name__)

ENDED_KEYS_KEPT = 100_000
"""Keys of ended episodes remembered, so that a late call gets 409 rather than 404."""


@dataclass
class _Prepared:
    """A call rendered and checked, ready to generate."""

    request: ChatRequest
    messages: list[dict[str, Any]]
    """The request's messages as sent."""
    internal: list[Message]
    """The same, as rendered (the model's own answers as it wrote them)."""
    new: list[Message]
    """The messages not recorded yet."""
    tools: list[dict[str, Any]]
    pending: list[int]
    """Prompt ids not persisted yet (mask 0)."""
    params: dict[str, Any]
    drift: bool
    started: float


class AgentSession:
    """One agent episode's side of the gateway (see the module docstring)."""

    def __init__(self, runner: EpisodeRunner, key: str, base_url: str) -> None:
        self.runner, self.key, self.base_url = runner, key, base_url
        self.ctx = runner.ctx
        self.calls = 0
        self.segments = 0
        self.rewrites = 0
        self.truncated: str | None = None
        """The budget that ended the episode (max_turns, max_tokens), once spent."""
        self.engine_error: str | None = None
        self.closed = False
        self._conv: Conversation | None = None
        self._history: list[dict[str, Any]] = []
        """The last call's messages as sent, and its answer as returned."""
        self._internal: list[Message] = []
        self._tools_key = ""
        self._answers: dict[str, Message] = {}
        """Every answer so far, by its OpenAI form's key, as the model wrote it."""
        self._last_ids: list[int] = []
        self._last_text = ""
        self._unwritten: TurnRecord | None = None
        """The last answered call's turn, committed during the next call's generation."""
        # A semaphore, not a lock: a streamed call starts in the request's task and goes on in
        # the response's, and a lock belongs to the task that took it.
        self._calls = anyio.Semaphore(1)
        self._write = anyio.Lock()

    @property
    def episode_id(self) -> int:
        return self.runner.episode_id

    def transcript(self) -> list[dict[str, Any]]:
        """The last call's conversation with its answer, in OpenAI's shape."""
        return [dict(m) for m in self._history]

    async def close(self) -> None:
        """Commit the last answered call's turn; no call is recorded from now on."""
        with anyio.CancelScope(shield=True):
            async with self._write:
                self.closed = True
                await self._commit()

    async def _commit(self) -> None:
        """Write the turn held back, if any (the caller holds `_write`)."""
        record, self._unwritten = self._unwritten, None
        if record is not None:
            await self.ctx.store.append_turn(self.episode_id, record)

    async def _while_writing(self, generation: Awaitable[Generation]) -> Generation:
        """`generation` while the previous call's turn commits (`runner.while_writing`)."""
        if self._unwritten is None:
            return await generation

        async def commit() -> None:
            async with self._write:
                await self._commit()

        return await while_writing(commit, generation)

    # ------------------------------------------------------------------ calls

    async def complete(self, req: ChatRequest) -> dict[str, Any]:
        """One non-streaming call: its OpenAI completion body."""
        async with self._calls:
            p = self._prepare(req)
            gen = await self._generate(p)
            turn, finish = await self._record(p, gen)
        message = reply_message(turn)
        logprobs = self._logprobs(gen) if req.logprobs else None
        return completion_body(_cid(self, gen), self._model(req), message, finish, logprobs,
                               self._usage(p, gen))  # fmt: skip

    async def stream(self, req: ChatRequest) -> AsyncIterator[dict[str, Any]]:
        """One streaming call: OpenAI chunks, the content as it is generated (text that may
        open a tool call is held back until it is known), then the tool calls, the finish
        reason and, with `stream_options.include_usage`, the usage."""
        async with self._calls:
            p = self._prepare(req)
            # Committed before the first chunk (a failure is then an error, not a cut stream):
            # a generator cannot hold a task group across its yields to overlap the two.
            with anyio.CancelScope(shield=True):
                async with self._write:
                    await self._commit()
            cid, model, sent, logged = f"chatcmpl-{self.episode_id}-{self.calls}", self._model(req), "", 0
            yield chunk(cid, model, {"role": "assistant", "content": ""})
            gen: Generation | None = None
            async for gen in self._generate_stream(p):
                visible = _streamable(self.ctx.renderer.decode(gen.output_ids), self.ctx.renderer.eos_text)
                logprobs = self._logprobs(gen, logged) if req.logprobs else None
                logged = len(gen.output_ids)
                if len(visible) > len(sent) or logprobs:
                    yield chunk(cid, model, {"content": visible[len(sent):]}, logprobs=logprobs)
                    sent = visible
            assert gen is not None  # the stream ends with a generation or raises
            turn, finish = await self._record(p, gen)
            message = reply_message(turn)
            content = message["content"] or ""
            delta: dict[str, Any] = {}
            if content.startswith(sent) and len(content) > len(sent):
                delta["content"] = content[len(sent):]
            if turn.tool_calls:
                delta["tool_calls"] = [{"index": i, **tool_call(c)} for i, c in enumerate(turn.tool_calls)]
            if delta:
                yield chunk(cid, model, delta)
            yield chunk(cid, model, {}, finish=finish)
            if (req.stream_options or {}).get("include_usage"):
                yield chunk(cid, model, {}, usage=self._usage(p, gen), choices=False)

    # ------------------------------------------------------------------ steps of a call

    def _prepare(self, req: ChatRequest) -> _Prepared:
        if self.closed:
            raise GatewayError(409, f"episode {self.episode_id} has ended: no more calls are "
                                    "recorded for it", code="episode_ended")  # fmt: skip
        cfg = self.ctx.cfg
        if self.truncated is None and self.calls >= cfg.max_turns:
            self.truncated = "max_turns"
        if self.truncated is not None:
            raise GatewayError(400, f"the episode's budget is spent ({self.truncated}: "
                                    f"{_limit(cfg, self.truncated)}); it ends truncated",
                               code="budget_exhausted")  # fmt: skip
        started = time.time()
        tools = req.function_tools()
        tools_key = json.dumps(tools, sort_keys=True)
        sent = req.messages
        names: dict[str, str] = {}
        n = len(self._history)
        extends = (self._conv is not None and tools_key == self._tools_key and len(sent) > n
                   and all(same_message(a, b) for a, b in zip(sent, self._history))
                   and all(m.get("role") != "assistant" for m in sent[n:]))  # fmt: skip
        if extends:
            assert self._conv is not None
            for m in self._history:
                _note_calls(m, names)
            new = [to_message(m, n + i, names) for i, m in enumerate(sent[n:])]
            internal = self._internal + new
            pending, drift = self._conv.add_turn(self._last_ids, internal, text=self._last_text)
        else:
            internal = []
            for i, m in enumerate(sent):
                ours = self._answers.get(_answer_key(m))
                internal.append(to_message(m, i, names) if ours is None else ours)
                _note_calls(m, names)
            new = list(internal)
            self._conv = Conversation(self.ctx.renderer, tools)
            pending, drift = self._conv.start(internal), False
            self.segments += 1
            self.rewrites += self.calls > 0
        budget = cfg.max_tokens - len(self._conv.ids)
        if budget <= 0:
            self.truncated = "max_tokens"
            raise GatewayError(400, f"the episode's token budget is spent (rollout.max_tokens = "
                                    f"{cfg.max_tokens}); it ends truncated", code="budget_exhausted")
        asked = req.max_completion_tokens or req.max_tokens
        params: dict[str, Any] = {
            "temperature": cfg.temperature if req.temperature is None else req.temperature,
            "top_p": cfg.top_p if req.top_p is None else req.top_p,
            "max_new_tokens": min(asked or cfg.max_new_tokens, cfg.max_new_tokens, budget),
        }
        if stops := [*cfg.stop, *req.stops()]:
            params["stop"] = stops
        if (constraint := req.tool_constraint()) is not None:
            params["structural_tag"] = constraint
        if req.seed is not None:
            params["sampling_seed"] = req.seed
        elif cfg.seeded_sampling and self.runner.seed is not None:
            params["sampling_seed"] = request_seed(self.runner.seed, self.calls)
        self._tools_key = tools_key
        return _Prepared(req, sent, internal, new, tools, pending, params, drift, started)

    def _options(self, p: _Prepared) -> dict[str, Any]:
        persisted = len(self._conv.ids) - len(p.pending) if self._conv else 0
        experts = self.ctx.routed_experts
        extra = {"top_logprobs_num": p.request.top_logprobs} if p.request.top_logprobs else None
        return dict(rid=f"agent-{self.episode_id}-call-{self.calls}-{time.monotonic_ns()}",
                    return_logprob=True, return_routed_experts=experts,
                    routed_experts_start_len=persisted if experts else 0,
                    routing_key=f"episode-{self.episode_id}", extra=extra)  # fmt: skip

    async def _generate(self, p: _Prepared) -> Generation:
        assert self._conv is not None
        with telemetry.chat(self.ctx.model_name, p.params["max_new_tokens"], p.params["temperature"]) as span:
            gen = await self._while_writing(self._engine(
                lambda: self.ctx.client.generate(self._conv.ids, p.params, **self._options(p))))  # type: ignore[union-attr]
            telemetry.record_usage(span, len(self._conv.ids), len(gen.output_ids),
                                   gen.finish_reason.type if gen.finish_reason else None)
        return self._checked(gen)

    async def _generate_stream(self, p: _Prepared) -> AsyncIterator[Generation]:
        assert self._conv is not None
        last: Generation | None = None
        try:
            async for last in self.ctx.client.stream(self._conv.ids, p.params, **self._options(p)):  # type: ignore[misc]
                yield last
        except EngineError as e:
            self.engine_error = str(e)
            raise GatewayError(502, f"the engine failed: {e}", type="server_error") from e
        if last is None:
            self.engine_error = "the engine's stream ended without a generation"
            raise GatewayError(502, self.engine_error, type="server_error")
        self._checked(last)

    async def _engine(self, call: Callable[[], Awaitable[Generation]]) -> Generation:
        """The engine's answer; a 503 (no engine took it, nothing generated) is sent again
        until the episode's deadline; any other engine failure is a 502 and fails the episode."""
        try:  # the retry machinery costs more CPU than the request: only after a 503
            return await call()
        except EngineUnavailableError:
            pass
        except EngineError as e:
            self.engine_error = str(e)
            raise GatewayError(502, f"the engine failed: {e}", type="server_error") from e
        retrying = AsyncRetrying(retry=retry_if_exception_type(EngineUnavailableError),
                                 wait=wait_exponential_jitter(initial=0.5, max=5.0),
                                 stop=stop_after_delay(self.ctx.cfg.episode_timeout_s), reraise=True)  # fmt: skip
        try:
            async for attempt in retrying:
                with attempt:
                    return await call()
        except EngineError as e:
            self.engine_error = str(e)
            raise GatewayError(502, f"the engine failed: {e}", type="server_error") from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _checked(self, gen: Generation) -> Generation:
        problem = None
        if gen.aborted:
            problem = f"generation aborted by the engine: {gen.finish_reason}"
        elif gen.logprobs is None or len(gen.logprobs) != len(gen.output_ids):
            problem = "the engine returned no logprob for some generated tokens"
        if problem is not None:
            self.engine_error = problem
            raise GatewayError(502, problem, type="server_error")
        return gen

    async def _record(self, p: _Prepared, gen: Generation) -> tuple[AssistantTurn, FinishReason]:
        """Persist the call as a turn, then remember it for the next one."""
        assert self._conv is not None
        renderer = self.ctx.renderer
        ids = gen.output_ids
        text = renderer.decode(ids)
        content = text[: -len(renderer.eos_text)] if text.endswith(renderer.eos_text) else text
        turn = parse_completion(content, id_prefix=f"call_{self.calls}_")
        answer = turn.to_message()
        reply = reply_message(turn)
        record = TurnRecord(
            tokens=self.runner._span(p.pending, gen), num_prompt_tokens=len(p.pending),
            started_at=p.started, finished_at=time.time(),
            messages=[_record(m) for m in [*p.new, answer]], tool_calls=_tool_records(turn),
            finish_reason=gen.finish_reason.type if gen.finish_reason else None, drift=p.drift,
            segment=self.segments - 1,
        )  # fmt: skip
        if self.closed:  # `close` sets it before its last commit, so this turn would be lost
            raise GatewayError(409, f"episode {self.episode_id} ended during this call",
                               code="episode_ended")
        self._unwritten = record  # committed during the next call's generation, or by `close`
        self.calls += 1
        if p.drift:
            log.warning("episode %d call %d: carried tokens drifted from the chat template",
                        self.episode_id, self.calls - 1)
        self._history = [*p.messages, reply]
        self._internal = [*p.internal, answer]
        self._answers[_answer_key(reply)] = answer
        self._last_ids, self._last_text = list(ids), text
        length = gen.finish_reason is not None and gen.finish_reason.type == "length"
        if length and len(self._conv.ids) + len(ids) >= self.ctx.cfg.max_tokens:
            self.truncated = "max_tokens"
        finish: FinishReason = "length" if length else "tool_calls" if turn.tool_calls else "stop"
        return turn, finish

    # ------------------------------------------------------------------ shapes

    def _model(self, req: ChatRequest) -> str:
        return req.model or self.ctx.model_name

    def _usage(self, p: _Prepared, gen: Generation) -> dict[str, int]:
        assert self._conv is not None
        prompt = len(self._conv.ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(gen.output_ids),
                "total_tokens": prompt + len(gen.output_ids)}  # fmt: skip

    def _logprobs(self, gen: Generation, start: int = 0) -> list[dict[str, Any]]:
        """OpenAI's `logprobs.content` for output tokens from `start` on."""
        decode = self.ctx.renderer.decode
        tops = gen.meta_info.get("output_top_logprobs") or []
        out = []
        assert gen.logprobs is not None
        for i in range(start, len(gen.output_ids)):
            token = decode([gen.output_ids[i]])
            top = tops[i] if i < len(tops) and tops[i] else []
            out.append({
                "token": token, "logprob": gen.logprobs[i], "bytes": list(token.encode()),
                "top_logprobs": [{"token": (t := decode([int(x[1])])), "logprob": float(x[0]),
                                  "bytes": list(t.encode())} for x in top],
            })  # fmt: skip
        return out


def _note_calls(m: dict[str, Any], names: dict[str, str]) -> None:
    """Remember the tool names of a message's calls by id (tool messages name their tool)."""
    for c in m.get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names[str(c.get("id") or "")] = fn["name"]


def _cid(session: AgentSession, gen: Generation) -> str:
    return f"chatcmpl-{session.episode_id}-{session.calls - 1}"


def _answer_key(m: dict[str, Any]) -> str:
    """What identifies an answer the gateway gave, in the shape a client sends it back."""
    if m.get("role") != "assistant":
        return ""
    calls = [c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
    if calls:
        return "calls:" + ",".join(str(c) for c in calls)
    content = m.get("content")
    return "text:" + content.strip() if isinstance(content, str) else ""


def _streamable(text: str, eos: str) -> str:
    """The prefix of a completion that is surely content: before any tool-call tag, without a
    trailing piece that may be the start of one or of the end-of-turn text, and stripped as the
    final content is."""
    cut = min((i for i in (text.find(OPEN), text.find(CLOSE)) if i >= 0), default=len(text))
    text = text[:cut]
    for marker in (OPEN, CLOSE, eos):
        for k in range(min(len(marker), len(text)), 0, -1):
            if text.endswith(marker[:k]):
                text = text[:-k]
                break
    return text.strip() if text.strip() else ""


def _limit(cfg: Any, why: str) -> str:
    return {"max_turns": f"rollout.max_turns = {cfg.max_turns} calls",
            "max_tokens": f"rollout.max_tokens = {cfg.max_tokens} tokens"}.get(why, why)  # fmt: skip


def _record(m: Message) -> MessageRecord:
    calls = m.get("tool_calls")
    return MessageRecord(role=m["role"], content=m.get("content", ""),
                         tool_calls=list(calls) if calls else None, name=m.get("name"))


def _tool_records(turn: AssistantTurn) -> list[ToolCallRecord]:
    """The calls the model made; the agent runs them, so their outputs are the tool messages
    of the next call, not part of these records."""
    records = [ToolCallRecord(name=c.name, arguments=c.raw_arguments if c.raw_arguments is not None
                              else json.dumps(c.arguments)) for c in turn.tool_calls]  # fmt: skip
    return records + [ToolCallRecord(name="", arguments=m.raw, status="malformed", output=m.reason)
                      for m in turn.malformed]  # fmt: skip


class Gateway:
    """Every running agent episode's session, by key; the HTTP side is `gateway_app`."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.base_url = ""
        """Where the gateway listens (set by serve once it does)."""
        self._sessions: dict[str, AgentSession] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    def open(self, runner: EpisodeRunner) -> AgentSession:
        if not self.base_url:
            raise RuntimeError("the agent gateway is not listening yet")
        key = f"ep{runner.episode_id}-{secrets.token_urlsafe(24)}"
        session = AgentSession(runner, key, f"{self.base_url}/agents/{key}/v1")
        self._sessions[key] = session
        return session

    def forget(self, session: AgentSession) -> None:
        self._sessions.pop(session.key, None)
        self._ended[session.key] = None
        while len(self._ended) > ENDED_KEYS_KEPT:
            self._ended.popitem(last=False)

    def session(self, key: str) -> AgentSession:
        """The running episode of `key`: 409 once it ended, 404 for a key never given."""
        found = self._sessions.get(key)
        if found is not None:
            return found
        if key in self._ended:
            raise GatewayError(409, "this episode has ended: no more calls are recorded for it",
                               code="episode_ended")
        raise GatewayError(404, "no running episode has this key", code="episode_not_found")

    @property
    def running(self) -> int:
        return len(self._sessions)
