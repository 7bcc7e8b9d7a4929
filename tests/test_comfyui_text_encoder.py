"""Split text encoders and the conditioning cache in a real ComfyUI (0.3.64 and 0.33, CPU).

In-process tier (tests/text_encoder_checks.py, one fresh ComfyUI interpreter per check): ComfyUI's own UMT5 and
Gemma 3 at a tiny size, split over two "cpu" entries, give the one-device conditioning; ComfyUI's model management
never moves a split encoder as a whole while it encodes, clones, applies a LoRA and samples a DiT, and unloading
releases every part; stock CLIPTextEncode hits the cache for the same text and misses for other text, a LoRA'd clone
and clip skip. Server tier: MGPU Load Text Encoder's split_devices input, through POST /prompt.
Skipped without a ComfyUI checkout (COMFYUI_PATH).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from comfyui_env import ComfyServer, run_checks

pytestmark = pytest.mark.comfyui


def in_comfyui(check: str, *args: Any, timeout: float = 600) -> Any:
    return run_checks("text_encoder_checks", check, *args, timeout=timeout)


def test_a_split_encoder_gives_the_one_device_conditioning(tmp_path: Path) -> None:
    facts = in_comfyui("check_split_encodes_like_one_device", str(tmp_path))
    for family in ("umt5", "gemma3"):
        f = facts[family]
        assert f["patcher"] == "SplitModelPatcher" and f["equal"] and f["finite"], (family, f)
        assert f["devices_used"] == [0, 1] and f["in_order"] and f["placed_as_mapped"], (family, f)
        # ComfyUI's model management holds each device's bytes on that device
        assert sorted(f["accounting"]) == [["DeviceShare", "cpu", f["bytes"][1]],
                                           ["SplitModelPatcher", "cpu", f["bytes"][0]]], (family, f)
    assert facts["gemma3"]["shape"][1] == 5   # every layer's output (4 layers + the embeddings), as for LTX-2
    # a plan's 1:3 moves layers to the second device (to the layer boundary nearest a quarter of the bytes)
    (first, second), (even_first, even_second) = facts["gemma3"]["planned 1:3"], facts["gemma3"]["bytes"]
    assert first < even_first and second > even_second and first < second


def test_the_same_text_neither_loads_nor_runs_the_encoder_again(tmp_path: Path) -> None:
    facts = in_comfyui("check_cache_hits_and_misses", str(tmp_path))
    steps = facts["steps"]
    ran = {name: (s["ran"], s["loaded"] > 0) for name, s in steps.items()}
    assert ran == {"first": (1, True), "same text": (0, False), "other text": (1, True), "lora": (1, True),
                   "lora again": (1, True), "base after lora": (0, False), "base, new text, after lora": (1, True),
                   "clip skip": (1, True)}, ran
    assert all(s["equal_to_one_device"] for s in steps.values()), steps
    assert facts["same_tensors"] and facts["lora_differs"]
    assert facts["class_after_clone"] == "CachedCLIP" and facts["patcher_after_lora"] == "SplitModelPatcher"


def test_an_encoder_loaded_before_comes_back_deferred_and_loads_only_for_what_needs_its_weights(tmp_path: Path):
    facts = in_comfyui("check_deferred_clip", str(tmp_path))
    assert facts.pop("before any load") and facts.pop("cache off"), facts   # the first load is never deferred
    assert facts.pop("is a comfy CLIP") and facts.pop("eager equal"), facts
    if "dynamic" in facts:   # ComfyUI 0.33's bookkeeping looked at it
        assert facts.pop("model patcher output") is False and facts.pop("dynamic") is False, facts
    assert facts == {
        "hit equal": True, "loads after a hit": [],
        "miss equal": True, "loads after a miss": ["one"], "patcher after the miss": "ModelPatcher",
        "lora equal": True, "clip skip equal": True, "clip_layer kept": True,
        "loads for lora, skip, clip_layer": ["one", "one", "one"],
        "failed load": "no memory", "after a failed load": True,
        "split miss equal": True, "split patcher": "SplitModelPatcher", "split loads": ["split"],
    }, facts


def test_comfyui_never_moves_a_split_encoder_and_unloading_releases_every_part(tmp_path: Path) -> None:
    facts = in_comfyui("check_comfyui_keeps_the_split_placed", str(tmp_path))
    for moved in ("first encode moved", "clone moved", "lora moved", "ksampler moved"):
        assert facts[moved] == [], (moved, facts)
    assert facts["placed after encode"] and facts["placed after ksampler"], facts
    assert sorted(e[0] for e in facts["still loaded after ksampler"]) == ["DeviceShare", "SplitModelPatcher"]
    assert all(e[2] > 0 for e in facts["still loaded after ksampler"]), facts
    assert facts["unload moved"] == ["<root>"], facts   # the whole encoder to host RAM, once
    assert not facts["placed after unload"] and not any(facts["loaded after unload"]), facts
    assert facts["encode after unload equal"] and facts["placed again"], facts
    assert not facts["placed after a share unloads"] and not facts["placed after release_all"], facts
    assert facts["encode after release_all equal"], facts


# --- server tier: MGPU Load Text Encoder through POST /prompt ------------------------------------------------------

@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    from comfy_checkpoints import random_state_dict, save_checkpoint
    from test_comfyui_nodes import CLIP_L, clip_l_shapes

    if not (comfyui_server.text_encoders / CLIP_L).exists():
        save_checkpoint(comfyui_server.text_encoders / CLIP_L, random_state_dict(clip_l_shapes(), seed=3))
    return comfyui_server


def encode_prompt(text: str, split_devices: str | None, device: str = "cpu") -> dict[str, Any]:
    from test_comfyui_nodes import CLIP_L

    loader = {"clip_name": CLIP_L, "type": "stable_diffusion", "device": device, "clip_name2": "none"}
    if split_devices is not None:
        loader["split_devices"] = split_devices
    return {"1": {"class_type": "MgpuLoadTextEncoder", "inputs": loader},
            "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}},
            "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}


def run(server: ComfyServer, prompt: dict[str, Any]) -> tuple[dict[str, Any], str]:
    before = len(server.log())
    entry = server.wait(server.post_prompt(prompt), timeout=300)
    return entry, server.log()[before:]


def shown(entry: dict[str, Any]) -> str:
    assert entry["status"]["status_str"] == "success", entry["status"]
    return entry["outputs"]["3"]["text"][0]


def test_split_devices_is_an_optional_string_after_the_saved_widgets(server: ComfyServer):
    """Saved workflows (clip_name, type, device, clip_name2) load unchanged: the device choices are the same and the
    new widget comes last, optional, empty by default (no split)."""
    spec = server.object_info("MgpuLoadTextEncoder")["input"]
    assert list(spec["required"]) == ["clip_name", "type", "device", "clip_name2"]
    assert spec["required"]["device"][1]["options"] == ["auto", "cpu"]
    kind, opts = spec["optional"]["split_devices"]
    assert kind == "STRING" and opts["default"] == "" and "cuda:0,cuda:1" in opts["tooltip"]


def test_clip_l_split_over_two_entries_encodes_as_on_one_device_and_a_repeat_comes_from_the_cache(server):
    one, _ = run(server, encode_prompt("a red fox in the snow", None))
    split, log = run(server, encode_prompt("a red fox in the snow", "cpu, cpu"))
    assert shown(split) == shown(one)
    assert "MGPU Load Text Encoder: split over cpu, cpu, as chosen" in log
    assert "MGPU Load Text Encoder: " in log and "of weights split over cpu " in log, log[-3000:]
    # another text evicts ComfyUI's own output of the encode node; the first text again then comes from our cache
    other, log = run(server, encode_prompt("a blue fox", "cpu, cpu"))
    assert shown(other) != shown(one) and "from the cache" not in log
    again, log = run(server, encode_prompt("a red fox in the snow", "cpu, cpu"))
    assert shown(again) == shown(one) and "MGPU: text encoder output from the cache" in log, log[-3000:]


@pytest.mark.parametrize("split_devices, says", [
    ("cuda:0,cuda:1", "MGPU Load Text Encoder: device cuda:0 does not exist"),
    ("auto", "MGPU Load Text Encoder: split_devices auto splits over every GPU, and this machine has no GPUs"),
    ("cpu", "names one device; list two or more"),
])
def test_split_devices_that_cannot_work_fail_the_prompt_naming_them(server: ComfyServer, split_devices, says):
    entry, _ = run(server, encode_prompt("x", split_devices))
    assert entry["status"]["status_str"] == "error"
    (err,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert err["node_type"] == "MgpuLoadTextEncoder" and says in err["exception_message"], err["exception_message"]


# --- a cache hit loads nothing, also when the loader runs again ----------------------------------------------------

def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def page_cache_bytes(path: Path) -> int:
    """How much of the file the kernel's page cache holds (mincore on a mapping of our own, which touches nothing):
    what any process read of it, by read() or through a mapping, since it was last evicted."""
    import ctypes
    import os

    libc, size, page = _libc(), path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)   # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * (-(-size // page)))()
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) * page


def evict(path: Path) -> int:
    """Drop the file's clean pages from the page cache (pages a process still maps stay); what is left in it."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return page_cache_bytes(path)


