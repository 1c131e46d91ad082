"""OpenTelemetry spans of the rollout path, named by the GenAI semantic conventions.

One `invoke_agent` span per episode, a `chat` span per generation and an `execute_tool` span
per tool call (recorded after the fact from the call's own start time and duration), each with
`gen_ai.*` attributes. Nothing is exported unless configured: without a tracer provider the
OpenTelemetry API is a no-op. `configure(cfg)` installs a provider exporting to the console or
to an OTLP endpoint when `telemetry.exporter` asks for one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

TRACER_NAME = "agent_rl"


@cache
def tracer() -> trace.Tracer:
    """Made once: a span per generation asked the API for it every time. Before a provider is
    installed this is the API's proxy tracer, which follows the provider `configure` installs
    later."""
    return trace.get_tracer(TRACER_NAME)


def _no_op() -> bool:
    """Whether spans go nowhere: the tracer is still the API's proxy and no provider is set."""
    return isinstance(tracer(), trace.ProxyTracer) and isinstance(trace.get_tracer_provider(),
                                                                   trace.ProxyTracerProvider)


def configure(exporter: str | None) -> None:
    """Install a tracer provider: None/"none" (no-op, the default) or "console"."""
    if exporter in (None, "none"):
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter != "console":
        raise ValueError(f"unknown telemetry exporter {exporter!r}: use none or console")
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)


def _operation(operation: str, target: str, kind: SpanKind, attributes: dict[str, Any]) -> Any:
    """A current span named `{operation} {target}` (the conventions' span name)."""
    return tracer().start_as_current_span(
        f"{operation} {target}", kind=kind,
        attributes={"gen_ai.operation.name": operation, **attributes},
    )  # fmt: skip


@contextmanager
def invoke_agent(env_id: str, episode_id: int, run: str) -> Iterator[Span]:
    """The span of one episode."""
    attributes = {"gen_ai.agent.name": env_id, "gen_ai.conversation.id": str(episode_id),
                  "agent_rl.run": run}  # fmt: skip
    with _operation("invoke_agent", env_id, SpanKind.INTERNAL, attributes) as span:
        yield span


@contextmanager
def chat(model: str, max_tokens: int, temperature: float) -> Iterator[Span]:
    """The span of one generation (none while no tracer provider is installed: the API's
    no-op span and its context cost ~10 us per generation, for nothing)."""
    if _no_op():
        yield trace.INVALID_SPAN
        return
    attributes = {"gen_ai.request.model": model, "gen_ai.request.max_tokens": max_tokens,
                  "gen_ai.request.temperature": temperature}  # fmt: skip
    with _operation("chat", model, SpanKind.CLIENT, attributes) as span:
        yield span


def record_usage(span: Span, input_tokens: int, output_tokens: int, finish_reason: str | None) -> None:
    span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    if finish_reason:
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason])


def execute_tool(name: str, call_id: str, started_at: float, duration_s: float, error: str | None,
                 attributes: dict[str, Any] | None = None) -> None:
    """Record a finished tool call as a span with its real start and end times."""
    start_ns = int(started_at * 1e9)
    span = tracer().start_span(
        f"execute_tool {name}",
        kind=SpanKind.INTERNAL,
        start_time=start_ns,
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call_id,
            **(attributes or {}),
        },
    )
    if error:
        span.set_attribute("error.type", error)
    span.end(end_time=start_ns + int(duration_s * 1e9))
