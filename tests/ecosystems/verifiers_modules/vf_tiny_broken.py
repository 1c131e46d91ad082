"""`vf_tiny_echo` with a reward that raises: verifiers records the error on the trace, and the
episode must end failed with that cause (never scored)."""

from __future__ import annotations

import verifiers.v1 as vf
from vf_tiny_echo import PROMPTS, EchoData, EchoTask, TwiceHarness


class BrokenTask(EchoTask):
    @vf.reward
    async def tokens(self, task: EchoData, trace: vf.Trace) -> float:
        raise ValueError("the verifier broke")


class BrokenTaskset(vf.Taskset[BrokenTask]):
    def load(self):
        for i, (prompt, base) in enumerate(PROMPTS):
            yield BrokenTask(EchoData(id=f"broken-{i}", prompt=prompt, base=base), self.config.task)


__all__ = ["BrokenTaskset", "TwiceHarness"]
