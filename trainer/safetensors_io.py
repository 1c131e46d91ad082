"""safetensors files read and written one tensor at a time, so conversion of a big model never
holds a second copy of it.

`LazyWeights` is a mapping from the names of a model directory's files to their tensors that
reads a tensor from its file only when asked for it (`pop` reads and forgets it) into a tensor
of our own, mapping the file for that one copy: the library's `safe_open` keeps the file mapped
while it is open, and every page a read touches counts in the process's RSS until then, a
second copy of the model by the end of a load. `save_streaming` writes the safetensors format (an 8-byte
little-endian header length, the JSON header with each tensor's dtype, shape and byte range,
then the bytes) tensor by tensor, where the library's `save_file` wants them all in memory at
once, as separate tensors (views of one parameter, such as gate and up of a fused MLP weight,
must be copied apart first).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_NAMES = {v: k for k, v in _DTYPES.items()}
_WINDOW = 64 * 2**20  # bytes of a file mapped at a time


class LazyWeights(MutableMapping[str, torch.Tensor]):
    """The tensors of safetensors `files`, read when asked for; a name in several files is the
    first file's."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, tuple[Path, torch.dtype, list[int], int, int]] = {}
        for f in files:
            with f.open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(size))
            for name, meta in header.items():
                if name == "__metadata__" or name in self._where:
                    continue
                begin, end = meta["data_offsets"]
                self._where[name] = (f, _DTYPES[meta["dtype"]], meta["shape"],
                                     8 + size + begin, end - begin)  # fmt: skip

    def __getitem__(self, name: str) -> torch.Tensor:
        _, dtype, shape, _, _ = self._where[name]
        out = torch.empty(shape, dtype=dtype)
        self._read(name, out)
        return out

    def pop_stacked(self, names: list[str]) -> torch.Tensor | None:
        """`names` popped and concatenated on dim 0, each read straight into its rows of the
        result (no second copy, as torch.cat of the pieces would make); None where they do not
        stack (dtypes or trailing shapes differ) or one is missing."""
        if not names or any(n not in self._where for n in names):
            return None
        metas = [self._where[n] for n in names]
        dtype, rest = metas[0][1], metas[0][2][1:]
        if any(m[1] != dtype or m[2][1:] != rest or not m[2] for m in metas):
            return None
        out = torch.empty([sum(m[2][0] for m in metas), *rest], dtype=dtype)
        row = 0
        for n, m in zip(names, metas):
            self._read(n, out[row : row + m[2][0]])
            row += m[2][0]
            del self._where[n]
        return out

    def _read(self, name: str, out: torch.Tensor) -> None:
        # The file is mapped a window at a time, each unmapped after its copy, so its pages
        # leave the RSS with it (torch's copy from a map beat readinto's 2x on a 1B model).
        path, _, _, offset, nbytes = self._where[name]
        dst = out.reshape(-1).view(torch.uint8)
        with path.open("rb") as f:
            if offset + nbytes > os.fstat(f.fileno()).st_size:
                raise ValueError(f"{path}: truncated, {name} ends past the end of the file")
            done = 0
            while done < nbytes:
                start = (offset + done) // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
                skip = offset + done - start
                n = min(nbytes - done, _WINDOW - skip)
                with mmap.mmap(f.fileno(), skip + n, access=mmap.ACCESS_COPY, offset=start) as m:
                    src = torch.frombuffer(m, dtype=torch.uint8, count=n, offset=skip)
                    dst[done : done + n].copy_(src)
                    del src
                done += n

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        raise TypeError("LazyWeights is read-only: it maps names to tensors on disk")

    def __delitem__(self, name: str) -> None:
        del self._where[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._where))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """`name`'s shape, without reading it."""
        return tuple(self._where[name][2])

    def copy(self) -> LazyWeights:
        """The same names over the same files, forgotten apart."""
        out = LazyWeights([])
        out._where = dict(self._where)
        return out


def save_streaming(
    tensors: Mapping[str, torch.Tensor],
    path: str | Path,
    metadata: dict[str, str] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `tensors` (cast to `dtype` if given) as one safetensors file, each made contiguous
    and written in turn: views and tensors that share storage are fine."""
    names = sorted(tensors)
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in names:
        t = tensors[name]
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * kind.itemsize
        header[name] = {"dtype": _NAMES[kind], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the library writes it
    with Path(path).open("wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in names:
            t = tensors[name].detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            if t.numel():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
