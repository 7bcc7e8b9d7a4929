"""MGPU Plan, MGPU Load Text Encoder and MGPU Load VAE in a real ComfyUI (CPU), through POST /prompt.

Skipped without a ComfyUI checkout (COMFYUI_PATH). This machine has no GPU, so real placements are cpu;
multi-GPU plans are made for simulated devices (the Plan node's devices spec).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from comfy_checkpoints import random_state_dict, save_checkpoint, write_tiny_wan21_t2v, write_wan21_vae
from comfyui_env import ComfyServer, PromptRejected
from safetensors.torch import load_file

from mgpu.planning.partition import Plan

pytestmark = pytest.mark.comfyui

WAN = "mgpu_nodes_wan.safetensors"
VAE = "mgpu_nodes_vae.safetensors"
CLIP_L = "mgpu_nodes_clip_l.safetensors"


def clip_l_shapes() -> dict[str, tuple[int, ...]]:
    """CLIP-L text model keys as ComfyUI's CLIPTextModel names them (comfy/clip_model.py, sd1_clip_config.json).

    ComfyUI builds CLIP-L from a fixed config, so the file is full size (123 M params, 246 MB in bf16).
    """
    d, ff, s = 768, 3072, {}
    s["text_model.embeddings.token_embedding.weight"] = (49408, d)
    s["text_model.embeddings.position_embedding.weight"] = (77, d)
    for i in range(12):
        p = f"text_model.encoder.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[f"{p}.self_attn.{proj}.weight"], s[f"{p}.self_attn.{proj}.bias"] = (d, d), (d,)
        for norm in ("layer_norm1", "layer_norm2"):
            s[f"{p}.{norm}.weight"], s[f"{p}.{norm}.bias"] = (d,), (d,)
        s[f"{p}.mlp.fc1.weight"], s[f"{p}.mlp.fc1.bias"] = (ff, d), (ff,)
        s[f"{p}.mlp.fc2.weight"], s[f"{p}.mlp.fc2.bias"] = (d, ff), (d,)
    s["text_model.final_layer_norm.weight"], s["text_model.final_layer_norm.bias"] = (d,), (d,)
    s["text_projection.weight"] = (d, d)
    return s


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    write_tiny_wan21_t2v(comfyui_server.diffusion_models / WAN)
    if not (comfyui_server.vae / VAE).exists():
        write_wan21_vae(comfyui_server.vae / VAE)
    if not (comfyui_server.text_encoders / CLIP_L).exists():
        save_checkpoint(comfyui_server.text_encoders / CLIP_L, random_state_dict(clip_l_shapes(), seed=3))
    return comfyui_server


def run(server: ComfyServer, prompt: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    return server.wait(server.post_prompt(prompt), timeout=timeout)


def error_of(entry: dict[str, Any]) -> dict[str, Any]:
    assert entry["status"]["status_str"] == "error", entry["status"]
    (data,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    return data


def plan_node(devices: str = "2x24GiB,cpu=64GiB", vae: str = VAE, **overrides) -> dict[str, Any]:
    inputs = {"dit": WAN, "text_encoder": "none", "vae": vae, "width": 64, "height": 64, "frames": 5, "batch": 1,
              "cfg": True, "dit_weight_dtype": "default", "devices": devices, "allow_offload": False,
              "prefer_speed": False}
    return {"class_type": "MgpuPlan", "inputs": {**inputs, **overrides}}


def test_nodes_are_listed_with_stable_device_values(server: ComfyServer):
    info = server.object_info()
    for name in ("MgpuPlan", "MgpuLoadTextEncoder", "MgpuLoadVAE"):
        assert info[name]["category"] == "MGPU", info[name]
    # the plan first (saved workflows connect by slot), then the size it was made for, for the latent node
    assert info["MgpuPlan"]["output"] == ["MGPU_PLAN", "INT", "INT", "INT", "INT"]
    assert info["MgpuPlan"]["output_name"] == ["plan", "width", "height", "frames", "batch"]
    assert info["MgpuPlan"]["output_node"] is True
    for name in ("MgpuLoadTextEncoder", "MgpuLoadVAE"):
        device = info[name]["input"]["required"]["device"]
        assert device[1]["options"] == ["auto", "cpu"]  # no GPU here; fsdp is for the diffusion model only
        assert info[name]["input"]["optional"]["plan"][0] == "MGPU_PLAN"
    types = info["MgpuLoadTextEncoder"]["input"]["required"]["type"][1]["options"]
    assert {"wan", "ltxv", "stable_diffusion"} <= set(types)
    assert VAE in info["MgpuPlan"]["input"]["required"]["vae"][1]["options"]
    # the plan sizes the DiT in the dtypes its loader can load it in
    planned = info["MgpuPlan"]["input"]["required"]["dit_weight_dtype"][1]["options"]
    assert planned == info["MgpuLoadDiffusionModel"]["input"]["required"]["weight_dtype"][1]["options"]


def test_plan_node_shows_the_table_and_sends_the_plan(server: ComfyServer):
    entry = run(server, {"1": plan_node()})
    assert entry["status"]["status_str"] == "success", entry["status"]
    out = entry["outputs"]["1"]
    plan = Plan.from_dict(out["mgpu_plan"][0])
    assert out["text"] == [plan.table()]
    assert [u.device for u in plan.usage] == ["cuda:0", "cuda:1", "cpu"]
    assert {p.role: p.file.rsplit("/", 1)[-1] for p in plan.placements} == {"dit": WAN, "vae": VAE}
    assert "cuda:0" in out["text"][0] and "headroom" in out["text"][0]
    rows = out["mgpu_chart"][0]
    assert [r["device"] for r in rows] == ["cuda:0", "cuda:1", "cpu"]
    for row, use in zip(rows, plan.usage):
        assert [sum(s["bytes"] for s in ph["segments"]) for ph in row["phases"]] == list(use.by_phase.values())
    kinds = {s["kind"] for r in rows for ph in r["phases"] for s in ph["segments"]}
    assert {"dit", "vae", "working"} <= kinds


def test_plan_node_with_auto_plans_this_machine(server: ComfyServer):
    entry = run(server, {"1": plan_node(devices="auto", vae="none")})
    plan = Plan.from_dict(entry["outputs"]["1"]["mgpu_plan"][0])
    assert [u.device for u in plan.usage] == ["cpu"] and plan.placement("dit").strategy == "cpu"


def test_plan_that_cannot_fit_fails_with_the_numbers(server: ComfyServer):
    entry = run(server, {"1": plan_node(devices="1x1GiB,cpu=1GiB", width=1280, height=720, frames=81)})
    err = error_of(entry)
    assert err["node_type"] == "MgpuPlan" and err["exception_type"].endswith("PlanError")
    msg = err["exception_message"].rstrip()
    assert msg.startswith("MGPU Plan: no placement fits.\ncannot place the dit")
    assert "cuda:0: budget 512 MiB" in msg and "ways out:" in msg


def test_plan_of_a_file_that_is_no_model_names_it(server: ComfyServer):
    bad = server.diffusion_models / "mgpu_nodes_not_a_model.safetensors"
    bad.write_bytes(b"<html>404 Not Found</html>")
    err = error_of(run(server, {"1": plan_node(dit=bad.name)}))
    assert err["node_type"] == "MgpuPlan" and err["exception_type"].endswith("SizingError")
    assert err["exception_message"].startswith("MGPU Plan: ") and bad.name in err["exception_message"]


def test_bad_device_spec_is_refused_when_queued(server: ComfyServer):
    with pytest.raises(PromptRejected) as info:
        server.post_prompt({"1": plan_node(devices="2x")})
    (error,) = info.value.body["node_errors"]["1"]["errors"]
    assert "MGPU Plan: devices: bad device spec '2x'" in error["details"]


def vae_decode_prompt(device: str, with_plan: dict | None = None) -> dict[str, Any]:
    prompt = {
        "2": {"class_type": "MgpuLoadVAE", "inputs": {"vae_name": VAE, "device": device}},
        "3": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 5,
                                                                   "batch_size": 1}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["2", 0]}},
        "5": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": f"mgpu_vae_{device}"}},
    }
    if with_plan is not None:
        prompt["1"] = with_plan
        prompt["2"]["inputs"]["plan"] = ["1", 0]
    return prompt


def test_vae_loader_on_cpu_decodes_a_latent(server: ComfyServer):
    from PIL import Image

    before = len(server.log())
    entry = run(server, vae_decode_prompt("cpu"))
    assert entry["status"]["status_str"] == "success", entry["status"]
    images = entry["outputs"]["5"]["images"]
    assert len(images) == 5  # 2 latent frames -> 5 video frames
    with Image.open(server.output_dir / images[0]["subfolder"] / images[0]["filename"]) as img:
        assert img.size == (64, 64)
    assert "VAE load device: cpu" in server.log()[before:]


def test_vae_auto_follows_a_plan_for_this_machine(server: ComfyServer):
    before = len(server.log())
    entry = run(server, vae_decode_prompt("auto", plan_node(devices="auto")))
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert "MGPU Load VAE: auto: following the plan (cpu on cpu)" in server.log()[before:]


def test_vae_auto_refuses_a_plan_made_for_other_devices(server: ComfyServer):
    err = error_of(run(server, vae_decode_prompt("auto", plan_node(devices="2x24GiB,cpu=64GiB"))))
    assert err["node_type"] == "MgpuLoadVAE"
    msg = err["exception_message"].rstrip()
    assert msg.startswith("MGPU Load VAE: device cuda:") and "does not exist (the MGPU Plan places the VAE there" in msg
    assert "this machine has cpu host RAM" in msg and msg.endswith("pick one of auto, cpu")


def queued_errors(server: ComfyServer, prompt: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST /prompt's status and its node_errors: ComfyUI refuses a prompt whose outputs all fail validation (400),
    and queues the valid outputs of one where some do (200), listing the others' node errors either way."""
    status, body = server._request("POST", "/prompt", {"prompt": prompt, "client_id": server.client_id})
    return status, body.get("node_errors", {})


