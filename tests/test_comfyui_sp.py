"""Sequence parallelism in a real ComfyUI: the Wan workflow at cfg 1 (a distilled model, nothing for a CFG split to
share) runs with its tokens split over 2 cpu ranks and gives stock ComfyUI's latent; at cfg > 1 the same loaded
MODEL splits the CFG rows instead. The split each step took is read from ComfyUI's log."""

from __future__ import annotations

import re

import pytest
from comfy_checkpoints import WanDiTConfig, write_tiny_wan21_t2v
from comfyui_env import ComfyServer
from test_comfyui_fsdp import _conditioning, _save, latents, max_diff, run

pytestmark = pytest.mark.comfyui

WAN = "mgpu_sp_wan.safetensors"   # dim 256: 2 heads, one per rank in attention
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    write_tiny_wan21_t2v(comfyui_server.diffusion_models / WAN, WanDiTConfig(dim=256, ffn_dim=512, num_layers=3))
    return comfyui_server


def _prompt(cfg: float, seed: int) -> dict:
    def sampler(model: str) -> dict:
        return {"class_type": "KSampler",
                "inputs": {"model": [model, 0], "positive": ["pos", 0], "negative": ["neg", 0],
                           "latent_image": ["latent", 0], "seed": seed, "steps": 3, "cfg": cfg,
                           "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}

    def loader(sp: str) -> dict:
        return {"class_type": "MgpuLoadDiffusionModel",
                "inputs": {"unet_name": WAN, "weight_dtype": "default", "device": "fsdp", "fsdp_ranks": 2,
                           "sequence_parallel": sp}}

    return {
        "stock_unet": {"class_type": "UNETLoader", "inputs": {"unet_name": WAN, "weight_dtype": "default"}},
        "sp_unet": loader("auto"),
        "pos": _conditioning(seed),
        "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": 48, "height": 48, "length": 9, "batch_size": 1}},   # 27 tokens: 14 / 13
        "stock": sampler("stock_unet"), "sp": sampler("sp_unet"),
        "save_stock": _save("stock"), "save_sp": _save("sp"),
    }


def _splits(log: str) -> set[tuple[int, int]]:
    return {(int(c), int(s)) for c, s in
            re.findall(r"mgpu_sp_wan\.safetensors: \d+ batch rows? per step split (\d+) \(CFG/batch\) x (\d+) "
                       r"\(sequence\)", log)}


def test_cfg_1_splits_the_tokens_and_matches_stock(server: ComfyServer) -> None:
    before = len(server.log())
    out = latents(server, run(server, _prompt(cfg=1.0, seed=11)))
    assert max_diff(out["sp"], out["stock"]) <= TOLERANCE
    assert _splits(server.log()[before:]) == {(1, 2)}


def test_cfg_above_1_splits_the_rows_with_the_same_model(server: ComfyServer) -> None:
    before = len(server.log())
    out = latents(server, run(server, _prompt(cfg=4.0, seed=12)))
    assert max_diff(out["sp"], out["stock"]) <= TOLERANCE
    assert _splits(server.log()[before:]) == {(2, 1)}
