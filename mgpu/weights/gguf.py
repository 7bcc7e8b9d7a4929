"""GGUF-quantized weights (city96's ComfyUI-GGUF files of Wan, LTX-Video) that FSDP2 shards and all-gathers as
their stored blocks, and dequantizes after the gather.

A quantized parameter becomes a ``GGUFWeight``: ``(rows, row_bytes)`` bytes (one row = one output row =
``in / block_size`` blocks) that carry their GGML type and logical row shape. FSDP2 shards it by whole rows like any
parameter, and its all-gather extension sends those bytes (uint8: every backend, gloo included, gathers bytes); after
the gather each unit's weights are dequantized, a chunk of rows at a time, to the unit's compute dtype (the unit's
``param_dtype``, or the dtype the network built the parameter in), so the layers see an ordinary ``(rows, in)``
weight. F16/BF16/F32 tensors load as plain tensors. Each rank reads only its rows from the file
(``load_gguf_sharded``), as ``mgpu.sharding.slice_load`` does for safetensors.

Used as: ``wrap_gguf_parameters(model, path)`` on the model built on meta, then ``mgpu.sharding.fsdp.shard``,
``materialize``, ``load_gguf_sharded(model, path)`` (``mgpu.sharding.model_ops.load`` does this for .gguf files).
Works on torch 2.11 and 2.13 (tests/test_gguf_sharded.py runs on both).

The block layouts are GGML's (ggml-common.h); the arithmetic follows ``gguf.quants`` (gguf-py), which the tests use
as the reference.
"""

from __future__ import annotations

import functools
import math
import os
import time
from contextlib import ExitStack
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map

from mgpu.errors import ShardingError
from mgpu.planning.sizing import GGUF_MAGIC, Header, TensorInfo, read_gguf_header
from mgpu.sharding.slice_load import LoadReport, _detect_prefix, _listing, _local_rows, _read

# GGML type -> (elements per block, bytes per block)
QUANTIZED: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
PLAIN: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED = (*QUANTIZED, *PLAIN)
# The dtype a GGUFWeight shows FSDP for its bytes: one byte per element, and floating, because torch 2.11's FSDP2
# makes every sharded parameter require grad first (uint8 cannot). Not one of mgpu.weights.quant's FP8_DTYPES, so
# fp8 wrapping leaves it alone; no op ever computes with it: the bytes inside are uint8.
BYTES_DTYPE = torch.float8_e8m0fnu


# ------------------------------------------------------------------------------------------ dequantization

def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 scale at byte ``at`` of every block, as an (n, 1) float32 column."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes (..., 32k) -> 4-bit values (..., 2, 32k): low nibbles first, then high (GGML's order within a run)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


