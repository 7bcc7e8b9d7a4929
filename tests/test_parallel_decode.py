"""MGPU VAE Decode without ComfyUI: the devices text, the choice of devices for auto (with and without an MGPU Plan),
the work split, and the per-device memory the planner gets (mgpu.planning.estimates.vae_parallel_decode_bytes)."""

from __future__ import annotations

import pytest

import ckpt_layouts as L
from loaders.parallel_decode import labels, parse_devices, pick_auto, planned, round_robin
from mgpu.errors import MgpuError
from mgpu.planning.devices import Device
from mgpu.planning.estimates import (ACTIVATION_SAFETY, CUDA_OVERHEAD_BYTES, GiB, MEASURED_WAN21_TILE_PEAKS, MiB,
                                     Workload, vae_decode_bytes, vae_parallel_decode_bytes, vae_tile_bytes,
                                     weight_bytes)
from mgpu.planning.partition import Placement, Plan
from mgpu.planning.sizing import size_component

GPUS = ["cuda:0", "cuda:1", "cuda:2"]


def gpu(index: int, free_gib: float) -> Device:
    return Device(id=f"cuda:{index}", kind="cuda", index=index, name="GPU", total_bytes=80 * GiB,
                  free_bytes=int(free_gib * GiB), source="spec")


HOST = Device(id="cpu", kind="cpu", index=None, name="host", total_bytes=64 * GiB, free_bytes=60 * GiB,
              source="spec")


# ------------------------------------------------------------------------------------------- devices text

@pytest.mark.parametrize("text, expected", [
    ("auto", None), (" AUTO ", None),
    ("cuda:0,cuda:1", ["cuda:0", "cuda:1"]), (" cuda:2 , CUDA:0 ", ["cuda:2", "cuda:0"]),
    ("cpu", ["cpu"]), ("cpu,cpu", ["cpu", "cpu"]), ("cuda:1,cpu", ["cuda:1", "cpu"]),
])
def test_devices_text_is_read_in_order(text, expected):
    assert parse_devices(text, GPUS) == expected


@pytest.mark.parametrize("text, says", [
    ("cuda:7", "device 'cuda:7' in devices 'cuda:7' does not exist on this machine; this machine has cuda:0, "
               "cuda:1, cuda:2, cpu"),
    ("cuda:0,,cuda:1", "device '' in devices 'cuda:0,,cuda:1' is empty"),
    ("", "devices is empty"),
    ("cuda", "'cuda' in devices 'cuda' names no GPU; write cuda:0, cuda:1"),
    ("auto,cuda:1", "auto cannot be combined"),
    ("cuda:1,cuda:0,cuda:1", "cuda:1 listed twice"),
    ("0,1", "device '0'"),
])
def test_a_bad_devices_text_says_what_is_wrong_and_what_there_is(text, says):
    with pytest.raises(MgpuError) as err:
        parse_devices(text, GPUS)
    assert str(err.value).startswith("MGPU VAE Decode: ") and says in str(err.value)


def test_without_gpus_only_cpu_entries_are_accepted():
    assert parse_devices("cpu,cpu,cpu", []) == ["cpu"] * 3
    with pytest.raises(MgpuError, match="this machine has cpu;"):
        parse_devices("cuda:0", [])


def test_entries_listed_twice_are_told_apart_in_messages():
    assert labels(["cpu", "cuda:0", "cpu"]) == ["cpu #1", "cuda:0", "cpu #2"]
    assert labels(["cuda:1", "cuda:0"]) == ["cuda:1", "cuda:0"]


def test_tiles_go_round_robin_and_each_exactly_once():
    assert round_robin(7, 3) == [[0, 3, 6], [1, 4], [2, 5]]
    assert round_robin(1, 2) == [[0], []]
    split = round_robin(50, 4)
    assert sorted(i for part in split for i in part) == list(range(50))


# -------------------------------------------------------------------------------------------------- auto

