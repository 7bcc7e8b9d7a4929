"""The plan splits a Wan file's tokens only where its ComfyUI network has a sequence-parallel adapter: VACE and Fun
Camera do (mgpu.families.ADAPTERS), S2V, HuMo and Animate do not, and the plan says so instead of promising a split
the ranks would not take. Families come from the real sizing of each variant's header (no ComfyUI needed)."""

from __future__ import annotations

import pytest

import ckpt_layouts as L
from mgpu.families import ADAPTERS
from mgpu.planning import parallel
from mgpu.planning.sizing import size_component

# variant -> (the key ComfyUI's detection reads for it, its shape, the network class ComfyUI builds)
VARIANTS = {
    "vace": ("vace_patch_embedding.weight", (256, 96, 1, 2, 2), "VaceWanModel"),
    "camera": ("control_adapter.conv.weight", (256, 1536, 2, 2), "CameraWanModel"),
    "s2v": ("casual_audio_encoder.encoder.final_linear.weight", (256, 1024), "WanModel_S2V"),
    "humo": ("audio_proj.audio_proj_glob_1.layer.bias", (512,), "HumoWanModel"),
    "animate": ("face_adapter.fuser_blocks.0.k_norm.weight", (128,), "AnimateWanModel"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_plan_splits_tokens_only_for_networks_with_an_adapter(tmp_path, variant):
    key, shape, network = VARIANTS[variant]
    layout = {**L.wan_dit(256, 512, 2), key: (shape, "BF16")}
    family = size_component(L.write_safetensors(tmp_path / f"{variant}.safetensors", layout, sparse=True)).family
    assert variant in family
    chosen = parallel.choose(2, 1, 2, family)   # cfg 1 (one row) on 2 ranks, 2 heads
    if network in ADAPTERS:
        assert (chosen.cfg, chosen.sp) == (1, 2), (family, chosen)
    else:
        assert (chosen.cfg, chosen.sp) == (2, 1), (family, chosen)
        assert f"{family} has no sequence-parallel adapter" in " ".join(chosen.reasons)
