"""The torch floor of the FSDP runtime is enforced at load, before any rank starts, with a message that says what
to do."""

from __future__ import annotations

import pytest
import torch

from mgpu.errors import MgpuError
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import ModelSpec, ShardedModule
from mgpu.torch_support import MIN_TORCH, require_fsdp_torch, torch_version


@pytest.mark.parametrize("text,parsed", [("2.13.0+cpu", (2, 13)), ("2.11.0+cu130", (2, 11)),
                                         ("2.12.0.dev20260101", (2, 12)), ("10.0.1", (10, 0))])
def test_torch_version(text: str, parsed: tuple[int, int]) -> None:
    assert torch_version(text) == parsed


def test_floor_accepts_the_floor_and_newer() -> None:
    floor = ".".join(map(str, MIN_TORCH))
    require_fsdp_torch(f"{floor}.0+cu130")
    require_fsdp_torch(f"{MIN_TORCH[0]}.{MIN_TORCH[1] + 3}.1")
    require_fsdp_torch()   # the torch running these tests


def test_older_torch_is_refused_with_the_way_out() -> None:
    with pytest.raises(MgpuError, match=r"needs torch >= 2\.11; this ComfyUI runs torch 2\.6\.0\+cu124.*"
                                        r"pip install -U 'torch>=2\.11'.*on one device"):
        require_fsdp_torch("2.6.0+cu124")


def test_a_sharded_load_on_old_torch_fails_before_any_rank_starts(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    pool = RankPool(PoolConfig(devices=["cpu", "cpu"]))
    try:
        with pytest.raises(MgpuError, match="needs torch >= 2.11"):
            ShardedModule(pool, ModelSpec(factory="tiny_models:tiny_mlp", checkpoint=str(tmp_path / "x"))).load()
        assert not pool.alive and pool.generation == 0
    finally:
        pool.close()
