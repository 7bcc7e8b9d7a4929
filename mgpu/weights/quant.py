"""fp8 weights that FSDP2 shards and all-gathers in their stored form: one byte per element on the wire.

FSDP2 gathers a parameter in its ``param_dtype``; for fp8 storage that either upcasts before the gather (twice the
bytes of bf16 storage, four times fp8's for fp32) or, without a ``param_dtype``, asks the process group for a float8
collective, which gloo (CPU ranks) lacks. ``Fp8Weight`` uses FSDP2's all-gather extension (the tensor-subclass
protocol torchao's float8 uses, ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``): every rank sends its fp8 rows
viewed as ``uint8`` (any backend gathers bytes), and after the gather the block's weight is either the fp8 tensor
itself (the module's own ops cast it, as ComfyUI's do) or, when the unit asks for a compute dtype, the fp8 values
upcast to it (exact: every fp8 value is representable in bf16, fp16 and fp32).

Layers that compute from a quantized tensor subclass (ComfyUI 0.33's ``QuantizedTensor``: fp8 data and a scale) get
it for each forward from ``view_weight_as``, built by the caller around the gathered fp8 bytes. Which fp8 compute
path a device takes, fp8 matmul or dequantizing per layer, is ``fp8_compute_path`` (ComfyUI's rule, as data, so the
plan, the ranks' reports and the tests share it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
# Names an fp8 dtype goes by in headers, nodes and plans ("F8_E4M3", "fp8_e4m3fn", "float8_e5m2").
FP8_NAME_PREFIXES = ("f8_", "fp8_", "float8_")
# ComfyUI's fp8 matmul (torch._scaled_mm, comfy_kitchen's kernels) needs fp8 tensor cores: Ada (sm_89) and newer.
FP8_MATMUL_MIN_CAPABILITY = (8, 9)
PLAIN_FP8_CAST = "plain fp8 weights: fp8 matmul only with --fast fp8_matrix_mult"


class Fp8Weight(torch.Tensor):
    """A plain fp8 tensor behind FSDP2's all-gather extension; every other op runs on the fp8 data it wraps.

    Sharding, ``to_empty`` and slice loading (chunk, narrow, new_zeros, copy_) therefore act on the fp8 bytes, and
    any fp8 result stays an ``Fp8Weight`` so FSDP's padded copies keep the extension.
    """

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Fp8Weight:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def __repr__(self) -> str:
        return f"Fp8Weight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs or {}))
        if func._schema.name.endswith("_"):
            return args[0]   # in place (copy_, zero_, ...): the wrapper itself, as for a plain tensor
        return tree_map(_wrap, out)

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
                            mp_policy) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's rows as bytes, padded to FSDP's chunk (the last ranks' chunks are shorter)."""
        data = self._data.contiguous()
        rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] != rows:
            padded = data.new_zeros((rows, *data.shape[1:]))
            padded[:data.shape[0]].copy_(data)
            data = padded
        return (data.view(torch.uint8),), None

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        """The gathered bytes as the stored fp8 (a view: no copy), or upcast to the unit's compute dtype."""
        (gathered,) = all_gather_outputs
        fp8 = gathered.view(self.dtype)
        if param_dtype == self.dtype:
            if out is None:
                return fp8, ()
            return None   # ``out`` views the gather buffer FSDP just refilled
        if out is not None:   # FSDP's unsharded parameter: the gathered rows without the last chunk's padding
            out.copy_(fp8[:out.shape[0]])
            return None
        full = fp8.to(param_dtype)
        return full, (full,)


def _unwrap(t: Any) -> Any:
    return t._data if isinstance(t, Fp8Weight) else t


def _wrap(t: Any) -> Any:
    return Fp8Weight(t) if isinstance(t, torch.Tensor) and not isinstance(t, Fp8Weight) and t.dtype in FP8_DTYPES \
        else t


def wrap_fp8_parameters(module: nn.Module) -> int:
    """Put every fp8 parameter of ``module`` behind ``Fp8Weight`` (before ``fully_shard``); returns how many."""
    count = 0
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.dtype in FP8_DTYPES and not isinstance(param, Fp8Weight):
                sub._parameters[name] = nn.Parameter(Fp8Weight(param.data), requires_grad=False)
                count += 1
    return count