@functools.cache
def _shifts(device: torch.device, count: int, step: int) -> torch.Tensor:
    """The uint8 shift amounts ``0, step, ..., (count - 1) step`` on ``device``, made once per device: a tensor built
    from host values in every dequantization would be a host-to-device copy, which waits for the GPU, per chunk of
    every weight, every step (constants are cached, never re-created in the step)."""
    return torch.arange(0, count * step, step, dtype=torch.uint8, device=device)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bytes (n, b) -> bit ``i`` of byte ``j`` at [n, i, j] for i < count (the 5th/6th bits of K-quants)."""
    return (qh.unsqueeze(1) >> _shifts(qh.device, count, 1).view(1, count, 1)) & 1


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).reshape(len(b), 32).float() - 8
    return _f16(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:]).reshape(len(b), 32).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32-bit little-endian ``qh`` of Q5_0/Q5_1 -> bit j of element j, (n, 32)."""
    return _bits(qh, 8).transpose(1, 2).reshape(len(qh), 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]).reshape(len(b), 32) | (_fifth_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]).reshape(len(b), 32) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins -> (n, 8) each."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)), dim=1)
    mins = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return scales.float(), mins.float()


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * scale * q - dmin * min per 32-element sub-block; q is (n, 8, 32)."""
    scales, mins = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * scales).unsqueeze(-1)
    dm = (_f16(b, 2) * mins).unsqueeze(-1)
    return (d * q.float() - dm).reshape(len(b), 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:].reshape(len(b), 4, 32)).reshape(len(b), 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 48:].reshape(len(b), 4, 32)).reshape(len(b), 8, 32)
    return _k_affine(b, low | (_bits(b[:, 16:48], 8) << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(b.device, 4, 2).view(1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).float() - 32).reshape(n, 16, 16)
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (d * q).reshape(n, 256)


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
               "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(data: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGML blocks (uint8, last dim a whole number of blocks) -> values (last dim in elements) in ``dtype``.

    Computed in float32 (as gguf-py does) and cast once at the end. Zero bytes dequantize to zeros.
    """
    if qtype in PLAIN:
        return data.contiguous().view(PLAIN[qtype]).to(dtype)
    block, block_bytes = QUANTIZED[qtype]
    lead, width = data.shape[:-1], data.shape[-1]
    blocks = data.reshape(-1, block_bytes)
    return _DEQUANTIZE[qtype](blocks).to(dtype).reshape(*lead, width // block_bytes * block)


# Values dequantized at a time after a gather: bounds the float32 temporaries of a large layer (Wan 14B's FFN has
# 71 M values; dequantized at once its intermediates would take about 1 GiB) to a few hundred MiB.
CHUNK_VALUES = 1 << 24


def dequantize_rows(data: torch.Tensor, qtype: str, out: torch.Tensor) -> torch.Tensor:
    """Dequantize the rows of ``data`` (rows, row_bytes) into ``out`` (rows, ...; any float dtype), a chunk of rows
    at a time; returns ``out``."""
    rows = data.shape[0]
    flat = out.view(rows, -1)
    step = max(1, CHUNK_VALUES // max(1, flat.shape[1]))
    for first in range(0, rows, step):
        flat[first:first + step] = dequantize(data[first:first + step], qtype)
    return out


def row_bytes(qtype: str, row_elements: int) -> int:
    """Bytes one row of ``row_elements`` takes in ``qtype``; the row must be whole blocks."""
    block, block_bytes = QUANTIZED[qtype]
    if row_elements % block:
        raise ShardingError(f"a {qtype} row of {row_elements} elements is not whole blocks of {block}")
    return row_elements // block * block_bytes


# ------------------------------------------------------------------------------------------ the parameter

class GGUFWeight(torch.Tensor):
    """A GGUF-quantized weight as FSDP2 shards it: ``(rows, row_bytes)`` bytes (``shape``; dtype ``BYTES_DTYPE``
    outside, uint8 inside) standing for ``(rows, *row_shape)`` values (``logical_shape``) of GGML type ``qtype``.

    Every op runs on the uint8 bytes it wraps, and any uint8 result stays a ``GGUFWeight`` with the same type and row
    shape, so FSDP's chunks, padded copies, flat views, ``to_empty`` and the slice loader's ``copy_`` keep it (rows
    and ``logical_shape`` mean something for the 2-D ones only). A cast to another dtype is refused: the values
    exist only after dequantization.
    """

    _data: torch.Tensor
    qtype: str
    row_shape: tuple[int, ...]
    compute_dtype: torch.dtype
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, qtype: str, row_shape: tuple[int, ...],
                compute_dtype: torch.dtype) -> GGUFWeight:
        if data.dtype != torch.uint8:
            raise TypeError(f"GGUFWeight holds uint8 blocks, got {data.dtype}")
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=BYTES_DTYPE,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, qtype: str, row_shape: tuple[int, ...], compute_dtype: torch.dtype):
        self._data = data
        self.qtype = qtype
        self.row_shape = tuple(row_shape)
        self.compute_dtype = compute_dtype

    @property
    def logical_shape(self) -> torch.Size:
        return torch.Size((self.shape[0], *self.row_shape))

    def __repr__(self) -> str:
        return f"GGUFWeight({self.qtype}, logical {tuple(self.logical_shape)}, {self._data!r})"

    def _like(self, data: torch.Tensor) -> GGUFWeight:
        return GGUFWeight(data, self.qtype, self.row_shape, self.compute_dtype)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This tensor's rows as values of ``logical_shape`` (``compute_dtype`` unless given)."""
        return dequantize(self._data, self.qtype, dtype or self.compute_dtype).view(self.logical_shape)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        proto = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, GGUFWeight))
        dtype = kwargs.get("dtype")
        if dtype in (BYTES_DTYPE, torch.uint8):   # new_zeros & co. ask for the outer dtype: the bytes are uint8
            kwargs = {**kwargs, "dtype": torch.uint8}
        elif dtype is not None:
            raise ShardingError(f"a {proto.qtype} GGUF weight cannot become {dtype} by {func}: it holds GGML "
                                "blocks; its values exist after FSDP's all-gather (or GGUFWeight.dequantized())")
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func._schema.name.endswith("_"):
            return args[0]   # in place (copy_, zero_, ...): the wrapper itself, as for a plain tensor
        return tree_map(lambda t: proto._like(t) if isinstance(t, torch.Tensor) and t.dtype == torch.uint8 else t,
                        out)

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module,
                            mp_policy) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's rows as uint8, padded to FSDP's chunk; the metadata: how many rows the whole weight has."""
        data = self._data.contiguous()
        rows = -(-outer_size[0] // mesh.size())
        if data.shape[0] != rows:
            padded = data.new_zeros((rows, data.shape[1]))
            padded[:data.shape[0]].copy_(data)
            data = padded
        return (data,), outer_size[0]

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        """The gathered blocks dequantized to ``(rows, *row_shape)`` (padding rows dropped) in the unit's
        ``param_dtype``, or without one (FSDP then passes ``BYTES_DTYPE``) in ``compute_dtype``."""
        (gathered,) = all_gather_outputs
        rows = metadata
        if out is not None:   # FSDP's unsharded parameter from the first gather, its storage just re-allocated
            dequantize_rows(gathered[:rows], self.qtype, out)
            return None
        dtype = self.compute_dtype if param_dtype == BYTES_DTYPE else param_dtype
        values = torch.empty((rows, *self.row_shape), dtype=dtype, device=gathered.device)
        dequantize_rows(gathered[:rows], self.qtype, values)
        return _Dequantized(values), (values,)


def _unwrap(t: Any) -> Any:
    return t._data if isinstance(t, GGUFWeight) else t


class _Dequantized(torch.Tensor):
    """The dequantized weight on its way out of ``fsdp_post_all_gather``.

    FSDP2 views the returned tensor in the parameter's stored shape with ``torch.as_strided(t, (rows, row_bytes))``
    (right for dtype-preserving extensions, e.g. fp8); a GGUF weight's values have another shape, so the view
    answers the values themselves, and the unit's layers get an ordinary ``(rows, in)`` weight.
    """

    _values: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, values: torch.Tensor) -> _Dequantized:
        return torch.Tensor._make_wrapper_subclass(cls, values.shape, strides=values.stride(), dtype=values.dtype,
                                                   device=values.device, requires_grad=False)

    def __init__(self, values: torch.Tensor):
        self._values = values

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrapped = tree_map(lambda t: t._values if isinstance(t, _Dequantized) else t, (args, kwargs or {}))
        if func is torch.ops.aten.as_strided.default:   # a fresh alias: the view FSDP asked for, of the values
            return torch.ops.aten.alias.default(unwrapped[0][0])
        return func(*unwrapped[0], **unwrapped[1])


# ------------------------------------------------------------------------------------------ files

def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a GGUF file (by its magic number, whatever its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (IsADirectoryError, FileNotFoundError):
        return False


def check_supported(header: Header, names: list[str] | None = None) -> None:
    """Refuse a file with tensors of a type this module cannot dequantize (all, or those in ``names``), naming
    the file, the tensors and their types: before any rank loads anything."""
    infos = header.tensors.values() if names is None else [header.tensors[n] for n in names if n in header.tensors]
    bad = [f"{i.name} ({i.dtype})" for i in infos if i.dtype not in SUPPORTED]
    if bad:
        types = sorted({i.dtype for i in infos if i.dtype not in SUPPORTED})
        raise ShardingError(
            f"{header.path} has {len(bad)} tensor(s) of a type comfy-mgpu cannot dequantize ({', '.join(types)}): "
            f"{', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}. Supported: {', '.join(SUPPORTED)}. Use a "
            "quantization made of those (e.g. Q8_0, Q6_K, Q5_K_M, Q4_K_M), or load this file with ComfyUI-GGUF's "
            "Unet Loader (GGUF) on one device.")


def shardable(info: TensorInfo) -> bool:
    """A quantized tensor whose dim-0 rows are whole blocks: it is sharded and gathered as its blocks. Others
    (a 1-D quantized tensor, a reshaped one whose rows split blocks) are dequantized when they load."""
    if info.dtype not in QUANTIZED or len(info.shape) < 2:
        return False
    return math.prod(info.shape[1:]) % QUANTIZED[info.dtype][0] == 0


def wrap_gguf_parameters(model: nn.Module, path: str | os.PathLike, prefix: str | None = None) -> list[str]:
    """Replace every parameter the GGUF file at ``path`` stores quantized (and shardable) by a ``GGUFWeight`` on
    the same device, before ``fully_shard``; returns their keys. The parameter's dtype becomes the weight's
    compute dtype. Shapes must match the file's; other tensors stay as the model built them (they load as plain
    tensors). Tensors of unsupported types raise ``ShardingError``.
    """
    header = read_gguf_header(path)
    names = [n for n, _ in model.named_parameters()]
    prefix = _detect_prefix(names, set(header.tensors)) if prefix is None else prefix
    check_supported(header, [prefix + n for n in names])
    params = [(sub, name, param, header.tensors.get(prefix + (f"{module_name}.{name}" if module_name else name)))
              for module_name, sub in model.named_modules() for name, param in sub._parameters.items()]
    params = [(sub, name, param, info) for sub, name, param, info in params
              if param is not None and info is not None and shardable(info) and not isinstance(param, GGUFWeight)]
    wrong = [f"{info.name}: file {info.shape} vs model {tuple(param.shape)}" for _, _, param, info in params
             if tuple(param.shape) != info.shape]
    if wrong:
        raise ShardingError(f"The GGUF file {header.path} does not match {type(model).__name__} (key prefix "
                            f"{prefix!r}): shape mismatches {_listing(wrong)}. Pick the file made for this model.")
    wrapped = []
    for sub, name, param, info in params:
        data = torch.empty((info.shape[0], row_bytes(info.dtype, math.prod(info.shape[1:]))), dtype=torch.uint8,
                           device=param.device)
        dtype = param.dtype if param.dtype.is_floating_point else torch.float32
        sub._parameters[name] = nn.Parameter(GGUFWeight(data, info.dtype, info.shape[1:], dtype), requires_grad=False)
        wrapped.append(info.name)
    return wrapped


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    local = _local(t)
    if isinstance(local, GGUFWeight):
        return (t.shape[0], *local.row_shape)
    return tuple(t.shape)


def _check(model: nn.Module, header: Header, prefix: str, targets: dict[str, torch.Tensor], keys: dict[str, str],
           unexpected: list[str]) -> None:
    """Refuse before reading anything: a partial load would leave a model that silently computes garbage."""
    path, entries = header.path, header.tensors
    present = [(t, entries[keys[n]]) for n, t in targets.items() if keys[n] in entries]
    check_supported(header, [keys[n] for n in targets])
    problems = [f"{label} {_listing(items)}" for label, items in (
        ("missing keys", [k for k in keys.values() if k not in entries]),
        ("unexpected keys", unexpected),
        ("shape mismatches", [f"{i.name}: file {i.shape} vs model {_logical_shape(t)}"
                              for t, i in present if i.shape != _logical_shape(t)]),
        ("type mismatches", [f"{i.name}: file {i.dtype} vs model {_local(t).qtype}" for t, i in present
                             if isinstance(_local(t), GGUFWeight) and _local(t).qtype != i.dtype]),
    ) if items]
    if problems:
        raise ShardingError(f"The GGUF file {path} does not match {type(model).__name__} (key prefix {prefix!r}): "
                            f"{'; '.join(problems)}. Pick the file made for this model.")
    meta = [n for n, t in targets.items() if t.is_meta]
    if meta:
        raise ShardingError(f"{type(model).__name__} still has meta tensors {_listing(meta)}; call "
                            f"mgpu.sharding.fsdp.materialize before loading {path}.")


def _fill(dest: torch.Tensor, info: TensorInfo, rows: tuple[int, int] | None, f: BinaryIO, path: str) -> int:
    """Read this rank's rows of one tensor into ``dest``; returns the bytes read."""
    total = info.shape[0] if info.shape else 1
    start, stop = rows or (0, total)
    if isinstance(dest, GGUFWeight) or info.dtype in PLAIN:   # rows are byte ranges of the file
        per_row = info.nbytes // total if total else 0
        nbytes = (stop - start) * per_row
        if nbytes:
            raw = _read(f, info.start + start * per_row, nbytes, path)
            data = torch.frombuffer(raw, dtype=torch.uint8 if isinstance(dest, GGUFWeight) else PLAIN[info.dtype])
            dest.copy_(data.view(dest.shape))
        return nbytes
    # quantized but not by whole rows: read it whole, dequantize, keep this rank's rows
    raw = _read(f, info.start, info.nbytes, path)
    values = dequantize(torch.frombuffer(raw, dtype=torch.uint8), info.dtype).view(info.shape)
    dest.copy_(values[start:stop] if info.shape else values)
    return info.nbytes


