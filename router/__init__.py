"""The metadata-preserving router between episode runners and SGLang workers.

It forwards SGLang-native and OpenAI-compatible requests with every byte intact both ways,
balances them (least outstanding, session affinity with bounded load, round robin), keeps
workers healthy (health checks, quarantine, circuit breaker, safe retries, timeouts), fans
control operations out to every worker, and exports Prometheus metrics and OpenTelemetry spans.
It knows nothing of the trajectory store or the trainer.

    from router import Router
    async with Router(config.router, workers=[engine_url]) as router:
        router.url, router.admin_token
"""

from __future__ import annotations

from router.app import Router

__all__ = ["Router"]