def store_as(module: nn.Module, dtype: torch.dtype, *, kinds: tuple[type[nn.Module], ...] = (nn.Linear,)) -> int:
    """Store the weights of ``kinds`` layers (Linear by default) in fp8 ``dtype``; returns how many.

    For models whose own layers compute in one dtype (plain ``nn.Linear``): shard them with a ``param_dtype`` and
    ``Fp8Weight`` hands each layer its weight upcast after the gather, so the file's fp8 bytes are what travels.
    """
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an fp8 dtype; storage in fp8 takes one of {sorted(map(str, FP8_DTYPES))}")
    count = 0
    for sub in module.modules():
        if isinstance(sub, kinds) and isinstance(getattr(sub, "weight", None), nn.Parameter):
            sub.weight = nn.Parameter(sub.weight.data.to(dtype), requires_grad=False)
            count += 1
    return count


SCALE_KEY = "scale_weight"   # ComfyUI's scaled-fp8 name for a layer's weight scale (weight = fp8 * scale)


def quantize_scaled(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, 0-d float32 scale) with ``weight ~ fp8 * scale``: the absmax maps to the format's largest value,
    so a weight of any magnitude uses fp8's whole range (unscaled fp8 loses the bits of small weights)."""
    w = weight.detach().float()
    scale = (w.abs().max() / torch.finfo(dtype).max).clamp_min(torch.finfo(torch.float32).tiny)
    return (w / scale).to(dtype), scale.reshape(())


