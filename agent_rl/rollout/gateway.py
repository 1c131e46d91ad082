"""The agent gateway's episodes: each call, in any of its dialects, becomes one recorded turn.

One `AgentSession` per running agent episode, reachable only under its own key
(`/agents/{key}/v1`, the key being the API key too). A call is rendered, generated and
persisted exactly as the episode runner does it for an SDK env (token-in/token-out through the
router with the episode as the session key, logprobs, the policy version of every token,
routed experts for MoE), and answered in the call's dialect with the tool calls parsed by
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

Budgets are the rollout's: `max_turns` calls, `max_tokens` tokens of the episode (all its
segments together: what is stored and trained), `max_new_tokens` per call (a cut is an OpenAI
`length` finish), the deadline. Once the turn or token budget is spent a call is refused with a
400 saying so and the episode ends as that truncation (reward 0), whatever the agent does next.
Calls after the episode ended get 409. One call runs at a time per episode (concurrent ones
wait their turn).

**Every call is atomic**: it completes and is kept (its turn recorded, the episode carrying its
answer), or it leaves the episode exactly as it was: carried tokens, history, segment, budgets,
call count (`_save` / `_restore`). So a stream the client closes, a client that times out (the
engine request is aborted: the app cancels the call when its client goes away), an engine error
and a request the engine refuses (a forced tool call's schema its constrained decoding cannot
compile: 400) leave nothing behind, and the next call's prompt is the kept calls' tokens.

Every dialect (OpenAI chat completions in `chat_completions`, Anthropic Messages in
`anthropic_wire`, OpenAI Responses in `responses_wire`) builds a `ChatRequest` and goes through
`answer` (not streamed) or `pieces` (streamed): one recording path, only the answer's shape
differs.

A call's turn is answered first and held in memory, and the held turns are written together
(`rollout.gateway_write_s`): during a call's generation once the oldest has waited that long or
they hold `HELD_TOKENS` tokens, and the rest with the episode's end, in its transaction. No call
waits for the store, writes land in order, and a write that fails fails the call it ran in (its
turns stay held for the next write, or the end's). An agent episode cannot be resumed
(`AgentEnv.resumable`): a crash fails it as interrupted whatever turns it kept, so holding them
loses nothing a write would have saved; only the store's view of a running episode lags. A
write per turn cost a commit, a task and a hop to the store's thread on every call
(bench/gateway.py: a call should cost serve what an SDK turn costs).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from agent_rl.kernel import telemetry
from agent_rl.sglang.generation import Generation
from agent_rl.kernel.errors import EngineError, EngineUnavailableError, StoreError
from agent_rl.sdk.messages import AssistantTurn, Message
from agent_rl.rollout.openai_wire import (
    ChatRequest,
    FinishReason,
    GatewayError,
    answer_key,
    message_key,
    note_calls,
    reply_message,
    streamable,
    to_message,
)
from agent_rl.rollout.render import Conversation
from agent_rl.store import MessageRecord, ToolCallRecord, TurnRecord
from agent_rl.sdk.tool_calls import parse_completion

from agent_rl.rollout.runner import request_seed, while_writing

if TYPE_CHECKING:
    from agent_rl.rollout.runner import EpisodeRunner

log = logging.getLogger(__name__)

ABORT_WAIT_S = 2.0
"""How long an abandoned call's abort may take before the gateway stops waiting for it."""

ENDED_KEYS_KEPT = 100_000
"""Keys of ended episodes remembered, so that a late call gets 409 rather than 404."""

HELD_TOKENS = 65_536
"""Tokens of held turns (`rollout.gateway_write_s`) past which they are written at the next
call, however recent: what an episode keeps in memory (routed experts included) stays bounded."""


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
    rid: str
    """The engine request's id (to abort it when the client goes away)."""
    known: int
    """How many of `messages` lead with the history kept (an extension's), whose keys are kept."""


@dataclass
class Answer:
    """A generated call, to be answered in its dialect's shape and kept."""

    prepared: _Prepared
    gen: Generation
    turn: AssistantTurn
    """The completion parsed: its text and tool calls."""
    reply: dict[str, Any]
    """`turn` as OpenAI's assistant message (`reply_message`), made once: the answer's body,
    the history the next call is compared with, and a Responses conversation share it."""
    finish: FinishReason
    record: TurnRecord
    text: str
    """The completion decoded, end-of-turn text included."""
    usage: dict[str, int]
    """OpenAI's usage: prompt (the whole carried prompt), completion and total tokens."""
    cid: str
    stop: str | None
    """The request's stop string the completion ended on, if it ended on one."""


