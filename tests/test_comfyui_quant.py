"""Quantized checkpoints through MGPU Load Diffusion Model (fsdp, 2 CPU ranks) + stock KSampler inside a real
ComfyUI, against stock UNETLoader + KSampler on the same file: ComfyUI's scaled-fp8 files on every version, its
``_quantization_metadata`` files where ComfyUI knows them (0.33+), and readable errors for what cannot be sharded.

Needs a ComfyUI checkout (COMFYUI_PATH); skips otherwise. The rank-level checks are test_comfy_quant_sharded.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from comfy_checkpoints import WanDiTConfig, write_tiny_wan21_t2v
from comfyui_env import ComfyServer
from safetensors.torch import load_file, save_file
from scaled_fp8_files import FP8, write_quantized, write_scaled_fp8
from test_comfyui_fsdp import (
    STEPS,
    TOLERANCE,
    _conditioning,
    _fsdp_loader,
    _sampler,
    _save,
    error_of,
    latents,
    max_diff,
    ranks_of,
    run,
)

pytestmark = pytest.mark.comfyui

PLAIN = "mgpu_quant_wan.safetensors"
SCALED = "mgpu_quant_wan_fp8_scaled.safetensors"
E4M3 = "mgpu_quant_wan_e4m3fn.safetensors"
E5M2 = "mgpu_quant_wan_e5m2.safetensors"
NVFP4 = "mgpu_quant_wan_nvfp4.safetensors"
PLAIN_FP8 = "mgpu_quant_wan_plain_e4m3fn.safetensors"
CPU_LINE = "fp8 compute: dequantize per layer on cpu (no fp8 matmul on a CPU)"


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    """A tiny Wan (ffn rows 255: the two ranks' shards differ and FSDP pads one) in each quantized layout."""
    folder = comfyui_server.diffusion_models
    plain = write_tiny_wan21_t2v(folder / PLAIN, WanDiTConfig(dim=256, ffn_dim=255, num_layers=3))
    write_scaled_fp8(plain, folder / SCALED, scale_input=0.5)
    write_quantized(plain, folder / E4M3)
    write_quantized(plain, folder / E5M2, "float8_e5m2")
    write_quantized(plain, folder / NVFP4, "nvfp4")
    write_plain_fp8(plain, folder / PLAIN_FP8)
    return comfyui_server


def write_plain_fp8(plain: Path, path: Path) -> None:
    """``plain`` as plain fp8 files store it: every floating tensor of >= 2 dims float8_e4m3fn, no scales; biases
    and norms keep their dtype."""
    state = load_file(str(plain))
    save_file({k: v.to(FP8) if v.is_floating_point() and v.ndim >= 2 else v for k, v in state.items()}, str(path))


def comfyui_version(server: ComfyServer) -> str:
    return re.search(r'__version__ = "([^"]+)"', (server.comfyui / "comfyui_version.py").read_text()).group(1)


def knows_quantized_format(server: ComfyServer) -> bool:
    return not comfyui_version(server).startswith("0.3.")


def stock_loader(unet: str) -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}}


def pairs_prompt(files: dict[str, str], seed: int = 5) -> dict[str, Any]:
    """Per file (name: unet file), stock UNETLoader and MGPU fsdp each into a KSampler and a SaveLatent:
    outputs ``stock_<name>`` and ``fsdp_<name>``."""
    prompt: dict[str, Any] = {
        "pos": _conditioning(seed),
        "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": 64, "height": 64, "length": 5, "batch_size": 1}},
    }
    for name, unet in files.items():
        for kind, loader in (("stock", stock_loader(unet)), ("fsdp", _fsdp_loader(unet))):
            prompt[f"{kind}_{name}_unet"] = loader
            prompt[f"{kind}_{name}"] = _sampler("KSampler", f"{kind}_{name}_unet", "neg", seed, STEPS)
            prompt[f"save_{kind}_{name}"] = _save(f"{kind}_{name}")
    return prompt


def test_scaled_fp8_file_matches_stock(server: ComfyServer) -> None:
    """A ComfyUI scaled-fp8 file (fp8 block weights, per-layer scale_weight, scale_input 0.5). ComfyUI 0.3.x builds
    it with its scaled-fp8 ops, 0.33 converts it to quantized layers; either way the ranks build what ComfyUI
    builds, shard the fp8 rows (gathered as fp8), hold every scale whole, and sample what UNETLoader samples; the
    host logs how the ranks compute fp8 once per load."""
    log_start = len(server.log())
    lat = latents(server, run(server, pairs_prompt({"plain": PLAIN, "scaled": SCALED})))
    diff = max_diff(lat["fsdp_scaled"], lat["stock_scaled"])
    print(f"scaled-fp8, ComfyUI {comfyui_version(server)}: max |fsdp - stock| = {diff:.3g}")
    assert diff <= TOLERANCE
    assert max_diff(lat["stock_scaled"], lat["stock_plain"]) > 10 * TOLERANCE   # the fp8 weights really changed it
    log = server.log()[log_start:]
    assert f"{SCALED} sharded over 2 ranks (cpu, cpu) loaded" in log
    assert log.count(CPU_LINE) == 1 and f"{PLAIN} sharded" in log   # once per load; the plain file has none


