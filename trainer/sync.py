"""Weight sync: ask the router (or one SGLang server) to load an exported HF directory.

`sync_weights(url, path, version, token)` POSTs `/update_weights_from_disk` with
`{"model_path": path, "weight_version": str(version)}`. The agent-rl router fans it out (pause,
update, continue, read back the version) to every worker and needs its admin bearer token
(`router.admin_token`); a bare SGLang server accepts the same body without a token. Any failure
is an EngineError with a one-line, actionable message; the trainer never hangs on it (bounded
timeout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from agent_rl.errors import EngineError


async def sync_weights(
    url: str, path: str | Path, version: int, token: str | None = None, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Load `path` on every engine behind `url`, labelled `str(version)`; return the answer."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"model_path": str(Path(path).resolve()), "weight_version": str(version)}
    endpoint = url.rstrip("/") + "/update_weights_from_disk"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.post(endpoint, json=body, headers=headers) as r:
                text = await r.text()
                if r.status == 401:
                    raise EngineError(
                        f"router at {url} refused the weight update (401): set [router] "
                        "admin_token to the router's admin token"
                    )
                if r.status != 200:
                    raise EngineError(
                        f"weight update at {endpoint} failed with HTTP {r.status}: {text[:200]}"
                    )
                try:
                    answer = await r.json(content_type=None)
                except ValueError:
                    answer = {"raw": text}
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise EngineError(
            f"cannot reach the router at {url} for the weight update ({type(e).__name__}: {e}); "
            "start it or pass --router-url"
        ) from e
    if isinstance(answer, dict) and answer.get("success") is False:
        raise EngineError(f"weight update at {endpoint} failed: {str(answer)[:300]}")
    return answer if isinstance(answer, dict) else {"answer": answer}


async def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """EngineError unless something answers HTTP at `url` (checked once, at trainer start)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(url.rstrip("/") + "/model_info") as r:
                await r.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise EngineError(
            f"router {url} is unreachable ({type(e).__name__}); start it (`agent-rl router` or "
            "`agent-rl serve`) or pass the right --router-url"
        ) from e


async def served_versions(url: str, timeout_s: float = 5.0) -> dict[str, str | None]:
    """Weight version of every engine in rotation behind the router at `url` ({} if it cannot
    say); a bare SGLang server reports its own under its URL."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(url.rstrip("/") + "/model_info") as r:
                if r.status != 200:
                    return {}
                info = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return {}
    if not isinstance(info, dict):
        return {}
    workers = info.get("worker_weight_versions")
    if isinstance(workers, dict):
        # Quarantined engines are left out: the router updates them when they come back.
        down = set(info.get("quarantined_workers") or [])
        return {str(k): v for k, v in workers.items() if k not in down}
    return {url: info.get("weight_version")}
