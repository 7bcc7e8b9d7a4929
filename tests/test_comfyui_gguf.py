"""GGUF diffusion models (city96's ComfyUI-GGUF files) in MGPU Load Diffusion Model, inside a real ComfyUI, on CPU
ranks: listed beside the stock files (the stock loaders' lists unchanged), sharded with fsdp as their GGUF blocks,
sampled by the stock KSampler to the latent of stock UNETLoader on a safetensors file holding the same weights
dequantized; refused on one device and for types the ranks cannot dequantize; planned from the header.

Needs a ComfyUI checkout (COMFYUI_PATH); skips otherwise.
"""

from __future__ import annotations

import sys

import pytest
import torch
from comfy_checkpoints import LTXVDiTConfig, WanDiTConfig, ltxv_dit_shapes, random_state_dict, wan21_dit_shapes
from comfyui_env import ComfyServer, find_comfyui
from safetensors.torch import save_file
from test_comfyui_fsdp import (
    LORA,
    STEPS,
    TOLERANCE,
    _base,
    _lora_node,
    _sampler,
    _save,
    error_of,
    latents,
    max_diff,
    ranks_of,
    rejection_of,
    run,
    write_lora,
)

import gguf_files as gf

pytestmark = pytest.mark.comfyui

GGUF = "mgpu_gguf_wan-Q8_0-Q4_K.gguf"
REFERENCE = "mgpu_gguf_wan_dequantized.safetensors"   # the GGUF's weights dequantized by gguf-py, fp32
UNSUPPORTED = "mgpu_gguf_wan-Q2_K.gguf"
# family: (GGUF, its dequantized safetensors, key prefix, shapes); LTXV's keys carry ComfyUI's prefix, Wan's shapes
# are the ones test_comfyui_fsdp's LoRA is written for
FILES = {
    "wan": (GGUF, REFERENCE, "", wan21_dit_shapes(WanDiTConfig(dim=256, ffn_dim=512, num_layers=3))),
    "ltxv": ("mgpu_gguf_ltxv-Q8_0-Q4_K.gguf", "mgpu_gguf_ltxv_dequantized.safetensors", "model.diffusion_model.",
             ltxv_dit_shapes(LTXVDiTConfig(num_layers=3))),
}
ROOT_QUANTIZED = ("text_embedding.0.weight", "caption_projection.linear_1.weight")   # in FSDP's root unit


