"""The parts of the FSDP diffusion loader that need no ComfyUI: rank devices, dtype agreement between ranks, pool
sharing and release, rank-failure messages, header-only meta state dicts. The ComfyUI tier is test_comfyui_fsdp.py."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from comfy_checkpoints import WanDiTConfig, wan21_dit_shapes, write_tiny_wan21_t2v

from loaders import pools
from loaders.rank_factory import (
    NUMERIC_FLAGS,
    agree_dtype,
    meta_state_dict,
    numeric_flags,
    restore_flags,
)
from mgpu.errors import MgpuError, RankFailure

# ----------------------------------------------------------------------------------------------- rank devices


def test_fsdp_ranks_zero_keeps_the_resolved_group() -> None:
    assert pools.fsdp_devices(["cuda:0", "cuda:1", "cuda:2"], 0) == ["cuda:0", "cuda:1", "cuda:2"]


def test_fsdp_ranks_takes_the_first_gpus() -> None:
    assert pools.fsdp_devices(["cuda:0", "cuda:1", "cuda:2"], 2) == ["cuda:0", "cuda:1"]


def test_fsdp_ranks_on_a_machine_without_gpu_is_that_many_cpu_ranks() -> None:
    assert pools.fsdp_devices(["cpu", "cpu"], 3) == ["cpu", "cpu", "cpu"]


def test_more_fsdp_ranks_than_gpus_names_the_gpus() -> None:
    with pytest.raises(MgpuError, match=r"fsdp_ranks is 3 but the FSDP group has only 2 GPU\(s\) \(cuda:0, cuda:1\)"):
        pools.fsdp_devices(["cuda:0", "cuda:1"], 3)


# ----------------------------------------------------------------------------------------------- dtype agreement

def _reply(preferred: str, **casts: str | None) -> dict:
    return {"preferred": preferred, "manual_cast": {preferred: casts.pop(preferred, None), **casts}}


def test_ranks_that_agree_keep_their_choice() -> None:
    replies = [_reply("bfloat16", float16=None, float32=None)] * 2
    assert agree_dtype(replies, ["cuda:0", "cuda:1"]) == ("bfloat16", None)


def test_fp8_storage_computes_in_the_common_cast() -> None:
    replies = [_reply("float8_e4m3fn", float8_e4m3fn="bfloat16")] * 2
    assert agree_dtype(replies, ["cuda:0", "cuda:1"]) == ("float8_e4m3fn", "bfloat16")


def test_mixed_gpus_fall_back_to_a_dtype_every_rank_computes_natively() -> None:
    ampere = _reply("bfloat16", float16=None, float32=None)
    turing = _reply("float16", bfloat16="float16", float32=None)   # no bf16 arithmetic: it would cast to fp16
    assert agree_dtype([ampere, turing], ["cuda:0", "cuda:1"]) == ("float16", None)


def test_a_forced_dtype_the_ranks_compute_differently_is_refused_with_the_devices() -> None:
    replies = [_reply("bfloat16"), _reply("bfloat16", bfloat16="float16")]
    with pytest.raises(MgpuError, match=r"cuda:0: bfloat16 \(computes as stored\); "
                                        r"cuda:1: bfloat16 \(computes float16\)"):
        agree_dtype(replies, ["cuda:0", "cuda:1"])


def test_only_the_host_flags_that_change_numerics_travel_to_the_ranks() -> None:
    import enum
    import json

    class PerformanceFeature(enum.Enum):   # as comfy.cli_args has it
        Fp16Accumulation = "fp16_accumulation"
        AutoTune = "autotune"
        CublasOps = "cublas_ops"

    fast = {PerformanceFeature.CublasOps, PerformanceFeature.Fp16Accumulation}
    args = SimpleNamespace(force_fp32=True, bf16_unet=False, use_pytorch_cross_attention=True, listen="0.0.0.0",
                           cpu=True, preview_method="auto", fp8_e4m3fn_unet=None, fast=fast, reserve_vram=2.0)
    flags = numeric_flags(args)
    assert flags == {"force_fp32": True, "bf16_unet": False, "use_pytorch_cross_attention": True,
                     "fast": ["cublas_ops", "fp16_accumulation"]}
    assert json.loads(json.dumps(flags)) == flags   # plain data: no ComfyUI class crosses to the ranks
    cli_args = SimpleNamespace(PerformanceFeature=PerformanceFeature)
    assert restore_flags(json.loads(json.dumps(flags)), cli_args) == {**flags, "fast": fast}
    assert restore_flags({"fast": []}, cli_args) == {"fast": set()}
    with pytest.raises(MgpuError, match="no --fast fp8_matrix_mult: they import another ComfyUI"):
        restore_flags({"fast": ["fp8_matrix_mult"]}, cli_args)
    assert "cpu" not in NUMERIC_FLAGS   # each rank sets it for its own device


# ----------------------------------------------------------------------------------------------- header only

def test_meta_state_dict_has_the_checkpoint_shapes_and_dtypes_without_weights(tmp_path) -> None:
    cfg = WanDiTConfig(dim=256, ffn_dim=512, num_layers=3)
    path = write_tiny_wan21_t2v(tmp_path / "wan.safetensors", cfg, prefix="model.diffusion_model.")
    sd = meta_state_dict(str(path))
    assert {k: tuple(v.shape) for k, v in sd.items()} == {
        "model.diffusion_model." + k: tuple(s) for k, s in wan21_dit_shapes(cfg).items()}
    assert all(v.is_meta and v.dtype == torch.bfloat16 for v in sd.values())


# ----------------------------------------------------------------------------------------------- pools

@dataclass
class FakePool:
    config: SimpleNamespace
    closed: bool = False

    def close(self) -> None:
        self.closed = True


@dataclass(eq=False)   # identity, as a ShardedModule has: pools keep them in weak sets
class FakeSharded:
    pool: FakePool
    handle: str
    spec: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(checkpoint="model.safetensors"))
    freed: int = 0
    loaded: bool = True

    def free(self) -> None:
        self.freed += 1
        self.loaded = False


@pytest.fixture
def fake_pools(monkeypatch):
    monkeypatch.setattr(pools, "_pools", {})
    monkeypatch.setattr(pools, "_models", {})
    monkeypatch.setattr(pools, "_slots", {})
    monkeypatch.setattr(pools, "_collected", deque())
    monkeypatch.setattr(pools, "RankPool", FakePool)
    monkeypatch.setattr(pools, "PoolConfig", lambda **kw: SimpleNamespace(**kw))


def test_models_on_the_same_devices_share_one_pool_that_outlives_them(fake_pools) -> None:
    pool = pools.acquire(["cpu", "cpu"], "a", ["/comfy"])
    assert pools.acquire(["cpu", "cpu"], "b", ["/comfy"]) is pool
    assert pool.config.devices == ["cpu", "cpu"] and pool.config.extra_sys_path == ["/comfy"]
    a, b = FakeSharded(pool, "a"), FakeSharded(pool, "b")
    pools.release(a)
    pools.release(b)
    assert (a.freed, b.freed) == (1, 1)
    assert not pool.closed                                   # the next model here starts without a restart
    assert pools.acquire(["cpu", "cpu"], "c", ["/comfy"]) is pool


def test_a_pool_on_other_devices_stops_only_the_idle_pools(fake_pools) -> None:
    idle = pools.acquire(["cuda:0", "cuda:1"], "a", [])
    busy = pools.acquire(["cuda:2", "cuda:3"], "b", [])
    pools.release(FakeSharded(idle, "a"))
    new = pools.acquire(["cuda:0", "cuda:1", "cuda:2"], "c", [])
    assert idle.closed and not busy.closed and not new.closed
    assert pools.acquire(["cuda:0", "cuda:1"], "d", []) is not idle   # a stopped pool is never handed out again


class Model:
    """Stands in for the host's BaseModel, which every clone of a MODEL shares."""


