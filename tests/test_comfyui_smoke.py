"""A real ComfyUI loads this pack and runs stock workflows on tiny checkpoints (CPU).

Needs a ComfyUI checkout (COMFYUI_PATH, or this pack inside ComfyUI/custom_nodes/<name>); skips otherwise.
Run locally:  COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests/test_comfyui_smoke.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from comfy_checkpoints import (
    EXPECTED_DETECTION,
    WanDiTConfig,
    wan21_vae_shapes,
    write_tiny_ltxv,
    write_tiny_wan21_t2v,
    write_wan21_vae,
)
from comfyui_env import HELPER_MODULE, PACK_LINK_NAME, SKIP_REASON, ComfyServer, find_comfyui
from safetensors.torch import load_file

pytestmark = pytest.mark.comfyui

WAN_FILE = "mgpu_tiny_wan21_t2v.safetensors"
LTXV_FILE = "mgpu_tiny_ltxv.safetensors"


def run_in_comfyui(code: str, timeout: float = 600.0) -> Any:
    """Run code in a fresh interpreter with ComfyUI importable on the CPU; the code sets `result` (JSON-able).

    A subprocess because importing comfy probes devices and parses global args, which must not leak into pytest.
    """
    comfyui = find_comfyui()
    if comfyui is None:
        pytest.skip(SKIP_REASON)
    prelude = (f"import sys, json\nsys.path.insert(0, {str(comfyui)!r})\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
               "from comfy.cli_args import args\nargs.cpu = True\n")
    proc = subprocess.run([sys.executable, "-c", prelude + code + "\nprint('@@RESULT@@' + json.dumps(result))\n"],
                          cwd=comfyui, capture_output=True, text=True, timeout=timeout, check=False)
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT@@")]
    assert proc.returncode == 0 and marker, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(marker[-1][len("@@RESULT@@"):])


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    """The session server with the tiny Wan and LTXV DiTs in its diffusion_models folder."""
    write_tiny_wan21_t2v(comfyui_server.diffusion_models / WAN_FILE)
    write_tiny_ltxv(comfyui_server.diffusion_models / LTXV_FILE)
    return comfyui_server


def wan_prompt(seed: int, steps: int = 2, cfg: float = 3.0, frames: int = 5, size: int = 64) -> dict[str, Any]:
    """UNETLoader(tiny Wan) + test conditioning (+ stock ConditioningZeroOut as negative) + KSampler + SaveLatent."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": WAN_FILE, "weight_dtype": "default"}},
        "2": {"class_type": "MgpuTestConditioning", "inputs": {"width": 4096, "tokens": 8, "seed": seed, "scale": 1.0}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
        "4": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": size, "height": size, "length": frames, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": seed,
            "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"latents/mgpu_{seed}"}},
    }


def saved_latent(server: ComfyServer, entry: dict[str, Any], node: str) -> torch.Tensor:
    (item,) = entry["outputs"][node]["latents"]
    return load_file(str(server.output_dir / item["subfolder"] / item["filename"]))["latent_tensor"]


def plain_log(server: ComfyServer) -> str:
    """The server log without the colours and level tags ComfyUI >= 0.33 puts before each line."""
    log = re.sub(r"\x1b\[[0-9;]*m", "", server.log())
    return re.sub(r"^\[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\] ?", "", log, flags=re.MULTILINE)


def test_comfyui_loads_the_pack_under_a_hyphenated_name(server: ComfyServer) -> None:
    log, pack = plain_log(server), str(server.pack_dir)
    assert Path(pack).resolve() == Path(__file__).resolve().parents[1]
    lines = log.splitlines()
    about_pack = [i for i, line in enumerate(lines) if pack in line]
    context = "\n".join(lines[max(0, about_pack[0] - 40):about_pack[-1] + 1]) if about_pack else server.log_tail()
    for bad in (f"(IMPORT FAILED): {pack}", f"Cannot import {pack}", f"Skip {pack} module"):
        assert bad not in log, f"ComfyUI did not load the pack ({bad!r}):\n{context}"
    assert re.search(rf"^\s*\d+\.\d+ seconds: {re.escape(pack)}\s*$", log, re.MULTILINE), server.log_tail()
    # the harness's own single-file node pack loaded beside it
    assert "MgpuTestConditioning" in server.object_info()
    assert re.search(rf"^\s*\d+\.\d+ seconds: .*{HELPER_MODULE}\.py\s*$", log, re.MULTILINE)


