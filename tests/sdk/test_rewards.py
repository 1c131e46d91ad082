"""Answer rules: normalization, EM, F1, exact numbers, and what `score` may return."""

from __future__ import annotations

import pytest

from agent_rl import EnvError, Reward
from agent_rl.sdk.rewards import (
    as_reward,
    exact_match,
    extract_answer,
    last_number,
    normalize_answer,
    number_match,
    token_f1,
)


def test_normalize_and_exact_match() -> None:
    assert normalize_answer("  The  Kingdom, of Veloria! ") == "kingdom of veloria"
    assert exact_match("the veloria.", "Veloria") == 1.0
    assert exact_match("Veloria Republic", ["x", "Veloria"]) == 0.0


def test_token_f1() -> None:
    assert token_f1("Veloria", "Veloria") == 1.0
    assert token_f1("north Veloria", "Veloria") == pytest.approx(2 / 3)
    assert token_f1("", "Veloria") == 0.0 and token_f1("abc", ["x", "abc d"]) == pytest.approx(
        2 / 3
    )


def test_numbers_compare_exactly() -> None:
    assert number_match("The answer is 1,788.", "1788") == 1.0
    assert number_match("420196140727489674", "420196140727489673") == 0.0  # equal as floats
    assert number_match("2.50", 2.5) == 1.0 and number_match("none", "1") == 0.0
    assert last_number("from -3 to -7") == "-7"


def test_answer_tags_and_score_return_values() -> None:
    assert extract_answer("think... <answer> Paris </answer> bye") == "Paris"
    assert extract_answer(" plain ") == "plain"
    assert as_reward(1) == Reward(value=1.0) and as_reward(True) == Reward(value=1.0)
    assert as_reward({"value": 0.5, "components": {"a": 1}}).components == {"a": 1.0}
    with pytest.raises(EnvError, match="return a float or a Reward"):
        as_reward("1")  # type: ignore[arg-type]
