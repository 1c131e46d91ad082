"""search-qa: demonstrations read real BM25 results and score full reward; reward rules."""

from __future__ import annotations

import pytest

from agent_rl import make
from agent_rl.sdk.demonstrations import demonstrations
from agent_rl.sdk.messages import ToolCall
from agent_rl.sdk.tool_calls import format_tool_call, parse_completion
from envs.search_qa.corpus import documents, questions
from envs.search_qa.env import search_corpus

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("split", ["train", "eval"])
async def test_demonstration_scores_full_reward_on_every_question(split: str) -> None:
    env = make("search-qa")
    n = env.task_source(split).size
    assert n is not None
    transcripts = await demonstrations("search-qa", n, split=split)
    assert {t.task.id for t in transcripts} == {t.id for t in env.task_source(split).take(n)}
    assert all(t.reward == 1.0 and t.terminated for t in transcripts)
    # Every hop was a real search whose results held the bridge entity.
    for t in transcripts[:20]:
        searches = [r for s in t.steps for r in s.tool_results]
        assert len(searches) == len(t.task["path"])
        for result, bridge in zip(searches, t.task["path"], strict=False):
            assert bridge in result.output


def test_corpus_and_questions_are_fixed_and_unambiguous() -> None:
    assert len(documents()) == 210 and len(questions()) == 320
    assert len({q["id"] for q in questions()}) == 320
    train, evals = make("search-qa").task_source("train"), make("search-qa").task_source("eval")
    assert train.size is not None and evals.size is not None and train.size + evals.size == 320


def test_bm25_finds_the_entity_article_first() -> None:
    q = questions()[0]
    assert search_corpus(f"{q['entity']} born", 3)[0].startswith(q["entity"])
    assert search_corpus("zzzz qqqq", 3) == []


async def test_reward_is_f1_with_em_component_and_answer_tags() -> None:
    env = make("search-qa")
    task = env.task_source().take(1)[0]
    await env.reset(task)
    no_hits = await env.step(parse_completion(format_tool_call("search", {"query": "xyzzy"})))
    assert no_hits.observations[0]["content"] == "no results"
    r = await env.step(parse_completion(f"<answer>the {task['answer']}</answer>"))
    assert r.reward == 1.0 and r.info.reward is not None and r.info.reward.components["em"] == 1.0
    await env.reset(task)
    partial = await env.step(parse_completion(f"{task['answer']} Republic"))
    assert 0 < partial.reward < 1 and partial.info.reward is not None
    assert partial.info.reward.components["em"] == 0.0
    em_env = make("search-qa", metric="em")
    await em_env.reset(task)
    assert (await em_env.step(parse_completion(f"{task['answer']} Republic"))).reward == 0.0


async def test_top_k_is_an_option() -> None:
    call = ToolCall(id="c", name="search", arguments={"query": "born"})
    assert (await make("search-qa").call_tool(call)).output.count("\n") == 2
    assert (await make("search-qa", top_k=5).call_tool(call)).output.count("\n") == 4
