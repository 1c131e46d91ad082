"""`search-qa`: multi-hop questions answered with a BM25 `search` tool over a bundled corpus.

Search-R1-style: the model searches (as many times as it needs, up to `max_turns`), reads the
top-k passages, and answers with the entity's name as its final message (an `<answer>...</answer>`
wrapper is accepted too). Reward: token F1 against the gold answer (1.0 for an exact match), or
exact match with `metric="em"`; both are recorded as components.

Tasks: the bundled questions (corpus.py); about a tenth (by a hash of the id) are the `eval`
split, the rest `train`.
The BM25 index (rank-bm25's Okapi BM25 over lower-cased word tokens) is built once per process.
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import Any, Literal

import numpy as np

from agent_rl.sdk.env import Env
from agent_rl.sdk.messages import Message
from agent_rl.sdk.rewards import Reward, exact_match, extract_answer, token_f1
from agent_rl.sdk.tasks import ListTasks, Task, TaskSource
from agent_rl.sdk.tool_calls import format_tool_call
from agent_rl.sdk.tools import tool
from envs.search_qa.corpus import CHAINS, documents, questions

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@functools.cache
def _index() -> Any:
    from rank_bm25 import BM25Okapi  # imported here so listing the env does not build anything

    return BM25Okapi([tokenize(d) for d in documents()])


def search_corpus(query: str, k: int) -> list[str]:
    """Top-k passages for the query, best first (ties broken by corpus order)."""
    scores = _index().get_scores(tokenize(query))
    order = np.lexsort((np.arange(len(scores)), -scores))[:k]
    return [documents()[i] for i in order if scores[i] > 0]


class SearchQAEnv(Env):
    """Multi-hop questions over a local encyclopedia with a BM25 search tool; F1 reward."""

    def __init__(
        self,
        *,
        top_k: int = 3,
        metric: Literal["f1", "em"] = "f1",
        max_turns: int | None = 6,
        **kwargs: Any,
    ) -> None:
        super().__init__(max_turns=max_turns, **kwargs)
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        self.top_k, self.metric = top_k, metric

    @tool
    def search(self, query: str) -> str:
        """Search the encyclopedia and return the best matching passages.

        Args:
            query: Keywords to search for, e.g. a name and what you want to know.
        """
        hits = search_corpus(query, self.top_k)
        return "\n".join(f"[{i}] {text}" for i, text in enumerate(hits, start=1)) or "no results"

    def builtin_tasks(self, split: str = "train") -> TaskSource:
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}: use 'train' or 'eval'")
        # A hash of the id, not the position, so every question type lands in both splits.
        chosen = [
            q for q in questions() if (zlib.crc32(q["id"].encode()) % 10 == 0) == (split == "eval")
        ]
        return ListTasks(Task(id=q["id"], data=q) for q in chosen)

    async def score(self, answer: str) -> Reward:
        assert self.task is not None
        pred = extract_answer(answer)
        em, f1 = exact_match(pred, self.task["answer"]), token_f1(pred, self.task["answer"])
        return Reward(value=em if self.metric == "em" else f1, components={"em": em, "f1": f1})

    async def demonstrate(self, messages: list[Message]) -> str:
        # Follow the question's chain, taking each bridge entity from the latest search results.
        assert self.task is not None
        chain = CHAINS[self.task["type"]]
        found = [self.task["entity"]]
        results = [m["content"] for m in messages if m["role"] == "tool"]
        for hop, result in zip(chain, results, strict=False):
            pattern = hop.pattern.format(*(re.escape(v) for v in found))
            m = re.search(pattern, result)
            if m is None:
                return f"I could not find it (no match for {pattern!r})."
            found.append(m.group(1))
        if len(found) == len(chain) + 1:
            return found[-1]
        return format_tool_call("search", {"query": chain[len(found) - 1].query.format(*found)})
