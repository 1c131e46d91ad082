"""The token view: every token of an episode with its text piece, rollout and trainer logprobs,
loss mask, policy version and (on request) routed experts.

Text pieces come from the run's tokenizer, looked up in order: `api.tokenizer`, the run's own
config (`engine.model`, as `serve` recorded it), this config's `engine.model`. Each token is
decoded on its own, so a character split across byte-level tokens shows as partial pieces:
the view shows what the model saw token by token, it does not re-tokenize anything.
Tokenizers load once per directory (transformers is imported only then).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from agent_rl.app.api.schemas import TokenView
from agent_rl.config import Config
from agent_rl.store import Store


def tokenizer_dir(cfg: Config, run_config: dict[str, Any] | None) -> Path | None:
    """The first configured tokenizer directory that exists."""
    engine = (run_config or {}).get("engine") or {}
    candidates = [cfg.api.tokenizer, engine.get("model"), cfg.engine.model]
    for c in candidates:
        if c and any(
            (Path(c) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            return Path(c)
    return None


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@functools.lru_cache(maxsize=4)
def _piece_cache(path: str) -> dict[int, str]:
    return {}


def decode_pieces(path: Path, token_ids: list[int]) -> list[str]:
    """Each token's text on its own (special tokens included), memoized per tokenizer."""
    tok = load_tokenizer(str(path))
    cache = _piece_cache(str(path))
    missing = sorted({t for t in token_ids if t not in cache})
    if missing:
        decoded = tok.batch_decode(
            [[t] for t in missing], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        cache.update(zip(missing, decoded))
    return [cache[t] for t in token_ids]


def _finite(values: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values.tolist()]


async def token_view(
    store: Store,
    cfg: Config,
    episode_id: int,
    run_config: dict[str, Any] | None,
    *,
    experts: bool = False,
) -> TokenView:
    tokens = await store.episode_tokens(episode_id)
    trainer = await store.trainer_logprobs(episode_id)
    ids = tokens.token_ids.tolist()
    path = tokenizer_dir(cfg, run_config)
    pieces = None
    if path is not None and ids:
        pieces = await anyio.to_thread.run_sync(decode_pieces, path, ids)
    elif path is not None:
        pieces = []
    return TokenView(
        token_ids=ids,
        pieces=pieces,
        logprobs=_finite(tokens.logprobs),
        trainer_logprobs=None if trainer is None else _finite(trainer),
        loss_mask=tokens.loss_mask.astype(int).tolist(),
        versions=tokens.versions.tolist(),
        routed_experts=(
            tokens.routed_experts.tolist()
            if experts and tokens.routed_experts is not None
            else None
        ),
        tokenizer=None if path is None else str(path),
    )
