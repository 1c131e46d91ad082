"""A tiny verifiers v1 environment, written against verifiers' public API only, for the tests
of the verifiers bridge: a taskset of two prompts and a harness that talks to the policy twice
(an answer, then "Again." and a second answer) through verifiers' interception endpoint.

The harness runs its loop in-process (the `Harness.launch` contract allows it as long as every
model call goes through the interception endpoint), so nothing is installed at run time. The
reward depends on what the engine produced (the completion tokens verifiers counted from the
usage it was given) and on the task's own data, so the stored reward can be checked against the
stored turns.
"""

from __future__ import annotations

from openai import AsyncOpenAI

import verifiers.v1 as vf

PROMPTS = [("Say hi.", 0.0), ("Count to three.", 0.25)]
"""(prompt, base reward) of each task."""
MAX_TOKENS = 6
"""Completion tokens per call."""


class EchoData(vf.TaskData):
    base: float = 0.0
    """Added to the reward: the task's own data reaches the score."""


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def tokens(self, task: EchoData, trace: vf.Trace) -> float:
        """Completion tokens of the episode's calls, over 100."""
        return trace.num_output_tokens / 100

    @vf.reward(weight=0.5)
    async def base(self, task: EchoData, trace: vf.Trace) -> float:
        return task.base * 2


class EchoTaskset(vf.Taskset[EchoTask]):
    def load(self):
        for i, (prompt, base) in enumerate(PROMPTS):
            yield EchoTask(EchoData(id=f"echo-{i}", prompt=prompt, base=base), self.config.task)


class TwiceHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        async with AsyncOpenAI(base_url=endpoint, api_key=secret) as client:
            messages = [{"role": "user", "content": data.prompt}]
            for follow_up in ("Again.", None):
                r = await client.chat.completions.create(
                    model=ctx.model, messages=messages, max_tokens=MAX_TOKENS)
                messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
                if follow_up is not None:
                    messages.append({"role": "user", "content": follow_up})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["EchoTaskset", "TwiceHarness"]
