"""The carried token stream and its incremental drift check (agent_rl/rollout/render.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_rl.sdk.messages import Message
from agent_rl.models import chat_template
from agent_rl.rollout.render import ChatRenderer, Conversation
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion
from envs.calculator.env import CalculatorEnv


def run_turns(renderer: ChatRenderer, turns: int) -> tuple[Conversation, list[Message], list[bool]]:
    """A calculator conversation of `turns` tool calls, carried turn by turn."""
    tools = CalculatorEnv().tool_schemas()
    messages: list[Message] = [{"role": "system", "content": "Be exact."},
                               {"role": "user", "content": "What is 12*34+5?"}]
    conv = Conversation(renderer, tools)
    conv.start(messages)
    drifts = []
    for t in range(turns):
        ids = renderer.encode(format_tool_call("calc", {"expression": f"12*34+{t}"})) + [renderer.eos_id]
        text = renderer.decode(ids)
        turn = parse_completion(text[: -len(renderer.eos_text)], id_prefix=f"call_{t}_")
        messages += [turn.to_message(), {"role": "tool", "name": "calc", "content": str(413 + t),
                                         "tool_call_id": f"call_{t}_0"}]
        _, drift = conv.add_turn(ids, messages, text=text)
        drifts.append(drift)
    return conv, messages, drifts


def test_carried_stream_is_the_full_rendering(tiny_dense_model: Path) -> None:
    renderer = ChatRenderer(tiny_dense_model)
    conv, messages, drifts = run_turns(renderer, 30)
    assert not any(drifts)
    # The incremental check never rendered the whole conversation; the stream still is it.
    assert conv.ids == renderer.encode(renderer.render(messages, conv.tools))


def with_template(model: Path, old: str, new: str) -> ChatRenderer:
    renderer = ChatRenderer(model)
    template = chat_template()
    assert old in template
    renderer.tokenizer.chat_template = template.replace(old, new, 1)
    return renderer


def test_a_header_that_changes_as_the_conversation_grows_is_drift(tiny_dense_model: Path) -> None:
    # Not prefix-stable: the system block counts the messages.
    renderer = with_template(tiny_dense_model, "{{- '<|im_start|>system\\n' }}",
                             "{{- '<|im_start|>system\\n' + (messages | length | string) + '\\n' }}")
    _, _, drifts = run_turns(renderer, 5)
    assert all(drifts)


@pytest.mark.parametrize("turns", [2, 12])
def test_rewriting_the_previous_completion_is_drift(tiny_dense_model: Path, turns: int) -> None:
    # Not prefix-stable: like templates that drop earlier reasoning, only the last assistant
    # message keeps its content once another one follows.
    renderer = with_template(
        tiny_dense_model, "{%- for message in messages %}",
        "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'assistant' %}"
        "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
        "{%- for message in messages %}{%- if message.role == 'assistant' and loop.index0 < ns.last %}"
        "{%- set message = {'role': 'assistant', 'content': 'earlier'} %}{%- endif %}",
    )
    _, _, drifts = run_turns(renderer, turns)
    assert drifts[0] is False  # one completion: nothing to rewrite yet
    assert all(drifts[1:])


def test_fast_paths_agree_with_transformers(tiny_dense_model: Path) -> None:
    # `render` calls the compiled template and `encode`/`decode` the Rust tokenizer directly;
    # transformers' own entry points must give the same text and ids.
    renderer = ChatRenderer(tiny_dense_model)
    conv, messages, _ = run_turns(renderer, 3)
    for tools in (conv.tools, []):
        for n in range(1, len(messages) + 1):
            for prompt in (True, False):
                text = renderer.render(messages[:n], tools, generation_prompt=prompt)
                assert text == renderer.render_reference(messages[:n], tools, generation_prompt=prompt)
                ids = renderer.encode(text)
                assert ids == renderer.tokenizer.encode(text, add_special_tokens=False)
                assert renderer.decode(ids) == renderer.tokenizer.decode(ids, skip_special_tokens=False)
