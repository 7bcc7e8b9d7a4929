"""ComfyUI scaled-fp8 checkpoints made from a plain one, in the layout ComfyUI's ``*_fp8_scaled.safetensors`` use:
a ``scaled_fp8`` marker, and per quantized Linear an fp8 ``weight`` with a scalar fp32 ``scale_weight`` (weight =
fp8 * scale) and ``scale_input``. Layers left unscaled keep their dtype and have no scale keys, as in real files."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn


def scaled_fp8_state(state: dict[str, torch.Tensor], quantize: str = "blocks.") -> dict[str, torch.Tensor]:
    """``state`` with the 2-d weights of keys starting with ``quantize`` stored as scaled fp8 (scale = absmax/448)."""
    out = {"scaled_fp8": torch.empty(0, dtype=FP8)}   # empty marker: ComfyUI also keeps scale_input (fp8 matmul)
    for key, value in state.items():
        if key.startswith(quantize) and key.endswith(".weight") and value.ndim == 2:
            layer = key.removesuffix("weight")
            scale = value.float().abs().max() / torch.finfo(FP8).max
            out |= {key: (value.float() / scale).to(FP8), f"{layer}scale_weight": scale.reshape(()),
                    f"{layer}scale_input": torch.ones(())}
        else:
            out[key] = value
    return out


def write_scaled_fp8(plain: str | Path, path: str | Path) -> Path:
    """The plain checkpoint at ``plain`` as a scaled-fp8 file at ``path`` (its repeated blocks quantized)."""
    save_file(scaled_fp8_state(load_file(str(plain))), str(path))
    return Path(path)
