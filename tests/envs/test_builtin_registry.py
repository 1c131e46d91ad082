"""Every built-in environment: registered as builtin, valid tool schemas, a demonstration."""

from __future__ import annotations

import pytest

from agent_rl import make
from agent_rl.sdk import registry

BUILTINS = ("calculator", "search-qa", "python-math", "code-tests")


@pytest.mark.parametrize("env_id", BUILTINS)
def test_builtin_env_is_complete(env_id: str) -> None:
    assert registry.spec(env_id).source == "builtin"
    env = make(env_id)
    assert env.env_id == env_id and env.has_demonstration()
    assert env.needs_sandbox == (env_id in ("python-math", "code-tests"))
    for split in ("train", "eval"):
        tasks = env.task_source(split).take(3, seed=0)
        assert len({t.id for t in tasks}) == 3 and tasks == env.task_source(split).take(3, seed=0)
    schemas = env.tool_schemas()
    assert schemas
    for schema in schemas:
        assert schema["type"] == "function"
        fn = schema["function"]
        assert fn["name"] and fn["description"]
        params = fn["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert set(params["required"]) <= set(params["properties"])
        assert all(p.get("description") for p in params["properties"].values())
