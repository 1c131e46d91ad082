"""A tiny verifiers environment whose `wait` task never ends by itself: its harness calls the
model once, then waits until it is cancelled (an env server killed under it, or the episode's
deadline). Its `once` task calls the model once and ends, scored by its completion tokens;
its `pause` task does too, 3 s after the call (a server stopped meanwhile must drain)."""

from __future__ import annotations

import asyncio

from openai import AsyncOpenAI

import verifiers.v1 as vf


class WaitData(vf.TaskData):
    wait: bool = False
    """Wait for cancellation after the model call."""
    pause_s: float = 0.0
    """Seconds to sleep after the model call before ending."""


class WaitTask(vf.Task[WaitData]):
    @vf.reward
    async def tokens(self, task: WaitData, trace: vf.Trace) -> float:
        return trace.num_output_tokens / 100


class WaitTaskset(vf.Taskset[WaitTask]):
    def load(self):
        yield WaitTask(WaitData(id="wait", prompt="Say hi.", wait=True), self.config.task)
        yield WaitTask(WaitData(id="once", prompt="Say hi."), self.config.task)
        yield WaitTask(WaitData(id="pause", prompt="Say hi.", pause_s=3.0), self.config.task)


class OnceHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        async with AsyncOpenAI(base_url=endpoint, api_key=secret) as client:
            await client.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": data.prompt}], max_tokens=6)
        if data.wait:
            await asyncio.Event().wait()
        await asyncio.sleep(data.pause_s)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["WaitTaskset", "OnceHarness"]
