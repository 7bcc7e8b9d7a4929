"""Quantized checkpoints made from a plain one, in the two layouts ComfyUI loads:

- scaled fp8 (ComfyUI's ``*_fp8_scaled.safetensors``): a ``scaled_fp8`` marker, and per quantized Linear an fp8
  ``weight`` with a scalar fp32 ``scale_weight`` (weight = fp8 * scale) and ``scale_input``;
- ComfyUI's quantized format (``_quantization_metadata`` in the safetensors metadata, ComfyUI 0.33's QUANTIZATION.md):
  the layers and their format in the metadata, per layer a ``weight`` in the format's storage dtype, ``weight_scale``
  and optionally ``input_scale``.

Layers left unquantized keep their dtype and have no scale keys, as in real files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _quantizable(key: str, value: torch.Tensor, quantize: str) -> bool:
    return key.startswith(quantize) and key.endswith(".weight") and value.ndim == 2


def _absmax_fp8(value: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, scalar fp32 scale) with value = fp8 * scale, the absmax mapped to the format's largest value."""
    scale = value.float().abs().max() / torch.finfo(dtype).max
    return (value.float() / scale).to(dtype), scale.reshape(())


def scaled_fp8_state(state: dict[str, torch.Tensor], quantize: str = "blocks.",
                     scale_input: float = 1.0) -> dict[str, torch.Tensor]:
    """``state`` with the 2-d weights of keys starting with ``quantize`` stored as scaled fp8 (scale = absmax/448)."""
    out = {"scaled_fp8": torch.empty(0, dtype=FP8)}   # empty marker: ComfyUI also keeps scale_input (fp8 matmul)
    for key, value in state.items():
        if _quantizable(key, value, quantize):
            layer = key.removesuffix("weight")
            weight, scale = _absmax_fp8(value, FP8)
            out |= {key: weight, f"{layer}scale_weight": scale, f"{layer}scale_input": torch.tensor(scale_input)}
        else:
            out[key] = value
    return out


def write_scaled_fp8(plain: str | Path, path: str | Path, scale_input: float = 1.0) -> Path:
    """The plain checkpoint at ``plain`` as a scaled-fp8 file at ``path`` (its repeated blocks quantized)."""
    save_file(scaled_fp8_state(load_file(str(plain)), scale_input=scale_input), str(path))
    return Path(path)


def quantized_state(state: dict[str, torch.Tensor], fmt: str = "float8_e4m3fn", quantize: str = "blocks.",
                    prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state`` in ComfyUI's quantized format, and the safetensors metadata that declares it.

    ``fmt`` float8_e4m3fn / float8_e5m2 quantize for real; any other format name (nvfp4, mxfp8, int8_tensorwise)
    only declares the layers in that format over e4m3 bytes: enough for a loader that must refuse it by name.
    """
    dtype = FORMATS.get(fmt, FP8)
    out: dict[str, torch.Tensor] = {}
    layers = {}
    for key, value in state.items():
        if _quantizable(key.removeprefix(prefix), value, quantize):
            layer = key.removesuffix(".weight")
            out[key], out[f"{layer}.weight_scale"] = _absmax_fp8(value, dtype)
            layers[layer] = {"format": fmt}
        else:
            out[key] = value
    return out, {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}


def write_quantized(plain: str | Path, path: str | Path, fmt: str = "float8_e4m3fn", prefix: str = "") -> Path:
    """The plain checkpoint at ``plain`` in ComfyUI's quantized format at ``path`` (its repeated blocks quantized)."""
    state, metadata = quantized_state(load_file(str(plain)), fmt, prefix=prefix)
    save_file(state, str(path), metadata=metadata)
    return Path(path)
