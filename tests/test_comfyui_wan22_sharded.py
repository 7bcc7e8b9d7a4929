"""Wan 2.2 sharded inside a real ComfyUI on CPU ranks: the two A14B experts taking turns on the same ranks, with
each rank's peak memory measured from outside; TI2V 5B (48-channel latent, per-frame timesteps from a noise mask);
the I2V models (Wan 2.1 I2V: CLIP image features and the concatenated image latent; a Wan 2.2 I2V expert: the
concatenated latent only). Each sharded result equals the stock nodes' on the same files.

These tests start their own ComfyUI servers (not the session one): a fresh one, whose ranks hold nothing before
the test, with a test node that stands in for a CLIP vision model (ComfyUI builds ViT-H full size, 1.3 GB), and
one whose ranks report 1 MiB free (``MGPU_SIMULATE_RANK_FREE``), so a loader with no plan must take the experts
one at a time there.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from comfy_checkpoints import (
    WanDiTConfig,
    random_state_dict,
    save_checkpoint,
    wan21_dit_shapes,
    write_tiny_wan21_t2v,
    write_wan21_vae,
)
from comfyui_env import ComfyServer, find_comfyui, start_server
from test_comfyui_fsdp import _conditioning, _save, latents, max_diff, run
from test_comfyui_wan22_experts import HIGH, LOW, _experts

import ckpt_layouts as L

pytestmark = [pytest.mark.comfyui, pytest.mark.timeout(900)]

TOLERANCE = 1e-4
# Experts big enough for their shards to stand out of a rank's ~0.5 GB of Python, torch and ComfyUI: 63 M
# parameters, 126 MB per rank in fp32 (the ranks compute in fp32 on the CPU), 252 MB more once gathered.
EXPERT = WanDiTConfig(dim=1024, ffn_dim=2048, num_layers=4)
VAE = "wan_2.1_vae.safetensors"
TI2V = "mgpu_wan22_ti2v_5b.safetensors"
I2V_21 = "mgpu_wan21_i2v.safetensors"
I2V_22 = "mgpu_wan22_i2v_low_noise.safetensors"
TEST_NODES = '''"""comfy-mgpu test node: CLIP vision output without a CLIP vision model (ComfyUI's ViT-H is 1.3 GB)."""
import torch
import comfy.clip_vision


class MgpuTestClipVisionOutput:
    """Seeded hidden states shaped like ViT-H/14's (257 tokens x 1280), as CLIPVisionEncode returns them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1})}}

    RETURN_TYPES = ("CLIP_VISION_OUTPUT",)
    FUNCTION = "make"
    CATEGORY = "testing/mgpu"

    def make(self, seed):
        gen = torch.Generator().manual_seed(seed)
        out = comfy.clip_vision.Output()
        out["last_hidden_state"] = torch.randn(1, 257, 1280, generator=gen)
        out["penultimate_hidden_states"] = torch.randn(1, 257, 1280, generator=gen)
        out["image_embeds"] = torch.randn(1, 1024, generator=gen)
        return (out,)


NODE_CLASS_MAPPINGS = {"MgpuTestClipVisionOutput": MgpuTestClipVisionOutput}
'''


def _start(root: Path, env: dict[str, str] | None = None) -> ComfyServer:
    """A fresh ComfyUI with this pack, the test nodes and ``env`` (the ranks inherit it)."""
    comfyui = find_comfyui()
    if comfyui is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH")
    (root / "base" / "custom_nodes").mkdir(parents=True)
    (root / "base" / "custom_nodes" / "mgpu_wan22_test_nodes.py").write_text(TEST_NODES)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        server = start_server(comfyui, root)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    write_tiny_wan21_t2v(server.diffusion_models / HIGH, EXPERT, seed=1)
    write_tiny_wan21_t2v(server.diffusion_models / LOW, EXPERT, seed=2)
    return server


def _stop(server: ComfyServer) -> None:
    leftovers = server.stop()
    assert not leftovers, "processes outlived the ComfyUI server:\n" + "\n".join(leftovers)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Iterator[ComfyServer]:
    server = _start(tmp_path_factory.mktemp("wan22_fresh"))
    try:
        yield server
    finally:
        _stop(server)


class PeakRss:
    """Samples every rank process's resident memory from outside (psutil, every 20 ms) while a prompt runs."""

    def __init__(self, server: ComfyServer):
        self.server, self.peak, self._stop, self._ranks = server, {}, threading.Event(), set()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def ranks(self) -> list[psutil.Process]:
        """The rank processes: children of the ComfyUI process (a short-lived fork of a rank, which carries the
        rank's command line and its copy-on-write pages, is its child, not ComfyUI's)."""
        try:
            children = psutil.Process(self.server.process.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [p for p in children if p.pid in self._ranks or self._is_rank(p)]

    def _is_rank(self, p: psutil.Process) -> bool:
        try:
            if "mgpu.ranks.rank" in p.cmdline():
                self._ranks.add(p.pid)
                return True
        except psutil.Error:
            pass
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.ranks():
                try:
                    self.peak[p.pid] = max(self.peak.get(p.pid, 0), p.memory_info().rss)
                except psutil.Error:   # a rank between two samples
                    continue
            time.sleep(0.02)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _two_expert_prompt(seed: int) -> dict:
    prompt = {"pos": _conditioning(5),
              "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
              "latent": {"class_type": "EmptyHunyuanLatentVideo",
                         "inputs": {"width": 48, "height": 48, "length": 5, "batch_size": 1}},
              **_experts("stock", "UNETLoader"), **_experts("fsdp", "MgpuLoadDiffusionModel")}
    for node in prompt.values():
        if node["class_type"] == "KSamplerAdvanced":
            node["inputs"]["noise_seed"] = seed
    return prompt


def _run_two_experts(server: ComfyServer) -> tuple[int, str]:
    """The two-expert workflow twice, the second time with another seed (the loaders' outputs are cached, the
    samplers run again), each == stock: the largest peak RSS of a rank, and the log lines the two runs added."""
    start = len(server.log())
    with PeakRss(server) as rss:
        for seed in (21, 22):
            out = latents(server, run(server, _two_expert_prompt(seed), timeout=600))
            for name in ("second", "high_only"):
                assert max_diff(out[f"fsdp_{name}"], out[f"stock_{name}"]) <= TOLERANCE
            assert max_diff(out["stock_second"], out["stock_high_only"]) > 100 * TOLERANCE   # the switch matters
    assert len(rss.peak) == 2, rss.peak
    return max(rss.peak.values()), server.log()[start:]


def test_two_experts_one_at_a_time_match_stock_and_halve_what_a_rank_holds(fresh, tmp_path_factory):
    """The same two-expert workflow (both loaders on fsdp, no plan) on a fresh ComfyUI whose ranks have room for
    both, and on one whose ranks report 1 MiB free: there the low-noise loader finds the high-noise expert on the
    ranks, weighs itself against their free memory and takes turns with it; from then on a sampler's first step
    frees the other expert and reloads its own. Both equal stock; a rank's peak memory drops by about one expert."""
    both_peak, both_log = _run_two_experts(fresh)
    assert f"{LOW} stays on the FSDP ranks beside {HIGH}" in both_log and "takes turns" not in both_log

    turns = _start(tmp_path_factory.mktemp("wan22_turns"), {"MGPU_SIMULATE_RANK_FREE": "1MiB"})
    try:
        turns_peak, turns_log = _run_two_experts(turns)
    finally:
        _stop(turns)
    switches = re.findall(r"freed (\S+) to load (\S+): ([\d.]+) s", turns_log)
    params = sum(math.prod(shape) for shape in wan21_dit_shapes(EXPERT).values())
    expert_per_rank = params * 4 // 2 + params * 4   # fp32 shard + the whole model kept gathered between steps
    print(f"\npeak RSS of a rank: both resident {both_peak / 2**20:.0f} MiB, one at a time {turns_peak / 2**20:.0f} "
          f"MiB, one expert per rank {expert_per_rank / 2**20:.0f} MiB; switches {switches}")
    assert f"no MGPU Plan: {LOW} takes turns with {HIGH} on the FSDP ranks" in turns_log
    # ComfyUI runs each loader when a sampler first needs it: the low-noise loader frees the high-noise expert; the
    # second run's samplers reload the high-noise one (freeing the other) and then the low-noise one
    assert [(a, b) for a, b, _ in switches] == [(HIGH, LOW), (LOW, HIGH), (HIGH, LOW)], switches
    assert turns_peak < both_peak - expert_per_rank // 2


# --------------------------------------------------------------------------------------------- TI2V 5B and I2V

def _write_wan(server: ComfyServer, name: str, layout: L.Layout, seed: int) -> None:
    if not (server.diffusion_models / name).exists():
        shapes = {k: shape for k, (shape, _) in layout.items()}
        save_checkpoint(server.diffusion_models / name, random_state_dict(shapes, seed))


def _vae(server: ComfyServer) -> dict:
    if not (server.vae / VAE).exists():
        write_wan21_vae(server.vae / VAE)
    return {"class_type": "VAELoader", "inputs": {"vae_name": VAE}}


def _pair(unet: str, positive: list, negative: list, latent: list, cfg: float, prefix: str) -> dict:
    """The same KSampler on the stock loader and on the sharded one (2 cpu ranks), each saved."""
    nodes = {}
    stock = {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}}
    for kind, loader in (("stock", stock),
                         ("fsdp", {"class_type": "MgpuLoadDiffusionModel",
                                   "inputs": {"unet_name": unet, "weight_dtype": "default", "device": "fsdp",
                                              "fsdp_ranks": 2}})):
        nodes[f"{prefix}_{kind}_unet"] = loader
        nodes[f"{prefix}_{kind}"] = {"class_type": "KSampler", "inputs": {
            "model": [f"{prefix}_{kind}_unet", 0], "positive": positive, "negative": negative, "latent_image": latent,
            "seed": 11, "steps": 3, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
        nodes[f"save_{prefix}_{kind}"] = _save(f"{prefix}_{kind}")
    return nodes


def test_ti2v_5b_with_per_frame_timesteps_matches_stock(fresh):
    """Wan 2.2 TI2V 5B (in and out 48 channels: ComfyUI's WAN22 model): a noise mask that goes from 0 on the first
    latent frame to 1 on the last gives each frame its own timestep (WAN22.process_timestep), which reaches the
    ranks as a [batch, frames] tensor. At cfg 3 the ranks split cond and uncond; at cfg 1 they split the tokens."""
    server = fresh
    _write_wan(server, TI2V, L.wan_dit(256, 512, 3, in_ch=48, out_ch=48), seed=3)
    prompt = {
        "pos": _conditioning(5), "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
        "vae": _vae(server),
        "empty": {"class_type": "Wan22ImageToVideoLatent",
                  "inputs": {"vae": ["vae", 0], "width": 64, "height": 64, "length": 9, "batch_size": 1}},
        "black": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}},
        "white": {"class_type": "EmptyImage",
                  "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0xFFFFFF}},
        "ramp": {"class_type": "ImageBatch", "inputs": {"image1": ["black", 0], "image2": ["white", 0]}},
        "mask": {"class_type": "ImageToMask", "inputs": {"image": ["ramp", 0], "channel": "red"}},
        "latent": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["empty", 0], "mask": ["mask", 0]}},
        **_pair(TI2V, ["pos", 0], ["neg", 0], ["latent", 0], 3.0, "cfg"),
        **_pair(TI2V, ["pos", 0], ["neg", 0], ["latent", 0], 1.0, "sp"),
        **{k: v for k, v in _pair(TI2V, ["pos", 0], ["neg", 0], ["empty", 0], 3.0, "nomask").items()
           if "stock" in k},
    }
    out = latents(server, run(server, prompt, timeout=600))
    assert out["cfg_stock"].shape == (1, 48, 3, 4, 4)
    assert max_diff(out["cfg_fsdp"], out["cfg_stock"]) <= TOLERANCE
    assert max_diff(out["sp_fsdp"], out["sp_stock"]) <= TOLERANCE
    assert max_diff(out["cfg_stock"], out["nomask_stock"]) > 100 * TOLERANCE   # the per-frame timesteps matter


