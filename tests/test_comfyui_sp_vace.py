"""Sequence parallelism for Wan VACE in a real ComfyUI: a tiny VACE file that ComfyUI's own detection takes for
WAN21_Vace, conditioned by two chained stock ``WanVaceToVideo`` nodes (two VACE contexts, strengths 1 and 0.7, one
with a control video), sampled at cfg 1 with its 27 tokens split over 2 cpu ranks, gives stock ComfyUI's latent.
The split each step took is read from ComfyUI's log."""

from __future__ import annotations

import re

import pytest
from comfy_checkpoints import WanDiTConfig, write_tiny_wan21_vace, write_wan21_vae
from comfyui_env import ComfyServer
from test_comfyui_fsdp import _conditioning, _save, latents, max_diff, run

pytestmark = pytest.mark.comfyui

VACE = "mgpu_sp_vace.safetensors"   # dim 256: 2 heads, one per rank in attention; VACE blocks after blocks 0 and 2
VAE = "mgpu_sp_vace_vae.safetensors"
TOLERANCE = 1e-4
SIZE, LENGTH = 48, 9    # latent 3 frames x 6 x 6 -> 27 tokens: 14 / 13


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    write_tiny_wan21_vace(comfyui_server.diffusion_models / VACE, WanDiTConfig(dim=256, ffn_dim=512, num_layers=4),
                          vace_layers=2)
    write_wan21_vae(comfyui_server.vae / VAE)
    return comfyui_server


def _vace(positive: list, negative: list, strength: float, control_video: str | None = None) -> dict:
    """ComfyUI's own VACE conditioning node; chained, it appends a second VACE context to the conditioning."""
    inputs = {"positive": positive, "negative": negative, "vae": ["vae", 0], "width": SIZE,
              "height": SIZE, "length": LENGTH, "batch_size": 1, "strength": strength}
    if control_video:
        inputs["control_video"] = [control_video, 0]
    return {"class_type": "WanVaceToVideo", "inputs": inputs}


def _prompt(seed: int) -> dict:
    def sampler(model: str, vace: str = "vace2") -> dict:
        return {"class_type": "KSampler",
                "inputs": {"model": [model, 0], "positive": [vace, 0], "negative": [vace, 1],
                           "latent_image": [vace, 2], "seed": seed, "steps": 2, "cfg": 1.0,
                           "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}

    return {
        "stock_unet": {"class_type": "UNETLoader", "inputs": {"unet_name": VACE, "weight_dtype": "default"}},
        "sp_unet": {"class_type": "MgpuLoadDiffusionModel",
                    "inputs": {"unet_name": VACE, "weight_dtype": "default", "device": "fsdp", "fsdp_ranks": 2,
                               "sequence_parallel": "auto"}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": VAE}},
        "pos": _conditioning(seed),
        "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
        "control": {"class_type": "EmptyImage",
                    "inputs": {"width": SIZE, "height": SIZE, "batch_size": LENGTH, "color": 0x3080C0}},
        "vace1": _vace(["pos", 0], ["neg", 0], 1.0),
        "vace2": _vace(["vace1", 0], ["vace1", 1], 0.7, control_video="control"),
        "stock": sampler("stock_unet"), "sp": sampler("sp_unet"), "one_context": sampler("stock_unet", "vace1"),
        "save_stock": _save("stock"), "save_sp": _save("sp"), "save_one_context": _save("one_context"),
    }


def _splits(log: str) -> set[tuple[int, int]]:
    return {(int(c), int(s)) for c, s in
            re.findall(r"mgpu_sp_vace\.safetensors: \d+ batch rows? per step split (\d+) \(CFG/batch\) x (\d+) "
                       r"\(sequence\)", log)}


def test_vace_at_cfg_1_splits_the_tokens_and_matches_stock(server: ComfyServer) -> None:
    before = len(server.log())
    out = latents(server, run(server, _prompt(seed=21), timeout=600))
    log = server.log()[before:]
    assert "VaceWanModel has no sequence-parallel adapter" not in log
    diff = max_diff(out["sp"], out["stock"])
    print(f"VACE, 2 contexts, cfg 1, sequence-parallel 2 vs stock: max latent difference {diff:.3g}")
    assert diff <= TOLERANCE
    assert _splits(log) == {(1, 2)}
    second = max_diff(out["one_context"], out["stock"])
    print(f"the second VACE context changes the latent by {second:.3g}")
    assert second > 100 * TOLERANCE
