"""agent_rl/kernel/encoding.py: a policy version survives the trip to SGLang's string label and
back, SGLang's own labels read as version 0, and a stored turn's versions come back as the labels
the engine gave (through the rollout's recorded generation and the wire parser)."""

from __future__ import annotations

import numpy as np
import pytest

from agent_rl.kernel.encoding import NO_EXPERT, NO_VERSION, policy_version, version_label
from agent_rl.rollout.recorded import RecordedTurn, recorded_generation
from agent_rl.sglang.generation import Generation
from agent_rl.store import TokenArrays


@pytest.mark.parametrize("version", [0, 1, 7, 123_456])
def test_label_round_trip(version: int) -> None:
    assert version_label(version) == str(version)
    assert policy_version(version_label(version)) == version


@pytest.mark.parametrize("label", [None, "default", "v0", ""])
def test_labels_not_ours_are_the_initial_version(label: str | None) -> None:
    assert policy_version(label) == 0


def test_a_string_label_passes_unchanged() -> None:
    assert version_label("default") == "default"
    assert version_label(np.int32(5).item()) == "5"


def test_sentinels_are_no_valid_id() -> None:
    # Expert ids and policy versions are >= 0; the readers test validity with `>= 0`.
    assert NO_EXPERT < 0 and NO_VERSION < 0


def test_stored_versions_come_back_as_the_engines_labels() -> None:
    span = TokenArrays.build(
        token_ids=[1, 2, 3, 4, 5], logprobs=[0, 0, -1, -1, -1], loss_mask=[0, 0, 1, 1, 1],
        versions=[NO_VERSION, NO_VERSION, 3, 3, 4],
    )
    gen = recorded_generation(RecordedTurn(span=span, num_prompt=2, finish_reason="stop"), "r")
    assert gen.weight_version == "4"
    assert [(s.version, s.start, s.end) for s in gen.weight_spans] == [("3", 0, 2), ("4", 2, 3)]
    assert [policy_version(s.version) for s in gen.weight_spans] == [3, 4]

    # SGLang's spans may carry the version as a JSON number: the parser labels it the same way.
    wire = Generation.from_response({
        "output_ids": [3, 4, 5],
        "meta_info": {"weight_version": "4",
                      "weight_versions": [{"version": 3, "start": 0, "end": 2},
                                          {"version": "4", "start": 2, "end": 3}]},
    })
    assert [(s.version, s.start, s.end) for s in wire.weight_spans] == [("3", 0, 2), ("4", 2, 3)]