# ComfyUI's own log line, written by comfy.sd.CLIP.__init__ (0.3.64 and 0.33) each time an encoder is built
COMFY_BUILDS_AN_ENCODER = "CLIP/text encoder model load device"
PLANNED_TE = "mgpu_te_plan_wan.safetensors"


def planned_encode(text: str, width: int) -> dict[str, Any]:
    """MGPU Plan -> MGPU Load Text Encoder (the plan connected) -> stock CLIPTextEncode."""
    from test_comfyui_nodes import CLIP_L

    return {
        "plan": {"class_type": "MgpuPlan", "inputs": {
            "dit": PLANNED_TE, "text_encoder": "none", "vae": "none", "width": width, "height": 64, "frames": 5,
            "batch": 1, "cfg": True, "dit_weight_dtype": "default", "devices": "auto", "allow_offload": False,
            "prefer_speed": False}},
        "te": {"class_type": "MgpuLoadTextEncoder", "inputs": {
            "clip_name": CLIP_L, "type": "stable_diffusion", "device": "cpu", "clip_name2": "none",
            "plan": ["plan", 0]}},
        "enc": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["te", 0], "text": text}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["enc", 0]}},
    }


def stock_encode(text: str) -> dict[str, Any]:
    from test_comfyui_nodes import CLIP_L

    return {"stock_te": {"class_type": "CLIPLoader", "inputs": {"clip_name": CLIP_L, "type": "stable_diffusion"}},
            "stock_enc": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["stock_te", 0], "text": text}},
            "3": {"class_type": "PreviewAny", "inputs": {"source": ["stock_enc", 0]}}}


