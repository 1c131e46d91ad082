"""Weight sync in memory against real SGLang on CPU: two engines (the session's tiny-moe server
and one of this module's) behind the real router, the real Megatron learner on the same model.

After a step, a `distributed` push (gloo group of the trainer and both engines) and a `tensor`
push (shared memory) each leave both engines serving the new version, with logprobs on fixed
tokens equal to the trainer's to 1e-5 (fp32). An engine SIGKILLed between two buckets of a
broadcast (fault injection: the kill is ours, timed by wrapping the bucket send) is dropped:
the push returns within its timeout, the survivor serves the version, the next push goes to
the survivor alone; restarted, the engine loads the router's restore point (the newest export)
before it serves, and the push after that brings it back into the group.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import SecretStr

from agent_rl.config import Config, RouterConfig, TrainerConfig
from agent_rl.config.trainer import WeightSyncConfig
from agent_rl.sglang.client import EngineClient
from agent_rl.engine.launcher import EngineServer
from router import Router
from tests.trainer._served import served_config, served_db  # noqa: F401 (fixture)
from tests.trainer._syncs import SEQUENCES, engine_logprobs, max_diff, trainer_logprobs
from trainer.batch import Batch
from trainer.learner import Learner, learner
from trainer.loop import TrainLoop
from trainer.weight_sync import MODES, make_sync, router_url
from trainer.weight_sync.distributed import Broadcast
from trainer.weight_sync.memory import buckets, parts

@pytest.fixture(scope="module")
def second_engine(
    engine_venv: Path, tiny_moe_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    """A second engine on tiny-moe for this module only (its ~2 GB go back after it); the kill
    test, last here, kills and restarts it."""
    server = EngineServer(tiny_moe_model, venv=engine_venv, startup_timeout_s=240.0,
                          log_dir=tmp_path_factory.mktemp("weight-sync-engine-logs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def engines(
    sglang_moe_server: EngineServer, second_engine: EngineServer, tiny_moe_model: Path
) -> Iterator[list[str]]:
    urls = [sglang_moe_server.url, second_engine.url]
    yield urls

    async def back() -> None:  # the session's server goes back to its initial weights
        for url in urls:
            async with EngineClient(url) as c:
                try:
                    await c.update_weights_from_disk(tiny_moe_model, weight_version="default")
                except Exception:  # noqa: BLE001 (the killed engine cannot)
                    if url == sglang_moe_server.url:
                        raise

    asyncio.run(back())


def _stepped(model: Path, cfg: TrainerConfig) -> Iterator[Learner]:
    """A learner one large RL step away from the model's weights."""
    with learner(model, cfg) as e:
        batch = Batch.from_sequences(
            SEQUENCES,
            loss_masks=[[0.0] * 2 + [1.0] * (len(s) - 2) for s in SEQUENCES],
            rollout_logprobs=[[-5.0] * len(s) for s in SEQUENCES],
            advantages=[1.0, -1.0],
        )
        e.rl_step(batch)
        yield e


def _router_config() -> RouterConfig:
    return RouterConfig(port=0, health_interval_s=0, admin_token="secret")


def test_buckets_keep_the_order_and_the_size_limit() -> None:
    weights = {"a": torch.zeros(10), "b": torch.zeros(30), "c": torch.zeros(5),
               "d": torch.zeros(100)}  # 40, 120, 20 and 400 bytes
    parts = [[name for name, _ in part] for part in buckets(weights, 160)]
    assert parts == [["a", "b"], ["c"], ["d"]]  # a tensor over the limit travels alone


def test_the_drafts_weights_go_to_the_draft_in_buckets_of_their_own() -> None:
    weights = {"model.embed_tokens.weight": torch.zeros(10), "mtp.fc.weight": torch.zeros(10),
               "model.norm.weight": torch.zeros(10), "mtp.norm.weight": torch.zeros(10),
               "lm_head.weight": torch.zeros(10)}  # fmt: skip
    cut = [([name for name, _ in bucket], selector) for bucket, selector in parts(weights, 80)]
    assert cut == [(["model.embed_tokens.weight", "model.norm.weight"], "target"),
                   (["lm_head.weight"], "target"),
                   (["mtp.fc.weight", "mtp.norm.weight"], "draft")]  # fmt: skip
    assert [s for _, s in parts({"a": torch.zeros(1)}, 80)] == ["target"]