def test_a_model_is_freed_when_its_model_is_garbage_not_before(fake_pools) -> None:
    pool = pools.acquire(["cpu", "cpu"], "a", [])
    held, dropped = Model(), Model()
    kept, gone = FakeSharded(pool, "a"), FakeSharded(pool, "b")
    pools.release_with(held, kept)
    pools.release_with(dropped, gone)
    cycle = [dropped]
    cycle.append(cycle)   # only the collector frees it, as with ComfyUI's caches
    del dropped, cycle
    pools.release_garbage()                    # synchronously: freed before the load that called it goes on
    assert (gone.freed, kept.freed) == (1, 0)
    assert "b" not in pools._models[("cpu", "cpu")] and "a" in pools._models[("cpu", "cpu")]


def test_a_model_dropped_with_no_load_coming_is_freed_by_the_fallback_thread(fake_pools) -> None:
    pool = pools.acquire(["cpu"], "a", [])
    model, sharded = Model(), FakeSharded(pool, "a")
    pools.release_with(model, sharded)
    del model
    deadline = time.monotonic() + 5
    while not sharded.freed and time.monotonic() < deadline:
        time.sleep(0.01)
    pools.drain()
    assert sharded.freed == 1                  # released once


def test_a_loader_run_again_evicts_only_its_own_previous_model(fake_pools) -> None:
    pool = [pools.acquire(["cpu", "cpu"], h, []) for h in ("a", "b", "c")][0]
    tab_a, tab_b, tab_b_again = (FakeSharded(pool, h) for h in ("a", "b", "c"))
    pools.occupy(("tab-A", "4"), tab_a)
    pools.occupy(("tab-B", "4"), tab_b)       # the same node id in another workflow: tab A's model stays
    assert (tab_a.freed, tab_b.freed) == (0, 0)
    pools.occupy(("tab-B", "4"), tab_b_again)  # node 4 of tab B loads again: its previous model goes first
    assert (tab_a.freed, tab_b.freed) == (0, 1)
    assert "b" in pools._models[("cpu", "cpu")]   # evicted, not released: it reloads if sampled again
    tab_b.loaded = True
    pools.occupy(("tab-B", "4"), tab_b)       # ... and that reload evicts the newer one in turn
    assert tab_b_again.freed == 1
    pools.occupy(None, FakeSharded(pool, "d"))  # no slot (a direct call): nothing evicted
    assert (tab_a.freed, tab_b.freed) == (0, 1)


