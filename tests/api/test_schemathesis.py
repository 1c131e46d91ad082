"""schemathesis against /openapi.json of a live API on a filled store: every documented
operation, with generated parameters, answers without a 5xx and as its schema says (status
codes, content types, response bodies). Bounded: a few examples per operation.

Operations are driven with Hypothesis directly (schemathesis's pytest plugin does not load
under this pytest). The event stream is left out: for a running episode it never ends, by
design; its own tests cover it."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.api.conftest import LiveServer

EXAMPLES = 15


def test_api_conforms_to_its_schema(live_server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{live_server.url}/openapi.json")
    schema = schema.exclude(path_regex=r"/events$")
    failures: dict[str, str] = {}
    tested = []
    for result in schema.get_all_operations():
        operation = result.ok()
        tested.append(operation.label)

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:  # type: ignore[no-untyped-def]
            # A cursor is opaque: only one from a previous page is valid, which no schema can
            # say, so a made-up one is rightly refused with 400 (the test below checks that).
            made_up_cursor = bool(case.query and case.query.get("cursor") is not None)
            case.call_and_validate(
                excluded_checks=[positive_data_acceptance] if made_up_cursor else []
            )

        try:
            check()
        except BaseExceptionGroup as e:  # schemathesis's FailureGroup: one report per operation
            failures[operation.label] = f"{type(e).__name__}: {e}"[:2000]
    assert len(tested) == 9, tested
    assert failures == {}


def test_a_made_up_cursor_is_a_400(live_server: LiveServer) -> None:
    import httpx

    r = httpx.get(f"{live_server.url}/api/v1/episodes", params={"cursor": "abc"})
    assert r.status_code == 400 and "invalid cursor" in r.json()["detail"]