def _details(errors: dict[str, Any], node: str) -> str:
    return "\n".join(e.get("details", "") for e in errors[node]["errors"])


def test_a_bad_device_is_reported_when_queued_even_beside_an_mgpu_plan(server: ComfyServer):
    """Checked at POST /prompt, before any node runs: alone the prompt is refused; beside an MGPU Plan (an output
    node that does not need the loader) ComfyUI still runs the plan, and the response names the loader's error."""
    status, errors = queued_errors(server, vae_decode_prompt("cuda:7"))
    assert status == 400 and errors["2"]["class_type"] == "MgpuLoadVAE"
    msg = _details(errors, "2")
    assert "MGPU Load VAE: device cuda:7 does not exist; this machine has cpu" in msg and "pick one of auto, cpu" in msg
    status, errors = queued_errors(server, vae_decode_prompt("cuda:7", plan_node(devices="auto")))
    assert "MGPU Load VAE: device cuda:7 does not exist" in _details(errors, "2")


def test_a_file_that_is_not_there_is_refused_when_queued_naming_it(server: ComfyServer):
    prompt = vae_decode_prompt("cpu")
    prompt["2"]["inputs"]["vae_name"] = "never_there.safetensors"
    status, errors = queued_errors(server, prompt)
    assert status == 400 and errors["2"]["class_type"] == "MgpuLoadVAE"
    assert "MGPU Load VAE: 'never_there.safetensors' is not in ComfyUI's vae folder" in _details(errors, "2")