def gguf_types(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """As a Q4_K_M-style file mixes them: the blocks' matrices Q8_0 and Q4_K in turn (Q8_0 where a row is not whole
    Q4_K blocks), one root weight Q8_0, the other matrices F16 (a 5-D patch embedding F32), small tensors, Wan's
    modulations and LTXV's scale-shift tables F32."""
    types = {}
    for i, (name, t) in enumerate(state.items()):
        if t.ndim == 2 and "blocks." in name:
            types[name] = ("Q8_0", "Q4_K")[i % 2] if t.shape[1] % 256 == 0 else "Q8_0"
        elif name.endswith(ROOT_QUANTIZED):
            types[name] = "Q8_0"
        elif t.ndim >= 2 and "modulation" not in name and "scale_shift_table" not in name:
            types[name] = "F32" if t.ndim > 4 else "F16"
        else:
            types[name] = "F32"
    return types


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    models = comfyui_server.diffusion_models
    for name, reference, prefix, shapes in FILES.values():
        state = {prefix + k: v for k, v in random_state_dict(shapes, dtype=torch.float32).items()}
        types = gguf_types(state)
        assert {"Q8_0", "Q4_K", "F32"} <= set(types.values())
        arch = "wan" if name == GGUF else "ltxv"
        dequantized = gf.write_gguf(models / name, state, types, arch=arch)
        save_file({k: v.contiguous() for k, v in dequantized.items()}, str(models / reference))
        if name == GGUF:
            gf.write_gguf(models / UNSUPPORTED, state, {**types, "blocks.1.ffn.0.weight": "Q2_K"}, arch=arch)
    write_lora(comfyui_server.models_dir / "loras" / LORA)
    return comfyui_server


def unet(name: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": "default"}}


def fsdp_unet(name: str, device: str = "fsdp", weight_dtype: str = "default") -> dict:
    return {"class_type": "MgpuLoadDiffusionModel",
            "inputs": {"unet_name": name, "weight_dtype": weight_dtype, "device": device, "fsdp_ranks": 2}}


def pairs(models: dict[str, dict], samplers: dict[str, str], seed: int = 5, family: str = "wan") -> dict:
    """The family's latent and conditioning, the loader nodes ``models``, one KSampler + SaveLatent per
    ``sampler: model``."""
    prompt = _base(family, seed)
    del prompt["stock_unet"], prompt["fsdp_unet"]
    prompt.update(models)
    for name, model in samplers.items():
        prompt[name] = _sampler("KSampler", model, "neg", seed, STEPS)
        prompt[f"save_{name}"] = _save(name)
    return prompt


def test_gguf_is_listed_by_the_mgpu_loaders_only(server: ComfyServer) -> None:
    info = server.object_info()
    ours = info["MgpuLoadDiffusionModel"]["input"]["required"]["unet_name"][1]["options"]
    planned = info["MgpuPlan"]["input"]["required"]["dit"][1]["options"]
    stock = info["UNETLoader"]["input"]["required"]["unet_name"][0]
    assert GGUF in ours and GGUF in planned and REFERENCE in ours
    assert GGUF not in stock and REFERENCE in stock


@pytest.mark.parametrize("family", list(FILES))
def test_sharded_gguf_matches_stock_on_its_dequantized_weights(server: ComfyServer, family: str) -> None:
    """MGPU Load Diffusion Model (fsdp, 2 CPU ranks) on the GGUF + stock KSampler == stock UNETLoader on the
    safetensors file of the same weights dequantized by gguf-py + stock KSampler."""
    name, reference, _, _ = FILES[family]
    prompt = pairs({"stock_unet": unet(reference), "gguf_unet": fsdp_unet(name)},
                   {"stock": "stock_unet", "gguf": "gguf_unet"}, family=family)
    start = len(server.log())
    lat = latents(server, run(server, prompt))
    stock = lat["stock"]
    assert torch.isfinite(stock).all() and stock.abs().max() > 0.1
    assert max_diff(lat["gguf"], stock) <= TOLERANCE, max_diff(lat["gguf"], stock)
    log = server.log()[start:]
    assert f"{name} sharded over 2 ranks (cpu, cpu) loaded" in log, log[-3000:]


def test_a_lora_on_the_sharded_gguf_matches_stock(server: ComfyServer) -> None:
    """Stock LoraLoaderModelOnly on the sharded GGUF (the LoRA a forward term on the quantized layers, a row patch
    on the F32 bias) == the same LoRA on stock UNETLoader's dequantized file (merged in fp32)."""
    prompt = pairs({"stock_unet": unet(REFERENCE), "gguf_unet": fsdp_unet(GGUF),
                    "stock_lora": _lora_node("stock_unet", 1.0), "gguf_lora": _lora_node("gguf_unet", 1.0)},
                   {"plain": "stock_unet", "stock": "stock_lora", "gguf": "gguf_lora"})
    lat = latents(server, run(server, prompt))
    assert max_diff(lat["gguf"], lat["stock"]) <= TOLERANCE, max_diff(lat["gguf"], lat["stock"])
    assert max_diff(lat["stock"], lat["plain"]) > 10 * TOLERANCE   # the LoRA did something


@pytest.mark.parametrize(("name", "loader", "expected"), [
    (GGUF, {"device": "cpu"}, ["is a GGUF file", "device fsdp", "ComfyUI-GGUF"]),
    (GGUF, {"weight_dtype": "fp8_e4m3fn"}, ["weight_dtype float8_e4m3fn does not apply", "default, bf16"]),
])
def test_what_cannot_shard_is_a_node_error_before_any_rank_loads(server: ComfyServer, name: str, loader: dict,
                                                                  expected: list[str]) -> None:
    before = {p.pid for p in ranks_of(server)}
    prompt = pairs({"gguf_unet": fsdp_unet(name, **loader)}, {"gguf": "gguf_unet"})
    error = error_of(run(server, prompt, ok=False))
    assert error["node_id"] == "gguf_unet" and error["node_type"] == "MgpuLoadDiffusionModel"
    for text in expected:
        assert text in error["exception_message"], error["exception_message"]
    assert {p.pid for p in ranks_of(server)} <= before


def test_a_type_the_ranks_cannot_dequantize_refuses_the_prompt_when_queued(server: ComfyServer) -> None:
    """Read from the file's header at POST /prompt: refused before any node runs, naming the tensor and its type."""
    before = {p.pid for p in ranks_of(server)}
    node_type, message = rejection_of(server, pairs({"gguf_unet": fsdp_unet(UNSUPPORTED)}, {"gguf": "gguf_unet"}),
                                      "gguf_unet")
    assert node_type == "MgpuLoadDiffusionModel"
    for text in ("blocks.1.ffn.0.weight (Q2_K)", "Supported: Q8_0", "ComfyUI-GGUF"):
        assert text in message, message
    assert {p.pid for p in ranks_of(server)} <= before


def test_the_plan_route_sizes_a_gguf_from_its_header(server: ComfyServer) -> None:
    """POST /mgpu/plan with the GGUF as the DiT: sized from its header, planned with its stored bytes."""
    from mgpu.planning.sizing import read_gguf_header

    status, body = server._request("POST", "/mgpu/plan", {"dit": GGUF, "devices": "2x24GiB"})
    assert status == 200, body
    dit = next(p for p in body["plan"]["placements"] if p["role"] == "dit")
    stored = sum(t.nbytes for t in read_gguf_header(server.diffusion_models / GGUF).tensors.values())
    assert dit["family"] == "wan2.1-t2v" and dit["weight_bytes"] == stored


def test_gguf_files_are_found_in_comfyui_gguf_s_folder_too(tmp_path, monkeypatch) -> None:
    """With ComfyUI-GGUF installed its loader's folder (unet_gguf) is searched as well, and a name resolves to the
    file in whichever folder holds it; the diffusion_models list itself is ComfyUI's (UNETLoader's) unchanged."""
    comfyui = find_comfyui()
    if comfyui is None:
        pytest.skip("no ComfyUI checkout")
    monkeypatch.syspath_prepend(str(comfyui))
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    import folder_paths

    from loaders import model_files

    ours, theirs = tmp_path / "diffusion_models", tmp_path / "gguf_only"
    (ours / "sub").mkdir(parents=True)
    theirs.mkdir()
    for path in (ours / "a.safetensors", ours / "sub" / "b.gguf", theirs / "c.gguf", theirs / "d.safetensors"):
        path.write_bytes(b"x")
    exts = folder_paths.folder_names_and_paths["diffusion_models"][1]
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models", ([str(ours)], exts))
    stock = folder_paths.get_filename_list("diffusion_models")
    assert model_files.dit_names() == ["a.safetensors", "sub/b.gguf"]
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "unet_gguf", ([str(ours), str(theirs)], {".gguf"}))
    assert model_files.dit_names() == ["a.safetensors", "c.gguf", "sub/b.gguf"]
    assert model_files.dit_path("c.gguf") == str(theirs / "c.gguf")
    assert model_files.dit_path("sub/b.gguf") == str(ours / "sub" / "b.gguf")
    assert model_files.dit_path("d.safetensors") is None   # not a .gguf, not in diffusion_models
    assert folder_paths.get_filename_list("diffusion_models") == stock == ["a.safetensors"]


def test_a_gguf_workflow_with_the_plan_connected_and_the_loader_on_auto_runs_sharded(server: ComfyServer) -> None:
    """MGPU Plan for the GGUF (with the example workflows' dit_weight_dtype fp8_e4m3fn) connected to MGPU Load
    Diffusion Model on auto: the plan shards it (cpu ranks: no GPU here) and drops the fp8 recast, so the loader
    that follows it, asked for 2 ranks where the plan has 1, plans them (the gathered weights' fit for 2) and loads
    the file on 2 cpu ranks, to stock's latent on the dequantized weights."""
    prompt = pairs({"stock_unet": unet(REFERENCE), "gguf_unet": fsdp_unet(GGUF, device="auto")},
                   {"stock": "stock_unet", "gguf": "gguf_unet"})
    prompt["plan"] = {"class_type": "MgpuPlan", "inputs": {
        "dit": GGUF, "text_encoder": "none", "vae": "none", "width": 64, "height": 64, "frames": 1, "batch": 1,
        "cfg": True, "dit_weight_dtype": "fp8_e4m3fn", "devices": "auto", "allow_offload": False,
        "prefer_speed": False}}
    prompt["gguf_unet"]["inputs"]["plan"] = ["plan", 0]
    start = len(server.log())
    lat = latents(server, run(server, prompt))
    assert max_diff(lat["gguf"], lat["stock"]) <= TOLERANCE, max_diff(lat["gguf"], lat["stock"])
    log = server.log()[start:]
    assert "fsdp_ranks 2: 2 ranks where the MGPU Plan has 1: no GPU: sharded over 2 cpu ranks" in log, log[-3000:]
    assert "auto: following a plan for this file alone (fsdp on cpu, cpu)" in log, log[-3000:]
    assert f"{GGUF} sharded over 2 ranks (cpu, cpu) loaded" in log, log[-3000:]
