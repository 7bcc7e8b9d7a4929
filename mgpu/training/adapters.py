"""Trainable adapters in a network's layers, through the hook ComfyUI's casting layers already have.

ComfyUI's operations (``comfy.ops``) cast each layer's weight to the compute dtype per forward and then apply the
functions in its ``weight_function`` / ``bias_function`` lists; ComfyUI's Train LoRA trains by putting its adapter
modules there (``ModelPatcher.add_weight_wrapper``). Under FSDP that hook sees the all-gathered weight (an fp8 one
upcast, a GGUF one dequantized, a quantized one dequantized by ComfyUI), so the same adapters, installed the same
way, train over a sharded base. They stay outside FSDP (a list attribute is no submodule): every rank holds them
whole and their gradients are summed by ``mgpu.training.ops.step``.

A model without ComfyUI's casting layers (diffusers', the demo's) takes an ``OutputLoRA`` on a plain ``nn.Linear``
instead, through a forward hook that adds the low-rank path to the layer's output (PEFT's way): the same LoRA, the
same keys, the base weight untouched whatever its storage.

Keys are the LoRA format ComfyUI's Train LoRA returns: ``<layer>.weight`` for a weight adapter (LoRA: its
``lora_up.weight``, ``lora_down.weight``, ``alpha`` entries), ``<layer>.diff`` for a 1-D weight and
``<layer>.diff_b`` for a bias (``Diff``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from mgpu.errors import TrainingError

HOOKS = {"weight": "weight_function", "bias": "bias_function"}


class Diff(nn.Module):
    """An additive difference for a 1-D weight or a bias, computed as ComfyUI's Train LoRA does (its ``BiasDiff``):
    the weight in the difference's dtype plus the difference, back in the weight's dtype."""

    def __init__(self, diff: torch.Tensor):
        super().__init__()
        self.diff = nn.Parameter(diff)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return (w.to(self.diff) + self.diff).to(w.dtype)


class OutputLoRA(nn.Module):
    """A LoRA on a plain ``nn.Linear``'s output: ``y + (alpha / rank) * up(down(x))``, which is ComfyUI's
    ``W + (alpha / rank) * up @ down`` applied to the input, computed in the adapter's dtype. Its tensors are named
    as ComfyUI's LoRA keys (``lora_up.weight``, ``lora_down.weight``, ``alpha``)."""

    def __init__(self, up: torch.Tensor, down: torch.Tensor, alpha: float):
        super().__init__()
        self.lora_up, self.lora_down = nn.Module(), nn.Module()
        self.lora_up.weight = nn.Parameter(up)
        self.lora_down.weight = nn.Parameter(down)
        self.alpha = nn.Parameter(torch.tensor(float(alpha), dtype=up.dtype, device=up.device), requires_grad=False)

    def hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        down, up = self.lora_down.weight, self.lora_up.weight
        low = torch.nn.functional.linear(torch.nn.functional.linear(args[0].to(down.dtype), down), up)
        return output + (low * (self.alpha / down.shape[0])).to(output.dtype)


def attach(model: nn.Module, adapters: dict[str, nn.Module]) -> dict[str, Callable[[], None]]:
    """Put each adapter (keyed ``<layer>.weight`` or ``<layer>.bias``) on its layer: alone in a ComfyUI casting
    layer's function list, or an ``OutputLoRA`` as a forward hook of a plain ``nn.Linear``. Returns what ``detach``
    calls to undo each. A layer that cannot take its adapter is refused by name, before any layer changes."""
    modules = dict(model.named_modules())
    found = []
    for key, adapter in adapters.items():
        layer, _, param = key.rpartition(".")
        module = modules.get(layer)
        if isinstance(adapter, OutputLoRA) and isinstance(module, nn.Linear) and param == "weight":
            found.append((key, module, None))
        elif module is not None and param in HOOKS and hasattr(module, HOOKS[param]):
            found.append((key, module, HOOKS[param]))
        else:
            raise TrainingError(f"no layer of {type(model).__name__} takes the adapter for {key!r} (a ComfyUI "
                                "casting layer takes ComfyUI's adapters; a torch Linear an OutputLoRA)")
    undo = {}
    for key, module, attr in found:
        if attr is None:
            # first of the layer's hooks: the LoRA term is part of its output, before any hook that moves it
            # (a sequence-parallel exchange of to_q/to_k/to_v's output, mgpu.families.wan_diffusers)
            undo[key] = module.register_forward_hook(adapters[key].hook, prepend=True).remove
            continue
        before = module.__dict__.get(attr)
        setattr(module, attr, [adapters[key]])   # an instance list: the class's list is shared by every layer
        undo[key] = partial(_restore, module, attr, before)
    return undo


def _restore(module: nn.Module, attr: str, before: object) -> None:
    if before is None:
        module.__dict__.pop(attr, None)
    else:
        setattr(module, attr, before)


def detach(undo: dict[str, Callable[[], None]]) -> None:
    """Give every layer ``attach`` changed its previous function list (or no hook) back."""
    for done in undo.values():
        done()


def build_output_loras(specs: list[dict], tensors: dict[str, torch.Tensor], lora_dtype: str,
                       device: torch.device) -> dict[str, nn.Module]:
    """The adapter factory for a model of plain torch layers (``"mgpu.training.adapters:build_output_loras"``): an
    ``OutputLoRA`` per ``{"key": "<layer>.weight", "kind": "adapter"}`` from ``<layer>.lora_up.weight``,
    ``<layer>.lora_down.weight`` and ``<layer>.alpha`` (default: the rank) in ``tensors``."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[lora_dtype]
    found: dict[str, nn.Module] = {}
    for spec in specs:
        if spec["kind"] != "adapter":
            raise TrainingError(f"{spec['key']}: a plain torch layer takes a LoRA only (kind 'adapter')")
        layer = spec["key"].rpartition(".")[0]
        up, down = tensors[f"{layer}.lora_up.weight"], tensors[f"{layer}.lora_down.weight"]
        alpha = float(tensors[f"{layer}.alpha"]) if f"{layer}.alpha" in tensors else float(down.shape[0])
        found[spec["key"]] = OutputLoRA(up.to(device=device, dtype=dtype, copy=True),
                                        down.to(device=device, dtype=dtype, copy=True), alpha)
    return found


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


def tensors(adapters: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Every adapter tensor (trainable or not, ``alpha`` too) under its LoRA key, detached, where it lives (an
    in-place change of one changes the adapter)."""
    found = {}
    for key, adapter in adapters.items():
        layer = key.rpartition(".")[0]
        if isinstance(adapter, Diff):
            found[lora_key(key)] = adapter.diff.detach()
            continue
        for name, param in adapter.named_parameters():
            found[f"{layer}.{name}"] = param.detach()
    return found


def state(adapters: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """``tensors`` on the CPU."""
    return {k: t.cpu() for k, t in tensors(adapters).items()}
