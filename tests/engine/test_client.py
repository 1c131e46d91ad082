"""EngineClient against the session's real SGLang server on CPU (tiny-moe, routing replay)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from agent_rl.sglang.client import EngineClient
from agent_rl.engine.launcher import EngineServer
from agent_rl.kernel.errors import EngineError
from agent_rl.models.corpus import CALC_TOOL

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PROMPT = [5, 6, 7, 8]


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_generate_logprobs_versions_and_routed_experts(sglang_moe_server: EngineServer) -> None:
    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            g = await c.generate(PROMPT, GREEDY, rid="t-gen", return_routed_experts=True)
            assert g.rid == "t-gen" and len(g.output_ids) == 8 == g.completion_tokens
            assert (
                g.logprobs is not None
                and len(g.logprobs) == 8
                and all(lp <= 0 for lp in g.logprobs)
            )
            assert g.finish_reason is not None and g.finish_reason.type in ("length", "stop")
            assert g.weight_version == "default"
            assert [(s.version, s.start, s.end) for s in g.weight_spans] == [("default", 0, 8)]
            # One row per position except the last, 2 layers, top-2 of 8 experts, distinct per row.
            assert g.routed_experts is not None and g.routed_experts.shape == (4 + 8 - 1, 2, 2)
            assert g.routed_experts.min() >= 0 and g.routed_experts.max() < 8
            assert np.all(g.routed_experts[..., 0] != g.routed_experts[..., 1])
            again = await c.generate(PROMPT, GREEDY)
            assert again.output_ids == g.output_ids and again.routed_experts is None

    run(go())


def test_stream_is_cumulative_and_matches_generate(sglang_moe_server: EngineServer) -> None:
    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            chunks = [g async for g in c.stream(PROMPT, GREEDY)]
            full = await c.generate(PROMPT, GREEDY)
        assert len(chunks) >= 2
        for a, b in zip(chunks, chunks[1:], strict=False):
            assert b.output_ids[: len(a.output_ids)] == a.output_ids
        assert all(g.finish_reason is None for g in chunks[:-1])
        assert chunks[-1].finish_reason is not None
        assert chunks[-1].output_ids == full.output_ids
        assert chunks[-1].logprobs == pytest.approx(full.logprobs, abs=1e-4)

    run(go())


def test_abort_returns_partial_tokens(sglang_moe_server: EngineServer) -> None:
    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            long = asyncio.create_task(
                c.generate(
                    [5, 6],
                    {"max_new_tokens": 3000, "ignore_eos": True},
                    rid="t-abort",
                    return_routed_experts=True,
                )
            )
            while not (await c.loads())[0]["num_running_reqs"]:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            await c.abort("t-abort")
            g = await asyncio.wait_for(long, 60)
        assert g.aborted and g.finish_reason is not None and g.finish_reason.type == "abort"
        assert 0 < len(g.output_ids) < 3000
        assert g.logprobs is not None and len(g.logprobs) == len(g.output_ids)
        # A partial episode keeps its routing for replay: one row per position but the last.
        assert g.routed_experts is not None
        assert g.routed_experts.shape == (2 + len(g.output_ids) - 1, 2, 2)

    run(go())


def test_pause_in_place_then_continue(sglang_moe_server: EngineServer) -> None:
    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            await c.pause_generation("in_place")
            try:
                # Sampled at temperature 1: the random model may draw EOS first, so it is ignored
                # (a CI run once stopped after one token).
                waiting = asyncio.create_task(
                    c.generate([5, 6], {"max_new_tokens": 4, "ignore_eos": True})
                )
                await asyncio.sleep(1.5)
                assert not waiting.done(), "a request completed while the engine was paused"
            finally:
                await c.continue_generation()
            g = await asyncio.wait_for(waiting, 60)
            assert len(g.output_ids) == 4 and g.finish_reason is not None
            assert g.finish_reason.type == "length"

    run(go())


def _perturbed_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if w.is_floating_point():
            weights[name] = (
                w + 0.5 * (w.std() + 1e-3) * torch.randn(w.shape, generator=gen)
            ).contiguous()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_update_weights_from_disk_changes_outputs_and_version(
    sglang_moe_server: EngineServer, tiny_moe_model: Path, tmp_path: Path
) -> None:
    other = _perturbed_copy(tiny_moe_model, tmp_path / "perturbed")

    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            before = await c.generate(PROMPT, GREEDY)
            try:
                result = await c.update_weights_from_disk(other, weight_version="v1")
                assert result["success"]
                after = await c.generate(PROMPT, GREEDY)
                assert after.weight_version == "v1" and after.weight_spans[0].version == "v1"
                assert (await c.model_info())["weight_version"] == "v1"
                assert after.output_ids != before.output_ids or not np.allclose(
                    after.logprobs, before.logprobs, atol=1e-3
                )
            finally:
                await c.update_weights_from_disk(tiny_moe_model, weight_version="default")
            restored = await c.generate(PROMPT, GREEDY)
            assert restored.output_ids == before.output_ids and restored.weight_version == "default"

    run(go())


def test_control_calls_and_health(sglang_moe_server: EngineServer) -> None:
    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            assert await c.health_generate()
            loads = await c.loads()
            assert loads and {"num_running_reqs", "num_waiting_reqs"} <= set(loads[0])
            info = await c.model_info()
            assert info["weight_version"] == "default" and info["model_path"]
            assert (await c.begin_weight_update())["success"]
            assert (await c.end_weight_update())["success"]
        async with EngineClient("http://127.0.0.1:9") as dead:
            assert not await dead.health_generate()
            with pytest.raises(EngineError, match="unreachable"):
                await dead.model_info()

    run(go())


def test_chat_template_tokens_match_sglang_tokenizer(
    sglang_moe_server: EngineServer, tiny_moe_model: Path
) -> None:
    """The engine loaded our tokenizer: its count of a rendered conversation equals ours."""
    tok = AutoTokenizer.from_pretrained(tiny_moe_model)
    messages = [{"role": "user", "content": "What is 12 * 34?"}]
    text = tok.apply_chat_template(
        messages, tools=[CALC_TOOL], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False).input_ids

    async def go() -> None:
        async with EngineClient(sglang_moe_server.url) as c:
            by_text = await c._post(
                "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}}
            )
            assert by_text["meta_info"]["prompt_tokens"] == len(ids)
            g = await c.generate(ids, {"max_new_tokens": 4, "temperature": 0})
            assert g.prompt_tokens == len(ids) and len(g.output_ids) == 4

    run(go())
