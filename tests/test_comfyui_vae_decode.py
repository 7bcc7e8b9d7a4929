"""MGPU VAE Decode in ComfyUI (CPU): the parallel decode equals VAE Decode (Tiled) with the same tile settings, its
tiles are really decoded by as many networks and threads as devices, Cancel stops it between tiles, a failing device
names itself, and a bad devices text fails before anything is decoded. "Devices" are cpu entries here (no GPU): the
split, the copies of the VAE and the threads are those of GPUs.

The numerical checks run inside a fresh ComfyUI interpreter (tests/vae_decode_checks.py); the node itself, through
POST /prompt of a real server. Skipped without a ComfyUI checkout (COMFYUI_PATH).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from comfy_checkpoints import write_tiny_wan21_t2v, write_wan21_vae
from comfyui_env import ComfyServer, PromptRejected, find_comfyui, run_checks

pytestmark = pytest.mark.comfyui

VAE = "mgpu_vae_decode_wan.safetensors"
DIT = "mgpu_vae_decode_wan_dit.safetensors"   # for the MGPU Plan (its VAE is what matters here)


def in_comfyui(check: str, folder: Path, timeout: float = 900) -> Any:
    return run_checks("vae_decode_checks", check, str(folder), timeout=timeout)


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> dict:
    facts = in_comfyui("check_wan_video", tmp_path_factory.mktemp("wan"))
    print("Wan 2.1 VAE:", json.dumps(facts))
    return facts


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> dict:
    return in_comfyui("check_image", tmp_path_factory.mktemp("image"))


# ------------------------------------------------------------------------------------------- same result

def test_wan_video_decoded_on_two_devices_equals_vae_decode_tiled(wan):
    assert wan["tiles"] == 8 and wan["shape"] == [9, 80, 80, 3] and wan["std"] > 0.05
    assert wan["max_diff_two"] == 0.0   # ComfyUI's own blend of the same tiles: exact


def test_wan_video_on_one_device_is_vae_decode_tiled_with_its_own_network(wan):
    assert wan["max_diff_one"] == 0.0
    assert wan["split_one"]["tiles_per_network"] == [8] and wan["split_one"]["own_network_decoded"]


def test_image_vae_on_two_and_three_devices_equals_vae_decode_tiled(image):
    """ComfyUI tiles an image latent three times over (three tile shapes), a batch of two item by item."""
    assert image["tiles"] >= 12 and image["std"] > 0.05
    assert image["max_diff_two"] == 0.0 and image["max_diff_three"] == 0.0


# ------------------------------------------------------------------------------------------------ split

def test_the_tiles_are_decoded_by_one_network_per_device_at_the_same_time(wan):
    """Seen from the networks: the VAE's own and one copy (its own weights) each decoded half of the very tiles
    ComfyUI cuts, each on its own thread, and their decodes overlapped in time."""
    two = wan["split_two"]
    assert two["tiles_per_network"] == [4, 4] and two["own_network_decoded"]
    assert not two["copies_share_weights"] and two["weight_devices"] == ["cpu"]
    assert two["threads"] == ["mgpu-vae-cpu #1", "mgpu-vae-cpu #2"]
    assert two["concurrent"]
    assert sorted(wan["tile_shapes"]) == wan["two_tile_shapes"]


def test_progress_goes_through_comfyuis_progress_bar_tile_by_tile(wan):
    """ComfyUI's progress hook (what sends the node's progress to the page, and checks Cancel) sees the tiles
    counted up to all 8 (0.33 throttles the updates in between)."""
    progress = wan["progress"]
    assert progress[0] == [1, 8] and progress[-1] == [8, 8]
    assert [v for v, _ in progress] == sorted({v for v, _ in progress}) and {t for _, t in progress} == {8}


def test_three_devices_share_the_image_tiles_round_robin(image):
    tiles, three = image["tiles"], image["split_three"]
    assert sorted(three["tiles_per_network"]) == sorted(len(range(i, tiles, 3)) for i in range(3))
    assert len(three["threads"]) == 3 and not three["copies_share_weights"]


# ------------------------------------------------------------------------------------------ with a plan

def test_auto_with_a_plan_decodes_where_the_plan_says(tmp_path):
    """A plan that splits the decode over two devices: two networks, each its share of the tiles, the same image as
    VAE Decode (Tiled); a plan that decodes in tiles on one device: the VAE's own network alone; one that decodes the
    whole video on one device: VAE Decode's image; a plan for GPUs this machine lacks: refused before any tile is
    decoded."""
    facts = in_comfyui("check_plan", tmp_path)
    assert facts["max_diff_split"] == 0.0 and facts["max_diff_one"] == 0.0
    assert len(facts["split"]["tiles_per_network"]) == 2 and facts["split"]["own_network_decoded"]
    assert facts["one"]["tiles_per_network"] == [sum(facts["split"]["tiles_per_network"])]
    assert facts["one"]["own_network_decoded"]
    # a plan that sized the whole video at once on one device: VAE Decode's own untiled decode, one call
    assert facts["max_diff_whole"] == 0.0 and facts["tiled_vs_whole"] > 0
    assert facts["whole"]["tiles_per_network"] == [1] and facts["whole"]["own_network_decoded"]
    assert facts["missing"].startswith("MGPU VAE Decode: the MGPU Plan splits the decode over cuda:0, cuda:1, but "
                                       "cuda:0, cuda:1 are not on this machine")
    assert facts["missing_decoded"] == 0


# --------------------------------------------------------------------------------------- cancel, failures

def test_cancel_stops_between_tiles_and_the_next_run_works(tmp_path):
    facts = in_comfyui("check_cancel", tmp_path)
    assert facts["raised"] == "InterruptProcessingException"
    assert facts["decoded_after_cancel"] <= 2 < facts["tiles"]   # at most the tile each device had begun
    assert facts["threads_left"] == [] and facts["flag_cleared"]
    assert facts["next_run_ok"] == [2, 128, 192, 3]


def test_a_failing_device_names_itself_and_a_bad_devices_text_fails_before_decoding(tmp_path):
    facts = in_comfyui("check_failures", tmp_path)
    assert facts["failing"].startswith("MGPU VAE Decode: cpu #2 failed decoding tile 2 of ")
    assert "RuntimeError: the copy's device broke; leave it out of devices" in facts["failing"]
    assert facts["missing"].startswith("MGPU VAE Decode: device 'cuda:3' in devices 'cpu,cuda:3' does not exist")
    assert "this machine has cpu" in facts["missing"]
    assert "device 'cpu;cpu'" in facts["garbled"]
    assert facts["missing_decoded"] == 0 and facts["garbled_decoded"] == 0
    assert facts["threads_left"] == []


# ------------------------------------------------------------------------------------------- the node

@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    if not (comfyui_server.vae / VAE).exists():
        write_wan21_vae(comfyui_server.vae / VAE)
    if not (comfyui_server.diffusion_models / DIT).exists():
        write_tiny_wan21_t2v(comfyui_server.diffusion_models / DIT)
    return comfyui_server


def test_the_node_offers_vae_decode_tiled_settings_and_a_devices_list(server):
    info = server.object_info()
    ours, stock = info["MgpuVAEDecode"], info["VAEDecodeTiled"]
    assert ours["category"] == "MGPU" and ours["output"] == ["IMAGE"]
    required = ours["input"]["required"]
    assert list(required)[:3] == ["samples", "vae", "devices"] and required["devices"][1]["default"] == "auto"
    assert list(ours["input"]["optional"]) == ["plan"] and ours["input"]["optional"]["plan"][0] == "MGPU_PLAN"
    for name, spec in stock["input"]["required"].items():
        if spec[0] == "INT":
            assert required[name][0] == "INT"
            assert {k: required[name][1].get(k) for k in ("default", "min", "max", "step")} == \
                {k: spec[1].get(k) for k in ("default", "min", "max", "step")}, name


def test_the_node_decodes_a_video_as_vae_decode_tiled_does(server):
    """A Wan latent through MGPU VAE Decode on cpu,cpu and through VAE Decode (Tiled): the same PNGs, also with an
    MGPU Plan connected and devices auto; a devices text naming a GPU this machine lacks refuses the prompt when it
    is queued, with the node's message."""
    tiles = {"tile_size": 64, "overlap": 16, "temporal_size": 8, "temporal_overlap": 4}
    prompt = {
        "1": {"class_type": "MgpuLoadVAE", "inputs": {"vae_name": VAE, "device": "cpu"}},
        "2": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 80, "height": 80, "length": 9,
                                                                  "batch_size": 1}},
        "3": {"class_type": "MgpuVAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0],
                                                        "devices": "cpu,cpu", **tiles}},
        "4": {"class_type": "VAEDecodeTiled", "inputs": {"samples": ["2", 0], "vae": ["1", 0], **tiles}},
        "5": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "mgpu_vae_decode"}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": "stock_vae_decode"}},
    }
    entry = server.wait(server.post_prompt(prompt), timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    ours = [server.output_dir / i["filename"] for i in entry["outputs"]["5"]["images"]]
    stock = [server.output_dir / i["filename"] for i in entry["outputs"]["6"]["images"]]
    assert len(ours) == len(stock) == 9
    assert [Image.open(p).tobytes() for p in ours] == [Image.open(p).tobytes() for p in stock]

    # with an MGPU Plan of this machine (no GPU: the VAE on the cpu, the short video decoded whole) and devices
    # auto: VAE Decode's PNGs, which the tiles' blending does not give
    prompt["7"] = {"class_type": "MgpuPlan", "inputs": {"dit": DIT, "text_encoder": "none", "vae": VAE, "width": 80,
                                                        "height": 80, "frames": 9, "batch": 1, "cfg": True,
                                                        "dit_weight_dtype": "default", "devices": "auto",
                                                        "allow_offload": False, "prefer_speed": False}}
    prompt["3"]["inputs"].update(devices="auto", plan=["7", 0])
    prompt["1"]["inputs"].update(device="auto", plan=["7", 0])
    prompt["8"] = {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}}
    prompt["9"] = {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "stock_whole"}}
    entry = server.wait(server.post_prompt(prompt), timeout=600)
    assert entry["status"]["status_str"] == "success", entry["status"]
    planned = [server.output_dir / i["filename"] for i in entry["outputs"]["5"]["images"]]
    whole = [server.output_dir / i["filename"] for i in entry["outputs"]["9"]["images"]]
    assert [Image.open(p).tobytes() for p in planned] == [Image.open(p).tobytes() for p in whole]
    assert [Image.open(p).tobytes() for p in whole] != [Image.open(p).tobytes() for p in stock]
    del prompt["7"], prompt["8"], prompt["9"], prompt["3"]["inputs"]["plan"], prompt["1"]["inputs"]["plan"]
    prompt["1"]["inputs"]["device"] = "cpu"

    prompt["3"]["inputs"]["devices"] = "cpu,cuda:5"   # refused when queued, before the sampler would run
    del prompt["4"], prompt["6"]
    with pytest.raises(PromptRejected) as info:
        server.post_prompt(prompt)
    errors = info.value.body["node_errors"]["3"]
    assert errors["class_type"] == "MgpuVAEDecode"
    assert any(e["details"].startswith("devices - MGPU VAE Decode: device 'cuda:5' in devices 'cpu,cuda:5' does not")
               for e in errors["errors"]), errors


def test_copies_of_a_dynamic_vram_vae_leave_its_device_state_behind(tmp_path):
    """ComfyUI 0.33 on an NVIDIA GPU: lazily built layers with comfy-aimdo's per-device handles (see the check).
    ComfyUI 0.3.x has no dynamic VRAM: the check says so, and the tree under test must then lack comfy-aimdo."""
    facts = in_comfyui("check_dynamic_vram", tmp_path)
    assert facts["applies"] == ("comfy-aimdo" in (find_comfyui() / "requirements.txt").read_text())
    if not facts["applies"]:
        return
    assert facts["comfy_layers"] > 10
    assert facts["max_diff_two"] == 0.0
    assert facts["split"]["tiles_per_network"] == [4, 4] and not facts["split"]["copies_share_weights"]
    assert facts["state_kept_on_original"]
