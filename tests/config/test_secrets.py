"""Free-form secrets: the value of an option named like a secret in an argument list
(`engine.extra_args`, an agent's command) or a command line in one string is masked wherever the
config is dumped (`agent_rl.config.secrets`); options that only look alike are kept."""

from __future__ import annotations

from agent_rl.app.api.replay import env_kwargs_for
from agent_rl.config import Config
from agent_rl.config.secrets import MASK, redact, redact_args, redact_text

KEY = "sk-pl4nted"


def test_engine_extra_args_are_dumped_masked() -> None:
    cfg = Config(engine={"extra_args": ["--api-key", KEY, f"--hf-token={KEY}", "--max-tokens",
                                        "5", "--tokenizer-path", "t", "--port", "1"]})  # fmt: skip
    shown = cfg.model_dump(mode="json")["engine"]["extra_args"]
    assert shown == ["--api-key", MASK, f"--hf-token={MASK}", "--max-tokens", "5",
                     "--tokenizer-path", "t", "--port", "1"]  # fmt: skip
    assert cfg.engine.extra_args[1] == KEY  # the process keeps the value
    assert KEY not in cfg.model_dump_json()


def test_argument_lists_and_command_lines() -> None:
    # A secret option with no value before the next option keeps that option.
    assert redact_args(["--api-key", "--port", "1"]) == ["--api-key", "--port", "1"]
    assert redact_args(["-password", KEY]) == ["-password", MASK]
    line = (f"OPENAI_API_KEY={KEY} my-agent --admin-token '{KEY} x' --api-key={KEY} "
            "--max-tokens 5 max_tokens=7 --port 1")  # fmt: skip
    shown = redact_text(line, [])
    assert KEY not in shown
    assert shown == (f"OPENAI_API_KEY={MASK} my-agent --admin-token {MASK} --api-key={MASK} "
                     "--max-tokens 5 max_tokens=7 --port 1")  # fmt: skip
    nested = redact({"rollout": {"env_kwargs": {"command": ["agent", "--token", KEY],
                                                "line": f"agent --client-secret {KEY}"}}})  # fmt: skip
    assert KEY not in str(nested)
    assert nested["rollout"]["env_kwargs"]["command"] == ["agent", "--token", MASK]


def test_replay_takes_a_masked_command_from_its_own_config() -> None:
    """A recorded env kwarg with a secret masked in it is not what the run used: replay takes
    this process's value."""
    command = ["agent", "--api-key", KEY]
    cfg = Config(rollout={"env": "calculator", "env_kwargs": {"command": command, "n": 2}})
    recorded = cfg.model_dump(mode="json")
    assert recorded["rollout"]["env_kwargs"]["command"] == ["agent", "--api-key", MASK]
    assert env_kwargs_for(cfg, recorded, "calculator") == {"command": command, "n": 2}
