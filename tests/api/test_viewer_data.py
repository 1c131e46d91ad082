"""The token strip the episode page draws: turn, version and segment boundaries where the
stream has them."""

from __future__ import annotations

from agent_rl.app.api.schemas import TokenView, TurnOut
from agent_rl.app.api.viewer_data import token_strip


def _turn(index: int, start: int, n: int, segment: int) -> TurnOut:
    return TurnOut(index=index, span_start=start, num_tokens=n, num_prompt_tokens=2,
                   finish_reason="stop", drift=False, started_at=0.0, finished_at=1.0,
                   segment=segment)  # fmt: skip


def test_a_rewritten_history_is_marked_where_its_segment_starts() -> None:
    n = 12
    view = TokenView(token_ids=list(range(n)), pieces=None, logprobs=[-0.1] * n,
                     trainer_logprobs=None, loss_mask=[0, 0, 1, 1] * 3, versions=[-1, -1, 0, 0] * 3,
                     routed_experts=None, tokenizer=None)  # fmt: skip
    turns = [_turn(0, 0, 4, 0), _turn(1, 4, 4, 1), _turn(2, 8, 4, 1)]
    marks = [(i, item["mark"]) for i, item in enumerate(token_strip(view, turns)) if "mark" in item]
    labels = [m for _, m in marks]
    assert labels.count("segment 1: history rewritten") == 1
    assert [m for m in labels if m.startswith("turn")] == ["turn 0", "turn 1", "turn 2"]
    # The branch mark comes right before the turn that starts the segment.
    at = labels.index("segment 1: history rewritten")
    assert labels[at + 1] == "turn 1"
    # An episode of one segment has no branch mark.
    plain = [_turn(0, 0, 4, 0), _turn(1, 4, 4, 0), _turn(2, 8, 4, 0)]
    assert not [i for i in token_strip(view, plain) if i.get("cls") == "segment"]
