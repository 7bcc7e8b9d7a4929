"""Weight patches on weights whose stored form cannot take a row delta (fp8, GGUF blocks, ComfyUI's quantized
tensors): the patch runs in the forward instead, ``y += s · B(A x)``, and the stored weight is never touched.

Which weights: decided by the stored form, not by a list of formats (``row_patchable``). A rank's shard that is a
plain tensor of fp32/bf16/fp16 takes its rows of the delta (``mgpu.weights.lora``); anything else (another dtype, or
a tensor subclass whatever dtype it reports) gets a forward hook on the module that owns it.

The output of a Linear, a Conv or a norm is linear in each of its parameters, so a patch on one adds a term that
needs only the module's input:

- Linear / Conv weight: a LoRA ``up @ down`` adds ``up · (down ⋆ x)`` (the layer's own map with ``down`` as weight,
  a conv with the layer's stride and padding, then ``up`` over the channels); a diff adds the layer's map with the
  diff as weight. A Linear is an ``nn.Linear`` or a layer with its ``in_features`` / ``out_features`` (ComfyUI
  0.33's quantized-tensor Linear does not subclass it);
- LayerNorm / RMSNorm weight: a diff adds ``diff · normalized(x)``;
- a bias of any of those: a diff adds it along the channel dim.

LoRAs stacked on one weight are concatenated (``[s1·up1, s2·up2] @ [down1; down2]`` is their sum) and diffs summed:
one pair of small matmuls per layer whatever the count. A set patch (replaces the weight) and strength_model (scales
the stored weight) cannot be a term: refused by name. Every rank holds these adapters whole: fp32 masters (pre-scaled)
in host RAM and, from the first forward, a copy in the input's dtype on the device; for a LoRA that is about the
LoRA file's bytes per rank, a full-size diff costs the weight's size.

Numerics: the term is computed in the input's dtype (fp32 stays fp32) and added to the layer's output. ComfyUI rounds
``W + s·up@down`` back into the stored dtype instead (into fp8 with stochastic rounding), so this is closer to the
exact merge than stock ComfyUI on the same file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from mgpu.errors import ShardingError
from mgpu.weights.quant import FP8_DTYPES

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORMS = (nn.LayerNorm, nn.RMSNorm)
ADVICE = "load the model with weight_dtype bf16, fp16 or fp32 to patch it"
Tensors = dict[str, torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def row_patchable(t: torch.Tensor) -> bool:
    """Whether this rank's shard of ``t`` can take rows of a delta: a plain tensor of fp32/bf16/fp16."""
    local = _local(t)
    return type(local) in (torch.Tensor, nn.Parameter) and local.dtype in PLAIN_DTYPES


def stored_form(t: torch.Tensor) -> str:
    """How ``t`` is stored on the ranks, for messages: its dtype where that says it (fp8), else its class and type."""
    local = _local(t)
    dtype = str(local.dtype).removeprefix("torch.")
    if type(local) in (torch.Tensor, nn.Parameter) or local.dtype in FP8_DTYPES:
        return dtype
    return f"{type(local).__name__} ({getattr(local, 'qtype', dtype)})"


def value_shape(t: torch.Tensor) -> torch.Size:
    """The shape of the values ``t`` stands for: its own, or, for a stored form whose elements are not values and
    that says so with a ``logical_shape`` (GGUF blocks: bytes per row), its rows times a row's value shape."""
    logical = getattr(_local(t), "logical_shape", None)
    return t.shape if logical is None else torch.Size((t.shape[0], *logical[1:]))


@dataclass
class ModuleTerms:
    """The patches on one module's quantized parameters, as what they add to its output (fp32 masters, CPU)."""

    ups: list[torch.Tensor] = field(default_factory=list)     # [out, r], scale folded in
    downs: list[torch.Tensor] = field(default_factory=list)   # [r, *weight.shape[1:]]: the layer's weight layout
    weight_diff: torch.Tensor | None = None
    bias_diff: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        kept = [*self.ups, *self.downs, self.weight_diff, self.bias_diff]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)


def collect(model: nn.Module, patches: dict[str, list[dict]], targets: dict[str, torch.Tensor],
            tensors: Tensors) -> dict[str, ModuleTerms]:
    """The forward terms for ``patches`` (parameter name -> ops, shapes already checked) on ``targets`` (the model's
    state dict), per owning module's name. Changes nothing: raises ShardingError, naming the weight, for a patch that
    cannot be a term."""
    terms: dict[str, ModuleTerms] = {}
    for name, ops in patches.items():
        owner, _, param = name.rpartition(".")
        module = model.get_submodule(owner)
        target = targets[name]
        _check(name, module, param, target, ops)
        found = terms.setdefault(owner, ModuleTerms())
        for op in ops:
            _add(found, param, target, op, tensors)
    return terms


def _class_name(module: nn.Module) -> str:
    """The module's own class name, not FSDP2's ``FSDP<name>`` subclass."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def is_linear(module: nn.Module) -> bool:
    """A layer computing ``F.linear(x, weight, bias)``: an ``nn.Linear``, or a layer that keeps its protocol
    (``in_features`` / ``out_features``) without subclassing it, as ComfyUI 0.33's quantized-tensor Linear."""
    return isinstance(module, nn.Linear) or not isinstance(module, nn.Embedding) and all(
        isinstance(getattr(module, a, None), int) for a in ("in_features", "out_features"))


