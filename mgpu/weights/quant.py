"""fp8 weights that FSDP2 shards and all-gathers in their stored form: one byte per element on the wire.

FSDP2 gathers a parameter in its ``param_dtype``; for fp8 storage that either upcasts before the gather (twice the
bytes of bf16 storage, four times fp8's for fp32) or, without a ``param_dtype``, asks the process group for a float8
collective, which gloo (CPU ranks) lacks. ``Fp8Weight`` uses FSDP2's all-gather extension (the tensor-subclass
protocol torchao's float8 uses, ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``): every rank sends its fp8 rows
viewed as ``uint8`` (any backend gathers bytes), and after the gather the block's weight is either the fp8 tensor
itself (the module's own ops cast it, as ComfyUI's do) or, when the unit asks for a compute dtype, the fp8 values
upcast to it (exact: every fp8 value is representable in bf16, fp16 and fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})


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
