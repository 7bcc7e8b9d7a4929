"""Two models on the same FSDP ranks (Wan 2.2 A14B's experts), without ComfyUI: the pools' one-at-a-time groups,
the loaders' decision from a plan or from the ranks' free memory, and the rank op that reports it.
The ComfyUI tier (the workflow, == stock, peak memory per rank) is test_comfyui_wan22_switch.py."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import psutil
import pytest

import ckpt_layouts as L
from loaders import experts, placement, pools
from mgpu.planning.devices import parse_spec
from mgpu.planning.estimates import Workload
from mgpu.planning.partition import ONE_AT_A_TIME, Component, Policy, make_plan
from mgpu.planning.sizing import size_component
from mgpu.ranks.pool import PoolConfig, RankPool

GiB = 1 << 30


@dataclass(eq=False)
class FakePool:
    """Answers the memory op as ranks on ``devices`` with ``free`` bytes each would."""
    devices: list[str]
    free: int = 64 * GiB
    calls: list[str] = field(default_factory=list)

    @property
    def config(self) -> SimpleNamespace:
        return SimpleNamespace(devices=self.devices)

    def call(self, op: str, payload: dict | None = None):
        self.calls.append(op)
        return [SimpleNamespace(rank=i, payload={"device": d, "free_bytes": self.free, "total_bytes": 80 * GiB,
                                                 "simulated": False}) for i, d in enumerate(self.devices)]


@dataclass(eq=False)   # identity, as a ShardedModule has: pools keep them in weak sets
class FakeSharded:
    pool: FakePool
    checkpoint: str
    reshard: bool = True
    handle: str = "dit-0"
    loaded: bool = True
    freed: int = 0
    load_replies: list[dict] = field(default_factory=lambda: [{"gathered_bytes_per_forward": 2 * GiB}])

    @property
    def spec(self) -> SimpleNamespace:
        return SimpleNamespace(checkpoint=self.checkpoint, reshard_after_forward=self.reshard)

    def free(self) -> None:
        self.freed += 1
        self.loaded = False


@pytest.fixture
def clean_pools(monkeypatch):
    monkeypatch.setattr(pools, "_turns", {})
    monkeypatch.setattr(pools, "_slots", {})
    monkeypatch.setattr(pools, "_models", {})
    live = set()
    monkeypatch.setattr(pools, "_live", live)   # loaded_beside looks here: what release_with registered
    return live


def test_models_that_take_turns_free_each_other_before_loading(clean_pools):
    pool, elsewhere = FakePool(["cuda:0", "cuda:1"]), FakePool(["cuda:2", "cuda:3"])
    high, low, other = FakeSharded(pool, "high.safetensors"), FakeSharded(pool, "low.safetensors"), \
        FakeSharded(pool, "other.safetensors")
    far = FakeSharded(elsewhere, "far.safetensors")
    pools.take_turns(low, [high])
    assert pools.make_room(low) == ["high.safetensors"] and (high.loaded, high.freed) == (False, 1)
    low.loaded = True
    assert pools.make_room(low) == []   # nothing of its group is loaded any more
    high.loaded = True                  # the high-noise expert reloads for the next prompt's first step
    assert pools.make_room(high) == ["low.safetensors"] and not low.loaded
    assert (other.freed, far.freed) == (0, 0) and pools.make_room(other) == []   # not in the group: untouched
    pools.take_turns(far)
    assert pools.make_room(far) == []   # a group is per pool: other devices never free these
    pools.release(high)
    low.loaded = True
    pools.take_turns(other)
    assert pools.make_room(other) == ["low.safetensors"] and high.freed == 2   # released: gone from the group


def _plan_files(tmp_path):
    fp8 = L.recast(L.wan21_t2v_14b(), "F8_E4M3")
    return [size_component(L.write_safetensors(tmp_path / name, fp8, sparse=True))
            for name in ("high.safetensors", "low.safetensors")]


@pytest.mark.parametrize("width, height, turns", [(640, 640, False), (1280, 720, True)])
def test_both_loaders_follow_the_plans_decision(clean_pools, tmp_path, width, height, turns):
    high_size, low_size = _plan_files(tmp_path)
    plan = make_plan([Component("dit", high_size), Component("dit_low_noise", low_size)],
                     parse_spec("2x24GiB,cpu=64GiB"), Workload(width, height, 81, 1, True))
    pool = FakePool(["cuda:0", "cuda:1"], free=1)   # the plan decides: the ranks are not asked
    high, low = FakeSharded(pool, high_size.path), FakeSharded(pool, low_size.path)
    clean_pools.add(high)
    assert experts.share_ranks(high, plan, "node") == (ONE_AT_A_TIME if turns else None)
    assert experts.share_ranks(low, plan, "node") == (ONE_AT_A_TIME if turns else None)
    assert pools.make_room(low) == ([high_size.path] if turns else [])
    assert pool.calls == []


def test_the_plans_one_at_a_time_also_frees_an_expert_its_loader_loaded_without_the_plan(clean_pools, tmp_path):
    high_size, low_size = _plan_files(tmp_path)
    plan = make_plan([Component("dit", high_size), Component("dit_low_noise", low_size)],
                     parse_spec("2x24GiB,cpu=64GiB"), Workload(1280, 720, 81, 1, True))
    pool = FakePool(["cuda:0", "cuda:1"])
    high, other = FakeSharded(pool, high_size.path), FakeSharded(pool, "other.safetensors")
    clean_pools.update({high, other})   # loaded by loaders with no plan connected
    low = FakeSharded(pool, low_size.path)
    assert experts.share_ranks(low, plan, "node") == ONE_AT_A_TIME
    assert pools.make_room(low) == [high_size.path] and other.loaded   # a model the plan does not name stays


@pytest.mark.parametrize("free, keep, others_keep, turns", [
    (24 * GiB, False, False, False),   # 6.9 GiB shard + 4.9 GiB working fit in 23.5 GiB (the ranks' own memory
    (12 * GiB, False, False, True),    # do not fit in 11.5 GiB                  is already taken from their free)
    (24 * GiB, True, False, True),     # + its whole gathered model (13.3 GiB) does not fit
    (23 * GiB, False, True, True),     # + the 11 GiB the other keeps gathered does not fit in 22.5 GiB
])
def test_without_a_plan_the_ranks_free_memory_decides(clean_pools, tmp_path, free, keep, others_keep, turns, caplog):
    """The loader's own plan (no MGPU Plan: device fsdp, the default workload) says what each rank holds of it; the
    ranks say what is free beside the model already there."""
    high_size, low_size = _plan_files(tmp_path)
    own = placement.plan_to_follow("dit", low_size.path, "fsdp", None, devices=parse_spec("2x24GiB,cpu=64GiB"))
    assert placement.is_own(own) and own.placement("dit").devices == ["cuda:0", "cuda:1"]
    pool = FakePool(["cuda:0", "cuda:1"], free=free)
    high = FakeSharded(pool, high_size.path, reshard=not others_keep,
                       load_replies=[{"gathered_bytes_per_forward": 11 * GiB}])
    low = FakeSharded(pool, low_size.path, reshard=not keep)
    assert experts.share_ranks(low, own, "node") is None   # nothing loaded beside it yet
    clean_pools.add(high)
    with caplog.at_level(logging.INFO, logger="mgpu"):
        assert experts.share_ranks(low, own, "node") == (ONE_AT_A_TIME if turns else None)
    assert pool.calls == [pools.MEMORY_OP]
    assert pools.make_room(low) == ([high_size.path] if turns else [])
    said = "takes turns with high.safetensors" if turns else "stays on the FSDP ranks beside high.safetensors"
    assert f"node: no MGPU Plan: low.safetensors {said}" in caplog.text


def test_a_plan_of_one_dit_leaves_the_decision_to_the_ranks(clean_pools, tmp_path):
    """An MGPU Plan of one DiT sharded over the ranks does not know the model already there: the ranks' free memory
    decides, weighed against what the plan says each rank holds."""
    high_size, low_size = _plan_files(tmp_path)
    plan = make_plan([Component("dit", low_size)], parse_spec("2x24GiB,cpu=64GiB"), Workload(),
                     Policy(prefer_speed=True))
    assert plan.placement("dit").strategy == "fsdp"
    pool = FakePool(["cuda:0", "cuda:1"], free=12 * GiB)
    clean_pools.add(FakeSharded(pool, high_size.path))
    assert experts.share_ranks(FakeSharded(pool, low_size.path), plan, "node") == ONE_AT_A_TIME


@pytest.mark.timeout(240)
def test_the_ranks_report_their_free_memory_or_the_simulated_one():
    """cpu ranks: the host's available RAM (each rank the same host); MGPU_SIMULATE_RANK_FREE replaces it."""
    for env, expect in (({}, None), ({"MGPU_SIMULATE_RANK_FREE": "3GiB"}, 3 * GiB)):
        pool = RankPool(PoolConfig(["cpu", "cpu"], env=env))
        try:
            ranks = pools.rank_memory(pool)
        finally:
            pool.close()
        assert [(d.id, d.kind, d.index, d.source) for d in ranks] == [("cpu", "cpu", None, "rank")] * 2
        available = psutil.virtual_memory().available
        for d in ranks:
            assert d.total_bytes == psutil.virtual_memory().total
            if expect is None:
                assert 0.5 * available < d.free_bytes < 1.5 * available and not d.simulated
            else:
                assert d.free_bytes == expect and d.simulated
    assert "MGPU_SIMULATE_RANK_FREE" not in os.environ
