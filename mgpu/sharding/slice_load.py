"""Per-rank slice loading of a safetensors checkpoint into an FSDP2-sharded model.

Each rank reads from disk only the rows of the shards it owns (plus the small unsharded tensors), so no rank ever
holds, maps or reads the whole checkpoint: a 28 GB model on 4 GPUs costs each rank ~7 GB of reads and memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from mgpu.errors import ShardingError
from mgpu.planning.sizing import TensorInfo, read_headers

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "C64": torch.complex64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "BOOL": torch.bool,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
if hasattr(torch, "float8_e8m0fnu"):  # torch >= 2.7
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
# A model attribute naming checkpoint keys (without prefix) that describe the file's format and hold no weights,
# e.g. ComfyUI's ``scaled_fp8`` marker: set by whoever built the model from them, they are not "unexpected".
FORMAT_KEYS = "checkpoint_format_keys"


@dataclass
class LoadReport:
    """What one rank read, so callers and tests can check that nobody read the whole checkpoint."""
    path: str
    rank: int
    world_size: int
    prefix: str
    tensors_read: int = 0
    bytes_read: int = 0
    sharded_bytes_read: int = 0      # rows of FSDP-sharded parameters owned by this rank
    unsharded_bytes_read: int = 0    # tensors every rank reads whole (buffers, unsharded parameters)
    reads: int = 0
    max_read_bytes: int = 0
    checkpoint_bytes: int = 0        # bytes of all checkpoint tensors the model uses
    unexpected: list[str] = field(default_factory=list)   # only when strict=False
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def count(self, nbytes: int, checkpoint_bytes: int, sharded: bool) -> None:
        """One tensor loaded: ``nbytes`` read from disk (its rows, or all of an unsharded one) of a checkpoint
        tensor of ``checkpoint_bytes``."""
        if nbytes:
            self.reads += 1
            self.max_read_bytes = max(self.max_read_bytes, nbytes)
        self.tensors_read += 1
        self.checkpoint_bytes += checkpoint_bytes
        if sharded:
            self.sharded_bytes_read += nbytes
        else:
            self.unsharded_bytes_read += nbytes

    def finish(self, began: float) -> LoadReport:
        self.bytes_read = self.sharded_bytes_read + self.unsharded_bytes_read
        self.seconds = time.perf_counter() - began
        return self


def shard_row_range(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that FSDP2 gives ``rank``: ``torch.chunk`` semantics.

    Chunks are ``ceil(rows / world_size)`` rows, so the last ones are shorter and ranks past the end get none
    (e.g. 4 rows on 3 ranks: 2, 2, 0). ``load_sharded`` checks the result against each local shard's shape.
    """
    chunk = -(-rows // world_size)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def _index(path: str) -> dict[str, tuple[str, TensorInfo]]:
    """Every checkpoint tensor with the file holding it, from the headers alone."""
    entries: dict[str, tuple[str, TensorInfo]] = {}
    for header in read_headers(path):
        for name, info in header.tensors.items():
            if name in entries:
                raise ShardingError(f"Tensor {name} is in both {entries[name][0]} and {header.path}; the checkpoint "
                                    f"{path} mixes two models: keep only one.")
            entries[name] = (header.path, info)
    return entries


def _detect_prefix(names: list[str], keys: set[str]) -> str:
    """The prefix that checkpoint keys put before model names (e.g. ComfyUI's ``model.diffusion_model.``)."""
    if all(n in keys for n in names):
        return ""
    candidates = {""}
    for name in names[:8]:
        candidates.update(k[:-len(name)] for k in keys
                          if k.endswith(name) and (len(k) == len(name) or k[-len(name) - 1] == "."))
    return max(sorted(candidates, key=len), key=lambda p: sum(p + n in keys for n in names))


def _listing(items: list[str], limit: int = 10) -> str:
    return f"{len(items)} ({', '.join(items[:limit])}{', ...' if len(items) > limit else ''})"


def _local_rows(name: str, t: torch.Tensor) -> tuple[int, int] | None:
    """Global dim-0 rows held by this rank, or ``None`` when the tensor is not sharded (read it whole)."""
    if not isinstance(t, DTensor):
        return None
    sharded = [(d, p) for d, p in enumerate(t.placements) if not isinstance(p, Replicate)]
    if not sharded:
        return None
    if len(sharded) > 1 or type(sharded[0][1]) is not Shard or sharded[0][1].dim != 0:
        raise ShardingError(f"Parameter {name} has placements {t.placements}; slice loading supports FSDP's "
                            f"Shard(0) (plus Replicate) only. Shard with mgpu.sharding.fsdp.shard.")
    mesh_dim = sharded[0][0]
    start, stop = shard_row_range(t.shape[0], t.device_mesh.size(mesh_dim), t.device_mesh.get_coordinate()[mesh_dim])
    expected = (stop - start, *t.shape[1:])
    if tuple(t.to_local().shape) != expected:
        raise ShardingError(f"Parameter {name}: local shard {tuple(t.to_local().shape)} is not the torch.chunk "
                            f"slice {expected} this loader expects; FSDP's layout changed in torch "
                            f"{torch.__version__}. Update mgpu.sharding.slice_load.shard_row_range.")
    return start, stop


def _read(f: BinaryIO, offset: int, nbytes: int, path: str) -> bytearray:
    """Read ``nbytes`` at ``offset`` into a fresh buffer: seek + readinto is copy-free and, unlike os.pread, portable."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        f.seek(offset + done)
        n = f.readinto(view[done:])
        if not n:
            raise ShardingError(f"{path} ended at byte {offset + done} while reading; the file is truncated.")
        done += n
    return buf


def _check(model: nn.Module, path: str, prefix: str, targets: dict[str, torch.Tensor], keys: dict[str, str],
           entries: dict[str, tuple[str, TensorInfo]], unexpected: list[str]) -> None:
    """Refuse before reading anything: a partial load would leave a model that silently computes garbage."""
    present = [(t, entries[keys[n]][1]) for n, t in targets.items() if keys[n] in entries]
    problems = [f"{label} {_listing(items)}" for label, items in (
        ("missing keys", [k for k in keys.values() if k not in entries]),
        ("unexpected keys", unexpected),
        ("shape mismatches", [f"{i.name}: checkpoint {i.shape} vs model {tuple(t.shape)}"
                              for t, i in present if i.shape != tuple(t.shape)]),
        ("tensors of unsupported dtype", [f"{i.name} ({i.dtype})" for _, i in present
                                          if i.dtype not in SAFETENSORS_DTYPES]),
    ) if items]
    if problems:
        raise ShardingError(f"The checkpoint {path} does not match {type(model).__name__} (key prefix {prefix!r}): "
                            f"{'; '.join(problems)}. Pick the checkpoint made for this model, or pass prefix= / "
                            f"key_map= to translate its key names.")
    meta = [n for n, t in targets.items() if t.is_meta]
    if meta:
        raise ShardingError(f"{type(model).__name__} still has meta tensors {_listing(meta)}; call "
                            f"mgpu.sharding.fsdp.materialize before loading {path}.")


def load_sharded(model: nn.Module, path: str | os.PathLike, *, key_map: Callable[[str], str] | None = None,
                 prefix: str | None = None, strict: bool = True) -> LoadReport:
    """Fill ``model``'s local shards and buffers from the checkpoint at ``path``, reading only this rank's rows.

    ``path``: a .safetensors file, a sharded folder or its index. Checkpoint key = ``prefix + key_map(model_name)``;
    ``prefix=None`` detects it (``""``, ``model.diffusion_model.``, ...). Unexpected keys count under that prefix
    only, so one component of a combined checkpoint loads by its prefix; the model's ``FORMAT_KEYS`` are none.
    Missing keys, shape mismatches and (with ``strict``) unexpected keys raise ``ShardingError`` before any read.
    Call after ``mgpu.sharding.fsdp.materialize``; unsharded models load too (every tensor then reads whole).
    """
    began = time.perf_counter()
    path = os.fspath(path)
    entries = _index(path)
    targets = model.state_dict(keep_vars=True)   # FSDP2 keeps the sharded DTensor parameters registered here
    names = {n: key_map(n) if key_map else n for n in targets}
    prefix = _detect_prefix(list(names.values()), set(entries)) if prefix is None else prefix
    keys = {n: prefix + k for n, k in names.items()}
    consumed = set(keys.values()) | {prefix + k for k in getattr(model, FORMAT_KEYS, ())}
    unexpected = sorted(k for k in entries.keys() - consumed if k.startswith(prefix))
    _check(model, path, prefix, targets, keys, entries, unexpected if strict else [])

    initialized = dist.is_available() and dist.is_initialized()
    report = LoadReport(path=path, rank=dist.get_rank() if initialized else 0,
                        world_size=dist.get_world_size() if initialized else 1, prefix=prefix,
                        unexpected=[] if strict else unexpected)
    files: dict[str, BinaryIO] = {}
    with ExitStack() as stack, torch.no_grad():
        for name, t in targets.items():
            file, info = entries[keys[name]]
            total_rows = info.shape[0] if info.shape else 1   # a 0-d tensor is one row
            row_bytes = info.nbytes // total_rows if total_rows else 0
            rows = _local_rows(name, t)
            start, stop = rows or (0, total_rows)
            nbytes = (stop - start) * row_bytes
            if nbytes:
                if file not in files:
                    files[file] = stack.enter_context(open(file, "rb", buffering=0))
                raw = _read(files[file], info.start + start * row_bytes, nbytes, file)
                dest = t.to_local() if isinstance(t, DTensor) else t
                dest.copy_(torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[info.dtype]).view(dest.shape))
            report.count(nbytes, info.nbytes, sharded=rows is not None)
    return report.finish(began)
