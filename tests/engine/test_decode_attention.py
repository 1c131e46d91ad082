"""Shim 5 of agent_rl/engine/sglang_cpu: the CPU engine's decode attention gathers each request's
keys and values with index_select where SGLang's loop indexed the KV cache with a tensor (its
decode attention was 45% of the scheduler's time at 32 requests in flight), and computes the
same thing: checked against SGLang's own method in the engine environment, on a paged KV cache
with scattered slots, lengths from 1 to 4096, grouped-query attention, and a sliding window
(which keeps SGLang's path). A request's result does not depend on the batch it decodes in (bit
for bit), which seeded sampling and `agent-rl eval` reruns rely on; the engine tests run on it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from agent_rl.engine.install import engine_env, engine_python


def test_decode_attention_equals_sglang_s_and_is_batch_invariant(engine_venv: Path) -> None:
    script = Path(__file__).with_name("_decode_attention.py")
    env = dict(engine_env("cpu"), AGENT_RL_ENGINE_FAST_ATTENTION="0")  # SGLang's own at start
    run = subprocess.run([str(engine_python(engine_venv)), str(script)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    cases = [json.loads(line) for line in run.stdout.splitlines()]
    print("\n".join(map(str, cases)))
    assert len(cases) == 7  # 4 decode, 2 prefill, 2 passes on the same tensors
    for case in cases:
        assert case["finite"], case
        assert case["max_abs_diff"] <= 1e-5, case
        assert case["batch_invariant"], case
