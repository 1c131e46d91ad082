"""Token-in, token-out conversation state: what the engine sees, and the drift check.

The model's own tokens are the truth: a completion is carried forward as the exact ids the
engine sampled, never re-tokenized. Everything else (system and user messages, tool
observations, template markup, the generation prompt) is rendered with the model's chat
template and tokenized. Each turn appends `completion ids + delta`, where the delta is the text
the template adds after the completion, up to and including the next generation prompt.

The drift check guards the classic multi-turn bug, a template that is not prefix-stable (e.g.
one that folds consecutive tool responses into one block, so earlier text changes as the
conversation grows): every turn, the carried ids are compared with a fresh rendering of the
whole conversation, tokenized segment by segment with each assistant turn replaced by the ids
the engine produced for it. A mismatch keeps the engine's tokens and is recorded as drift.

`encode_transcript` is the same rendering for a whole text-level conversation (a
demonstration): every completion tokenized with loss mask 1, plus the end-of-turn token that
ends it, and the text around the completions with loss mask 0 (supervised warm-start data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from agent_rl.messages import Message


class ChatRenderer:
    """The model's chat template and tokenizer (loaded once per process, shared by runners)."""

    def __init__(self, model_dir: Path | str) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        eos = self.tokenizer.eos_token
        if eos is None:
            raise ValueError(f"the tokenizer in {model_dir} has no eos token to end a turn")
        self.eos_text: str = eos
        self.eos_id: int = self.tokenizer.eos_token_id

    def render(self, messages: list[Message], tools: list[dict[str, Any]], *, generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def generation_prompt(self, messages: list[Message], tools: list[dict[str, Any]]) -> str:
        """The text the template adds to open an assistant turn (e.g. `<|im_start|>assistant\n`)."""
        with_prompt = self.render(messages, tools)
        without = self.render(messages, tools, generation_prompt=False)
        return with_prompt[len(without):] if with_prompt.startswith(without) else ""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class Conversation:
    """The carried token stream of one episode and the completions inside it."""

    renderer: ChatRenderer
    tools: list[dict[str, Any]]
    ids: list[int] = field(default_factory=list)
    """Every token the engine has seen or produced, in order."""
    completions: list[tuple[str, list[int]]] = field(default_factory=list)
    """(text as decoded, engine ids) of each assistant turn, in order."""
    anchor: str = ""
    """The generation prompt, which precedes every completion in a rendering."""

    def start(self, messages: list[Message]) -> list[int]:
        """Render the initial prompt; returns its ids (all of them new)."""
        self.anchor = self.renderer.generation_prompt(messages, self.tools)
        self.ids = self.renderer.encode(self.renderer.render(messages, self.tools))
        return list(self.ids)

    def add_turn(self, completion_ids: list[int], messages: list[Message]) -> tuple[list[int], bool]:
        """Carry a completion and the observations that followed it (already in `messages`).

        Returns the new non-model ids appended after the completion (observations and the next
        generation prompt) and whether the carried stream drifted from a fresh rendering."""
        text = self.renderer.decode(completion_ids)
        self.completions.append((text, list(completion_ids)))
        self.ids.extend(completion_ids)
        fresh = self.renderer.render(messages, self.tools)
        segments = _split(fresh, [t for t, _ in self.completions], self.anchor)
        if segments is None:
            # The fresh rendering does not even contain the completions: carry on with the
            # observations rendered after the last completion's text as best we can.
            tail = fresh[fresh.rfind(self.renderer.eos_text) + len(self.renderer.eos_text):] if self.renderer.eos_text in fresh else fresh
            delta = self.renderer.encode(tail)
            self.ids.extend(delta)
            return delta, True
        delta = self.renderer.encode(segments[-1])
        expected: list[int] = []
        for i, segment in enumerate(segments[:-1]):
            expected.extend(self.renderer.encode(segment))
            expected.extend(self.completions[i][1])
        expected.extend(delta)
        self.ids.extend(delta)
        return delta, expected != self.ids


def _split(text: str, completions: list[str], anchor: str) -> list[str] | None:
    """The pieces of `text` between the completions (len(completions) + 1 of them), or None if
    the completions do not occur in order. Each completion is looked for right after `anchor`
    (the generation prompt), so a short completion is not matched inside earlier text."""
    pieces, pos = [], 0
    for c in completions:
        at = text.find(anchor + c, pos)
        if at < 0:
            return None
        at += len(anchor)
        pieces.append(text[pos:at])
        pos = at + len(c)
    pieces.append(text[pos:])
    return pieces


def encode_transcript(
    renderer: ChatRenderer, messages: list[Message], tools: list[dict[str, Any]]
) -> tuple[list[int], list[float]] | None:
    """(token ids, loss mask) of a whole conversation, or None if the template does not render
    the completions verbatim (then its tokens would not be what the model should write)."""
    completions = [str(m["content"]) for m in messages if m["role"] == "assistant"]
    if not completions:
        return None
    text = renderer.render(messages, tools, generation_prompt=False)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    segments = _split(text, completions, renderer.generation_prompt(messages[:first], tools))
    if segments is None:
        return None
    ids: list[int] = []
    mask: list[float] = []
    for i, segment in enumerate(segments):
        if i > 0:  # the segment after a completion starts with the eos that ended it
            if not segment.startswith(renderer.eos_text):
                return None
            segment = segment[len(renderer.eos_text):]
        piece = renderer.encode(segment)
        ids += piece
        mask += [0.0] * len(piece)
        if i < len(completions):
            completion = renderer.encode(completions[i]) + [renderer.eos_id]
            ids += completion
            mask += [1.0] * len(completion)
    if mask and mask[0]:
        mask[0] = 0.0  # token 0 has no prediction
    return ids, mask
