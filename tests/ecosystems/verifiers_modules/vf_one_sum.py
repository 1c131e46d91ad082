"""`vf_calculator` (agent-rl's verifiers taskset, on the verifiers `PYTHONPATH` by default) with
one row, the question the tests' memorized weights answer with a real `calc` call
(`tests/rollout/gateway_helpers.memorize_calculator`): its harness and reward unchanged."""

from __future__ import annotations

from vf_calculator import CalcData, CalcHarness, CalcTask, CalcTaskset


class OneSumTaskset(CalcTaskset):
    def load(self):
        yield CalcTask(CalcData(id="sum", prompt="What is 2+3?", expression="2+3", answer="5"),
                       self.config.task)


__all__ = ["OneSumTaskset", "CalcHarness"]
