"""What every completed episode must satisfy: tokens are the truth, and they agree with the
transcript, the loss mask, the logprobs, the versions and the routed experts."""

from __future__ import annotations

from typing import Any

import numpy as np

from agent_rl.sdk.registry import make
from agent_rl.rollout.render import ChatRenderer
from agent_rl.store import EpisodeDetail, Store, TokenArrays


async def check_episode(store: Store, renderer: ChatRenderer, episode_id: int, *, experts: bool) -> None:
    detail = await store.get_episode(episode_id)
    e = detail.episode
    tokens = await store.episode_tokens(episode_id)
    assert e.drift_count == 0, f"episode {episode_id} drifted"
    assert len(tokens) == e.num_tokens == sum(t.num_tokens for t in detail.turns)

    # The loss mask covers exactly the model's tokens: each turn's completion.
    for t in detail.turns:
        span = tokens.loss_mask[t.span_start : t.span_start + t.num_tokens]
        assert span.tolist() == [0] * t.num_prompt_tokens + [1] * (t.num_tokens - t.num_prompt_tokens)
    model = tokens.loss_mask == 1
    assert int(model.sum()) == e.num_model_tokens > 0
    # One logprob and one policy version per model token; none elsewhere.
    assert np.all(np.isfinite(tokens.logprobs[model])) and np.all(tokens.logprobs[model] <= 0)
    assert np.all(tokens.versions[model] >= 0) and np.all(tokens.versions[~model] == -1)
    assert np.all(tokens.logprobs[~model] == 0)

    check_transcript(renderer, detail, tokens, make(e.env_id).tool_schemas())

    if experts:
        assert tokens.routed_experts is not None
        assert tokens.routed_experts.shape[0] == len(tokens)
        # Every position fed to the engine has its experts; only each turn's last token may not.
        known = tokens.routed_experts[:, 0, 0] >= 0
        assert known.sum() >= len(tokens) - len(detail.turns)


def check_transcript(
    renderer: ChatRenderer, detail: EpisodeDetail, tokens: TokenArrays, tools: list[dict[str, Any]]
) -> None:
    """The tokens decode to the transcript as the chat template renders it (NUL, which a model
    can generate, is stored in text as U+FFFD on every backend; the token arrays keep it)."""
    messages = [
        {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "name") and v is not None}
        for m in detail.messages
    ]
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    rendered = renderer.render(messages[: last_assistant + 1], tools, generation_prompt=False)
    decoded = renderer.decode(tokens.token_ids.tolist()).replace("\x00", "\ufffd")  # as stored
    assert rendered.startswith(decoded), "the token stream is not the rendered transcript"
    assert rendered[len(decoded):] in ("\n", renderer.eos_text + "\n")
