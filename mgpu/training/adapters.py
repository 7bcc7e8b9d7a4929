"""Trainable adapters in a network's layers, through the hook ComfyUI's casting layers already have.

ComfyUI's operations (``comfy.ops``) cast each layer's weight to the compute dtype per forward and then apply the
functions in its ``weight_function`` / ``bias_function`` lists; ComfyUI's Train LoRA trains by putting its adapter
modules there (``ModelPatcher.add_weight_wrapper``). Under FSDP that hook sees the all-gathered weight (an fp8 one
upcast, a GGUF one dequantized, a quantized one dequantized by ComfyUI), so the same adapters, installed the same
way, train over a sharded base. They stay outside FSDP (a list attribute is no submodule): every rank holds them
whole and their gradients are summed by ``mgpu.training.ops.step``.

Keys are the LoRA format ComfyUI's Train LoRA returns: ``<layer>.weight`` for a weight adapter (LoRA: its
``lora_up.weight``, ``lora_down.weight``, ``alpha`` entries), ``<layer>.diff`` for a 1-D weight and
``<layer>.diff_b`` for a bias (``Diff``).
"""

from __future__ import annotations

import torch
from torch import nn

HOOKS = {"weight": "weight_function", "bias": "bias_function"}


class Diff(nn.Module):
    """An additive difference for a 1-D weight or a bias, computed as ComfyUI's Train LoRA does (its ``BiasDiff``):
    the weight in the difference's dtype plus the difference, back in the weight's dtype."""

    def __init__(self, diff: torch.Tensor):
        super().__init__()
        self.diff = nn.Parameter(diff)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return (w.to(self.diff) + self.diff).to(w.dtype)


def attach(model: nn.Module, adapters: dict[str, nn.Module]) -> dict[str, tuple[nn.Module, str, object]]:
    """Put each adapter (keyed ``<layer>.weight`` or ``<layer>.bias``) alone in its layer's function list; returns
    what ``detach`` needs to give each layer its list back. A layer without that list is not a ComfyUI casting layer:
    refused by name, before any layer changes."""
    modules = dict(model.named_modules())
    found = []
    for key in adapters:
        layer, _, param = key.rpartition(".")
        module = modules.get(layer)
        if module is None or param not in HOOKS or not hasattr(module, HOOKS[param]):
            raise ValueError(f"no ComfyUI casting layer takes an adapter for {key!r} in {type(model).__name__}")
        found.append((key, module, HOOKS[param]))
    saved = {}
    for key, module, attr in found:
        saved[key] = (module, attr, module.__dict__.get(attr))
        setattr(module, attr, [adapters[key]])   # an instance list: the class's list is shared by every layer
    return saved


def detach(saved: dict[str, tuple[nn.Module, str, object]]) -> None:
    """Give every layer ``attach`` changed its previous function list back."""
    for module, attr, before in saved.values():
        if before is None:
            module.__dict__.pop(attr, None)
        else:
            setattr(module, attr, before)


def trainable(adapters: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
    """The trainable parameters, named as the LoRA's keys (``<layer>.lora_up.weight``, ``<layer>.diff``), in
    the adapters' order: the optimizer's order, and the order gradients are reduced in."""
    found = {}
    for key, adapter in adapters.items():
        layer = key.rpartition(".")[0]
        for name, param in adapter.named_parameters():
            if param.requires_grad:
                found[f"{layer}.{name}" if not isinstance(adapter, Diff) else lora_key(key)] = param
    return found


def lora_key(key: str) -> str:
    """The LoRA key of a ``Diff`` installed at ``key``: ``<layer>.diff`` for a weight, ``<layer>.diff_b`` for a
    bias, as ComfyUI's Train LoRA names them."""
    layer, _, param = key.rpartition(".")
    return f"{layer}.diff" if param == "weight" else f"{layer}.diff_b"


def state(adapters: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Every adapter tensor (trainable or not, ``alpha`` too) under its LoRA key, detached, on the CPU."""
    found = {}
    for key, adapter in adapters.items():
        layer = key.rpartition(".")[0]
        if isinstance(adapter, Diff):
            found[lora_key(key)] = adapter.diff.detach().cpu()
            continue
        for name, param in adapter.named_parameters():
            found[f"{layer}.{name}"] = param.detach().cpu()
    return found
