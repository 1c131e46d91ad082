"""A stand-in for a GPU engine: SGLang's native `/generate` protocol, scripted, fault-free.

It exists to measure what `serve` itself costs per turn (bench/serve_ceiling.py, and the test
that a turn's cost does not grow with the conversation): a CPU SGLang decodes a few hundred
tokens/s, which hides serve's own cost, and no GPU engine runs here. It is NOT an engine: it
computes nothing from the prompt. Each `/generate` answers the completion the caller scripted
for that turn (token ids, with a logprob per token, the weight version that "sampled" them and
a finish reason, shaped exactly as SGLang's `meta_info`), instantly or at `tokens_per_s` per
request. The turn is read from the runner's request id (`episode-E-turn-T-...`); a request
without one is turn 0. It also answers the probes a router and serve make (`/health`,
`/health_generate`, `/model_info`, `/v1/loads`).

Run it in a process of its own (`python -m agent_rl.testing.stand_in_engine --script FILE`), so that
its CPU is not counted as serve's, or in-process with `StandInEngine(...).start()` in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

_TURN = re.compile(r"-turn-(\d+)-")


class StandInEngine:
    """Answers turn t with `completions[min(t, len - 1)]` (token ids), then `eos_id`."""

    def __init__(self, completions: Sequence[Sequence[int]], eos_id: int, *,
                 tokens_per_s: float | None = None, weight_version: str = "0",
                 host: str = "127.0.0.1", port: int = 0) -> None:  # fmt: skip
        if not completions:
            raise ValueError("script at least one completion")
        self.eos_id = eos_id
        self.tokens_per_s = tokens_per_s
        self.weight_version = weight_version
        self.host, self.port = host, port
        self.requests = 0
        # The answers are built once: the stand-in should cost its host as little as it can.
        self._answers = [self._answer([*c, eos_id]) for c in completions]
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _answer(self, ids: list[int]) -> tuple[int, str, str]:
        logprobs = [[-0.5, t, None] for t in ids]
        # rid and prompt_tokens are spliced in per request.
        head = json.dumps({"text": "", "output_ids": ids})[:-1] + ', "meta_info": {"id": "'
        tail = json.dumps({
            "finish_reason": {"type": "stop", "matched": self.eos_id},
            "completion_tokens": len(ids), "cached_tokens": 0,
            "output_token_logprobs": logprobs, "weight_version": self.weight_version,
        })[1:] + "}"
        return len(ids), head, tail

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        rid = str(body.get("rid") or "")
        m = _TURN.search(rid)
        turn = int(m.group(1)) if m else 0
        n, head, tail = self._answers[min(turn, len(self._answers) - 1)]
        if self.tokens_per_s:
            await asyncio.sleep(n / self.tokens_per_s)
        prompt = len(body.get("input_ids") or ())
        text = f'{head}{json.dumps(rid)[1:-1]}", "prompt_tokens": {prompt}, {tail}'
        return web.Response(text=text, content_type="application/json")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stand-in", "is_generation": True,
                                  "weight_version": self.weight_version})

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({"loads": [{"num_running_reqs": 0, "num_waiting_reqs": 0}]})

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self.generate)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self.model_info)
        app.router.add_get("/v1/loads", self.loads)
        for path in ("/health", "/health_generate", "/flush_cache"):
            app.router.add_route("*", path, self.ok)
        return app

    async def start(self) -> StandInEngine:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> StandInEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def main(argv: list[str] | None = None) -> None:
    """Serve a script (JSON: {"completions": [[ids...], ...], "eos_id": N}) until killed;
    prints the URL once it listens."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--script", type=Path, required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens-per-s", type=float, default=None, help="per request; default instant")
    args = ap.parse_args(argv)
    script: dict[str, Any] = json.loads(args.script.read_text())

    async def run() -> None:
        engine = StandInEngine(script["completions"], int(script["eos_id"]),
                               tokens_per_s=args.tokens_per_s, port=args.port)
        await engine.start()
        print(engine.url, flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


if __name__ == "__main__":
    main()