def test_tensors_sglang_fuses_within_one_load_travel_in_one_bucket() -> None:
    """SGLang's DeepSeek-V3 loader fuses `q_a_proj` with `kv_a_proj_with_mqa` only when one
    `load_weights` call holds both: a bucket boundary between them left the fused parameter
    as it was. The pair travels together (moved up beside the first), in the family's order."""
    names = ["0.self_attn.q_a_proj.weight", "0.self_attn.q_b_proj.weight",
             "0.self_attn.kv_a_proj_with_mqa.weight", "0.mlp.gate.weight",
             "1.self_attn.q_b_proj.weight", "1.self_attn.kv_a_proj_with_mqa.weight",
             "1.self_attn.q_a_proj.weight"]  # fmt: skip
    weights = {f"model.layers.{name}": torch.zeros(10) for name in names}  # 40 bytes each
    cut = [[name.removeprefix("model.layers.") for name, _ in b] for b in buckets(weights, 40)]
    assert cut == [[names[0], names[2]], [names[1]], [names[3]], [names[4]],
                   [names[6], names[5]]]  # fmt: skip
    assert [len(b) for b in buckets(weights, 1 << 20)] == [7]


def test_a_native_nextn_layer_goes_to_the_draft_under_its_export_names() -> None:
    """GLM-4.5's and DeepSeek-V3's draft is model layer `num_hidden_layers` (the one carrying
    `eh_proj`), which SGLang's NextN class loads by those names: the whole layer, and no trunk
    layer, travels in the draft's buckets."""
    nextn = ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
             "model.layers.2.self_attn.o_proj.weight", "model.layers.2.mlp.gate.weight",
             "model.layers.2.shared_head.norm.weight"]  # fmt: skip
    trunk = ["model.embed_tokens.weight", "model.layers.1.self_attn.o_proj.weight",
             "model.layers.1.mlp.gate.weight", "model.layers.12.input_layernorm.weight",
             "model.norm.weight"]  # fmt: skip
    weights = {name: torch.zeros(10) for name in trunk[:2] + nextn + trunk[2:]}
    cut = [([name for name, _ in b], selector) for b, selector in parts(weights, 1 << 20)]
    assert cut == [(trunk, "target"), (nextn, "draft")]


def test_every_configurable_mode_has_its_sync() -> None:
    """`trainer.weight_sync.mode`'s values are exactly `MODES`' keys: a mode added to the config
    without its class (or the reverse) fails here."""
    modes = typing.get_args(WeightSyncConfig.model_fields["mode"].annotation)
    assert sorted(MODES) == sorted(modes)
    client = EngineClient("http://127.0.0.1:9")  # never called
    for mode in modes:
        sync = make_sync(client, WeightSyncConfig(mode=mode))
        assert isinstance(sync, MODES[mode]) and sync.in_memory == (mode != "disk")


def test_the_router_is_the_option_then_the_trainers_then_the_rollouts() -> None:
    both = Config(trainer={"weight_sync": {"router_url": "http://t"}},
                  rollout={"router_url": "http://r"})
    assert router_url(both, "http://option") == "http://option"
    assert router_url(both) == "http://t"
    assert router_url(Config(rollout={"router_url": "http://r"})) == "http://r"
    assert router_url(Config()) is None


def test_bucket_size_by_mode_unless_set() -> None:
    client = EngineClient("http://127.0.0.1:9")  # never called
    size = lambda mode, **kw: make_sync(  # noqa: E731
        client, WeightSyncConfig(mode=mode, **kw)).limit_bytes  # type: ignore[attr-defined]
    assert size("distributed") == 64 << 20  # gloo on CPU: bench/weight_sync.py's fastest
    assert size("tensor") == 256 << 20
    for mode in ("distributed", "tensor"):
        assert size(mode, bucket_mb=8) == 8 << 20


