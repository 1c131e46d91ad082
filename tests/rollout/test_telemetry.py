"""Spans of the rollout path follow OpenTelemetry's GenAI conventions: one `invoke_agent` per
episode, a `chat` per generation, an `execute_tool` per tool call, with `gen_ai.*` attributes."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agent_rl.kernel import telemetry
from agent_rl.app.serve import serve
from tests.rollout.conftest import serve_config
from tests.rollout.fault_envs import register_fault_envs

pytestmark = pytest.mark.anyio


async def test_episode_generation_and_tool_spans(tmp_path: Path, sglang_moe_server, tiny_moe_model: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The global provider can be set once per process; the module's tracer lookup is pointed at
    # this test's provider instead.
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer(telemetry.TRACER_NAME))
    register_fault_envs()
    cfg = serve_config(f"sqlite:///{tmp_path / 'store.db'}", sglang_moe_server.url, tiny_moe_model,
                       env="test-tool-raises", stop=["e"])
    await serve(cfg, max_episodes=2)
    spans = exporter.get_finished_spans()
    by_op: dict[str, list] = {}
    for s in spans:
        by_op.setdefault(s.attributes.get("gen_ai.operation.name"), []).append(s)
    assert len(by_op["invoke_agent"]) == 2
    assert len(by_op["chat"]) >= 2 and len(by_op["execute_tool"]) >= 2
    agent = by_op["invoke_agent"][0]
    assert agent.attributes["gen_ai.agent.name"] == "test-tool-raises"
    chat = by_op["chat"][0]
    assert chat.attributes["gen_ai.usage.output_tokens"] > 0
    assert chat.parent is not None and chat.parent.span_id in {a.context.span_id for a in by_op["invoke_agent"]}
    tool = by_op["execute_tool"][0]
    assert tool.attributes["gen_ai.tool.name"] == "boom" and tool.attributes["error.type"] in ("exception", "tool_error")
    assert tool.end_time >= tool.start_time
    assert trace.get_tracer_provider() is not provider  # nothing leaked into the global state
