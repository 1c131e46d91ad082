"""The byte-level BPE tokenizer of the tiny models, trained offline, with the chat template.

Contract:
- `build_tokenizer()` returns a `transformers.PreTrainedTokenizerFast` trained with `tokenizers`
  on `agent_rl.models.corpus`; the same call always yields the same vocabulary and merges.
- Byte-level, so any text round-trips; digits are split one per token (like Qwen2's
  pre-tokenizer), which helps tiny models with arithmetic.
- `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are special tokens; `<tool_call>`, `</tool_call>`,
  `<tool_response>`, `</tool_response>` are single added tokens that survive
  `skip_special_tokens=True` (as in Qwen2.5), so tool calls stay visible in decoded text.
- The chat assistant ends its turn with `<|im_end|>`, which is the tokenizer's eos token.
- `chat_template.jinja` renders tools and tool calls Hermes/Qwen-style; see its header for the
  two deliberate differences from Qwen's template (prefix stability for token-in/token-out).
"""

from __future__ import annotations

import functools
import json
from importlib.resources import files
from typing import Any

import jinja2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from agent_rl.models.corpus import corpus
from agent_rl.models.presets import DEFAULT_VOCAB_SIZE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2's split: contractions, words, ONE digit at a time, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def chat_template() -> str:
    """The Jinja chat template shipped with the package."""
    return files("agent_rl.models").joinpath("chat_template.jinja").read_text()


def _renderer() -> Any:
    # Same environment options as transformers' chat-template renderer, enough for a corpus.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    template = env.from_string(chat_template())

    def render(messages: list[dict], tools: list[dict]) -> str:
        return template.render(messages=messages, tools=tools, add_generation_prompt=False)

    return render


@functools.lru_cache(maxsize=4)
def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer (total size <= vocab_size, specials included).

    Cached per process (training takes about a second); treat the result as read-only.
    """
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(_renderer(), seed=seed), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = chat_template()
    return hf