def test_a_plain_fp8_file_is_sharded_as_fp8_and_matches_stock(server: ComfyServer) -> None:
    """A plain fp8 file: the ranks keep it fp8 (the bytes the plan sizes: test_fp8_storage.py) and ComfyUI's
    manual-cast ops cast each gathered layer to fp32, so it samples what UNETLoader samples where ComfyUI keeps the
    file fp8 (weight_dtype fp8_e4m3fn: on one GPU the upcast model does not fit, or one with fp8 compute; its
    default on a CPU upcasts the whole model instead). The load log says fp8 is stored, what computes, and the fp8
    compute path once."""
    prompt = pairs_prompt({"fp8": PLAIN_FP8})
    prompt["stock_fp8_unet"]["inputs"]["weight_dtype"] = "fp8_e4m3fn"
    log_start = len(server.log())
    lat = latents(server, run(server, prompt))
    diff = max_diff(lat["fsdp_fp8"], lat["stock_fp8"])
    print(f"plain fp8, ComfyUI {comfyui_version(server)}: max |fsdp - stock fp8| = {diff:.3g}")
    assert diff <= TOLERANCE
    log = server.log()[log_start:]
    assert re.search(rf"{PLAIN_FP8} sharded over 2 ranks \(cpu, cpu\) loaded in [\d.]+ s \(float8_e4m3fn, compute "
                     r"float32;", log), log[-3000:]
    assert log.count(CPU_LINE) == 1


def test_quantized_float8_files_match_stock_or_are_refused_by_name(server: ComfyServer) -> None:
    """ComfyUI 0.33: ``_quantization_metadata`` files with float8_e4m3fn and float8_e5m2 layers, sharded, sample
    what UNETLoader samples. ComfyUI 0.3.x does not know the format (it would drop the scales): the loader node
    fails naming the file, this ComfyUI and the way out."""
    prompt = pairs_prompt({"e4m3": E4M3, "e5m2": E5M2})
    if not knows_quantized_format(server):
        for name in ("e4m3", "e5m2"):   # only the sharded loader under test
            for node in (f"stock_{name}_unet", f"stock_{name}", f"save_stock_{name}"):
                del prompt[node]
        error = error_of(run(server, prompt, ok=False))
        assert error["node_id"] in ("fsdp_e4m3_unet", "fsdp_e5m2_unet")
        message = error["exception_message"]
        assert "is a ComfyUI quantized checkpoint" in message and f"({comfyui_version(server)})" in message
        assert "Update ComfyUI" in message
        return
    log_start = len(server.log())
    lat = latents(server, run(server, prompt))
    for name in ("e4m3", "e5m2"):
        diff = max_diff(lat[f"fsdp_{name}"], lat[f"stock_{name}"])
        print(f"{name}, ComfyUI {comfyui_version(server)}: max |fsdp - stock| = {diff:.3g}")
        assert diff <= TOLERANCE
    assert max_diff(lat["stock_e4m3"], lat["stock_e5m2"]) > 10 * TOLERANCE   # the formats really differ
    assert server.log()[log_start:].count(CPU_LINE) == 2


def test_a_format_the_ranks_cannot_shard_is_a_readable_error(server: ComfyServer) -> None:
    """An nvfp4 file: the loader node fails before any rank starts, naming the file, the layer format and what to
    do (load it on one device); on ComfyUI 0.3.x, that this ComfyUI does not know the format."""
    before = {p.pid for p in ranks_of(server)}
    prompt = pairs_prompt({"nvfp4": NVFP4})
    for node in ("stock_nvfp4_unet", "stock_nvfp4", "save_stock_nvfp4"):
        del prompt[node]
    error = error_of(run(server, prompt, ok=False))
    assert error["node_id"] == "fsdp_nvfp4_unet" and error["node_type"] == "MgpuLoadDiffusionModel"
    message = error["exception_message"]
    assert NVFP4 in message
    if knows_quantized_format(server):
        assert "cannot shard these quantized layers: nvfp4: 30 layers (blocks.0." in message
        assert "load this file on one device" in message
    else:
        assert "does not know" in message and "Update ComfyUI" in message
    assert {p.pid for p in ranks_of(server)} <= before
