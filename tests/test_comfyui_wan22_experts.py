"""ComfyUI's own Wan 2.2 A14B workflow shape (two diffusion models: a high-noise expert for the first steps, a
low-noise one for the rest; ModelSamplingSD3 on each; two KSamplerAdvanced with start/end steps, the first returning
its leftover noise) with both loaders set to fsdp: both experts shard over the same 2 cpu ranks and the latent equals
the same workflow with stock UNETLoaders. Both experts stay resident here (the ranks have room for both); taking
them one at a time is test_comfyui_wan22_sharded.py. MGPU Plan takes both experts and shows its decision."""

from __future__ import annotations

import pytest
from comfy_checkpoints import WanDiTConfig, write_tiny_wan21_t2v
from comfyui_env import ComfyServer
from test_comfyui_fsdp import _conditioning, _save, latents, max_diff, run

pytestmark = pytest.mark.comfyui

HIGH, LOW = "mgpu_wan22_high_noise.safetensors", "mgpu_wan22_low_noise.safetensors"
STEPS, SWITCH = 4, 2
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    cfg = WanDiTConfig(dim=256, ffn_dim=512, num_layers=3)   # A14B experts share one architecture, not weights
    write_tiny_wan21_t2v(comfyui_server.diffusion_models / HIGH, cfg, seed=1)
    write_tiny_wan21_t2v(comfyui_server.diffusion_models / LOW, cfg, seed=2)
    return comfyui_server


def _experts(prefix: str, loader: str) -> dict:
    nodes = {}
    for name, unet in (("high", HIGH), ("low", LOW)):
        inputs = {"unet_name": unet, "weight_dtype": "default"}
        if loader == "MgpuLoadDiffusionModel":
            inputs.update(device="fsdp", fsdp_ranks=2)
        nodes[f"{prefix}_{name}_unet"] = {"class_type": loader, "inputs": inputs}
        nodes[f"{prefix}_{name}"] = {"class_type": "ModelSamplingSD3",
                                     "inputs": {"model": [f"{prefix}_{name}_unet", 0], "shift": 8.0}}
    common = {"positive": ["pos", 0], "negative": ["neg", 0], "noise_seed": 21, "steps": STEPS, "cfg": 3.5,
              "sampler_name": "euler", "scheduler": "simple"}
    nodes[f"{prefix}_first"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": [f"{prefix}_high", 0], "latent_image": ["latent", 0], "add_noise": "enable",
        "start_at_step": 0, "end_at_step": SWITCH, "return_with_leftover_noise": "enable"}}
    nodes[f"{prefix}_second"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": [f"{prefix}_low", 0], "latent_image": [f"{prefix}_first", 0], "add_noise": "disable",
        "start_at_step": SWITCH, "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    nodes[f"save_{prefix}_second"] = _save(f"{prefix}_second")
    nodes[f"{prefix}_high_only"] = {"class_type": "KSamplerAdvanced", "inputs": {
        **common, "model": [f"{prefix}_high", 0], "latent_image": ["latent", 0], "add_noise": "enable",
        "start_at_step": 0, "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    nodes[f"save_{prefix}_high_only"] = _save(f"{prefix}_high_only")
    return nodes


def test_two_expert_workflow_with_both_loaders_on_fsdp_matches_stock(server: ComfyServer) -> None:
    prompt = {"pos": _conditioning(5), "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
              "latent": {"class_type": "EmptyHunyuanLatentVideo",
                         "inputs": {"width": 48, "height": 48, "length": 5, "batch_size": 1}},
              **_experts("stock", "UNETLoader"), **_experts("fsdp", "MgpuLoadDiffusionModel")}
    entry = run(server, prompt)
    out = latents(server, entry)
    assert max_diff(out["fsdp_second"], out["stock_second"]) <= TOLERANCE
    assert max_diff(out["fsdp_high_only"], out["stock_high_only"]) <= TOLERANCE
    # the switch matters: the high-noise expert alone gives another latent, so the low-noise one really ran
    assert max_diff(out["stock_second"], out["stock_high_only"]) > 100 * TOLERANCE


A14B = {"dit": "mgpu_wan22_a14b_high_noise_fp8.safetensors",
        "dit_low_noise": "mgpu_wan22_a14b_low_noise_fp8.safetensors"}


def test_the_plan_node_takes_both_experts_and_shows_its_decision(server: ComfyServer) -> None:
    """MGPU Plan with Wan 2.2 A14B's two fp8 experts (header-only files in the real layout) for 2x24GiB at 720p:
    one at a time, with the numbers and the cost of a switch in the node's text; an API prompt made before the
    dit_low_noise input existed plans one DiT as before."""
    import ckpt_layouts as L

    for name in A14B.values():
        if not (server.diffusion_models / name).exists():
            L.write_safetensors(server.diffusion_models / name, L.recast(L.wan21_t2v_14b(), "F8_E4M3"), sparse=True)
    inputs = {**A14B, "text_encoder": "none", "vae": "none", "width": 1280, "height": 720, "frames": 81, "batch": 1,
              "cfg": True, "dit_weight_dtype": "default", "devices": "2x24GiB,cpu=64GiB", "allow_offload": False,
              "prefer_speed": False}
    out = run(server, {"plan": {"class_type": "MgpuPlan", "inputs": inputs}})["outputs"]["plan"]
    text, plan = out["text"][0], out["mgpu_plan"][0]
    assert {p["role"]: p["experts"] for p in plan["placements"]} == {"dit": "one_at_a_time",
                                                                     "dit_low_noise": "one_at_a_time"}
    assert "dit_low_noise: fsdp on cuda:0, cuda:1" in text and "DiT shard (1 expert at a time)" in text
    assert "both experts resident would need 24.8 GiB per rank" in text and "~7.1 s at an assumed 2 GB/s" in text
    del inputs["dit_low_noise"]
    out = run(server, {"plan": {"class_type": "MgpuPlan", "inputs": inputs}})["outputs"]["plan"]
    assert [(p["role"], p["experts"]) for p in out["mgpu_plan"][0]["placements"]] == [("dit", None)]
