"""What the whole-run quickstart tests share: one SFT.

`agent-rl quickstart --agent` warm-starts on the SDK run's demonstrations with the SDK run's
settings (test_dialects.py's `test_an_agent_runs_sft_is_the_sdk_runs`), so its base model and
SFT are the SDK run's: the SDK test keeps them, and the agent test, run after it (the two are
one `one_at_a_time` group, so one worker runs both, in file order), starts from them as a
resumed quickstart would, skipping about a minute of SFT. Run alone, it does its own SFT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agent_rl.app.quickstart.recipe import BASE_MODEL, SFT_MODEL, STATE_FILE


class SharedSFT:
    """A quickstart's base model and SFT, kept by one whole-run test for the next."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def keep(self, workdir: Path, sft_steps: int) -> None:
        for model in (BASE_MODEL, SFT_MODEL):
            shutil.copytree(workdir / model, self.root / model)
        (self.root / STATE_FILE).write_text(json.dumps({"sft": sft_steps}))

    def seed(self, workdir: Path, sft_steps: int) -> bool:
        """Start `workdir` from the kept SFT if one was kept at `sft_steps`; whether it was."""
        state = self.root / STATE_FILE
        if not state.is_file() or json.loads(state.read_text()) != {"sft": sft_steps}:
            return False
        for model in (BASE_MODEL, SFT_MODEL):
            shutil.copytree(self.root / model, workdir / model)
        shutil.copy(state, workdir / STATE_FILE)
        return True


@pytest.fixture(scope="session")
def shared_sft(tmp_path_factory: pytest.TempPathFactory) -> SharedSFT:
    return SharedSFT(tmp_path_factory.mktemp("quickstart-sft"))
