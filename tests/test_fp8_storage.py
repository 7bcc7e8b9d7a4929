"""A plain fp8 diffusion model (fp8 matrices, no scales) sharded over ranks whose GPU lacks fp8 compute (3090, A100):
the ranks keep it fp8, the bytes the plan sized, and ComfyUI's manual-cast ops cast each layer after the gather.
ComfyUI alone would upcast it to fp16/bf16 there whenever the model fits the GPU whole, which a rank's share nearly
always does: twice the resident and all-gathered bytes, and out of memory at the first step (Wan 14B fp8 on 2x3090).

The cpu ranks answer ComfyUI's device queries as a 24 GiB RTX 3090 (tests/fake_rank_gpu.py), so the dtypes they
choose are that GPU's. The sampled output against stock ComfyUI is test_comfyui_quant.py's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import ckpt_layouts as L
import pytest
import tiny_models as tm

from loaders.rank_factory import agree_dtype, fp8_compute_summary
from mgpu.planning.devices import parse_spec
from mgpu.planning.estimates import Workload, weight_bytes
from mgpu.planning.partition import Component, Placement, Policy, make_plan
from mgpu.planning.sizing import size_component
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import ModelSpec, ShardedModule

pytestmark = [pytest.mark.comfyui,
              pytest.mark.skipif(tm.comfyui_path() is None, reason="needs a ComfyUI checkout (COMFYUI_PATH)")]

TESTS = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
PREPARE = "loaders.rank_factory:prepare"
FACTORY = "loaders.rank_factory:diffusion_model"
# What a rank holds beyond its 1/N of the file's bytes: ComfyUI stores the 1-d tensors (biases, norms: bf16 in the
# file) in the storage dtype too and keeps Wan's patch embedding in fp32; the dim-0 shards round up. ~0.5% here;
# an upcast model holds 100% more.
SHARD_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def pool():
    """Two cpu ranks whose ComfyUI takes them for 24 GiB RTX 3090s."""
    pool = RankPool(PoolConfig(devices=["cpu"] * RANKS, extra_sys_path=[tm.comfyui_path(), TESTS],
                               imports=["fake_rank_gpu"]))
    yield pool
    pool.close()


def plain_fp8_file(folder: Path) -> Path:
    """A tiny Wan as plain fp8 files store it: matrices float8_e4m3fn, biases and norms bf16 (sparse: zeros)."""
    return L.write_safetensors(folder / "wan_fp8_e4m3fn.safetensors", L.recast(L.wan_dit_tiny(), "F8_E4M3"),
                               sparse=True)


def dit_placement(path: Path) -> Placement:
    """The plan for this file on two 24 GiB sm_86 GPUs: sharded over both."""
    gpus = [dataclasses.replace(d, capability=(8, 6)) for d in parse_spec("2x24GiB")]
    plan = make_plan([Component("dit", size_component(str(path)))], gpus, Workload(frames=17),
                     Policy(prefer_speed=True))
    placed = plan.placement("dit")
    assert placed.strategy == "fsdp" and len(placed.devices) == RANKS
    return placed


def load_on_ranks(pool: RankPool, path: Path, unet_dtype: str | None = None,
                  flags: dict | None = None) -> tuple[str, str | None, str | None, list[int]]:
    """(storage dtype, compute dtype, the fp8 compute line the host logs, parameter bytes each rank holds) of the
    file loaded as MGPU Load Diffusion Model loads it: every rank's ``prepare``, one agreed dtype, the sharded load."""
    flags = flags or {}
    replies = pool.call(PREPARE, {"checkpoint": str(path), "flags": flags, "unet_dtype": unet_dtype})
    dtype, cast = agree_dtype([r.payload for r in replies], pool.config.devices)
    fp8 = fp8_compute_summary([r.payload for r in replies])
    sharded = ShardedModule(pool, ModelSpec(factory=FACTORY, checkpoint=str(path), key_prefix="",
                                            factory_kwargs={"checkpoint": str(path), "devices": pool.config.devices,
                                                            "flags": flags, "unet_dtype": dtype}))
    try:
        return dtype, cast, fp8, [r["local_param_bytes"] for r in sharded.load()]
    finally:
        sharded.free()


def assert_shards(held: list[int], planned_bytes: int) -> None:
    share = planned_bytes / RANKS
    for rank, nbytes in enumerate(held):
        assert abs(nbytes - share) <= SHARD_TOLERANCE * share, (
            f"rank {rank} holds {nbytes} B of parameters, the plan {share:.0f} B")


def test_a_plain_fp8_file_stays_fp8_on_ranks_without_fp8_compute(pool: RankPool, tmp_path: Path) -> None:
    """The plan sizes the file's fp8 bytes; every rank stores fp8 (its 1/2 of them) and computes in fp16, as ComfyUI
    computes fp8 weights on a 3090, instead of storing fp16 (twice the plan). The plan and the load log say that
    each layer is dequantized (a faked 3090 is still a cpu to our own path: it names that reason)."""
    path = plain_fp8_file(tmp_path)
    placed = dit_placement(path)
    assert placed.weight_dtype == "f8_e4m3" and placed.weight_bytes == size_component(str(path)).total_bytes
    dtype, cast, fp8, held = load_on_ranks(pool, path)
    print(f"plain fp8 file on 2 faked 3090s: {dtype} (compute {cast}); per rank {held} B, plan "
          f"{placed.weight_bytes / RANKS:.0f} B")
    assert (dtype, cast) == ("float8_e4m3fn", "float16")
    assert_shards(held, placed.weight_bytes)
    assert fp8 == "fp8 compute: dequantize per layer on cpu (no fp8 matmul on a CPU)"
    assert [r for r in placed.reasons if r.startswith("fp8 compute: dequantize per layer on cuda:0 (sm_86: fp8 "
                                                          "matmul needs sm_89); dequantize per layer on cuda:1")]


def test_a_chosen_weight_dtype_still_wins(pool: RankPool, tmp_path: Path) -> None:
    """The node's weight_dtype, and ComfyUI's --bf16-unet, store the file upcast: the plan sized as a recast
    (``weight_bytes(size, dtype)``) is what the ranks hold."""
    path = plain_fp8_file(tmp_path)
    upcast = weight_bytes(size_component(str(path)), "bf16")
    dtype, cast, fp8, held = load_on_ranks(pool, path, unet_dtype="bfloat16")
    assert (dtype, cast, fp8) == ("bfloat16", None, None)
    assert_shards(held, upcast)
    dtype, cast, fp8, held = load_on_ranks(pool, path, flags={"bf16_unet": True})   # flags stay set: the last load
    assert (dtype, cast, fp8) == ("bfloat16", None, None)
    assert_shards(held, upcast)
