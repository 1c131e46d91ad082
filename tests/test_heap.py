"""`long_lived_heap`: what serve's collector settings are while it serves, and after."""

from __future__ import annotations

import gc

from agent_rl.heap import YOUNG_THRESHOLD, long_lived_heap


def test_freezes_the_heap_and_restores_the_collector_after() -> None:
    before, frozen_before = gc.get_threshold(), gc.get_freeze_count()
    alive = [object() for _ in range(10)], {"a": [1]}  # tracked containers alive at entry
    with long_lived_heap():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > frozen_before
        scanned = {id(o) for o in gc.get_objects()}
        assert all(gc.is_tracked(c) and id(c) not in scanned for c in alive)  # frozen out of the scans
        cycle: list[object] = []
        cycle.append(cycle)  # a cycle made while serving is still the collector's to find
        assert any(o is cycle for o in gc.get_objects(generation=0))
        del cycle
        assert gc.collect() >= 1
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen_before


def test_nested_uses_keep_the_outermost_settings() -> None:
    before = gc.get_threshold()
    with long_lived_heap(young=5_000):
        with long_lived_heap(young=9_000):
            assert gc.get_threshold()[0] == 5_000
        assert gc.get_threshold()[0] == 5_000  # the inner exit does not restore
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