@dataclass
class _Saved:
    """An episode's state before a call (`AgentSession._save`)."""

    conv: Conversation | None
    checkpoint: Any
    segments: int
    rewrites: int
    tools: list[dict[str, Any]] | None
    spent: int


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
        self._tools: list[dict[str, Any]] | None = None
        """The tools the carried segment was rendered with."""
        self._history_keys: list[tuple[Any, ...]] = []
        """`message_key` of each message of `_history`, to compare a request's against."""
        self._spent = 0
        """Tokens of the episode's earlier segments (`rollout.max_tokens` is the episode's)."""
        self._answers: dict[str, Message] = {}
        """Every answer so far, by its OpenAI form's key, as the model wrote it."""
        self._last_ids: list[int] = []
        self._last_text = ""
        self.responses: dict[str, list[dict[str, Any]]] = {}
        """The conversation of each Responses answer kept, by its id (`previous_response_id`)."""
        self._held: list[TurnRecord] = []
        """Kept calls' turns not written yet, in order (see the module docstring)."""
        # A semaphore, not a lock: a streamed call starts in the request's task and goes on in
        # the response's, and a lock belongs to the task that took it. fast_acquire: taking
        # one nobody holds (the usual case: an agent makes one call at a time) does not yield
        # to the event loop, a round of the loop saved per call.
        self._calls = anyio.Semaphore(1, fast_acquire=True)
        self._write = anyio.Lock(fast_acquire=True)

    @property
    def episode_id(self) -> int:
        return self.runner.episode_id

    def transcript(self) -> list[dict[str, Any]]:
        """The last call's conversation with its answer, in OpenAI's shape."""
        return [dict(m) for m in self._history]

    async def close(self) -> list[TurnRecord]:
        """No call is kept from now on. Returns the kept calls' turns not written yet (none
        once taken): the episode's end writes them with its terminal state, in one
        transaction. Turns being written meanwhile (during a call in flight) land first."""
        with anyio.CancelScope(shield=True):
            async with self._write:
                self.closed = True
                records, self._held = self._held, []
        return records

    def _write_due(self) -> bool:
        """Whether the held turns are to be written during this call (see the module docstring)."""
        if not self._held:
            return False
        return (time.time() - self._held[0].finished_at >= self.ctx.cfg.gateway_write_s
                or sum(len(r.tokens) for r in self._held) >= HELD_TOKENS)  # fmt: skip

    async def _commit(self) -> None:
        """Write the held turns, if any, in one transaction (the caller holds `_write`).

        Committed without its own fsync (`durable=False`: SQLite's `NORMAL`, which a crash of
        the process does not lose, unlike one of the machine): an agent's episode cannot be
        resumed, so after a machine crash it fails as interrupted whatever turns it kept, and
        the durable commit of its end makes every turn before it durable too (the WAL is
        written in order). The fsync is ~0.1 ms of CPU per commit (docs/benchmarks.md,
        bench/gateway.py)."""
        records, self._held = self._held, []
        if not records:
            return
        try:
            await self.ctx.store.append_turns(self.episode_id, records, durable=False)
        except BaseException as e:  # none of them landed: the next write, or the end's, takes them
            self._held[:0] = records
            if isinstance(e, StoreError):  # the client's call was fine: a 503 it may make again
                raise GatewayError(503, f"the store could not record this episode's earlier calls ({e}); "
                                        "this call was not kept and can be made again",
                                   type="server_error", code="store_unavailable") from e  # fmt: skip
            raise

    async def _while_writing(self, generation: Awaitable[Generation]) -> Generation:
        """`generation`, while the held turns are written if they are due (`runner.while_writing`)."""
        if not self._write_due():
            return await generation

        async def commit() -> None:
            async with self._write:
                await self._commit()

        return await while_writing(commit, generation)

    # ------------------------------------------------------------------ calls

    async def answer(self, req: ChatRequest) -> Answer:
        """One call, not streamed: generated, then kept (every dialect's recording path)."""
        async with self._calls:
            saved = self._save()
            try:
                p = self._prepare(req)
                answer = self._answer(p, await self._generate(p))
            except BaseException:
                self._restore(saved)
                raise
            self._keep(answer)
        return answer

    async def pieces(self, req: ChatRequest) -> AsyncIterator[Generation | Answer | None]:
        """One call, streamed (every dialect's recording path): None once the engine took it
        and produced its first piece (a refusal or failure raises before: budget, a bad
        message, a tool schema the engine's constrained decoding cannot compile, so it is an
        HTTP error rather than a cut stream), then the cumulative generations, then the
        `Answer`. The call is kept when the consumer asks for more after the `Answer` (once
        it sent the answer's last events); one closed before that leaves the episode as it
        was (`_save`)."""
        async with self._calls:
            saved, kept = self._save(), False
            try:
                p = self._prepare(req)
                # Written before the first chunk (a failure is then an error, not a cut stream):
                # a generator cannot hold a task group across its yields to overlap the two.
                if self._write_due():
                    with anyio.CancelScope(shield=True):
                        async with self._write:
                            await self._commit()
                gen: Generation | None = None
                async with aclosing(self._generate_stream(p)) as generations:
                    async for gen in generations:
                        yield gen
                assert gen is not None  # the stream ends with a generation or raises
                answer = self._answer(p, gen)
                yield answer
                self._keep(answer)
                kept = True
            finally:
                if not kept:
                    self._restore(saved)

    def prompt_tokens(self) -> int:
        """The carried prompt's length (during a call: the prompt it generates after)."""
        return len(self._conv.ids) if self._conv is not None else 0

    def visible(self, gen: Generation) -> str:
        """The part of a generation so far that is surely content (`openai_wire.streamable`)."""
        return streamable(self.ctx.renderer.decode(gen.output_ids), self.ctx.renderer.eos_text)

    def count_tokens(self, req: ChatRequest) -> int:
        """The tokens of `req` rendered as a fresh prompt (the episode is not touched)."""
        internal: list[Message] = []
        names: dict[str, str] = {}
        for i, m in enumerate(req.messages):
            ours = self._answers.get(answer_key(m))
            internal.append(to_message(m, i, names) if ours is None else ours)
            note_calls(m, names)
        renderer = self.ctx.renderer
        return len(renderer.encode(renderer.render(internal, req.function_tools())))

    # ------------------------------------------------------------------ atomic calls

    def _save(self) -> _Saved:
        """What a call changes before it is kept: the carried tokens (and the conversation
        they belong to), the segment and rewrite counts, the tools. A call that fails or is
        abandoned (the client went away, the engine failed or refused it) is undone with
        `_restore`, so the next call's prompt is the kept calls' tokens and nothing else."""
        conv = self._conv
        return _Saved(conv, conv.checkpoint() if conv is not None else None,
                      self.segments, self.rewrites, self._tools, self._spent)  # fmt: skip

    def _restore(self, saved: _Saved) -> None:
        self._conv = saved.conv
        if saved.conv is not None and saved.checkpoint is not None:
            saved.conv.restore(saved.checkpoint)
        self.segments, self.rewrites, self._tools = saved.segments, saved.rewrites, saved.tools
        self._spent = saved.spent

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
        sent = req.messages
        names: dict[str, str] = {}
        n = len(self._history)
        # Our side's keys are kept from the call before; a message passed on as it is (the
        # Responses API's `previous_response_id`) is ours by identity, and one sent back as we
        # gave it (the usual case) is equal as a dict, both cheaper than its key.
        extends = (self._conv is not None and tools == self._tools and len(sent) > n
                   and all(a is b or a == b or message_key(a) == k
                           for a, b, k in zip(sent, self._history, self._history_keys))
                   and all(m.get("role") != "assistant" for m in sent[n:]))  # fmt: skip
        if extends:
            assert self._conv is not None
            for m in self._history:
                note_calls(m, names)
            new = [to_message(m, n + i, names) for i, m in enumerate(sent[n:])]
            internal = self._internal + new
            pending, drift = self._conv.add_turn(self._last_ids, internal, text=self._last_text)
        else:
            internal = []
            for i, m in enumerate(sent):
                ours = self._answers.get(answer_key(m))
                internal.append(to_message(m, i, names) if ours is None else ours)
                note_calls(m, names)
            new = list(internal)
            if self._conv is not None:  # the segment that ends: its tokens count in the budget
                self._spent += len(self._conv.ids) + len(self._last_ids)
            self._conv = Conversation(self.ctx.renderer, tools)
            pending, drift = self._conv.start(internal), False
            self.segments += 1
            self.rewrites += self.calls > 0
        budget = cfg.max_tokens - self._spent - len(self._conv.ids)
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
        self._tools = tools
        rid = f"agent-{self.episode_id}-call-{self.calls}-{time.monotonic_ns()}"
        return _Prepared(req, sent, internal, new, tools, pending, params, drift, started, rid, n if extends else 0)

    def _options(self, p: _Prepared) -> dict[str, Any]:
        persisted = len(self._conv.ids) - len(p.pending) if self._conv else 0
        experts = self.ctx.routed_experts
        extra = {"top_logprobs_num": p.request.top_logprobs} if p.request.top_logprobs else None
        return dict(rid=p.rid, return_logprob=True, return_routed_experts=experts,
                    routed_experts_start_len=persisted if experts else 0,
                    routing_key=f"episode-{self.episode_id}", extra=extra)  # fmt: skip

    async def _generate(self, p: _Prepared) -> Generation:
        assert self._conv is not None
        with telemetry.chat(self.ctx.model_name, p.params["max_new_tokens"], p.params["temperature"]) as span:
            try:
                gen = await self._while_writing(self._engine(
                    lambda: self.ctx.client.generate(self._conv.ids, p.params, **self._options(p))))  # type: ignore[union-attr]
            except anyio.get_cancelled_exc_class():
                await self._abort(p)
                raise
            telemetry.record_usage(span, len(self._conv.ids), len(gen.output_ids),
                                   gen.finish_reason.type if gen.finish_reason else None)
        return self._checked(gen)

    async def _generate_stream(self, p: _Prepared) -> AsyncIterator[Generation | None]:
        """None once the engine took the request and produced its first piece, then the
        cumulative generations; a refusal or failure raises before the None."""
        assert self._conv is not None
        last: Generation | None = None
        done = False
        try:
            async with aclosing(self.ctx.client.stream(self._conv.ids, p.params, **self._options(p))) as pieces:  # type: ignore[arg-type]
                async for last in pieces:
                    if last.aborted:
                        self._checked(last)
                    if not done:
                        done = True
                        yield None
                    yield last
        except EngineError as e:
            raise self._engine_failed(e) from e
        except (anyio.get_cancelled_exc_class(), GeneratorExit):
            if last is None or not last.finish_reason:
                with anyio.CancelScope(shield=True):
                    await self._abort(p)
            raise
        if last is None:
            self.engine_error = "the engine's stream ended without a generation"
            raise GatewayError(502, self.engine_error, type="server_error")
        self._checked(last)

    async def _abort(self, p: _Prepared) -> None:
        """Best effort: tell the engine to stop a generation nobody waits for any more (its
        connection is closed too, which SGLang notices on its own, within seconds)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(ABORT_WAIT_S):
            try:
                await self.ctx.client.abort(p.rid)
            except EngineError as e:  # a router without its admin token refuses it: no harm
                log.debug("episode %d: abort of %s: %s", self.episode_id, p.rid, e)

    async def _engine(self, call: Callable[[], Awaitable[Generation]]) -> Generation:
        """The engine's answer; a request no engine received (the router's 503, or the router
        not reachable: `EngineUnavailableError`) is sent again until the episode's deadline; a
        request the engine refuses (a tool schema its constrained decoding cannot compile) is a
        400; any other engine failure is a 502."""
        try:  # the retry machinery costs more CPU than the request: only after a refusal
            return await call()
        except EngineUnavailableError:
            pass
        except EngineError as e:
            raise self._engine_failed(e) from e
        retrying = AsyncRetrying(retry=retry_if_exception_type(EngineUnavailableError),
                                 wait=wait_exponential_jitter(initial=0.5, max=5.0),
                                 stop=stop_after_delay(self.ctx.cfg.episode_timeout_s), reraise=True)  # fmt: skip
        try:
            async for attempt in retrying:
                with attempt:
                    return await call()
        except EngineError as e:
            raise self._engine_failed(e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _engine_failed(self, e: Exception) -> GatewayError:
        message = str(e)
        if _refused_schema(message):
            return GatewayError(400, f"the engine's constrained decoding refused the forced tool "
                                     f"call's schema: {message}", param="tools")  # fmt: skip
        self.engine_error = message
        return GatewayError(502, f"the engine failed: {message}", type="server_error")

    def _checked(self, gen: Generation) -> Generation:
        problem = None
        if gen.aborted:
            why = gen.finish_reason.message if gen.finish_reason else None
            if why and _refused_schema(why):
                raise self._engine_failed(EngineError(why))
            problem = f"generation aborted by the engine: {gen.finish_reason}"
        elif gen.logprobs is None or len(gen.logprobs) != len(gen.output_ids):
            problem = "the engine returned no logprob for some generated tokens"
        if problem is not None:
            self.engine_error = problem
            raise GatewayError(502, problem, type="server_error")
        return gen

    def _answer(self, p: _Prepared, gen: Generation) -> Answer:
        """The call's answer and its turn record; nothing of the episode changes yet."""
        assert self._conv is not None
        renderer = self.ctx.renderer
        text = renderer.decode(gen.output_ids)
        content = text[: -len(renderer.eos_text)] if text.endswith(renderer.eos_text) else text
        turn = parse_completion(content, id_prefix=f"call_{self.calls}_")
        record = TurnRecord(
            tokens=self.runner._span(p.pending, gen), num_prompt_tokens=len(p.pending),
            started_at=p.started, finished_at=time.time(),
            messages=[_record(m) for m in [*p.new, turn.to_message()]], tool_calls=_tool_records(turn),
            finish_reason=gen.finish_reason.type if gen.finish_reason else None, drift=p.drift,
            segment=self.segments - 1,
        )  # fmt: skip
        length = gen.finish_reason is not None and gen.finish_reason.type == "length"
        finish: FinishReason = "length" if length else "tool_calls" if turn.tool_calls else "stop"
        prompt = len(self._conv.ids)
        usage = {"prompt_tokens": prompt, "completion_tokens": len(gen.output_ids),
                 "total_tokens": prompt + len(gen.output_ids)}  # fmt: skip
        matched = gen.finish_reason.matched if gen.finish_reason is not None else None
        stop = matched if isinstance(matched, str) and matched in p.params.get("stop", ()) else None
        return Answer(p, gen, turn, reply_message(turn), finish, record, text, usage,
                      f"chatcmpl-{self.episode_id}-{self.calls}", stop)  # fmt: skip

    def _keep(self, a: Answer) -> None:
        """The call is kept: its turn is held for the next commit, and the episode carries its
        answer. No await in here: a kept call is kept whole."""
        assert self._conv is not None
        p, gen, turn, record, text = a.prepared, a.gen, a.turn, a.record, a.text
        if self.closed:  # `close` took the last turn for the end already: this one would be lost
            raise GatewayError(409, f"episode {self.episode_id} ended during this call",
                               code="episode_ended")
        self._held.append(record)  # written during a later call's generation, or with the end
        self.calls += 1
        self.engine_error = None
        if p.drift:
            log.warning("episode %d call %d: carried tokens drifted from the chat template",
                        self.episode_id, self.calls - 1)
        answer = turn.to_message()
        reply = a.reply
        ids = gen.output_ids
        self._history = [*p.messages, reply]
        # An extension's leading messages match the history kept, key for key: only the new
        # ones and the answer are keyed.
        self._history_keys = [*self._history_keys[: p.known],
                              *(message_key(m) for m in self._history[p.known:])]
        self._internal = [*p.internal, answer]
        self._answers[answer_key(reply)] = answer
        self._last_ids, self._last_text = list(ids), text
        length = gen.finish_reason is not None and gen.finish_reason.type == "length"
        if length and self._spent + len(self._conv.ids) + len(ids) >= self.ctx.cfg.max_tokens:
            self.truncated = "max_tokens"


def _refused_schema(message: str) -> bool:
    """Whether an engine error is SGLang refusing the request's grammar (a forced tool call's
    schema that xgrammar cannot compile, e.g. a `$ref` to a missing definition): the client's
    request is at fault, not the engine."""
    return "grammar" in message.lower() and ("compile" in message.lower() or "invalid" in message.lower())


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