def test_a_changed_plan_reruns_the_loader_and_a_cached_encode_reads_nothing_of_the_encoder_file(server):
    """Only MGPU Plan's width changes: ComfyUI runs MGPU Load Text Encoder and CLIPTextEncode again, the text is in
    the cache, and the encoder file is not read (the kernel's page cache gains none of its 246 MB after we evicted
    it) nor built (ComfyUI's own line). A text not in the cache then loads the encoder, as stock ComfyUI's does."""
    from comfy_checkpoints import write_tiny_wan21_t2v
    from test_comfyui_nodes import CLIP_L

    write_tiny_wan21_t2v(server.diffusion_models / PLANNED_TE)
    encoder = server.text_encoders / CLIP_L
    size = encoder.stat().st_size
    first, log = run(server, planned_encode("a lighthouse at dusk", width=64))
    assert log.count(COMFY_BUILDS_AN_ENCODER) == 1 and "from the cache" not in log, log[-3000:]

    # Pages a live CLIP still maps stay cached (ComfyUI 0.33 keeps some of the first run's weights mapped from the
    # file); loading the encoder again reads the whole file, so the evicted rest would come back.
    kept = evict(encoder)
    assert kept < size // 2, f"{kept} of {size} bytes stay in the page cache: nothing to measure"
    again, log = run(server, planned_encode("a lighthouse at dusk", width=80))
    read = page_cache_bytes(encoder) - kept
    print(f"plan changed, same text: {read} of the encoder's {size} bytes read ({kept} mapped before)")
    assert read < size // 100, f"{read} of {size} bytes of the encoder were read"
    assert COMFY_BUILDS_AN_ENCODER not in log, log[-3000:]
    assert "MGPU: text encoder output from the cache" in log, log[-3000:]
    assert shown(again) == shown(first)

    kept = evict(encoder)   # the control: a text not in the cache loads the encoder the loader deferred
    other, log = run(server, planned_encode("a lighthouse at dawn", width=96))
    read = page_cache_bytes(encoder) - kept
    print(f"plan changed, new text: {read} of the encoder's {size} bytes read ({kept} mapped before)")
    assert log.count(COMFY_BUILDS_AN_ENCODER) == 1 and "from the cache" not in log, log[-3000:]
    assert read > (size - kept) // 2, f"only {read} of {size} bytes read when the encoder loaded"
    stock, _ = run(server, stock_encode("a lighthouse at dawn"))
    assert shown(other) == shown(stock) != shown(first)
