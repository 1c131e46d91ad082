"""The quickstart's recipe: options, and the config every process of the run reads.

The first run writes `agent-rl.toml` into the working directory (every `agent-rl` command run
there picks it up: `agent-rl episodes list`, `agent-rl api`...) and later runs read it back, so
a resumed run keeps its settings, ports and admin token; edit it to change the recipe.

Why these numbers (measured on 2 CPU cores; see the README's quickstart section):
- `calculator` with a deliberately imperfect teacher (`teacher_tool_rate`): half the
  demonstrations answer by mental math, which the small student cannot imitate, so SFT leaves a
  policy that uses the tool about half the time; RL then discovers that the tool pays.
- `tools_in_prompt = false`: the tool's JSON schema would be ~80% of every sequence.
- the `quickstart` model preset (1M parameters; `--family` puts another family's tiny preset at
  its size), SFT at lr 3e-3 on 32 transcripts a step,
  RL at lr 1e-4 (3e-4 and up made the tiny policy collapse in the shared notes' runs).
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, field_validator

from agent_rl.config import Config, load_config
from agent_rl.kernel.errors import ConfigError

CONFIG_FILE = "agent-rl.toml"
STATE_FILE = "quickstart.json"
RUN_NAME = "quickstart"
ENV_ID = "calculator"
ENV_KWARGS: dict[str, Any] = {
    "teacher_tool_rate": 0.5, "tools_in_prompt": False, "min_terms": 3, "max_terms": 3,
    "max_digits": 1, "max_turns": 3,
}
AGENT_ENV_ID = "calculator-agent"
"""`--agent`: the same tasks, solved by envs/calculator_agent's plain-`openai` agent through the
gateway. Its prompts are the SDK env's token for token (no tool schemas, the same call and
tool-message format), so the calculator's demonstrations warm-start it."""
AGENT_ENV_IDS = {"chat": AGENT_ENV_ID, "responses": "calculator-agent-responses",
                 "messages": "calculator-agent-anthropic"}  # fmt: skip
"""`--agent --dialect`: the same agent written against the gateway's other dialects
(envs/calculator_agent/dialects.py: `responses.create`, Anthropic's client)."""
AGENT_CLIENTS = {"chat": "openai", "responses": "openai", "messages": "anthropic"}
"""The client library each dialect's agent is written with (the `[agents]` extra installs them)."""
AGENT_ENV_KWARGS: dict[str, Any] = {
    "tools_in_prompt": False, "min_terms": 3, "max_terms": 3, "max_digits": 1, "max_turns": 3,
}
VERIFIERS_ENV_KWARGS: dict[str, Any] = {
    "config": {"taskset": {"min_terms": 3, "max_terms": 3, "max_digits": 1}},
    "splits": {"eval": {"taskset": {"seed": 1}}},
    "demonstrations": ENV_ID, "demonstration_kwargs": ENV_KWARGS,
}  # fmt: skip
"""`--env verifiers:vf_calculator`: the calculator written as a verifiers v1 taskset and harness
(envs/verifiers_env/tasksets/vf_calculator.py), run in a verifiers env server of its own. Its
harness shows the model what the calculator env does, so the calculator's demonstrations
warm-start it (its `demonstrations`); its eval split is the taskset's rows of another seed."""
MODEL_PRESET = "quickstart"
MODEL_SIZE = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size")  # fmt: skip
"""The quickstart model's dimensions, which `--family` gives that family's tiny preset: about the
same compute per token, so the recipe's steps and learning rates carry over."""
BASE_MODEL = Path("runs/model")
SFT_MODEL = Path("runs/sft")


class Options(BaseModel):
    """What `agent-rl quickstart` is asked to do (its command-line options)."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    sft_steps: int = Field(default=400, ge=1)
    rl_steps: int = Field(default=80, ge=1)
    """RL optimizer steps in total (a resumed run trains up to this many)."""
    rl_minutes: float = Field(default=5.0, gt=0)
    """Wall-clock bound of the RL stage in this run; it stops earlier at `rl_steps`."""
    eval_tasks: int = Field(default=64, ge=2)
    eval_samples: int = Field(default=4, ge=1)
    cluster: bool = False
    """Cluster mode, on PostgreSQL: the RL stage's two engines, router, two serves and trainer
    placed on a local Ray cluster by `agent-rl launch` (on_ray.py), which restarts what dies;
    SFT and the evaluations (two engines) stay under the quickstart's own supervisor."""
    store_url: str | None = None
    """Store URL (cluster mode needs PostgreSQL); unset: SQLite in the working directory."""
    agent: bool = False
    """Train the calculator agent written with the `openai` client (`calculator-agent`,
    through serve's gateway) instead of the SDK's `calculator` env."""
    dialect: Literal["chat", "responses", "messages"] = "chat"
    """With `agent`: the API the agent is written against (chat completions, Responses, or
    Anthropic's Messages)."""
    env: Literal["verifiers:vf_calculator"] | None = None
    """Train this environment of another ecosystem instead (`verifiers:vf_calculator`: the
    calculator as a verifiers taskset, in the verifiers environment `AGENT_RL_VERIFIERS_PYTHON`
    names, else the checkout's `.venv-verifiers`)."""
    family: str | None = None
    """The model's family (an HF `model_type` of agent_rl.families, e.g. `llama`, `glm4_moe`):
    its tiny preset at the quickstart model's size (`MODEL_SIZE`); unset: the `quickstart`
    preset (a qwen2). An MoE family's engines return their routed experts (R3)."""

    @field_validator("family")
    @classmethod
    def _has_a_preset(cls, family: str | None) -> str | None:
        if family is not None:
            try:
                base_model(family)
            except ConfigError as e:  # pydantic reports a ValueError as the option's error
                raise ValueError(str(e)) from e
        return family