def dequantize_scaled(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight * scale_weight``: in the weight's dtype when it arrives upcast (the unit's ``param_dtype``), in the
    scale's (float32) when it arrives as fp8. The 0-d float32 scale does not promote the product, which is rounded
    once: bf16 weights equal ``(fp8 * scale).to(bf16)``, the dequantized weights a one-device model would hold."""
    dtype = module.scale_weight.dtype if weight.dtype in FP8_DTYPES else weight.dtype
    return weight.to(dtype) * module.scale_weight


def store_scaled(module: nn.Module, dtype: torch.dtype, *,
                 kinds: tuple[type[nn.Module], ...] = (nn.Linear,)) -> int:
    """Store the weights of ``kinds`` layers as scaled fp8 (ComfyUI's scaled-fp8 idea, plain layers): an fp8
    ``weight`` and a 0-d float32 ``scale_weight`` buffer, multiplied in each forward; returns how many.

    Build the model with this before sharding it: FSDP shards the fp8 weight and gathers it as fp8 bytes
    (``Fp8Weight``), every rank holds the scale whole (a buffer: loaded from the checkpoint's ``scale_weight`` key),
    and ``dequantize_scaled`` runs after the gather, inside the layer's forward (``view_weight_as``).
    Checkpoint values come from ``quantize_scaled``.
    """
    count = store_as(module, dtype, kinds=kinds)
    for sub in module.modules():
        if isinstance(sub, kinds) and getattr(sub, "weight", None) is not None and sub.weight.dtype == dtype:
            sub.register_buffer(SCALE_KEY, torch.ones((), dtype=torch.float32, device=sub.weight.device
                                                       if not sub.weight.is_meta else "cpu"))
            view_weight_as(sub, dequantize_scaled)
    return count


def view_weight_as(module: nn.Module, make: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
    """During each forward of ``module`` its ``weight`` is ``make(module, weight)``; the weight is put back after.

    For layers that compute from a quantized tensor subclass (ComfyUI's ``QuantizedTensor``): FSDP2 gathers the
    fp8 rows (``Fp8Weight``) and re-strides whatever the all-gather extension returns to a plain tensor, which would
    dequantize such a subclass; so the unit's parameter stays the gathered fp8 tensor, and ``make`` wraps it, without
    a copy, for the one call. Runs inside the unit's forward, after FSDP has set the gathered parameter.
    """
    held: list[torch.Tensor] = []

    def before(mod: nn.Module, args: tuple) -> None:
        held.append(mod._parameters["weight"])
        mod._parameters["weight"] = make(mod, held[-1])

    def after(mod: nn.Module, args: tuple, output: Any) -> None:
        if held:   # always_call: also when the forward raised, so the next unshard finds FSDP's own parameter
            mod._parameters["weight"] = held.pop()

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after, always_call=True)


def is_fp8_name(dtype: str | None) -> bool:
    """Whether a dtype name from a header, a node or a plan is an fp8 one."""
    return (dtype or "").lower().startswith(FP8_NAME_PREFIXES)


@dataclass(frozen=True)
class Fp8Compute:
    """How one device computes the fp8 layers of a scaled-fp8 or quantized checkpoint, and why."""

    device: str
    matmul: bool   # fp8 x fp8 matmul (torch._scaled_mm); False: each layer dequantizes its weight and computes
    reason: str

    def __str__(self) -> str:
        how = "torch._scaled_mm" if self.matmul else "dequantize per layer"
        return f"{how} on {self.device} ({self.reason})"

    def to_dict(self) -> dict:
        return {"device": self.device, "matmul": self.matmul, "reason": self.reason, "summary": str(self)}


def fp8_compute_path(device: str, capability: tuple[int, int] | None, *, forced: bool = False,
                     full_precision: bool = False, plain_cast: bool = False) -> Fp8Compute:
    """ComfyUI's choice for fp8 layers (``comfy.model_management.supports_fp8_compute``, ``comfy.ops``), as data.

    fp8 matmul on an NVIDIA GPU of compute ``capability`` >= 8.9, or anywhere ComfyUI's ``--supports-fp8-compute``
    (``forced``) says so; unless the checkpoint asks for full-precision matmul (scaled-fp8 files with a 2-element
    ``scaled_fp8`` marker, ``full_precision_matrix_mult`` layers). Everywhere else (CPU, older GPUs, ``capability``
    None: not an NVIDIA GPU, or a simulated one) each layer dequantizes its weight to the compute dtype and runs a
    plain matmul. ``plain_cast``: plain fp8 weights (no scales), which ComfyUI's ops cast per layer even where the
    device has fp8 matmul, unless it runs with ``--fast fp8_matrix_mult`` (``comfy.ops.pick_operations``).
    """
    if full_precision:
        return Fp8Compute(device, False, "the checkpoint asks for full-precision matmul")
    path = _device_fp8_path(device, capability, forced)
    return Fp8Compute(device, False, PLAIN_FP8_CAST) if plain_cast and path.matmul else path


def _device_fp8_path(device: str, capability: tuple[int, int] | None, forced: bool) -> Fp8Compute:
    if forced:
        return Fp8Compute(device, True, "--supports-fp8-compute")
    kind = torch.device(device).type
    if kind != "cuda" or capability is None:
        return Fp8Compute(device, False, "no fp8 matmul on a CPU" if kind == "cpu" else
                          "no NVIDIA compute capability known for it")
    sm = f"sm_{capability[0]}{capability[1]}"
    if tuple(capability) < FP8_MATMUL_MIN_CAPABILITY:
        return Fp8Compute(device, False, f"{sm}: fp8 matmul needs sm_89")
    return Fp8Compute(device, True, sm)


FP8_COMPUTE = "fp8 compute: "


def fp8_compute_line(paths: Iterable[Fp8Compute | str]) -> str:
    """One line for a log or a plan: ``fp8 compute: torch._scaled_mm on cuda:0 (sm_90)``, equal entries once
    (paths, or their ``str``: the ranks send them as plain data)."""
    return FP8_COMPUTE + "; ".join(dict.fromkeys(str(p) for p in paths))


def fp8_plan_line(weight_dtype: str | None, devices: Iterable[tuple[str, tuple[int, int] | None]]) -> str | None:
    """The plan's line for an fp8 DiT on ``devices`` (id, capability): None unless ``weight_dtype`` is fp8. Where a
    GPU computes, the host RAM beside it (offload) only holds the weights. The plan knows neither the file's fp8
    kind nor ComfyUI's flags: where a GPU has fp8 matmul, the line says that plain fp8 files take it only with
    ``--fast fp8_matrix_mult`` (the load log then names each rank's path)."""
    if not is_fp8_name(weight_dtype):
        return None
    devices = list(devices)
    computing = [d for d in devices if torch.device(d[0]).type != "cpu"] or devices
    paths = [fp8_compute_path(device, capability) for device, capability in computing]
    plain = f"; {PLAIN_FP8_CAST}, else dequantize per layer" if any(p.matmul for p in paths) else ""
    return f"{fp8_compute_line(paths)} (ComfyUI's choice for scaled-fp8 and quantized fp8 layers{plain})"
