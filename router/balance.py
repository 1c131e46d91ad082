"""Choosing a worker for a request: least outstanding, session affinity with bounded load, round robin.

Least outstanding requests is the default for requests without a session: the worker with the
fewest requests in flight through this router wins (ties rotate), which adapts to uneven
generation lengths without any model of the engine.

Session affinity keeps the turns of one multi-turn episode on one worker, so its prefix stays in
that worker's radix cache. A session (the `X-SMG-Routing-Key` header, as slime sends it, or the
body's `session_id`) is placed by rendezvous hashing and then remembered; it stays on its worker
while that worker's load is within the bound `ceil(load_factor * (total + 1) / n)`
(consistent hashing with bounded loads, Mirrokni et al. 2018). A hot session that would push its
worker past the bound spills to the next worker in its hash order, so one session cannot pin a
worker. New sessions avoid workers that are still behind an in-progress weight update when an
up-to-date worker is available.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from itertools import count

from agent_rl.config import RouterConfig
from router.workers import Worker


def _rank(key: str, url: str) -> int:
    # blake2b is stable across processes (unlike hash()), so a restarted router places
    # sessions where the previous one did.
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


class Balancer:
    """Picks a worker among the eligible ones; remembers where each session lives."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._rr = count()
        self._sessions: OrderedDict[str, str] = OrderedDict()

    def choose(self, candidates: list[Worker], session: str | None = None) -> Worker:
        """The worker for one request; `candidates` is non-empty and all admit traffic."""
        if self.config.policy == "round-robin":
            return candidates[next(self._rr) % len(candidates)]
        if session is not None and self.config.policy == "session-affinity":
            return self._affine(candidates, session)
        return self._least_outstanding(self._fresh(candidates))

    def session_worker(self, session: str) -> str | None:
        """The worker URL a session is pinned to, if any (for tests and `GET /workers`)."""
        return self._sessions.get(session)

    def forget_worker(self, url: str) -> None:
        """Drop the sessions of a removed worker; they are placed afresh on their next turn."""
        for key in [k for k, u in self._sessions.items() if u == url]:
            del self._sessions[key]

    def _least_outstanding(self, candidates: list[Worker]) -> Worker:
        low = min(w.outstanding for w in candidates)
        tied = [w for w in candidates if w.outstanding == low]
        return tied[next(self._rr) % len(tied)] if len(tied) > 1 else tied[0]

    def _fresh(self, candidates: list[Worker]) -> list[Worker]:
        """Candidates not behind an in-progress weight update (all of them if none is)."""
        fresh = [w for w in candidates if not w.updating]
        return fresh or candidates

    def bound(self, candidates: list[Worker]) -> int:
        """The most outstanding requests a worker may hold for a session request to stick to it."""
        total = sum(w.outstanding for w in candidates)
        return max(1, math.ceil(self.config.affinity_load_factor * (total + 1) / len(candidates)))

    def _affine(self, candidates: list[Worker], session: str) -> Worker:
        bound = self.bound(candidates)
        pinned = self._sessions.get(session)
        if pinned is not None:
            home = next((w for w in candidates if w.url == pinned), None)
            if home is not None:
                self._sessions.move_to_end(session)
                if home.outstanding < bound:
                    return home
                # Over the bound: this turn spills to the next worker in hash order, but the
                # session stays pinned so its later turns return to its cached prefix.
                return self._spill(candidates, session, bound)
            # The pinned worker is gone or unhealthy: place the session afresh.
        worker = self._spill(self._fresh(candidates), session, bound)
        self._remember(session, worker.url)
        return worker

    def _spill(self, candidates: list[Worker], session: str, bound: int) -> Worker:
        ordered = sorted(candidates, key=lambda w: _rank(session, w.url), reverse=True)
        for w in ordered:
            if w.outstanding < bound:
                return w
        return self._least_outstanding(candidates)

    def _remember(self, session: str, url: str) -> None:
        self._sessions[session] = url
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.config.affinity_max_sessions:
            self._sessions.popitem(last=False)