def base_model(family: str | None) -> tuple[str, dict[str, Any]]:
    """The preset of the run's base model and the fields it overrides: the quickstart preset, or
    `family`'s first tiny preset at the quickstart model's size."""
    from agent_rl.models.presets import PRESETS

    if family is None:
        return MODEL_PRESET, {}
    named = [name for name, p in PRESETS.items() if p.architecture == family]
    if not named:
        having = sorted({p.architecture for p in PRESETS.values()})
        raise ConfigError(f"--family {family}: no tiny preset of that family; one of {', '.join(having)}")
    return named[0], PRESETS[MODEL_PRESET].model_dump(include=set(MODEL_SIZE))


def recipe(opts: Options, moe: bool = False) -> dict[str, Any]:
    """The config of a new quickstart run (TOML-ready); `moe`: the base model is an MoE, whose
    engines return the experts each token was routed to (R3: the trainer replays them)."""
    from agent_rl.engine.launcher import free_port  # httpx: kept off the CLI's import path

    store_url = opts.store_url or "sqlite:///agent_rl.db"
    if opts.env is not None:
        env, env_kwargs = opts.env, {**VERIFIERS_ENV_KWARGS, "python": verifiers_python()}
    elif opts.agent:
        env, env_kwargs = AGENT_ENV_IDS[opts.dialect], AGENT_ENV_KWARGS
    else:
        env, env_kwargs = ENV_ID, ENV_KWARGS
    return {
        "run": {"name": RUN_NAME},
        "store": {"url": store_url},
        "engine": {"model": str(BASE_MODEL), "log_dir": "runs/logs", "moe_routing_replay": moe},
        "router": {"port": free_port(), "admin_token": secrets.token_urlsafe(24)},
        "api": {"port": free_port()},
        "rollout": {
            "env": env, "env_kwargs": env_kwargs, "seed": opts.seed, "group_size": 8,
            "max_concurrent_episodes": 64, "max_turns": 3, "max_tokens": 512,
            "max_new_tokens": 48, "temperature": 1.0, "heartbeat_s": 2.0, "stale_after_s": 15.0,
        },  # fmt: skip
        "trainer": {
            "model": str(SFT_MODEL), "seed": opts.seed, "groups_per_step": 8,
            "micro_batch_size": 32, "max_staleness": 2, "export_every": 1, "checkpoint_every": 5,
            "claim_lease_s": 30.0, "data_poll_s": 0.5, "checkpoint_dir": "runs/checkpoints",
            "keep_checkpoints": 2, "export_dir": "runs/exports",
            "tensorboard_dir": "runs/tensorboard",
            "optim": {"lr": 1e-4},
            "sft": {"lr": 3e-3, "batch_size": 32, "steps": opts.sft_steps},
        },  # fmt: skip
    }


def sft_demonstrations(opts: Options, cfg: Config) -> tuple[str, dict[str, str]]:
    """The environment whose demonstrations the SFT stage trains on, and the settings its
    `agent-rl train --sft` process adds to the run's config (as AGENT_RL_* variables).

    An agent run's demonstrations are the SDK env's (an agent has no teacher): the calculator
    with the calculator's kwargs, the teacher's included (the environment's settings add to the
    file's), so an agent run's SFT is the SDK run's. A verifiers env names its own (its
    `demonstrations`)."""
    if opts.env is not None:
        return opts.env, {}
    if cfg.rollout.env != ENV_ID:
        return ENV_ID, {"AGENT_RL_ROLLOUT__ENV_KWARGS": json.dumps(ENV_KWARGS)}
    return ENV_ID, {}


def verifiers_python() -> str:
    """The verifiers environment's Python, as an absolute path (the recipe's processes run in
    the working directory): `AGENT_RL_VERIFIERS_PYTHON`, else this checkout's `.venv-verifiers`."""
    from envs.verifiers_env.env import PYTHON_VAR

    named = os.environ.get(PYTHON_VAR)
    python = Path(named) if named else Path(__file__).resolve().parents[3] / ".venv-verifiers/bin/python"
    if not python.is_file():
        raise ConfigError(f"--env verifiers:... needs a virtual environment with verifiers==0.4.0: "
                          f"set {PYTHON_VAR} to its Python (python -m venv .venv-verifiers && "
                          ".venv-verifiers/bin/pip install verifiers==0.4.0)")
    return str(python.absolute())


def check_agent_client(opts: Options) -> None:
    """`--agent`: the client its agent is written with must be installed, or every episode
    would fail on its import; said before anything starts."""
    if not opts.agent or opts.env is not None:
        return
    client = AGENT_CLIENTS[opts.dialect]
    try:
        importlib.import_module(client)
    except ImportError as e:
        raise ConfigError(f"--agent --dialect {opts.dialect}: the example agent is written with the "
                          f"{client} client, which is not installed ({e}): "
                          "pip install -e '.[agents]'") from e


def write_or_load(workdir: Path, opts: Options, moe: bool = False) -> Config:
    """The run's config: written on the first run (`recipe`), read back (and validated) afterwards."""
    path = workdir / CONFIG_FILE
    if not path.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "# Written by `agent-rl quickstart`; every agent-rl command run in this directory reads it.\n"
            + tomli_w.dumps(recipe(opts, moe))
        )
        path.chmod(0o600)  # it holds the router's admin token
    return load_config(path)
