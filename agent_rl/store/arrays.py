"""Token-level arrays of an episode span, stored as compact little-endian blobs.

Tokens are the truth: what the trainer reads back must be bit-for-bit what the engine produced.
Every array is encoded with an explicit little-endian dtype (`<i4`, `<f4`, `|u1`), so a blob
written on one machine decodes identically on any other; float32 logprobs keep -inf, NaN and
denormals exactly. Optional zlib compression trades CPU for row size.

numpy is imported where arrays are made, not with the module: the store's readers of summaries
(`agent-rl episodes list`, the API's listings) never touch a token array and should not pay
for loading it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike, NDArray

# numpy dtype strings (numpy takes them wherever it takes a dtype).
TOKEN_DTYPE = "<i4"
LOGPROB_DTYPE = "<f4"
MASK_DTYPE = "|u1"
VERSION_DTYPE = "<i4"
EXPERT_DTYPE = "<i4"

CODEC_RAW = "raw"
CODEC_ZLIB = "zlib"


@dataclass(frozen=True, eq=False)
class TokenArrays:
    """Aligned per-token arrays of one span of an episode's token stream.

    `loss_mask` is 1 on tokens the model produced and 0 on prompt and tool-observation tokens;
    `versions` holds the policy version that sampled each model token (`NO_VERSION`, -1,
    elsewhere); `routed_experts`, for MoE models, is `[tokens, layers, topk]` expert ids
    (`NO_EXPERT`, -1, where the engine reported none) or None. Both sentinels are defined in
    `agent_rl.kernel.encoding`.
    """

    token_ids: NDArray[np.int32]
    logprobs: NDArray[np.float32]
    loss_mask: NDArray[np.uint8]
    versions: NDArray[np.int32]
    routed_experts: NDArray[np.int32] | None = None

    @classmethod
    def build(
        cls,
        token_ids: ArrayLike,
        logprobs: ArrayLike,
        loss_mask: ArrayLike,
        versions: ArrayLike,
        routed_experts: ArrayLike | None = None,
    ) -> TokenArrays:
        """Validate shapes and coerce to the stored dtypes."""
        import numpy as np

        ids = np.ascontiguousarray(token_ids, dtype=TOKEN_DTYPE).reshape(-1)
        n = ids.shape[0]
        arrays = TokenArrays(
            token_ids=ids,
            logprobs=np.ascontiguousarray(logprobs, dtype=LOGPROB_DTYPE).reshape(-1),
            loss_mask=np.ascontiguousarray(loss_mask, dtype=MASK_DTYPE).reshape(-1),
            versions=np.ascontiguousarray(versions, dtype=VERSION_DTYPE).reshape(-1),
            routed_experts=None
            if routed_experts is None
            else np.ascontiguousarray(routed_experts, dtype=EXPERT_DTYPE),
        )
        for name in ("logprobs", "loss_mask", "versions"):
            if getattr(arrays, name).shape[0] != n:
                raise ValueError(f"{name} has {getattr(arrays, name).shape[0]} entries, token_ids {n}")
        re = arrays.routed_experts
        if re is not None and (re.ndim != 3 or re.shape[0] != n):
            raise ValueError(f"routed_experts must be [tokens={n}, layers, topk], got {list(re.shape)}")
        return arrays

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def __eq__(self, other: object) -> bool:
        """Bitwise equality (NaN payloads and -0.0 included), which is what round-trips promise."""
        import numpy as np

        if not isinstance(other, TokenArrays):
            return NotImplemented
        if (self.routed_experts is None) != (other.routed_experts is None):
            return False
        pairs = [
            (self.token_ids, other.token_ids),
            (self.logprobs.view("<u4"), other.logprobs.view("<u4")),
            (self.loss_mask, other.loss_mask),
            (self.versions, other.versions),
        ]
        if self.routed_experts is not None:
            pairs.append((self.routed_experts, other.routed_experts))
        return all(a.shape == b.shape and np.array_equal(a, b) for a, b in pairs)

    def slice(self, start: int, stop: int) -> TokenArrays:
        """Tokens [start, stop) of the stream, every array cut alike."""
        experts = self.routed_experts
        return TokenArrays(
            token_ids=self.token_ids[start:stop], logprobs=self.logprobs[start:stop],
            loss_mask=self.loss_mask[start:stop], versions=self.versions[start:stop],
            routed_experts=None if experts is None else experts[start:stop],
        )

    @staticmethod
    def concat(spans: list[TokenArrays]) -> TokenArrays:
        """Join spans in order into the episode's whole token stream."""
        import numpy as np

        if not spans:
            return TokenArrays.build([], [], [], [])
        experts = [s.routed_experts for s in spans]
        has_experts = all(e is not None for e in experts)
        return TokenArrays(
            token_ids=np.concatenate([s.token_ids for s in spans]),
            logprobs=np.concatenate([s.logprobs for s in spans]),
            loss_mask=np.concatenate([s.loss_mask for s in spans]),
            versions=np.concatenate([s.versions for s in spans]),
            routed_experts=np.concatenate(experts) if has_experts else None,
        )


def encode(array: np.ndarray, codec: str) -> bytes:
    """Serialize one array (already in its stored dtype) with the codec."""
    raw = array.tobytes()
    return zlib.compress(raw, 1) if codec == CODEC_ZLIB else raw


def decode(blob: bytes, dtype: str, codec: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Inverse of `encode`; the result owns its memory and is writable."""
    import numpy as np

    raw = zlib.decompress(blob) if codec == CODEC_ZLIB else blob
    out = np.frombuffer(raw, dtype=dtype).copy()
    return out.reshape(shape) if shape is not None else out
