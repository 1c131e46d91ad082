"""`engine.speculative` / `agent-rl engine start --speculative`: SGLang's speculative decoding
with the model's own MTP draft. The flags are built for a GPU host and parsed by SGLang's own
argument parser in the engine environment (no GPU is needed to parse them; serving with them
is not run here: SGLang's CPU engine starts no speculative algorithm): a Qwen3-MoE's MTP draft
from the target's own directory, a dense model's EAGLE draft from its `draft/`. On CPU, and for
a model without a draft SGLang could serve, the engine refuses with one line before any
launch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent_rl.engine.launcher import EngineServer
from agent_rl.kernel.errors import EngineError
from tests._engine_scripts import EngineScripts

PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
print(json.dumps({k: v for k, v in vars(args).items() if k.startswith("speculative_")}))
"""


@pytest.fixture
def drafted_moe(tiny_moe_model: Path, tmp_path: Path) -> Path:
    """The tiny MoE with an `mtp.*` tensor in a second safetensors file (the launcher reads
    tensor names from the files' headers, as an export with `trainer.mtp.layers` has them)."""
    out = tmp_path / "drafted"
    shutil.copytree(tiny_moe_model, out)
    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, str(out / "mtp.safetensors"))
    return out


@pytest.fixture
def drafted_dense(tiny_dense_model: Path, tmp_path: Path) -> Path:
    """The tiny dense Qwen2 with an EAGLE draft directory as an export writes it (`draft/`,
    its config naming SGLang's `Qwen2ForCausalLMEagle`; trainer/hf_convert.py)."""
    out = tmp_path / "drafted-dense"
    shutil.copytree(tiny_dense_model, out)
    (out / "draft").mkdir()
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLMEagle"], num_hidden_layers=1)
    (out / "draft" / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_gpu_flags_parse_in_sglang(
    kind: str, drafted_moe: Path, drafted_dense: Path, engine_venv: Path, engine_scripts: EngineScripts
) -> None:
    model = drafted_moe if kind == "moe" else drafted_dense
    server = EngineServer(model, venv=engine_venv, device="cuda", speculative_steps=2)
    cmd = server.command("python")
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "EAGLE"
    proc = engine_scripts.run("-c", PARSE, *cmd[3:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed["speculative_algorithm"] == "EAGLE"
    # The MoE's MTP draft is served from the target's own dir, the dense one's from draft/.
    draft = model if kind == "moe" else model / "draft"
    assert parsed["speculative_draft_model_path"] == str(draft)
    assert (parsed["speculative_num_steps"], parsed["speculative_eagle_topk"],
            parsed["speculative_num_draft_tokens"]) == (2, 1, 3)  # fmt: skip
    plain = EngineServer(model, venv=engine_venv, device="cuda").command("python")
    assert not any(flag.startswith("--speculative") for flag in plain)


def _refusal(server: EngineServer) -> str:
    with pytest.raises(EngineError) as e:
        server.start()
    assert server.pid is None  # refused before a launch
    message = str(e.value)
    assert "\n" not in message
    return message


def test_refused_on_cpu_and_without_a_draft(
    drafted_moe: Path, tiny_moe_model: Path, tiny_dense_model: Path, engine_venv: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    cpu = _refusal(EngineServer(drafted_moe, venv=engine_venv, device="cpu", speculative_steps=3))
    assert cpu.startswith("speculative decoding needs a GPU")
    missing = _refusal(EngineServer(tiny_moe_model, venv=engine_venv, device="cuda",
                                    speculative_steps=3))  # fmt: skip
    assert "no mtp.* draft weights" in missing and "trainer.mtp.layers" in missing
    dense = _refusal(EngineServer(tiny_dense_model, venv=engine_venv, device="cuda",
                                  speculative_steps=3))  # fmt: skip
    assert "no EAGLE draft in draft/" in dense and "trainer.mtp.layers" in dense
    other = tmp_path / "mistral"  # an architecture no family in agent_rl.families is
    shutil.copytree(tiny_dense_model, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    unknown = _refusal(EngineServer(other, venv=engine_venv, device="cuda", speculative_steps=3))
    assert "is a MistralForCausalLM" in unknown and "Qwen2ForCausalLM" in unknown


def test_cli_refuses_speculative_on_cpu_in_one_line(drafted_moe: Path, tmp_path: Path) -> None:
    """This host has no GPU: `agent-rl engine start --speculative` exits 1 saying why."""
    proc = subprocess.run(
        [sys.executable, "-c", "from agent_rl.app.cli import main; main()", "engine", "start",
         "--model", str(drafted_moe), "--speculative", "--speculative-steps", "2"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and "speculative decoding needs a GPU" in errors[0], proc.stderr
    assert "engine ready" not in proc.stdout