def test_auto_takes_the_vae_gpu_first_then_every_gpu_with_room():
    machine = [gpu(0, 30), gpu(1, 2), gpu(2, 10), HOST]
    chosen, why = pick_auto(machine, need=4 * GiB, home="cuda:2")
    assert chosen == ["cuda:2", "cuda:0"]
    assert "left out cuda:1 (2 GiB free)" in why


def test_auto_keeps_the_vae_gpu_even_when_its_memory_is_taken():
    """ComfyUI makes room on the VAE's own device (it unloads its models there); the copies elsewhere cannot."""
    chosen, _ = pick_auto([gpu(0, 0.5), gpu(1, 20)], need=4 * GiB, home="cuda:0")
    assert chosen == ["cuda:0", "cuda:1"]


def test_auto_falls_back_to_the_vae_device_alone():
    chosen, why = pick_auto([gpu(0, 1), gpu(1, 1), HOST], need=4 * GiB, home="cpu")
    assert chosen == ["cpu"] and "no GPU has the 4 GiB" in why
    chosen, why = pick_auto([HOST], need=4 * GiB, home="cpu")
    assert chosen == ["cpu"] and "no GPU" in why


# ------------------------------------------------------------------------------------------ auto with a plan

def vae_plan(strategy: str, devices: list[str]) -> Plan:
    """A plan whose VAE decodes ``strategy`` on ``devices``: 0.25 GiB of weights + 5 GiB working on each."""
    placed = Placement(role="vae", file="vae.safetensors", family="wan-vae", strategy=strategy, devices=devices,
                       weight_dtype="bf16", weight_bytes=GiB // 4, resident_bytes=dict.fromkeys(devices, GiB // 4),
                       working_bytes=dict.fromkeys(devices, 5 * GiB), tiled=strategy == "split")
    return Plan(placements=[placed], usage=[], devices=[], workload={}, policy={}, reasons=[])


def test_auto_with_a_plan_takes_the_plans_split_with_the_vae_device_first():
    chosen, why = planned(vae_plan("split", ["cuda:0", "cuda:1", "cuda:2"]), GPUS, home="cuda:1")
    assert chosen == ["cuda:1", "cuda:0", "cuda:2"]
    assert why == "auto: the MGPU Plan's split over cuda:1, cuda:0, cuda:2 (5.2 GiB each: a VAE copy and one tile " \
                  "of VAE Decode (Tiled)'s default size)"


def test_auto_with_a_plan_that_decodes_on_one_device_keeps_the_vae_device():
    chosen, why = planned(vae_plan("single", ["cuda:0"]), GPUS, home="cuda:2")
    assert chosen == ["cuda:2"] and "decodes on one device" in why
    assert planned(vae_plan("cpu", ["cpu"]), [], home="cpu")[0] == ["cpu"]


def test_auto_without_a_planned_vae_is_left_to_free_memory():
    assert planned(None, GPUS, home="cuda:0") is None
    no_vae = Plan(placements=[], usage=[], devices=[], workload={}, policy={}, reasons=[])
    assert planned(no_vae, GPUS, home="cuda:0") is None


def test_a_plan_for_other_gpus_is_refused_with_the_way_out():
    with pytest.raises(MgpuError) as err:
        planned(vae_plan("split", ["cuda:0", "cuda:3", "cuda:4"]), ["cuda:0", "cuda:1"], home="cuda:0")
    assert str(err.value).startswith("MGPU VAE Decode: the MGPU Plan splits the decode over cuda:0, cuda:3, cuda:4, "
                                     "but cuda:3, cuda:4 are not on this machine (it has cuda:0, cuda:1, cpu); make "
                                     "the plan with devices 'auto' for this machine, or write the devices here")


# ------------------------------------------------------------------------------------------------ memory

@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pvae")
    layouts = {"wan_vae": L.wan_vae(), "wan22_vae": L.wan_vae("2.2"), "ltxv_vae": L.ltxv_vae()}
    return {n: size_component(L.write_safetensors(folder / f"{n}.safetensors", lay, sparse=True))
            for n, lay in layouts.items()}