def load_gguf_sharded(model: nn.Module, path: str | os.PathLike, *, prefix: str | None = None,
                      strict: bool = True) -> LoadReport:
    """Fill ``model``'s local shards and buffers from the GGUF file at ``path``, reading only this rank's rows.

    ``GGUFWeight`` parameters (``wrap_gguf_parameters``) get their rows' blocks as stored; F16/BF16/F32 tensors
    their rows converted to the parameter's dtype. Missing keys, shape mismatches, unsupported types and (with
    ``strict``) unexpected keys raise ``ShardingError`` before any read. Call after ``materialize``.
    """
    began = time.perf_counter()
    path = os.fspath(path)
    header = read_gguf_header(path)
    targets = model.state_dict(keep_vars=True)
    prefix = _detect_prefix(list(targets), set(header.tensors)) if prefix is None else prefix
    keys = {n: prefix + n for n in targets}
    unexpected = sorted(k for k in header.tensors.keys() - set(keys.values()) if k.startswith(prefix))
    _check(model, header, prefix, targets, keys, unexpected if strict else [])

    initialized = dist.is_available() and dist.is_initialized()
    report = LoadReport(path=path, rank=dist.get_rank() if initialized else 0,
                        world_size=dist.get_world_size() if initialized else 1, prefix=prefix,
                        unexpected=[] if strict else unexpected)
    with ExitStack() as stack, torch.no_grad():
        f = stack.enter_context(open(path, "rb", buffering=0))
        for name, t in targets.items():
            info = header.tensors[keys[name]]
            rows = _local_rows(name, t)
            report.count(_fill(_local(t), info, rows, f, path), info.nbytes, sharded=rows is not None)
    return report.finish(began)