def test_pack_nodes_are_listed_in_object_info(server: ComfyServer) -> None:
    ours = {name: d for name, d in server.object_info().items() if d.get("python_module") == f"custom_nodes.{PACK_LINK_NAME}"}
    assert ours, "ComfyUI lists no node from the pack (comfy_entrypoint / NODE_CLASS_MAPPINGS missing?)"
    for name, d in ours.items():
        assert d["name"] == name and isinstance(d["input"], dict) and isinstance(d["output"], list)


def test_system_stats_report_cpu_device(server: ComfyServer) -> None:
    stats = server.get("/system_stats")
    assert stats["system"]["comfyui_version"]
    assert [d["type"] for d in stats["devices"]] == ["cpu"]


def test_pack_web_extensions_are_served(server: ComfyServer) -> None:
    web = server.pack_dir / "web"
    scripts = sorted(p.relative_to(web).as_posix() for p in web.rglob("*.js")) if web.is_dir() else []
    if not scripts:
        pytest.skip("the pack has no web/*.js yet")
    listed = server.get("/extensions")
    for rel in scripts:
        assert f"/extensions/{PACK_LINK_NAME}/{rel}" in listed


def test_tiny_checkpoints_are_detected_by_comfyui_itself(tmp_path: Path) -> None:
    """ComfyUI's own loaders classify the tiny files and find every key; the shape tables equal its classes'."""
    write_tiny_wan21_t2v(tmp_path / "wan_bare.safetensors")
    write_tiny_wan21_t2v(tmp_path / "wan_prefixed.safetensors", WanDiTConfig(dim=256, ffn_dim=512, num_layers=3),
                         prefix="model.diffusion_model.")
    write_tiny_ltxv(tmp_path / "ltxv.safetensors")
    write_wan21_vae(tmp_path / "wan_vae.safetensors")
    result = run_in_comfyui(f"""
import torch, comfy.sd, comfy.utils, comfy.ops
import comfy_checkpoints as cc
from comfy.ldm.wan.model import WanModel
from comfy.ldm.lightricks.model import LTXVModel
from comfy.ldm.wan.vae import WanVAE
tmp = {str(tmp_path)!r}
result = {{}}
def shapes(m):
    return {{k: list(v.shape) for k, v in m.state_dict().items()}}
def table(t):
    return {{k: list(v) for k, v in t.items()}}
ops = comfy.ops.disable_weight_init
result["wan_table"] = shapes(WanModel(dim=256, ffn_dim=512, num_heads=2, num_layers=3, device="meta", operations=ops)) == table(cc.wan21_dit_shapes(cc.WanDiTConfig(dim=256, ffn_dim=512, num_layers=3)))
result["ltxv_table"] = shapes(LTXVModel(cross_attention_dim=256, attention_head_dim=8, num_layers=3, device="meta", operations=ops)) == table(cc.ltxv_dit_shapes(cc.LTXVDiTConfig(head_dim=8, num_layers=3)))
with torch.device("meta"):
    vae_meta = WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0)
result["vae_table"] = shapes(vae_meta) == table(cc.wan21_vae_shapes())
for name in ("wan_bare", "wan_prefixed", "ltxv"):
    sd = comfy.utils.load_torch_file(f"{{tmp}}/{{name}}.safetensors")
    n_keys = len(sd)
    patcher = comfy.sd.load_diffusion_model(f"{{tmp}}/{{name}}.safetensors")
    net = patcher.model.diffusion_model
    result[name] = dict(classes=[type(patcher.model.model_config).__name__, type(patcher.model).__name__, type(net).__name__],
                        unet_config={{k: v for k, v in patcher.model.model_config.unet_config.items() if type(v) in (int, str)}},
                        keys_match=len(net.state_dict()) == n_keys, finite=all(bool(torch.isfinite(p).all()) for p in net.parameters()))
vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(f"{{tmp}}/wan_vae.safetensors"))
result["vae"] = dict(classes=[type(vae.first_stage_model).__name__], latent_channels=vae.latent_channels,
                     keys=len(vae.first_stage_model.state_dict()))
""")
    assert result["wan_table"] and result["ltxv_table"] and result["vae_table"]
    for name in ("wan_bare", "wan_prefixed"):
        assert result[name]["classes"] == list(EXPECTED_DETECTION["wan21_t2v"]), result[name]
        assert result[name]["keys_match"] and result[name]["finite"]
    assert result["wan_bare"]["unet_config"] == {"image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256,
                                                 "num_layers": 2, "num_heads": 1, "in_dim": 16, "out_dim": 16,
                                                 "freq_dim": 256}
    assert result["wan_prefixed"]["unet_config"]["num_layers"] == 3 and result["wan_prefixed"]["unet_config"]["num_heads"] == 2
    assert result["ltxv"]["classes"] == list(EXPECTED_DETECTION["ltxv"]) and result["ltxv"]["keys_match"]
    assert result["ltxv"]["unet_config"] == {"image_model": "ltxv", "num_layers": 2, "attention_head_dim": 4,
                                             "cross_attention_dim": 128}
    assert result["vae"] == {"classes": list(EXPECTED_DETECTION["wan21_vae"]), "latent_channels": 16,
                             "keys": len(wan21_vae_shapes())}


