"""ComfyUI's weight patches on a sharded MODEL (what LoraLoaderModelOnly / LoraLoader add) as an ``mgpu.weights.lora``
PatchSet: the ranks apply them to their own rows, or in the forward where a weight is stored quantized (fp8, GGUF),
so stock LoRA nodes work on the FSDP MODEL whatever its storage. The host does not know how each weight is stored;
the ranks decide, and refuse by name what a quantized weight cannot take (a set patch, strength_model).

``ModelPatcher.patches`` maps a weight name to a list of ``(strength, adapter, strength_model, offset, function)``
(``ModelPatcher.add_patches``); ``comfy.lora.calculate_weight`` applies them in order. Supported: plain LoRA
(``LoRAAdapter`` without a mid/Tucker weight, DoRA scale or reshape) and the ``diff`` / ``set`` patches LoRA files
carry for biases and norms. Anything else (LoHa, LoKr, OFT, model merges, offsets, functions) is refused by name,
never applied wrong or dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from comfy.weight_adapter import LoRAAdapter, WeightAdapterBase

from mgpu.errors import MgpuError
from mgpu.weights.lora import BASE, PatchSet

PREFIX = "diffusion_model."   # BaseModel's network: the ranks' model is the network alone
ADVICE = ("remove that node (e.g. the LoRA loader) or convert the file to a plain LoRA, or load the model on one "
          "device (MGPU Load Diffusion Model, device cuda:N or cpu)")


def patch_set(patches: dict[str, list[tuple]], key: Any, shapes: dict[str, torch.Size], label: str) -> PatchSet:
    """The PatchSet for ``patches`` (a ModelPatcher's), identified by ``key`` (its ``patches_uuid``); ``shapes``
    gives each patched weight's shape. Raises MgpuError, naming the weight and the patch type, for what the ranks
    cannot apply, and naming the weights that do not fit when the LoRA was made for another model."""
    ps = PatchSet(key=key if patches else BASE)
    names: dict[int, str] = {}   # one tensor used twice (the same LoRA stacked) travels once
    misfits: list[str] = []

    def send(t: torch.Tensor) -> str:
        if id(t) not in names:
            names[id(t)] = f"t{len(names)}"
            ps.tensors[names[id(t)]] = t.detach().to("cpu").contiguous()
        return names[id(t)]

    for name, entries in patches.items():
        if not name.startswith(PREFIX):
            ps.unmatched.append(name)
            continue
        try:
            ps.patches[name.removeprefix(PREFIX)] = [_op(name, entry, shapes[name], send, label) for entry in entries]
        except _DoesNotFit as exc:
            misfits.append(f"{name}: {exc}")
    if misfits:
        _refuse_misfits(label, misfits, len(patches))
    return ps


class _DoesNotFit(Exception):
    """A patch whose tensors do not make the weight's shape: the LoRA is for another model."""


def _refuse_misfits(label: str, misfits: list[str], total: int) -> None:
    shown = "; ".join(misfits[:3]) + (f"; and {len(misfits) - 3} more" if len(misfits) > 3 else "")
    raise MgpuError(f"{label}: {len(misfits)} of the {total} weights a LoRA patches do not fit this model ({shown}). "
                    "The LoRA was made for another model (another family, or another size, e.g. a Wan 14B LoRA on Wan "
                    "1.3B): pick a LoRA made for this model in the LoRA loader node (LoraLoaderModelOnly / "
                    "LoraLoader), or remove that node")


def _op(name: str, entry: tuple, shape: torch.Size, send, label: str) -> dict:
    strength, adapter, strength_model, offset, function = entry
    if offset is not None or function is not None:
        _refuse(label, name, "a patch on part of the weight (offset) or with a conversion function")
    if isinstance(adapter, list):
        _refuse(label, name, "a model merge (weights of another model)")
    if isinstance(adapter, WeightAdapterBase):
        op = _lora(name, adapter, strength, shape, send, label)
    else:
        op = _plain(name, adapter, strength, shape, send, label)
    if strength_model != 1.0:
        op["model_scale"] = strength_model
    return op


def _lora(name: str, adapter: WeightAdapterBase, strength: float, shape: torch.Size, send, label: str) -> dict:
    if type(adapter) is not LoRAAdapter:
        _refuse(label, name, f"a {getattr(adapter, 'name', type(adapter).__name__)} adapter "
                             f"({type(adapter).__name__}; only plain LoRA is supported)")
    up, down, alpha, mid, dora_scale, reshape = adapter.weights
    extra = [what for what, present in (("a mid (Tucker/LoCon) weight", mid), ("a DoRA scale", dora_scale),
                                        ("a reshape_weight", reshape)) if present is not None]
    if extra:
        _refuse(label, name, f"a LoRA with {' and '.join(extra)}")
    if up.dim() < 2 or down.dim() < 2 or up.shape[0] != shape[0] or up[0].numel() != down.shape[0] \
            or up.shape[0] * down[0].numel() != shape.numel():
        raise _DoesNotFit(f"LoRA up {tuple(up.shape)} and down {tuple(down.shape)} for a {tuple(shape)} weight")
    scale = strength * (alpha / down.shape[0] if alpha is not None else 1.0)
    return {"kind": "lora", "up": send(up), "down": send(down), "scale": float(scale)}


def _plain(name: str, adapter: tuple, strength: float, shape: torch.Size, send, label: str) -> dict:
    kind, value = ("diff", adapter) if len(adapter) == 1 else adapter
    if kind not in ("diff", "set"):
        _refuse(label, name, f"a {kind!r} patch")
    tensor = value[0]
    if tuple(tensor.shape) != tuple(shape):
        raise _DoesNotFit(f"a {kind} of shape {tuple(tensor.shape)} for a {tuple(shape)} weight")
    op: dict = {"kind": kind, kind: send(tensor)}
    if kind == "diff":
        op["scale"] = float(strength)
    return op


def _refuse(label: str, name: str, what: str) -> None:
    raise MgpuError(f"{label}: the weight {name} carries {what}, which the FSDP ranks cannot apply; {ADVICE}")
