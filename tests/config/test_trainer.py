"""`[trainer]` and its sections (agent_rl/config/trainer.py): every flat key of before is
refused, from a TOML file, the environment and overrides alike, with a one-line error naming
the key to write instead; the new keys load; "ppo" is refused with what to write."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli_w

from agent_rl.config import load_config
from agent_rl.config.moved import TRAINER_MOVED
from agent_rl.config.trainer import TrainerConfig, WeightSyncConfig
from agent_rl.kernel.errors import ConfigError

# A value each old key accepted, so that nothing but the move can be the reason it is refused.
OLD_VALUES = {
    "loss_type": "grpo", "aggregation": "token-mean", "advantage_std_normalize": False,
    "distributed_optimizer": False, "mtp_detach": False, "mtp_train": False,
    "eval_cpu_idle": False, "mtp_objective": "kl", "weight_sync": "tensor",
    "router_url": "http://127.0.0.1:9", "eval_router_url": "http://127.0.0.1:9",
    "eval_env": "calculator", "eval_split": "eval", "weight_sync_host": "127.0.0.1",
}  # fmt: skip


def _old_value(key: str) -> object:
    return OLD_VALUES.get(key, 1)


@pytest.fixture(autouse=True)
def _no_config_around(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no ./agent-rl.toml
    monkeypatch.delenv("AGENT_RL_CONFIG", raising=False)


@pytest.mark.parametrize("old", sorted(TRAINER_MOVED))
def test_every_old_key_is_refused_with_its_new_name(
    old: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = TRAINER_MOVED[old]
    expected = f"trainer.{old} moved: write trainer.{new}"
    path = tmp_path / "old.toml"
    path.write_text(tomli_w.dumps({"trainer": {old: _old_value(old)}}))
    with pytest.raises(ConfigError) as file_error:
        load_config(path)
    assert str(file_error.value) == f"{expected} (in {path})"
    with pytest.raises(ConfigError, match="^" + _literal(expected)):
        load_config(trainer={old: _old_value(old)})
    monkeypatch.setenv(f"AGENT_RL_TRAINER__{old.upper()}", str(_old_value(old)))
    with pytest.raises(ConfigError) as env_error:
        load_config()
    assert str(env_error.value) == f"{expected} (in the environment (AGENT_RL_*))"
    assert "\n" not in str(env_error.value)


def test_the_new_key_of_every_old_one_exists() -> None:
    """Each table entry names a field that is there, so the message never sends a user to a
    key that is refused in turn."""
    for old, new in TRAINER_MOVED.items():
        section, _, field = new.split(" ")[0].partition(".")
        assert field in type(getattr(TrainerConfig(), section)).model_fields, old


def test_several_old_keys_are_named_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text(tomli_w.dumps({"trainer": {"adam_beta1": 0.5, "eval_every": 2}}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (
        "trainer.adam_beta1 moved: write trainer.optim.beta1; "
        f"trainer.eval_every moved: write trainer.eval.every (in {path})"
    )


def test_the_sections_load_from_toml_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "new.toml"
    path.write_text(tomli_w.dumps({"trainer": {
        "groups_per_step": 3,
        "optim": {"lr": 1e-4, "beta1": 0.8},
        "loss": {"policy_loss": "gspo", "advantage": "rloo", "kl_coef": 0.1},
        "parallel": {"tp": 2},
        "mtp": {"layers": 1, "objective": "tv"},
        "eval": {"every": 5},
        "sft": {"steps": 7},
        "weight_sync": {"mode": "tensor", "bucket_mb": 8.0},
    }}))  # fmt: skip
    monkeypatch.setenv("AGENT_RL_TRAINER__SFT__LR", "0.01")
    t = load_config(path).trainer
    assert (t.groups_per_step, t.optim.lr, t.optim.beta1, t.optim.beta2) == (3, 1e-4, 0.8, 0.99)
    assert (t.loss.policy_loss, t.loss.advantage, t.loss.kl_coef) == ("gspo", "rloo", 0.1)
    assert (t.parallel.tp, t.parallel.pp, t.mtp.layers, t.mtp.objective) == (2, 1, 1, "tv")
    assert (t.eval.every, t.sft.steps, t.sft.lr) == (5, 7, 0.01)
    assert (t.weight_sync.mode, t.weight_sync.bucket_mb) == ("tensor", 8.0)


def test_defaults_are_those_of_before() -> None:
    t = TrainerConfig()
    assert (t.optim.lr, t.optim.beta2, t.optim.grad_clip) == (3e-5, 0.99, 1.0)
    assert (t.loss.policy_loss, t.loss.advantage, t.loss.tis_cap) == ("grpo", "grpo", 2.0)
    assert (t.loss.clip_eps_low, t.loss.clip_eps_high) == (0.2, 0.28)
    assert (t.eval.every, t.eval.nice, t.sft.demos, t.weight_sync.mode) == (0, 10, 4096, "disk")
    assert (t.weight_sync.timeout_s, t.parallel.distributed_optimizer) == (60.0, True)


def test_ppo_is_refused_with_what_to_write(tmp_path: Path) -> None:
    path = tmp_path / "ppo.toml"
    path.write_text(tomli_w.dumps({"trainer": {"loss": {"policy_loss": "ppo"}}}))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"invalid value for 'trainer.loss.policy_loss' in {path}: "
                                   '"ppo" was removed')
    assert 'write trainer.loss.policy_loss = "grpo"' in str(e.value)


def test_a_section_given_as_a_model_is_not_a_moved_key() -> None:
    """`weight_sync` is both an old key and a section: given the section (a table, or the model
    itself, as Python callers do), it is the section."""
    section = WeightSyncConfig(mode="tensor")
    assert TrainerConfig(weight_sync=section).weight_sync.mode == "tensor"
    assert TrainerConfig(weight_sync={"mode": "tensor"}).weight_sync == section


def test_a_section_given_a_plain_value_is_an_invalid_value(tmp_path: Path) -> None:
    """`optim = 1` is not a moved key (only `weight_sync = "disk"` was a key of its own)."""
    with pytest.raises(ConfigError, match="invalid value for 'trainer.optim'"):
        load_config(trainer={"optim": 1})


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_the_quickstart_recipe_writes_the_sections(tmp_path: Path) -> None:
    """The TOML `agent-rl quickstart` writes loads, with its learning rates in their sections."""
    from agent_rl.app.quickstart.recipe import Options, write_or_load

    t = write_or_load(tmp_path, Options(sft_steps=7)).trainer
    assert (t.optim.lr, t.sft.lr, t.sft.batch_size, t.sft.steps) == (1e-4, 3e-3, 32, 7)


def test_every_field_of_every_section_has_a_docstring() -> None:
    """The string under each field is its documentation (agent_rl/config/base.py)."""
    import ast

    import agent_rl.config.trainer as module

    tree = ast.parse(Path(module.__file__).read_text())
    fields = 0
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                fields += 1
                after = body[i + 1] if i + 1 < len(body) else None
                doc = after.value if isinstance(after, ast.Expr) else None
                name = f"{cls.name}.{ast.unparse(node.target)}"
                assert isinstance(doc, ast.Constant) and isinstance(doc.value, str), name
    # the 61 of before, stale_siblings and keep_checkpoints, and the seven sections
    assert fields == 63 + 7
