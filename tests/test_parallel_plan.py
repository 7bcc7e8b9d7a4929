"""The cfg x sp split the planner picks for an FSDP group, and its warning when N GPUs are likely slower."""

from __future__ import annotations

import pytest

from mgpu.planning import parallel
from mgpu.planning.devices import parse_spec


@pytest.mark.parametrize("ranks, rows, heads, expect", [
    (2, 2, 40, (2, 1)),    # CFG on 2 GPUs: one branch each, nothing to exchange
    (2, 1, 40, (1, 2)),    # cfg 1 (distilled LoRA): the tokens split instead
    (4, 2, 40, (2, 2)),    # 2 CFG branches x 2 sequence halves
    (8, 2, 40, (2, 4)),
    (4, 1, 12, (1, 4)),    # Wan 1.3B: 12 heads
    (3, 2, 12, (1, 3)),    # 3 ranks cannot split 2 rows, but 12 heads split in 3
    (4, 4, 40, (4, 1)),    # two videos with CFG: 4 rows, 4 ranks, no exchange needed
])
def test_degrees_fill_the_mesh(ranks, rows, heads, expect):
    d = parallel.choose(ranks, rows, heads, "wan2.1-t2v-14b")
    assert (d.cfg, d.sp) == expect
    assert d.cfg * d.sp == ranks


def test_heads_that_do_not_divide_fall_back_to_the_batch_split_and_say_which_degrees_would():
    d = parallel.choose(3, 2, 40, "wan2.1-t2v-14b")   # 3 divides neither 2 rows nor 40 heads
    assert (d.cfg, d.sp) == (3, 1)
    text = " ".join(d.reasons)
    assert "40 attention heads" in text and "2, 4, 5, 8" in text and "1 of the 3 ranks get no rows" in text


def test_ltxv_splits_its_tokens_over_its_32_heads():
    assert [(d.cfg, d.sp) for d in (parallel.choose(4, 1, 32, "ltxv"), parallel.choose(4, 2, 32, "ltxv"))] == [
        (1, 4), (2, 2)]


def test_ltx2_splits_its_video_tokens_and_prices_the_audio_queries_gather():
    """LTX-2's audio queries attend to every video token: each layer all-gathers the video keys and values at the
    audio width, on top of the video self-attention's all-to-alls."""
    assert (parallel.choose(2, 1, 32, "ltx2-av").cfg, parallel.choose(2, 1, 32, "ltx2-av").sp) == (1, 2)
    group = [g.__class__(**{**g.__dict__, "capability": (8, 9)}) for g in parse_spec("2x24GiB:p2p")]
    ltx2 = dict(params=19_000_000_000, weight_bytes=19_000_000_000, hidden=4096, layers=48, tokens=14_400, rows=1,
                resharding=False)
    video_only = parallel.estimate(parallel.choose(2, 1, 32, "ltx2-av"), group, **ltx2)
    with_audio = parallel.estimate(parallel.choose(2, 1, 32, "ltx2-av"), group, kv_gather_width=2048, **ltx2)
    moved = lambda d: d.step_seconds - d.single_seconds / 2   # no resharding: the rest is the exchanges
    assert moved(with_audio) == pytest.approx(1.5 * moved(video_only))   # 2 x width/2 x 2 ranks over 4 all-to-alls


def test_families_without_an_adapter_and_sp_off_use_the_batch_split():
    d = parallel.choose(4, 1, 24, "hunyuan-video")
    assert (d.cfg, d.sp) == (4, 1) and "hunyuan-video has no sequence-parallel adapter" in " ".join(d.reasons)
    d = parallel.choose(4, 1, 40, "wan2.1-t2v-14b", sequence_parallel=False)
    assert (d.cfg, d.sp) == (4, 1) and "sequence parallelism is off" in " ".join(d.reasons)


WAN_14B = dict(params=14_000_000_000, weight_bytes=28_000_000_000, hidden=5120, layers=40)


def test_a_720p_video_on_nvlink_is_estimated_near_linear():
    group = [g.__class__(**{**g.__dict__, "capability": (9, 0)}) for g in parse_spec("8x80GiB:nvlink")]
    d = parallel.estimate(parallel.choose(8, 2, 40, "wan"), group, tokens=75_600, rows=2, resharding=False,
                          **WAN_14B)
    assert not d.warnings
    assert 6.0 < d.single_seconds / d.step_seconds <= 8.0


def test_a_short_clip_resharding_over_pcie_warns_with_numbers():
    """Few tokens, the whole model all-gathered every step over PCIe without P2P: slower than one GPU."""
    group = [g.__class__(**{**g.__dict__, "capability": (8, 9)}) for g in parse_spec("2x24GiB:pcie")]
    d = parallel.estimate(parallel.choose(2, 1, 40, "wan"), group, tokens=1_560, rows=1, resharding=True,
                          **WAN_14B)
    assert d.step_seconds > d.single_seconds
    (warning,) = d.warnings
    assert "likely slower than one GPU" in warning and "over pcie" in warning and "GB moved per rank" in warning


def test_the_slowest_link_of_the_group_prices_it():
    gpus = parse_spec("2x80GiB:nvlink,2x80GiB:nvlink")
    assert parallel.group_link(gpus[:2]) == "nvlink"
    assert parallel.group_link(gpus) == "pcie"
    assert parallel.group_link(gpus[:1]) is None
