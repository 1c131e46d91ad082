"""What the gateway tests share: a tap between serve and the engine that keeps what the engine
saw and produced, and the checks every stored agent episode must pass against it.

The tap is a real HTTP hop on loopback (not a fake): it forwards every request to the real
SGLang server unchanged and keeps each `/generate`'s `input_ids` and the engine's `output_ids`,
so a test can compare the store with the engine's own answers.
"""

from __future__ import annotations

import contextlib
import json
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from agent_rl.rollout.render import ChatRenderer
from agent_rl.store import Store
from tests.rollout.invariants import check_transcript


class Tap:
    """A loopback proxy in front of one engine that records every generation."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.generations: list[tuple[list[int], list[int]]] = []
        """(input_ids, output_ids) of every /generate, in order of completion."""
        self.routing_keys: list[str | None] = []
        self.requests: list[tuple[dict[str, Any], dict[str, Any]]] = []
        """(request body, the engine's last answer) of every /generate, in order of completion."""
        self.fail_rids: set[str] = set()
        """Fault injection: a /generate whose rid starts with one of these is answered 500
        without reaching the engine (the prefix is then used up)."""
        self.url = ""

    def outputs_for(self, input_ids: list[int]) -> list[list[int]]:
        return [out for inp, out in self.generations if inp == input_ids]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/generate" and self.fail_rids:
            rid = str(json.loads(body).get("rid"))
            hit = next((p for p in self.fail_rids if rid.startswith(p)), None)
            if hit is not None:
                self.fail_rids.discard(hit)
                return web.Response(status=500, text="injected engine failure")
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with self._session.request(request.method, self.upstream + request.path_qs, data=body or None,
                                         headers=headers) as resp:  # fmt: skip
            generate = request.path == "/generate" and resp.status == 200
            sent = json.loads(body) if generate else {}
            if generate and sent.get("stream"):
                return await self._stream(request, resp, sent)
            payload = await resp.read()
            if generate:
                self._keep(sent, json.loads(payload), request)
            return web.Response(body=payload, status=resp.status,
                                content_type=resp.content_type if resp.content_type else None)  # fmt: skip

    async def _stream(self, request: web.Request, resp: Any, sent: dict[str, Any]) -> web.StreamResponse:
        """A streamed generation passed on as it comes (so the gateway sees its first tokens
        while the engine still writes), read to its end even when the gateway went away, so
        what the engine did with it (finished, aborted) is kept."""
        out = web.StreamResponse(status=resp.status, headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        last, gone = None, False
        async for line in resp.content:
            text = line.decode().strip()
            if text.startswith("data:") and "[DONE]" not in text:
                last = json.loads(text[len("data:"):])
            if not gone:
                try:
                    await out.write(line)
                except (ConnectionError, RuntimeError):
                    gone = True
        if last is not None and "output_ids" in last:
            self._keep(sent, last, request)
        if not gone:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await out.write_eof()
        return out

    def _keep(self, sent: dict[str, Any], out: dict[str, Any], request: web.Request) -> None:
        self.routing_keys.append(request.headers.get("X-SMG-Routing-Key"))
        self.generations.append((list(sent["input_ids"]), list(out["output_ids"])))
        self.requests.append((sent, out))

    @asynccontextmanager
    async def running(self):  # type: ignore[no-untyped-def]
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as self._session:
            try:
                yield self
            finally:
                await runner.cleanup()


async def check_agent_episode(store: Store, renderer: ChatRenderer, tap: Tap, episode_id: int,
                              tools: list[dict[str, Any]], *, experts: bool = True) -> None:  # fmt: skip
    """Tokens are the truth for an agent episode of one segment: every turn's completion is
    what the engine produced for exactly the carried prompt, the tokens decode to the
    transcript, one logprob and one version per model token, and the loss mask is exactly
    the model's tokens."""
    detail = await store.get_episode(episode_id)
    e = detail.episode
    tokens = await store.episode_tokens(episode_id)
    ids = tokens.token_ids.tolist()
    assert e.drift_count == 0, f"episode {episode_id} drifted"
    assert len(ids) == e.num_tokens == sum(t.num_tokens for t in detail.turns)
    for t in detail.turns:
        start, prompt_end, end = t.span_start, t.span_start + t.num_prompt_tokens, t.span_start + t.num_tokens
        # The engine saw the carried stream up to here, and produced exactly this completion.
        assert ids[start:end][t.num_prompt_tokens:] in tap.outputs_for(ids[:prompt_end]), \
            f"episode {episode_id} turn {t.index}: not the engine's output for its prompt"
        assert tokens.loss_mask[start:end].tolist() == [0] * t.num_prompt_tokens + [1] * (t.num_tokens - t.num_prompt_tokens)
    model = tokens.loss_mask == 1
    assert int(model.sum()) == e.num_model_tokens > 0
    assert np.all(np.isfinite(tokens.logprobs[model])) and np.all(tokens.logprobs[model] <= 0)
    assert np.all(tokens.versions[model] >= 0) and np.all(tokens.versions[~model] == -1)
    assert np.all(tokens.logprobs[~model] == 0)

    check_transcript(renderer, detail, tokens, tools)
    if experts:
        assert tokens.routed_experts is not None and tokens.routed_experts.shape[0] == len(ids)
        known = tokens.routed_experts[:, 0, 0] >= 0
        assert known.sum() >= len(ids) - len(detail.turns)


QUESTION = "What is 2+3?"
CALL_TEXT = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'
FINAL_TEXT = "The answer is 5."


def memorize_calculator(model_dir: Path, out_dir: Path, tool_sets: list[list[dict[str, Any]]]) -> Path:
    """`model_dir`'s weights fine-tuned (plain torch, a few dozen steps) until greedy decoding
    answers QUESTION, asked with any of `tool_sets`, with CALL_TEXT and, after the tool's "5",
    with FINAL_TEXT: a random tiny model never writes a tool call, and the tests need the
    engine itself to write real ones. Writes only the weights (what `update_weights_from_disk`
    loads) to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent_rl.rollout.render import encode_transcript

    if (out_dir / "config.json").is_file():
        return out_dir
    renderer = ChatRenderer(model_dir)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": CALL_TEXT},
                {"role": "tool", "content": "5", "name": "calc", "tool_call_id": "call_0_0"},
                {"role": "assistant", "content": FINAL_TEXT}]  # fmt: skip
    batch = []
    for tools in tool_sets:
        encoded = encode_transcript(renderer, messages, tools)  # type: ignore[arg-type]
        assert encoded is not None
        ids, mask = encoded
        x = torch.tensor([ids])
        labels = x.clone()
        labels[torch.tensor([mask]) == 0] = -100
        batch.append((x, labels))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    for _ in range(300):
        losses = [model(input_ids=x, labels=labels).loss for x, labels in batch]
        loss = torch.stack(losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if max(x.item() for x in losses) < 0.002:
            break
    model.save_pretrained(out_dir)
    return out_dir
