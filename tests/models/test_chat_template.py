"""The chat template: tools, tool calls and tool responses, prefix-stable across turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from agent_rl.models.corpus import CALC_TOOL, SEARCH_TOOL

CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 12 * 34, and who wrote Hamlet?"},
    {
        "role": "assistant",
        "content": "I will use both tools.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calc", "arguments": {"expression": "12 * 34"}},
            },
            {
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "hamlet author"}'},
            },
        ],
    },
    {"role": "tool", "content": "408"},
    {"role": "tool", "content": "Hamlet is a tragedy written by William Shakespeare."},
    {"role": "assistant", "content": "12 * 34 = 408, and Hamlet was written by Shakespeare."},
    {"role": "user", "content": "Thanks! Now 5 + 5?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expression": "5 + 5"}}}
        ],
    },
    {"role": "tool", "content": "10"},
    {"role": "assistant", "content": "10"},
]


@pytest.fixture(scope="module")
def tok(tiny_dense_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_dense_model)


def test_renders_tools_calls_and_responses(tok: PreTrainedTokenizerBase) -> None:
    text = tok.apply_chat_template(CONVERSATION, tools=[CALC_TOOL, SEARCH_TOOL], tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(CALC_TOOL, ensure_ascii=False) + "\n" in text
    assert (
        '<|im_start|>assistant\nI will use both tools.\n<tool_call>\n{"name": "calc", "arguments": '
        '{"expression": "12 * 34"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
        '{"query": "hamlet author"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Each tool response is its own user turn, rendered identically whatever follows it.
    assert text.count("<|im_start|>user\n<tool_response>\n") == 3
    assert "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n10<|im_end|>\n")


def test_prefix_stable_across_turns(tok: PreTrainedTokenizerBase) -> None:
    tools = [CALC_TOOL, SEARCH_TOOL]
    full = tok.apply_chat_template(CONVERSATION, tools=tools, tokenize=False)
    for k in range(1, len(CONVERSATION)):
        prefix = tok.apply_chat_template(CONVERSATION[:k], tools=tools, tokenize=False)
        assert full.startswith(prefix), k
        if CONVERSATION[k]["role"] == "assistant":
            prompt = tok.apply_chat_template(
                CONVERSATION[:k], tools=tools, tokenize=False, add_generation_prompt=True
            )
            assert full.startswith(prompt), k
            # Token level: the prompt's ids are a prefix of the whole conversation's ids.
            ids_prompt = tok(prompt, add_special_tokens=False).input_ids
            ids_full = tok(full, add_special_tokens=False).input_ids
            assert ids_full[: len(ids_prompt)] == ids_prompt, k


def test_tokens_round_trip_and_markers_are_single_tokens(tok: PreTrainedTokenizerBase) -> None:
    text = tok.apply_chat_template(CONVERSATION, tools=[CALC_TOOL], tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    for marker in [
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ]:
        assert len(tok(marker, add_special_tokens=False).input_ids) == 1, marker
    assert tok.eos_token == "<|im_end|>"
    # Tool-call markers survive skip_special_tokens (the episode runner parses decoded text).
    call = '<tool_call>\n{"name": "calc"}\n</tool_call><|im_end|>'
    decoded = tok.decode(tok(call, add_special_tokens=False).input_ids, skip_special_tokens=True)
    assert decoded == '<tool_call>\n{"name": "calc"}\n</tool_call>'
    # Digits are one token each.
    assert tok.convert_ids_to_tokens(tok("2026", add_special_tokens=False).input_ids) == list(
        "2026"
    )


def test_generation_prompt_without_tools_or_system(tok: PreTrainedTokenizerBase) -> None:
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
