"""Fixtures for the trainer tests: one torch thread, and megatron's process-global state torn
down after each test that builds a model, so the next can pick other parallel sizes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def solo() -> Iterator[None]:
    """torch.distributed + megatron groups as a world of one (TP=PP=EP=1)."""
    from trainer import dist_env
    from trainer.arch import Parallel

    dist_env.init(Parallel())
    yield
    dist_env.teardown()