@pytest.mark.parametrize("mode", ["distributed", "tensor"])
def test_push_serves_the_trainers_weights_on_both_engines(
    mode: str, engines: list[str], tiny_moe_model: Path
) -> None:
    """With an MTP draft: its buckets go with `selector: "draft"`, which SGLang takes (and,
    serving no draft on CPU, loads nowhere; test_mtp.py loads them into SGLang's draft)."""
    cfg = TrainerConfig(weight_sync={"mode": mode, "bucket_mb": 0.5, "timeout_s": 60},
                        optim={"lr": 1e-2}, micro_batch_size=4, mtp={"layers": 1})
    for e in _stepped(tiny_moe_model, cfg):
        ours = trainer_logprobs(e)
        weights = e.hf_state_dict()
        drafts = sum(s == "draft" for _, s in parts(weights, 1 << 19))
        assert drafts >= 1

        async def go() -> Any:
            before = await engine_logprobs(engines[0])
            async with Router(_router_config(), engines) as router:
                client = EngineClient(router.url, token="secret")
                sync = make_sync(client, cfg.weight_sync)
                report = await sync.push(weights, 7)
                await sync.close()
                await client.aclose()
            return before, report, [await engine_logprobs(u) for u in engines]

        before, report, after = asyncio.run(go())
    assert report.ok and sorted(report.updated) == sorted(engines), report
    # Bucketed: 0.5 MB buckets of a ~3 MB model, the draft's after the policy's; all loaded.
    assert report.buckets == len(list(parts(weights, 1 << 19))) > drafts
    assert max_diff(before[1], ours) > 1e-3  # the step moved the weights
    for url, (version, theirs) in zip(engines, after):
        diff = max_diff(theirs, ours)
        print(f"{mode}: {url} serves {version}; max |engine - trainer| logprob {diff:.2e}")
        assert version == "7"
        assert diff <= 1e-5


def test_a_new_trainer_joins_engines_that_kept_a_dead_trainers_group(
    engines: list[str], tiny_moe_model: Path
) -> None:
    """A trainer that dies leaves its group on the engines (nobody destroys it); its successor
    must form a group of its own at its first push, not meet "group name already created"."""
    cfg = TrainerConfig(weight_sync={"mode": "distributed", "timeout_s": 60}, micro_batch_size=4)
    for e in _stepped(tiny_moe_model, cfg):
        weights = e.hf_state_dict()

        async def go() -> list[Any]:
            async with Router(_router_config(), engines) as router:
                client = EngineClient(router.url, token="secret")
                dead = make_sync(client, cfg.weight_sync)
                successor = make_sync(client, cfg.weight_sync)
                assert isinstance(dead, Broadcast) and isinstance(successor, Broadcast)
                reports = [await dead.push(weights, 8)]  # then never closed, as if killed
                reports.append(await successor.push(weights, 9))
                for sync in (successor, dead):
                    await sync.close()
                await client.aclose()
            return reports

        first, second = asyncio.run(go())
    assert first.ok, first
    assert second.ok and sorted(second.updated) == sorted(engines), second


class _RouterThread(threading.Thread):
    """The router on an event loop of its own (the trainer loop runs its own, as in `train`)."""

    def __init__(self, workers: list[str]) -> None:
        super().__init__(daemon=True)
        self.workers, self.ready, self.router = workers, threading.Event(), None

    def run(self) -> None:
        async def main() -> None:
            async with Router(_router_config(), self.workers) as router:
                self.router, self.stop_event = router, asyncio.Event()
                self.loop = asyncio.get_running_loop()
                self.ready.set()
                await self.stop_event.wait()

        asyncio.run(main())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.join(30)


