"""Token-in, token-out conversation state: what the engine sees, and the drift check.

The model's own tokens are the truth: a completion is carried forward as the exact ids the
engine sampled, never re-tokenized. Everything else (system and user messages, tool
observations, template markup, the generation prompt) is rendered with the model's chat
template and tokenized. Each turn appends `completion ids + delta`, where the delta is the text
the template adds after the completion, up to and including the next generation prompt.

The drift check guards the classic multi-turn bug, a template that is not prefix-stable (e.g.
one that folds consecutive tool responses into one block, or drops earlier reasoning, so
earlier text changes as the conversation grows). It is incremental, so that a turn costs the
same at turn 50 as at turn 2: every turn renders a window of the conversation, its head (the
messages before the first completion) then the previous turn and this one, and checks that the
text around the two completions is what the carried stream holds there (the head's prompt and
the previous turn's observations); the text after this completion is the new delta. A template
whose rendering of a turn changes only once the conversation has moved more than one turn past
it is not caught. A mismatch keeps the engine's tokens and marks the turn where it shows as
drifted.

`encode_transcript` is the same rendering for a whole text-level conversation (a
demonstration): every completion tokenized with loss mask 1, plus the end-of-turn token that
ends it, and the text around the completions with loss mask 0 (supervised warm-start data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _alias_reasoning_fields, _compile_jinja_template

from agent_rl.sglang.generation import TokenIds
from agent_rl.sdk.messages import Message


ENCODE_CACHE_SIZE = 4096
"""Texts whose ids a renderer remembers."""


class ChatRenderer:
    """The model's chat template and tokenizer (loaded once per process, shared by runners)."""

    def __init__(self, model_dir: Path | str) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
        eos = self.tokenizer.eos_token
        if eos is None:
            raise ValueError(f"the tokenizer in {model_dir} has no eos token to end a turn")
        self.eos_text: str = eos
        self.eos_id: int = self.tokenizer.eos_token_id
        self._special_tokens = dict(self.tokenizer.special_tokens_map)
        # The Rust tokenizer itself, where transformers' wrapper would give the same ids and text
        # (it adds ~100 us of Python per call); else the wrapper.
        backend = getattr(self.tokenizer, "_tokenizer", None)
        plain = not getattr(self.tokenizer, "split_special_tokens", False) and not getattr(
            self.tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = backend if backend is not None and plain else None
        # The same texts come back all the time: a group's n episodes share their prompt, and
        # observations repeat ("<tool_response>413</tool_response>" and the markup around it).
        self._encoded: dict[str, list[int]] = {}

    def render(self, messages: list[Message], tools: list[dict[str, Any]], *, generation_prompt: bool = True) -> str:
        """The chat template's text, as `apply_chat_template(..., tokenize=False)` renders it.

        The compiled template is called directly: `apply_chat_template` also deep-copies every
        message and tool schema into plain data on each call (for objects a caller might pass),
        which was most of a turn's rendering time; our messages and schemas are plain already.
        tests/rollout/test_render.py checks the two agree."""
        template = self.tokenizer.get_chat_template(None, tools or None)
        compiled = _compile_jinja_template(template)
        chat = _alias_reasoning_fields(
            [{k: v for k, v in m.items() if v is not None} for m in messages]
        )
        return compiled.render(
            messages=chat, tools=tools or None, documents=None,
            add_generation_prompt=generation_prompt, **self._special_tokens,
        )

    def render_reference(self, messages: list[Message], tools: list[dict[str, Any]], *,
                         generation_prompt: bool = True) -> str:  # fmt: skip
        """`render` through `apply_chat_template` itself (the reference the tests compare to)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def generation_prompt(self, messages: list[Message], tools: list[dict[str, Any]]) -> str:
        """The text the template adds to open an assistant turn (e.g. `<|im_start|>assistant\n`)."""
        with_prompt = self.render(messages, tools)
        without = self.render(messages, tools, generation_prompt=False)
        return with_prompt[len(without):] if with_prompt.startswith(without) else ""

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._encoded.get(text)
        if ids is None:
            if self._backend is not None:
                ids = self._backend.encode(text, add_special_tokens=False).ids
            else:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(self._encoded) >= ENCODE_CACHE_SIZE:
                del self._encoded[next(iter(self._encoded))]  # the oldest
            self._encoded[text] = ids
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class Conversation:
    """The carried token stream of one episode and the completions inside it."""

    renderer: ChatRenderer
    tools: list[dict[str, Any]]
    ids: TokenIds = field(default_factory=TokenIds)
    """Every token the engine has seen or produced, in order (sent as JSON kept as it grows)."""
    anchor: str = ""
    """The generation prompt, which precedes every completion in a rendering."""
    head: list[Message] = field(default_factory=list)
    """The messages before the first completion."""
    prompt_text: str = ""
    """The head as rendered, with the generation prompt: the text before the first completion."""
    previous: tuple[list[Message], str, str] | None = None
    """The previous turn: its messages (the completion's, then the observations), the
    completion's text and the text carried after it."""

    def start(self, messages: list[Message]) -> list[int]:
        """Render the initial prompt; returns its ids (all of them new)."""
        self.head = list(messages)
        self.prompt_text = self.renderer.render(messages, self.tools)
        without = self.renderer.render(messages, self.tools, generation_prompt=False)
        # As `ChatRenderer.generation_prompt`, from the rendering the prompt needs anyway.
        self.anchor = self.prompt_text[len(without):] if self.prompt_text.startswith(without) else ""
        self.ids = TokenIds(self.renderer.encode(self.prompt_text))
        return list(self.ids)

    def checkpoint(self) -> tuple[tuple[int, int], Any]:
        """The state `add_turn` changes, for `restore`."""
        return self.ids.mark(), self.previous

    def restore(self, checkpoint: tuple[tuple[int, int], Any]) -> None:
        """Back to `checkpoint`: the turns carried since are forgotten."""
        mark, self.previous = checkpoint
        self.ids.rewind(mark)

    def add_turn(self, completion_ids: list[int], messages: list[Message], *,
                 text: str | None = None) -> tuple[list[int], bool]:  # fmt: skip
        """Carry a completion and the observations that followed it (the last messages of
        `messages`: the completion's, then the observations; `text` is the completion decoded,
        if the caller has it).

        Returns the new non-model ids appended after the completion (observations and the next
        generation prompt) and whether the template's rendering disagrees with the carried
        stream around this turn or the previous one (see the module docstring)."""
        if text is None:
            text = self.renderer.decode(completion_ids)
        step = _last_step(messages)
        self.ids.extend(completion_ids)
        window, completions = list(self.head), []
        if self.previous is not None:
            window += self.previous[0]
            completions.append(self.previous[1])
        window += step
        completions.append(text)
        fresh = self.renderer.render(window, self.tools)
        segments = _split(fresh, completions, self.anchor)
        if segments is None:
            # The fresh rendering does not even contain the completions: carry on with the
            # observations rendered after the last completion's text as best we can.
            eos = self.renderer.eos_text
            tail = fresh[fresh.rfind(eos) + len(eos):] if eos in fresh else fresh
            delta = self.renderer.encode(tail)
            self.ids.extend(delta)
            self.previous = (step, text, tail)
            return delta, True
        carried = [self.prompt_text] + ([self.previous[2]] if self.previous is not None else [])
        drift = segments[:-1] != carried
        delta = self.renderer.encode(segments[-1])
        self.ids.extend(delta)
        self.previous = (step, text, segments[-1])
        return delta, drift


def _last_step(messages: list[Message]) -> list[Message]:
    """The last assistant message and the observations after it."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return list(messages[i:])
    raise ValueError("add_turn needs the completion's assistant message in `messages`")


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