def test_a_listed_file_that_is_gone_names_the_file(server: ComfyServer):
    """A dangling link is listed by ComfyUI but cannot be opened: refused when queued, naming the file."""
    link = server.vae / "mgpu_gone.safetensors"
    if not link.is_symlink():
        os.symlink(server.vae / "does-not-exist.safetensors", link)
    prompt = vae_decode_prompt("cpu")
    prompt["2"]["inputs"]["vae_name"] = link.name
    status, errors = queued_errors(server, prompt)
    assert status == 400
    assert "MGPU Load VAE: 'mgpu_gone.safetensors' is not in ComfyUI's vae folder" in _details(errors, "2")


def test_text_encoder_loader_encodes_on_cpu(server: ComfyServer):
    before = len(server.log())
    prompt = {
        "1": {"class_type": "MgpuLoadTextEncoder", "inputs": {"clip_name": CLIP_L, "type": "stable_diffusion",
                                                              "device": "cpu", "clip_name2": "none"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": "a red fox in the snow"}},
        "5": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    }
    entry = run(server, prompt)
    assert entry["status"]["status_str"] == "success", entry["status"]
    log = server.log()[before:]
    assert "CLIP/text encoder model load device: cpu, offload device: cpu" in log
    assert "clip missing" not in log and "clip unexpected" not in log, log[-3000:]
    shown = entry["outputs"]["5"]["text"][0]
    assert "tensor(" in shown and "nan" not in shown


def test_text_encoder_type_and_device_errors(server: ComfyServer):
    prompt = {"1": {"class_type": "MgpuLoadTextEncoder", "inputs": {"clip_name": CLIP_L, "type": "wan",
                                                                    "device": "cuda:1", "clip_name2": "none"}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    status, errors = queued_errors(server, prompt)
    assert status == 400 and errors["1"]["class_type"] == "MgpuLoadTextEncoder"
    assert "MGPU Load Text Encoder: device cuda:1 does not exist" in _details(errors, "1")
    prompt["1"]["inputs"]["device"] = "fsdp"
    assert "fsdp shards only the diffusion model" in _details(queued_errors(server, prompt)[1], "1")


def test_a_latent_of_another_size_than_the_plan_warns_with_the_numbers(server: ComfyServer):
    """The plan sized memory for 64x64x5: a latent wired from the plan's width, height, frames and batch outputs
    samples that size and says nothing; one typed apart at 128x128 says so at the first step (4x the tokens), and
    at 32x32 too (a quarter)."""
    def prompt(size: int | None) -> dict[str, Any]:
        wired = {"width": ["1", 1], "height": ["1", 2], "length": ["1", 3], "batch_size": ["1", 4]}
        return {
            "1": plan_node(devices="auto", vae="none"),
            "2": {"class_type": "MgpuLoadDiffusionModel", "inputs": {
                "unet_name": WAN, "weight_dtype": "default", "device": "auto", "fsdp_ranks": 0, "plan": ["1", 0]}},
            "3": {"class_type": "MgpuTestConditioning", "inputs": {"width": 4096, "tokens": 8, "seed": 1, "scale": 1.0}},
            "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": wired if size is None else {
                "width": size, "height": size, "length": 5, "batch_size": 1}},
            "5": {"class_type": "KSampler", "inputs": {
                "model": ["2", 0], "positive": ["3", 0], "negative": ["3", 0], "latent_image": ["4", 0],
                "seed": size or 0, "steps": 1, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
                "denoise": 1.0}},
            "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"mgpu_plan_{size}"}},
        }

    before = len(server.log())
    entry = run(server, prompt(None))
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert "but the MGPU Plan was made for" not in server.log()[before:]
    (saved,) = entry["outputs"]["6"]["latents"]
    latent = load_file(str(server.output_dir / saved["subfolder"] / saved["filename"]))["latent_tensor"]
    assert tuple(latent.shape) == (1, 16, 2, 8, 8)   # 64x64x5, batch 1: the plan's size came down the wires
    before = len(server.log())
    assert run(server, prompt(128))["status"]["status_str"] == "success"
    log = server.log()[before:]
    assert "latent 2x16x2x16x16 is 128 tokens x batch 2 = 256, but the MGPU Plan was made for 64x64x5, batch 1 " \
           "with CFG = 32 tokens x batch 2 = 64 (this is 4.0x that)" in log, log[-3000:]
    before = len(server.log())
    assert run(server, prompt(32))["status"]["status_str"] == "success"
    log = server.log()[before:]
    assert "latent 2x16x2x4x4 is 8 tokens a video, but the MGPU Plan was made for 64x64x5, batch 1 with CFG = 32 " \
           "tokens a video" in log, log[-3000:]