def test_a_released_model_leaves_its_slot(fake_pools) -> None:
    pool = pools.acquire(["cpu"], "a", [])
    first, second = FakeSharded(pool, "a"), FakeSharded(pool, "b")
    pools.occupy(("w", "4"), first)
    pools.release(first)
    pools.occupy(("w", "4"), second)
    assert first.freed == 1 and pools._slots == {("w", "4"): second}


# ----------------------------------------------------------------------------------------------- messages

def test_a_killed_rank_becomes_a_node_error_with_rank_device_cause_and_advice() -> None:
    original = RankFailure("rank 1 (cuda:1, pid 42) was killed by SIGKILL during 'forward'; the pool was shut down "
                           "and restarts on next use.\n--- end of rank 1 log ---\nallocating 80 GiB",
                           rank=1, device="cuda:1", exitcode=-9, signal="SIGKILL", traceback="allocating 80 GiB")
    err = pools.explain(original, "wan.safetensors sharded over 2 ranks: a denoising step")
    text = str(err)
    assert text.startswith("wan.safetensors sharded over 2 ranks: a denoising step failed: rank 1 (cuda:1, pid 42) "
                           "was killed by SIGKILL")
    assert "Queue the prompt again" in text and "out of memory" in text
    assert text.endswith("--- end of rank 1 log ---\nallocating 80 GiB")
    assert (err.rank, err.device, err.signal, err.exitcode) == (1, "cuda:1", "SIGKILL", -9)


def test_a_rank_error_is_not_blamed_on_memory() -> None:
    err = pools.explain(RankFailure("rank 0 (cpu) raised KeyError: 'x' in 'forward'", rank=0, device="cpu"), "load")
    assert "out of memory" not in str(err) and "rank 0 (cpu) raised KeyError" in str(err)
