"""trainer.safetensors_io: what it writes the safetensors library reads back bit for bit, and
what the library writes it reads back the same, views of one storage and casts included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from trainer.safetensors_io import LazyWeights, save_streaming


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(6, 4, generator=g)
    return {
        "gate": fused[:3],  # views of one storage, as an export's gate/up are
        "up": fused[3:],
        "t": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
    }


def test_streamed_file_reads_back_in_the_library(tmp_path: Path) -> None:
    tensors = _tensors()
    save_streaming(tensors, tmp_path / "a.safetensors", {"format": "pt"})
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k


def test_streamed_cast_applies_to_floating_tensors_only(tmp_path: Path) -> None:
    tensors = _tensors()
    save_streaming(tensors, tmp_path / "a.safetensors", dtype=torch.bfloat16)
    back = LazyWeights([tmp_path / "a.safetensors"])
    assert back["ids"].dtype == torch.int64 and torch.equal(back["ids"], tensors["ids"])
    assert torch.equal(back["up"], tensors["up"].to(torch.bfloat16))


def test_lazy_reads_what_the_library_wrote(tmp_path: Path) -> None:
    tensors = {k: v.contiguous().clone() for k, v in _tensors().items()}
    save_file(dict(list(tensors.items())[:4]), str(tmp_path / "a.safetensors"))
    save_file({**dict(list(tensors.items())[4:]), "gate": torch.ones(1)},
              str(tmp_path / "b.safetensors"))  # fmt: skip
    lazy = LazyWeights([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert set(lazy) == set(tensors)
    assert lazy.shape("t") == (6, 4)
    for k, v in tensors.items():  # "gate" is the first file's
        assert torch.equal(lazy[k], v), k
    copy = lazy.copy()
    assert torch.equal(copy.pop("gate"), tensors["gate"])
    assert "gate" not in copy and "gate" in lazy
    with pytest.raises(TypeError):
        lazy["x"] = torch.ones(1)


def test_pop_stacked_reads_pieces_into_one_tensor(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    save_file({"gate": gate, "up": up, "other": torch.ones(2, 3)}, str(tmp_path / "a.safetensors"))
    lazy = LazyWeights([tmp_path / "a.safetensors"])
    assert lazy.pop_stacked(["gate", "other"]) is None  # trailing shapes differ
    assert lazy.pop_stacked(["gate", "missing"]) is None
    assert torch.equal(lazy.pop_stacked(["gate", "up"]), torch.cat([gate, up]))
    assert set(lazy) == {"other"}
