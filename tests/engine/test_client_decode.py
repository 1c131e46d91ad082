"""Decoding SGLang's /generate payloads into Generation (no server: payloads as SGLang 0.5.23
writes them, shapes taken from recorded responses)."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from agent_rl.sglang.generation import Generation, WeightSpan, decode_routed_experts
from agent_rl.kernel.errors import EngineError


def _body(output_ids: list[int], prompt_tokens: int, **meta: object) -> dict:
    return {
        "text": "x",
        "output_ids": output_ids,
        "meta_info": {
            "id": "rid-1",
            "finish_reason": {"type": "length", "length": len(output_ids)},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(output_ids),
            "cached_tokens": 1,
            "weight_version": "v2",
            "weight_versions": [
                {"version": "v1", "start": 0, "end": 2},
                {"version": "v2", "start": 2, "end": 3},
            ],
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(output_ids)],
            **meta,
        },
    }


def test_tokens_logprobs_versions_finish() -> None:
    g = Generation.from_response(_body([43, 202, 35], prompt_tokens=4))
    assert g.rid == "rid-1" and g.output_ids == [43, 202, 35]
    assert g.logprobs == [-0.5, -1.5, -2.5]
    assert g.weight_spans == [WeightSpan("v1", 0, 2), WeightSpan("v2", 2, 3)]
    assert (
        g.finish_reason is not None
        and g.finish_reason.type == "length"
        and g.finish_reason.length == 3
    )
    assert not g.aborted and g.cached_tokens == 1 and g.routed_experts is None


def test_routed_experts_shape_is_tokens_minus_one_by_layers_by_topk() -> None:
    # 4 prompt + 3 output tokens -> 6 rows, 2 layers, top-2.
    experts = np.arange(6 * 2 * 2, dtype="<i4") % 8
    b64 = base64.b64encode(experts.tobytes()).decode()
    g = Generation.from_response(_body([1, 2, 3], prompt_tokens=4, routed_experts=b64), moe_topk=2)
    assert g.routed_experts is not None and g.routed_experts.shape == (6, 2, 2)
    assert g.routed_experts.dtype == np.int32
    assert np.array_equal(g.routed_experts.reshape(-1), experts)
    # Without top-k the rows are still right; layers and experts stay flattened.
    assert decode_routed_experts(b64, 6, None).shape == (6, 4)
    with pytest.raises(EngineError, match="do not fill"):
        decode_routed_experts(b64, 5, 2)


def test_logprobs_that_do_not_match_output_ids_are_an_error() -> None:
    body = _body([1, 2], prompt_tokens=2)
    body["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(EngineError, match="do not match"):
        Generation.from_response(body)


def test_streaming_chunk_without_finish_reason() -> None:
    body = _body([7], prompt_tokens=3, finish_reason=None)
    g = Generation.from_response(body)
    assert g.finish_reason is None and not g.aborted


def test_token_ids_keep_their_json_as_they_grow() -> None:
    from agent_rl.sglang.generation import TokenIds, json_body

    ids = TokenIds([1, 2])
    ids.extend([3, 40000])
    ids.append(5)
    ids += [6]
    ids.extend([])
    assert ids == [1, 2, 3, 40000, 5, 6] and json.loads(ids.json()) == ids
    assert json.loads(TokenIds().json()) == []
    body = {"input_ids": ids, "sampling_params": {"temperature": 1.0}, "rid": "r"}
    assert json.loads(json_body(body)) == {**body, "input_ids": list(ids)}
    assert json.loads(json_body({"input_ids": ids})) == {"input_ids": list(ids)}
    for edit in (lambda: ids.insert(0, 1), ids.pop, lambda: ids.__setitem__(0, 9), ids.clear):
        with pytest.raises(TypeError, match="only grow"):
            edit()
    assert json.loads(ids.json()) == ids == [1, 2, 3, 40000, 5, 6]