def test_train_loop_pushes_every_step_and_names_exports(
    engines: list[str], tiny_moe_model: Path, served_db: Path, tmp_path: Path
) -> None:
    """`agent-rl train`'s loop with weight_sync.mode = "distributed": a push after each step (both
    engines serve it), an export every `export_every` steps named to the router as the
    weights a returning engine loads first."""
    shutil.copy(served_db, tmp_path / "store.db")
    thread = _RouterThread(engines)
    thread.start()
    assert thread.ready.wait(30) and thread.router is not None
    try:
        cfg = served_config(tmp_path / "store.db", thread.router.url, tiny_moe_model)
        cfg = cfg.model_copy(update={
            "router": cfg.router.model_copy(update={"admin_token": SecretStr("secret")}),
            "trainer": TrainerConfig(
                groups_per_step=2, micro_batch_size=4, checkpoint_dir=tmp_path / "ckpt",
                export_dir=tmp_path / "exports", tensorboard_dir=None, data_poll_s=0.2,
                weight_sync={"mode": "distributed", "router_url": thread.router.url},
                export_every=2)})
        lines: list[str] = []
        with learner(tiny_moe_model, cfg.trainer) as e:
            stats = TrainLoop(cfg, e, log=lines.append).run(max_steps=2)
        print("\n".join(lines))
        assert stats.steps == 2 and stats.version == 2 and stats.failed_syncs == 0, lines
        assert [h["weight_sync_ok"] for h in stats.history] == [True, True]
        assert thread.router.control.last_update is not None
        assert thread.router.control.last_update[1] == "2"  # v2's export, not v1 (none made)
        assert not (tmp_path / "exports" / "v000001").exists()
    finally:
        thread.stop()
    for url in engines:
        assert asyncio.run(engine_logprobs(url))[0] == "2"


def test_engine_killed_mid_broadcast_is_dropped_and_catches_up_after_restart(
    engines: list[str], second_engine: EngineServer, tiny_moe_model: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = TrainerConfig(weight_sync={"mode": "distributed", "bucket_mb": 0.25, "timeout_s": 20},
                        optim={"lr": 1e-2}, micro_batch_size=4)
    original = Broadcast._broadcast_bucket
    sent: list[int] = []

    async def killing(self: Broadcast, *args: Any, **kwargs: Any) -> Any:
        # Fault injection: the second engine dies after the first bucket reached it.
        if len(sent) == 1:
            os.killpg(second_engine.pid, signal.SIGKILL)
        sent.append(1)
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(Broadcast, "_broadcast_bucket", killing)
    for e in _stepped(tiny_moe_model, cfg):
        ours = trainer_logprobs(e)
        weights = e.hf_state_dict()
        export = e.export_hf(tmp_path / "v000009")  # what the loop names as restore point

        async def go() -> Any:
            # Health checks on: the dead engine is quarantined, and restored once it answers.
            rcfg = _router_config().model_copy(
                update={"health_interval_s": 0.5, "quarantine_after": 1, "recover_after": 1})
            async with Router(rcfg, engines) as router:
                client = EngineClient(router.url, token="secret")
                sync = make_sync(client, cfg.weight_sync)
                t0 = time.monotonic()
                first = await sync.push(weights, 8)
                took = time.monotonic() - t0
                second = await sync.push(weights, 9)
                await client.restore_point(export, "9")
                await second_engine.astart()  # restarted on its launch weights
                worker = router.pool.get(engines[1])
                assert worker is not None
                for _ in range(240):  # restored only once it loaded the restore point
                    if not worker.quarantined:
                        break
                    await asyncio.sleep(0.25)
                restored = worker.weight_version, worker.quarantined
                third = await sync.push(weights, 10)  # and it rejoins the group
                await sync.close()
                await client.aclose()
            return first, took, second, restored, third

        first, took, second, restored, third = asyncio.run(go())
    print(f"kill mid-broadcast: push took {took:.1f}s, dropped {first.dropped}; next {second}; "
          f"restarted engine restored at {restored}; then {third}")
    assert not first.ok and list(first.dropped) == [engines[1]]
    assert first.updated == [engines[0]]
    assert took < 3 * cfg.weight_sync.timeout_s
    assert second.ok and second.updated == [engines[0]]
    assert restored == ("9", False)
    assert third.ok and sorted(third.updated) == sorted(engines)
    for url in engines:
        version, theirs = asyncio.run(engine_logprobs(url))
        assert version == "10"
        assert max_diff(theirs, ours) <= 1e-5