def test_i2v_image_conditioning_matches_stock(fresh):
    """WanImageToVideo encodes a start image with the Wan VAE into the latent concatenated to the noise (plus its
    mask: 36 input channels); Wan 2.1 I2V also gets CLIP image features (clip_fea, cached on the ranks like the
    text context). A Wan 2.2 I2V expert has no CLIP branch: the same node without clip_vision_output. At cfg 3 the
    ranks split cond and uncond, at cfg 1 the tokens."""
    server = fresh
    _write_wan(server, I2V_21, L.wan_dit(256, 512, 3, in_ch=36, i2v=True), seed=4)
    _write_wan(server, I2V_22, L.wan_dit(256, 512, 3, in_ch=36), seed=6)
    common = {"vae": ["vae", 0], "width": 64, "height": 64, "length": 9, "batch_size": 1,
              "start_image": ["image", 0]}
    prompt = {
        "pos": _conditioning(5), "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
        "vae": _vae(server),
        "image": {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1,
                                                         "color": 0x3366CC}},
        "clip_vision": {"class_type": "MgpuTestClipVisionOutput", "inputs": {"seed": 9}},
        "i2v": {"class_type": "WanImageToVideo", "inputs": {"positive": ["pos", 0], "negative": ["neg", 0],
                                                             "clip_vision_output": ["clip_vision", 0], **common}},
        "i2v_noclip": {"class_type": "WanImageToVideo",
                       "inputs": {"positive": ["pos", 0], "negative": ["neg", 0], **common}},
        **_pair(I2V_21, ["i2v", 0], ["i2v", 1], ["i2v", 2], 3.0, "wan21"),
        **_pair(I2V_21, ["i2v", 0], ["i2v", 1], ["i2v", 2], 1.0, "wan21_sp"),
        **_pair(I2V_22, ["i2v_noclip", 0], ["i2v_noclip", 1], ["i2v_noclip", 2], 3.0, "wan22"),
        **{k: v for k, v in _pair(I2V_21, ["i2v_noclip", 0], ["i2v_noclip", 1], ["i2v_noclip", 2], 3.0,
                                  "wan21_noclip").items() if "stock" in k},
    }
    out = latents(server, run(server, prompt, timeout=600))
    assert out["wan21_stock"].shape == (1, 16, 3, 8, 8)
    assert max_diff(out["wan21_fsdp"], out["wan21_stock"]) <= TOLERANCE
    assert max_diff(out["wan21_sp_fsdp"], out["wan21_sp_stock"]) <= TOLERANCE   # cfg 1: the tokens split
    assert max_diff(out["wan22_fsdp"], out["wan22_stock"]) <= TOLERANCE
    assert max_diff(out["wan21_stock"], out["wan21_noclip_stock"]) > 100 * TOLERANCE   # clip_fea matters