@pytest.mark.parametrize("vae", ["wan_vae", "wan22_vae", "ltxv_vae"])
def test_a_device_of_the_parallel_decode_holds_a_vae_copy_and_one_tile(vaes, vae):
    size, wl = vaes[vae], Workload(1280, 720, 81)
    tile = vae_tile_bytes(size, wl)
    need = vae_parallel_decode_bytes(size, wl)
    assert need == weight_bytes(size, None) + int(ACTIVATION_SAFETY * tile + 0.999) + CUDA_OVERHEAD_BYTES
    assert vae_parallel_decode_bytes(size, wl, weight_dtype="fp32") - need == weight_bytes(size, "fp32") - \
        weight_bytes(size, None)


@pytest.mark.parametrize("vae", ["wan_vae", "wan22_vae", "ltxv_vae"])
def test_the_per_device_need_does_not_grow_with_the_video(vaes, vae):
    """ComfyUI's tiled decode keeps the whole video on its one device; a device of the parallel decode only its
    tile, so a video 4x as long and 2.25x as large needs the same per device."""
    size = vaes[vae]
    short, long = Workload(1280, 720, 81), Workload(1920, 1080, 321)
    assert vae_parallel_decode_bytes(size, long) == vae_parallel_decode_bytes(size, short)
    assert vae_decode_bytes(size, long, tiled=True) > 2 * vae_decode_bytes(size, short, tiled=True) - \
        CUDA_OVERHEAD_BYTES
    assert vae_parallel_decode_bytes(size, long) < vae_decode_bytes(size, long, tiled=True)


def test_the_tile_follows_the_tile_settings_and_never_exceeds_the_video(vaes):
    size, wl = vaes["wan_vae"], Workload(1280, 720, 81)
    assert vae_tile_bytes(size, wl, tile_px=256) < vae_tile_bytes(size, wl, tile_px=512)
    assert vae_tile_bytes(size, wl, tile_frames=16) < vae_tile_bytes(size, wl, tile_frames=64)
    small = Workload(256, 256, 9)   # smaller than one tile: the tile is the video
    assert vae_tile_bytes(size, small) == vae_tile_bytes(size, small, tile_px=4096, tile_frames=4096)
    assert vae_tile_bytes(size, small) < vae_tile_bytes(size, Workload(512, 512, 9))


@pytest.mark.parametrize("px", sorted(MEASURED_WAN21_TILE_PEAKS))
def test_the_tile_estimate_covers_comfyuis_measured_wan_decoder(vaes, px):
    """The live-tensor peak of one Wan 2.1 tile, 8 latent frames, fp32, as measured in ComfyUI 0.3.64 and 0.33.0
    (the larger of the two), is within the estimate with its safety factor."""
    ours = ACTIVATION_SAFETY * vae_tile_bytes(vaes["wan_vae"], Workload(px, px, 29), act_bytes=4, tile_px=px,
                                              tile_frames=32)
    assert ours >= MEASURED_WAN21_TILE_PEAKS[px]


def test_wan21_720p_numbers(vaes):
    """Default tiles (512 px, 64 frames -> 16 latent frames), bf16: one tile is about 4 GiB with the safety factor,
    a little above ComfyUI 0.33's own reservation for such a tile (7000 x 64 x 64 x 64 x 2 bytes = 3.4 GiB), and
    a device needs 5.3 GiB with the VAE copy (0.24 GiB) and the CUDA overhead, for a video of any length."""
    size, wl = vaes["wan_vae"], Workload(1280, 720, 81)
    comfyui_tile = 7000 * 64 * 64 * 64 * 2
    assert comfyui_tile < ACTIVATION_SAFETY * vae_tile_bytes(size, wl) < 1.5 * comfyui_tile
    assert 5 * GiB < vae_parallel_decode_bytes(size, wl) < 5.5 * GiB
    assert weight_bytes(size, None) < 250 * MiB
