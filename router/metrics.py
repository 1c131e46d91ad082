"""Prometheus metrics and OpenTelemetry spans of the router.

Metrics live in a registry owned by one router instance (not the process-global one), so several
routers in one process (tests, an embedded router beside other services) never collide.
Spans follow the OpenTelemetry GenAI naming (`gen_ai.operation.name` and a span named after the
operation); the router extracts the caller's W3C `traceparent` and injects its own span's
context into the upstream request, so a worker's trace continues the caller's. With no tracer
provider configured the OpenTelemetry API is a no-op and the caller's `traceparent` is forwarded
unchanged.
"""

from __future__ import annotations

from typing import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import ProxyTracerProvider, Span, SpanKind, Tracer, TracerProvider
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Proxied paths -> GenAI operation names; anything else is reported under its path.
OPERATIONS = {
    "/generate": "generate",
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/v1/embeddings": "embeddings",
}

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics:
    """The router's counters, gauges and histograms, in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "agent_rl_router_requests", "Proxied requests by route and status code.",
            ["route", "code"], registry=r,
        )
        self.latency = Histogram(
            "agent_rl_router_request_seconds", "Time from receiving a request to its last byte sent.",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "agent_rl_router_in_flight", "Requests forwarded to a worker and not finished.",
            ["worker"], registry=r,
        )
        self.retries = Counter(
            "agent_rl_router_retries", "Requests re-sent to another worker after a failure that "
            "happened before any byte reached the first one.", ["worker"], registry=r,
        )
        self.upstream_errors = Counter(
            "agent_rl_router_upstream_errors", "Failed upstream requests by kind.",
            ["worker", "kind"], registry=r,
        )
        self.quarantines = Counter(
            "agent_rl_router_quarantines", "Times a worker was quarantined by failed health checks.",
            ["worker"], registry=r,
        )
        self.breaker_opens = Counter(
            "agent_rl_router_circuit_breaker_opens", "Times a worker's circuit breaker opened.",
            ["worker"], registry=r,
        )
        self.healthy = Gauge(
            "agent_rl_router_worker_healthy", "1 if the worker is not quarantined, else 0.",
            ["worker"], registry=r,
        )
        self._request_children: dict[tuple[str, int], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}

    def observe(self, route: str, code: int, seconds: float) -> None:
        """Count one finished request. Label children are cached: `labels()` takes a lock and
        builds a key on every call, a measurable share of the router's CPU per request."""
        key = (route, code)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(route, str(code))
        counter.inc()
        histogram = self._latency_children.get(route)
        if histogram is None:
            histogram = self._latency_children[route] = self.latency.labels(route)
        histogram.observe(seconds)

    def forget(self, worker: str) -> None:
        """Drop the per-worker gauges of a removed worker (counters keep their history)."""
        for gauge in (self.in_flight, self.healthy):
            try:
                gauge.remove(worker)
            except KeyError:
                pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RouterTracer:
    """Spans around forwarded requests, with W3C trace context in and out."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self._provider = provider
        self._tracer: Tracer | None = None

    def _current(self) -> Tracer | None:
        """The tracer, or None while no tracer provider is installed (spans would be no-ops).

        The global provider is looked up per request because an embedding process may install
        one after the router started; until then the router skips span bookkeeping entirely and
        the caller's traceparent travels on untouched with the other headers.
        """
        if self._tracer is not None:
            return self._tracer
        provider = self._provider or trace.get_tracer_provider()
        if isinstance(provider, ProxyTracerProvider):
            return None
        self._tracer = provider.get_tracer("agent_rl.router")
        return self._tracer

    def start(self, path: str, incoming: Mapping[str, str]) -> Span | None:
        """Start the span of one forwarded request, as a child of the caller's traceparent."""
        tracer = self._current()
        if tracer is None:
            return None
        operation = OPERATIONS.get(path, path)
        parent: Context = propagate.extract(incoming)
        return tracer.start_span(
            operation,
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={"gen_ai.operation.name": operation, "gen_ai.provider.name": "sglang"},
        )

    @staticmethod
    def inject(span: Span, outgoing: MutableMapping[str, str]) -> None:
        """Write the span's context as `traceparent` (and `tracestate`) into upstream headers."""
        propagate.inject(outgoing, context=trace.set_span_in_context(span))
