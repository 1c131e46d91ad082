"""Turns generated before: answered again from their record instead of the engine.

A fork copies its parent's first turns, and a resumed episode re-runs the turns it persisted
before its serve died; both go through the episode runner with each recorded completion
presented exactly as the engine returned it (`recorded_generation`: token ids, logprobs, the
weight version of each run of tokens), so the environment is stepped through the same states
and the token stream is rebuilt bit for bit. `recorded_turns` reads them from the store, each
with the observations that followed it (for the resumed episode's check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_rl.kernel.encoding import version_label
from agent_rl.sglang.generation import FinishReason, Generation, WeightSpan
from agent_rl.store import Store, TokenArrays


@dataclass
class RecordedTurn:
    """A turn generated before, answered from its record instead of the engine."""

    span: TokenArrays
    """The turn's tokens as stored: prompt or observations (mask 0), then the completion."""
    num_prompt: int
    finish_reason: str | None
    observations: list[dict[str, Any]] | None = None
    """Resume: the messages stored after this turn's assistant message, to compare."""


def recorded_generation(recorded: RecordedTurn, rid: str) -> Generation:
    """A recorded turn's completion as the engine returned it: its ids, logprobs and the
    weight version of each run of tokens."""
    span, num_prompt = recorded.span, recorded.num_prompt
    ids = span.token_ids[num_prompt:]
    versions = span.versions[num_prompt:].tolist()
    spans, start = [], 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            spans.append(WeightSpan(version=version_label(versions[start]), start=start, end=i))
            start = i
    finish = recorded.finish_reason
    return Generation(
        rid=rid, output_ids=ids.tolist(), text="",
        finish_reason=FinishReason(type=finish) if finish else None,
        logprobs=span.logprobs[num_prompt:].tolist(),
        weight_version=version_label(versions[-1]) if versions else None, weight_spans=spans,
        prompt_tokens=num_prompt, completion_tokens=len(ids), cached_tokens=0,
    )  # fmt: skip


def split_transcript(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """(initial messages, [(assistant message, the observations that followed it)])."""
    initial: list[dict[str, Any]] = []
    turns: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for m in messages:
        if m["role"] == "assistant":
            turns.append((m, []))
        elif turns:
            turns[-1][1].append(m)
        else:
            initial.append(m)
    return initial, turns


def span_of(tokens: TokenArrays, start: int, length: int) -> TokenArrays:
    """Tokens [start, start + length) of an episode's stream."""
    end = start + length
    experts = None if tokens.routed_experts is None else tokens.routed_experts[start:end]
    return TokenArrays(tokens.token_ids[start:end], tokens.logprobs[start:end],
                       tokens.loss_mask[start:end], tokens.versions[start:end], experts)


async def recorded_turns(
    store: Store, episode_id: int, *, upto: int | None = None, observations: bool = False
) -> list[RecordedTurn]:
    """The episode's first `upto` (all) turns as stored; with `observations`, each carries the
    messages stored after its assistant message."""
    detail = await store.get_episode(episode_id)
    tokens = await store.episode_tokens(episode_id)
    _, transcript = split_transcript(detail.messages)
    turns = detail.turns if upto is None else detail.turns[:upto]
    return [
        RecordedTurn(
            span_of(tokens, t.span_start, t.num_tokens), t.num_prompt_tokens, t.finish_reason,
            observations=transcript[t.index][1] if observations and t.index < len(transcript) else None,
        )
        for t in turns
    ]
