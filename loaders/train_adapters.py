"""Rank side of MGPU Train LoRA's adapters (``"loaders.train_adapters:build"``, imported on the ranks): ComfyUI's own
trainable weight adapters, made from the first values the host drew, so the ranks train what ComfyUI's Train LoRA
trains, with its arithmetic (``comfy.weight_adapter``)."""

from __future__ import annotations

import torch
from torch import nn

from mgpu.training.adapters import Diff, lora_key

LORA_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(specs: list[dict], tensors: dict[str, torch.Tensor], lora_dtype: str,
          device: torch.device) -> dict[str, nn.Module]:
    """One trainable module per spec (``{"key": "<layer>.weight" | "<layer>.bias", "kind": "adapter" | "diff"}``),
    keyed as specified, from ``tensors`` (LoRA keys: ``<layer>.lora_up.weight``, ``<layer>.alpha``,
    ``<layer>.diff``, ``<layer>.diff_b``), on ``device`` in ``lora_dtype``: a weight adapter as ComfyUI loads an
    existing LoRA to train on (its loader, then ``to_train``), a 1-D weight or a bias as a ``Diff``."""
    from comfy.weight_adapter import adapters

    dtype = LORA_DTYPES[lora_dtype]
    found: dict[str, nn.Module] = {}
    for spec in specs:
        key = spec["key"]
        if spec["kind"] == "diff":
            found[key] = Diff(tensors[lora_key(key)].to(device=device, dtype=dtype, copy=True))
            continue
        layer = key.rpartition(".")[0]
        alpha = float(tensors[f"{layer}.alpha"]) if f"{layer}.alpha" in tensors else 1.0
        loaded = next((a for a in (cls.load(layer, tensors, alpha, None) for cls in adapters) if a is not None), None)
        if loaded is None:
            raise ValueError(f"no ComfyUI weight adapter reads the values sent for {layer}")
        found[key] = loaded.to_train().to(device=device, dtype=dtype)
    return found


def training_mode(on: bool) -> None:
    """ComfyUI's switch for its training code paths (0.33: rope and attention helpers with autograd formulas, as
    its Train LoRA sets it while it runs); ComfyUI 0.3.x has none and needs none."""
    import comfy.model_management as mm

    if hasattr(mm, "in_training"):
        mm.in_training = on