def test_stock_wan_workflow_runs_and_streams_progress(server: ComfyServer) -> None:
    steps = 2
    prompt_id = server.post_prompt(wan_prompt(seed=11, steps=steps))
    entry = server.wait(prompt_id, timeout=300)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[:3000]
    latent = saved_latent(server, entry, "6")
    assert latent.shape == (1, 16, 2, 8, 8) and torch.isfinite(latent).all() and latent.abs().sum() > 0

    server.wait_ws(prompt_id, "execution_success", timeout=30)
    msgs = server.ws_messages(prompt_id)
    progress = [m["data"] for m in msgs if m["type"] == "progress" and m["data"]["node"] == "5"]
    assert [(p["value"], p["max"]) for p in progress] == [(i, steps) for i in range(1, steps + 1)]
    executing = [m["data"]["node"] for m in msgs if m["type"] == "executing"]
    assert executing.index("5") < executing.index("6")


def test_cfg_changes_the_result(server: ComfyServer) -> None:
    """At cfg > 1 the negative (uncond) branch runs batched with the positive one; at cfg 1 ComfyUI skips it.

    Only the KSampler re-runs between the two prompts (ComfyUI caches the unchanged upstream nodes).
    """
    latents = []
    for cfg in (3.0, 1.0):
        entry = server.wait(server.post_prompt(wan_prompt(seed=21, cfg=cfg)), timeout=300)
        assert entry["status"]["status_str"] == "success", entry["status"]
        latents.append(saved_latent(server, entry, "6"))
    assert latents[0].shape == latents[1].shape and not torch.equal(latents[0], latents[1])


def test_stock_ltxv_workflow_runs(server: ComfyServer) -> None:
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": LTXV_FILE, "weight_dtype": "default"}},
        "2": {"class_type": "MgpuTestConditioning", "inputs": {"width": 4096, "tokens": 8, "seed": 5, "scale": 1.0}},
        "3": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["2", 0]}},
        "4": {"class_type": "EmptyLTXVLatentVideo", "inputs": {"width": 64, "height": 64, "length": 9, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": 5,
            "steps": 2, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": "latents/mgpu_ltxv"}},
    }
    entry = server.wait(server.post_prompt(prompt), timeout=300)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[:3000]
    latent = saved_latent(server, entry, "6")
    assert latent.shape == (1, 128, 2, 2, 2) and torch.isfinite(latent).all()


def test_interrupt_stops_a_running_sampler(server: ComfyServer) -> None:
    steps = 10_000  # KSampler maximum
    prompt_id = server.post_prompt(wan_prompt(seed=31, steps=steps))
    server.wait_ws(prompt_id, "progress", timeout=300)
    server.interrupt()
    entry = server.wait(prompt_id, timeout=120)
    assert entry["status"]["status_str"] == "error"
    assert "execution_interrupted" in [m[0] for m in entry["status"]["messages"]]
    done = [m["data"]["value"] for m in server.ws_messages(prompt_id) if m["type"] == "progress"]
    assert done and max(done) < steps
