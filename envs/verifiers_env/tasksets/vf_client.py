"""The OpenAI client agent-rl's harnesses (`vf_calculator`, `vf_chat`) open per episode against
verifiers' interception endpoint, written against `openai` only (verifiers' pin, `openai<3`).

An `AsyncOpenAI` built with its default HTTP client makes a TLS context of its own, loading the
CA bundle: tens of milliseconds of CPU, for every episode of an env server that runs thousands
(the endpoint is plain HTTP on loopback: the context is never used). The clients share one,
made once per process.
"""

from __future__ import annotations

import ssl

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

TLS = ssl.create_default_context()


def interception_client(endpoint: str, secret: str) -> AsyncOpenAI:
    """A client of the episode's interception endpoint: no retries (a failed call is the
    episode's, as verifiers records it), the process's TLS context."""
    return AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0,
                       http_client=DefaultAsyncHttpxClient(verify=TLS))  # fmt: skip