def _check(name: str, module: nn.Module, param: str, target: torch.Tensor, ops: list[dict]) -> None:
    why = f"{name} is stored as {stored_form(target)} on the ranks, which cannot take a row delta"
    supported = (param == "weight" and (is_linear(module) or isinstance(module, (*CONVS, *NORMS)))
                 or param == "bias" and (is_linear(module) or isinstance(module, (*CONVS, nn.LayerNorm))))
    if not supported:
        raise ShardingError(f"{why}, and a patch on the {param!r} of a {_class_name(module)} cannot run in the "
                            f"forward instead (only Linear, Conv1d/2d/3d, LayerNorm and RMSNorm weights and biases "
                            f"can); {ADVICE}")
    for op in ops:
        if op.get("model_scale", 1.0) != 1.0:
            raise ShardingError(f"{why}: strength_model {op['model_scale']} scales the stored weight itself; {ADVICE}")
        if op["kind"] == "set":
            raise ShardingError(f"{why}: a set patch replaces the stored weight; {ADVICE}")
        if op["kind"] == "lora" and not (is_linear(module) or isinstance(module, CONVS) and module.groups == 1):
            raise ShardingError(f"{why}, and a LoRA on a {_class_name(module)}"
                                f"{' with groups' if isinstance(module, CONVS) else ''} cannot run in the forward "
                                f"instead (a Linear's or an ungrouped Conv's can); {ADVICE}")


def _add(terms: ModuleTerms, param: str, target: torch.Tensor, op: dict, tensors: Tensors) -> None:
    """Fold one op into ``terms``, copied out of the call's shared memory (reused by the next call) as fp32."""
    def master(key: str) -> torch.Tensor:
        return tensors[key].to("cpu", torch.float32, copy=True)

    if op["kind"] == "lora":
        up, down = master(op["up"]), master(op["down"])
        terms.ups.append(up.flatten(1) * op["scale"])
        terms.downs.append(down.reshape(down.shape[0], *value_shape(target)[1:]))
        return
    diff = master(op["diff"]) * op["scale"]
    kept = terms.weight_diff if param == "weight" else terms.bias_diff
    diff = diff if kept is None else kept + diff
    if param == "weight":
        terms.weight_diff = diff
    else:
        terms.bias_diff = diff


class ForwardTerm:
    """Forward hook: adds the module's ``ModuleTerms`` to its output, computed in the input's dtype."""

    def __init__(self, terms: ModuleTerms):
        up = torch.cat(terms.ups, dim=1) if terms.ups else None
        down = torch.cat(terms.downs) if terms.downs else None
        self.masters = (up, down, terms.weight_diff, terms.bias_diff)
        self._on: tuple[tuple, tuple] | None = None   # (device, dtype) and the masters cast there

    def _tensors(self, device: torch.device, dtype: torch.dtype) -> tuple:
        if self._on is None or self._on[0] != (device, dtype):
            self._on = ((device, dtype), tuple(None if t is None else t.to(device, dtype) for t in self.masters))
        return self._on[1]

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        dtype = x.dtype if x.dtype in PLAIN_DTYPES else torch.float32
        x = x.to(dtype)
        up, down, weight_diff, bias_diff = self._tensors(x.device, dtype)
        parts = []
        if down is not None:
            parts.append(_up_map(module, _weight_map(module, x, down), up))
        if weight_diff is not None:
            parts.append(_weight_map(module, x, weight_diff))
        if bias_diff is not None:
            parts.append(bias_diff.view(-1, *[1] * len(module.kernel_size)) if isinstance(module, CONVS)
                         else bias_diff)
        return output.add_(sum(parts[1:], parts[0]).to(output.dtype))


def _weight_map(module: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The module's output without bias as if ``weight`` were its weight (linear in it)."""
    if isinstance(module, CONVS):
        return module._conv_forward(x, weight, None)
    if isinstance(module, nn.LayerNorm):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps) * weight
    if isinstance(module, nn.RMSNorm):
        return F.rms_norm(x, module.normalized_shape, None, module.eps) * weight
    return F.linear(x, weight)


def _up_map(module: nn.Module, h: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``up`` [out, r] over the channels of ``h`` = the layer's map with ``down``: its last dim after a Linear,
    dim 1 after a Conv."""
    if not isinstance(module, CONVS):
        return F.linear(h, up)
    spatial = len(module.kernel_size)
    return (F.conv1d, F.conv2d, F.conv3d)[spatial - 1](h, up.view(*up.shape, *[1] * spatial))


def install(model: nn.Module, terms: dict[str, ModuleTerms]) -> list[RemovableHandle]:
    """Hook each module's terms on; removing the handles gives back the model as loaded (weights never touched).
    First among the module's forward hooks: the term adds to the layer's own output, before hooks that reshape it
    (sequence parallelism's exchange after diffusers Wan's ``to_v``, ``mgpu.families.wan_diffusers``)."""
    return [model.get_submodule(owner).register_forward_hook(ForwardTerm(t), prepend=True)
            for owner, t in terms.items()]
