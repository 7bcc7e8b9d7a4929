"""Stock LoRA nodes on an FSDP MODEL whose weights the ranks store quantized, inside a real ComfyUI on CPU ranks.

Such weights cannot take a row delta, so the ranks add each LoRA's term in the forward (``y += s · up (down x)``) and
never touch them. The reference is the exact math: stock UNETLoader on a file holding the same weights dequantized
to fp32, plus the same LoRA merged in fp32. Stock ComfyUI on the quantized file itself merges the LoRA into the fp8
weights with stochastic rounding, so it is further from the exact result; the tests record by how much.

Needs a ComfyUI checkout (COMFYUI_PATH); skips otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from comfy_checkpoints import WanDiTConfig, ltxv_dit_shapes, write_tiny_wan21_t2v
from comfyui_env import ComfyServer, comfyui_version
from safetensors.torch import load_file, save_file
from scaled_fp8_files import write_scaled_fp8
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
    run,
    write_lora,
)

pytestmark = pytest.mark.comfyui

FP8 = torch.float8_e4m3fn
PLAIN = "mgpu_lq_wan.safetensors"                  # bf16, as real files
FP8_VALUES = "mgpu_lq_wan_fp8_values.safetensors"  # fp32 holding fp8 values: fp8 storage of it is exact
SCALED = "mgpu_lq_wan_fp8_scaled.safetensors"      # ComfyUI scaled fp8 made from PLAIN
SCALED_DEQUANTIZED = "mgpu_lq_wan_fp8_scaled_dequantized.safetensors"
CONFIG = WanDiTConfig(dim=256, ffn_dim=512, num_layers=3)   # the shapes test_comfyui_fsdp's LoRA is written for


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    models = comfyui_server.diffusion_models
    write_tiny_wan21_t2v(models / PLAIN, CONFIG)
    save_file({k: v.float().to(FP8).float() for k, v in load_file(str(models / PLAIN)).items()},
              str(models / FP8_VALUES))
    write_scaled_fp8(models / PLAIN, models / SCALED)
    old_ops = comfyui_version(comfyui_server.comfyui).startswith("0.3.")
    save_file(dequantized(load_file(str(models / SCALED)), old_ops), str(models / SCALED_DEQUANTIZED))
    write_lora(comfyui_server.models_dir / "loras" / LORA)
    return comfyui_server


def dequantized(scaled: dict[str, torch.Tensor], every_linear_fp8: bool) -> dict[str, torch.Tensor]:
    """A scaled-fp8 state as the fp32 values ComfyUI computes with: weight = fp8 x scale_weight. ComfyUI 0.3's
    scaled-fp8 ops build every Linear in fp8 (``every_linear_fp8``), weight and bias, those the file leaves unscaled
    too (scale 1); ComfyUI 0.33 converts the scaled layers to quantized tensors and keeps the rest as stored."""
    linears = {k.removesuffix("weight") for k, v in scaled.items() if k.endswith(".weight") and v.ndim == 2}
    out = {}
    for key, value in scaled.items():
        layer = key.removesuffix(key.rpartition(".")[2])
        if key == "scaled_fp8" or key.endswith(("scale_weight", "scale_input")):
            continue
        if every_linear_fp8 and layer in linears:
            value = value.to(FP8)
        if key.endswith("weight") and f"{layer}scale_weight" in scaled:
            value = value.float() * scaled[f"{layer}scale_weight"]
        out[key] = value.float()
    return out


def unet(name: str, weight_dtype: str = "default") -> dict:
    return {"class_type": "UNETLoader", "inputs": {"unet_name": name, "weight_dtype": weight_dtype}}


def fsdp_unet(name: str, weight_dtype: str = "default") -> dict:
    return {"class_type": "MgpuLoadDiffusionModel",
            "inputs": {"unet_name": name, "weight_dtype": weight_dtype, "device": "fsdp", "fsdp_ranks": 2}}


# variant -> (the sharded quantized model, stock ComfyUI on the same quantized file, the exact-math reference file)
VARIANTS = {
    "fp8_weight_dtype": (fsdp_unet(FP8_VALUES, "fp8_e4m3fn"), unet(FP8_VALUES, "fp8_e4m3fn"), FP8_VALUES),
    "scaled_fp8_file": (fsdp_unet(SCALED), unet(SCALED), SCALED_DEQUANTIZED),
}


def lora_prompt(variant: str) -> dict:
    """The quantized FSDP model, the reference and stock, each plain and with the LoRA at 1.0 (and 0.5); the
    sampler of ``<model>_<strength>`` saves its latent under that name."""
    quantized, stock, reference = VARIANTS[variant]
    prompt = _base("wan", seed=5)
    prompt.update({"fsdp_unet": quantized, "stock_unet": stock, "ref_unet": unet(reference)})
    runs = {"ref_plain": "ref_unet", "fsdp_plain": "fsdp_unet"}
    for model, strengths in (("ref", ("full", "half")), ("fsdp", ("full", "half")), ("stock", ("full",))):
        for strength in strengths:
            prompt[f"lora_{model}_{strength}"] = _lora_node(f"{model}_unet", 1.0 if strength == "full" else 0.5)
            runs[f"{model}_{strength}"] = f"lora_{model}_{strength}"
    for name, model in runs.items():
        prompt[name] = _sampler("KSampler", model, "neg", 5, STEPS)
        prompt[f"save_{name}"] = _save(name)
    return prompt


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_lora_on_quantized_weights_matches_the_exact_merge(server: ComfyServer, variant: str,
                                                             record_property) -> None:
    """fp8 storage on the ranks (the MGPU loader's weight_dtype fp8_e4m3fn, or a ComfyUI scaled-fp8 file) + stock
    LoraLoaderModelOnly at two strengths and without == UNETLoader on the dequantized weights in fp32 + the same
    LoRA; the base weights are loaded once and never reloaded."""
    log_start = len(server.log())
    lat = latents(server, run(server, lora_prompt(variant)))
    log = server.log()[log_start:]
    diffs = {f"fsdp_{s}": max_diff(lat[f"fsdp_{s}"], lat[f"ref_{s}"]) for s in ("plain", "full", "half")}
    stock = max_diff(lat["stock_full"], lat["ref_full"])
    record_property("max_abs_diff", {**diffs, "stock_fp8_full": stock,
                                     "lora_effect": max_diff(lat["ref_full"], lat["ref_plain"]),
                                     "latent_absmax": lat["ref_full"].abs().max().item()})
    assert all(d <= TOLERANCE for d in diffs.values()), diffs
    assert max_diff(lat["ref_full"], lat["ref_plain"]) > 10 * TOLERANCE    # the LoRA changes the result ...
    assert max_diff(lat["ref_half"], lat["ref_full"]) > 10 * TOLERANCE     # ... and so does its strength
    assert stock > diffs["fsdp_full"]   # stock rounds the merged weights back into fp8: further from the exact math
    name = VARIANTS[variant][0]["inputs"]["unet_name"]
    assert log.count(f"{name} sharded over 2 ranks") == 1   # loaded once, never reloaded for a LoRA change
    at_forward = [int(n) for n in re.findall(r"\((\d+) weights stored quantized patched in the forward", log)]
    assert at_forward and all(n > 0 for n in at_forward), at_forward


def test_a_lora_for_another_model_is_refused_or_ignored_as_stock_and_comfyui_goes_on(server: ComfyServer) -> None:
    """A Wan 14B LoRA on this Wan (the names match, the shapes do not): the sampler fails with the weights, the loader
    nodes and what to do, before any step. An LTX-Video LoRA on Wan (no name matches): ComfyUI's own loader warns
    "lora key not loaded" and drops it, so the result is the plain model's, as with stock. Then the same server
    samples on."""
    loras = server.models_dir / "loras"
    g = torch.Generator().manual_seed(5)
    wan14b = {}
    for block in range(3):
        name = f"diffusion_model.blocks.{block}.self_attn.q"
        wan14b[f"{name}.lora_up.weight"] = torch.randn(5120, 4, generator=g).to(torch.bfloat16) * 0.1
        wan14b[f"{name}.lora_down.weight"] = torch.randn(4, 5120, generator=g).to(torch.bfloat16) * 0.1
    save_file(wan14b, str(loras / "mgpu_lq_wan14b.safetensors"))
    ltxv = {}
    for key, shape in ltxv_dit_shapes().items():
        if key.startswith("transformer_blocks.0.attn1.to_") and key.endswith(".weight") and len(shape) == 2:
            layer = f"diffusion_model.{key.removesuffix('.weight')}"
            ltxv[f"{layer}.lora_A.weight"] = torch.randn(4, shape[1], generator=g) * 0.1
            ltxv[f"{layer}.lora_B.weight"] = torch.randn(shape[0], 4, generator=g) * 0.1
    assert ltxv
    save_file(ltxv, str(loras / "mgpu_lq_ltxv.safetensors"))

    prompt = _base("wan", seed=6)
    prompt["fsdp_unet"] = VARIANTS["fp8_weight_dtype"][0]
    del prompt["stock_unet"]
    prompt["lora"] = _lora_node("fsdp_unet", 1.0, "mgpu_lq_wan14b.safetensors")
    prompt["sample"] = _sampler("KSampler", "lora", "neg", 6, 2)
    prompt["save_sample"] = _save("sample")
    error = error_of(run(server, prompt, ok=False))
    assert error["node_id"] == "sample"
    message = error["exception_message"]
    assert "3 of the 3 weights a LoRA patches do not fit this model" in message, message
    assert "diffusion_model.blocks.0.self_attn.q.weight: LoRA up (5120, 4) and down (4, 5120) for a (256, 256)" in message
    assert "made for another model" in message and "LoraLoaderModelOnly" in message

    log_start = len(server.log())
    prompt["lora"]["inputs"]["lora_name"] = "mgpu_lq_ltxv.safetensors"
    prompt["plain"] = _sampler("KSampler", "fsdp_unet", "neg", 6, 2)
    prompt["save_plain"] = _save("plain")
    lat = latents(server, run(server, prompt))
    assert torch.equal(lat["sample"], lat["plain"])   # nothing of it applied, as stock ComfyUI
    log = server.log()[log_start:]
    assert "lora key not loaded: diffusion_model.transformer_blocks.0.attn1.to_q" in log
    assert "weight patches for" not in log   # nothing reached the ranks
