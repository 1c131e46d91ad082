"""OpenAI's chat completions answered: a call made through the gateway's one recording path
(`AgentSession.answer` / `pieces`), answered as a completion or its stream of chunks, as
`anthropic_wire` and `responses_wire` answer theirs. The shapes are `openai_wire`'s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from agent_rl.rollout.openai_wire import ChatRequest, chunk, completion_body, logprobs_content, tool_call
from agent_rl.sglang.generation import Generation

if TYPE_CHECKING:
    from agent_rl.rollout.gateway import AgentSession


async def complete(session: AgentSession, req: ChatRequest) -> dict[str, Any]:
    """One chat-completions call, not streamed: its OpenAI completion body."""
    a = await session.answer(req)
    logprobs = logprobs_content(session.ctx.renderer.decode, a.gen) if req.logprobs else None
    return completion_body(a.cid, req.model or session.ctx.model_name, a.reply, a.finish, logprobs, a.usage)


async def stream(session: AgentSession, req: ChatRequest) -> AsyncIterator[dict[str, Any]]:
    """One chat-completions call, streamed: OpenAI chunks, the content as it is generated
    (text that may open a tool call is held back until it is known), then the tool calls,
    the finish reason and, with `stream_options.include_usage`, the usage."""
    cid, model = f"chatcmpl-{session.episode_id}-{session.calls}", req.model or session.ctx.model_name
    sent, logged = "", 0
    async with aclosing(session.pieces(req)) as pieces:
        async for piece in pieces:
            if piece is None:
                yield chunk(cid, model, {"role": "assistant", "content": ""})
            elif isinstance(piece, Generation):
                visible = session.visible(piece)
                logprobs = logprobs_content(session.ctx.renderer.decode, piece, logged) if req.logprobs else None
                logged = len(piece.output_ids)
                if len(visible) > len(sent) or logprobs:
                    yield chunk(cid, model, {"content": visible[len(sent):]}, logprobs=logprobs)
                    sent = visible
            else:
                content = piece.reply["content"] or ""
                delta: dict[str, Any] = {}
                if content.startswith(sent) and len(content) > len(sent):
                    delta["content"] = content[len(sent):]
                if piece.turn.tool_calls:
                    delta["tool_calls"] = [{"index": i, **tool_call(c)} for i, c in enumerate(piece.turn.tool_calls)]
                if delta:
                    yield chunk(cid, model, delta)
                yield chunk(cid, model, {}, finish=piece.finish)
                if (req.stream_options or {}).get("include_usage"):
                    yield chunk(cid, model, {}, usage=piece.usage, choices=False)
