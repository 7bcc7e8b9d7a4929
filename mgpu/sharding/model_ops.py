"""Rank-side ops for a sharded model: load it from a checkpoint slice by slice, run a forward on this rank's share
of the batch, give the working memory back when sampling ends, report what it holds. ``mgpu.sharding.sharded`` calls
them by path (``"mgpu.sharding.model_ops:load"``).

Forward inputs arrive as *references* so the host sends each tensor once: ``{"t": name}`` is a tensor of this call,
``{"c": digest}`` a tensor cached on the ranks by content hash (text context: same for every step), ``{"v": value}``
plain data. The batch split is done here, not on the host: every rank reads the whole batch from shared memory and
computes rows ``[lo, hi)``; a rank with no rows still runs a forward on one row and drops it, because FSDP's
all-gathers need every rank. With sequence parallelism (``mgpu.families``) the rows are split over cfg groups, and
the ranks of a group compute the same rows together, one answering.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from torch.distributed.fsdp import FSDPModule

from mgpu.families import Layout, Layouts, parallelize
from mgpu.sharding.fsdp import build_meta, compute_dtype_for, materialize, reset_after_failed_forward, shard
from mgpu.weights.gguf import GGUFWeight, is_gguf, load_gguf_sharded, wrap_gguf_parameters
from mgpu.weights.quant import FP8_DTYPES
from mgpu.ranks.rank import RankContext, Tensors, import_path
from mgpu.sharding.slice_load import load_sharded

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}


def batch_rows(batch: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a batch of ``batch`` that ``rank`` computes: contiguous, the first ranks take the extra."""
    base, extra = divmod(batch, ranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def rank_rows(batch: int, layout: Layout, rank: int, split: bool = True) -> tuple[int, int, bool]:
    """Rows ``[lo, hi)`` of the batch that ``rank`` computes, and whether it answers with them.

    The cfg groups split the batch (CFG: cond and uncond on different groups); every rank of a group computes the
    group's rows (sequence parallelism splits their tokens) and the first answers. ``split=False``: every rank
    computes the whole batch, rank 0 answers (FSDP alone, no work split)."""
    if not split:
        return 0, batch, rank == 0
    group, position = layout.coords(rank)
    lo, hi = batch_rows(batch, layout.cfg, group)
    return lo, hi, lo < hi and position == 0


def _local_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank actually stores (its DTensor shards, or whole unsharded tensors)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _gathered_bytes(model: nn.Module, param_dtype: torch.dtype | None) -> int:
    """Bytes one forward all-gathers in total (every sharded parameter once, in the compute dtype; fp8 and GGUF
    blocks as stored).

    Analytic: FSDP2 gathers each unit's padded flat parameters once per forward when it reshards after forward.
    """
    total = 0
    for p in model.parameters():
        as_stored = p.dtype in FP8_DTYPES or isinstance(p.to_local() if hasattr(p, "to_local") else p, GGUFWeight)
        gathered = p.dtype if as_stored else param_dtype or p.dtype   # mgpu.weights.quant.Fp8Weight, GGUFWeight
        itemsize = torch.empty((), dtype=gathered).element_size()
        total += p.numel() * itemsize
    return total


def load(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Build on meta, shard, allocate this rank's shards, read them from the checkpoint."""
    handle = payload["handle"]
    ctx.objects.pop(handle, None)
    seconds = {}
    t0 = time.perf_counter()
    factory = partial(import_path(payload["factory"]), **payload.get("factory_kwargs", {}))
    param_dtype = compute_dtype_for(ctx.torch_device, DTYPES[payload.get("param_dtype")])
    model = build_meta(factory)
    layouts = parallelize(model, ctx.mesh, payload.get("sp_degree", 1),   # before FSDP renames the class
                          timeout=ctx.collective_timeout)
    checkpoint = payload["checkpoint"]
    gguf = is_gguf(checkpoint)
    if gguf:   # its quantized weights become GGUFWeights before FSDP shards them
        wrap_gguf_parameters(model, checkpoint, payload.get("key_prefix"))
    seconds["build"] = time.perf_counter() - t0
    shard(model, ctx.mesh, blocks=payload.get("blocks"), param_dtype=param_dtype,
          reshard_after_forward=payload.get("reshard_after_forward", True), prefetch=payload.get("prefetch", 1))
    for unit in model.modules():   # a cancelled step stops before the next block, on every rank at once
        if isinstance(unit, FSDPModule) and unit is not model:
            unit.register_forward_pre_hook(lambda module, args: ctx.raise_if_cancelled(), prepend=True)
    materialize(model, ctx.torch_device)
    seconds["shard"] = time.perf_counter() - t0 - seconds["build"]
    report = (load_gguf_sharded if gguf else load_sharded)(model, checkpoint, prefix=payload.get("key_prefix"))
    seconds["read"] = report.seconds
    model.eval()
    ctx.objects[handle] = {"model": model, "param_dtype": param_dtype, "cache": {}, "layouts": layouts,
                           "reshard_after_forward": payload.get("reshard_after_forward", True)}
    return {"report": report.to_dict(), "local_param_bytes": _local_bytes(model), "seconds": seconds,
            "gathered_bytes_per_forward": _gathered_bytes(model, param_dtype), "layout": layouts.describe()}


def _resolve(ref: dict, tensors: Tensors, cache: dict[str, torch.Tensor], device: torch.device,
             rows: tuple[int, int, int]) -> Any:
    if "t" in ref:
        return tensors[ref["t"]].to(device, non_blocking=True)
    if "c" in ref:
        return cache[ref["c"]]
    if "d" in ref:   # a dict whose entries are references (ComfyUI's transformer_options)
        return {k: _resolve(r, tensors, cache, device, rows) for k, r in ref["d"].items()}
    if "chunks" in ref:
        return _chunk_rows(_resolve(ref["chunks"], tensors, cache, device, rows), *rows)
    if "l" in ref:   # a list or tuple holding tensors (LTX-2's [video, audio] latents)
        values = [_resolve(r, tensors, cache, device, rows) for r in ref["l"]]
        return tuple(values) if ref["tuple"] else values
    return ref["v"]


def _chunk_rows(values: Any, batch: int, lo: int, hi: int) -> Any:
    """The entries of rows [lo, hi) of a list or tensor with one entry per equal chunk of the batch (``PerChunk``):
    one per whole chunk the rows cover, else (the rows cut a chunk) one per row, so entries and rows still agree."""
    per = batch // len(values)
    if lo % per == 0 and hi % per == 0:
        return values[lo // per:hi // per]
    picked = [row // per for row in range(lo, hi)]
    return values[picked] if isinstance(values, torch.Tensor) else [values[i] for i in picked]


def _rows(value: Any, batch: int, lo: int, hi: int, batched: bool) -> Any:
    if batched and isinstance(value, (list, tuple)):   # each of its tensors by its own dim 0, as the host marked it
        return type(value)(_rows(v, batch, lo, hi, True) for v in value)
    if batched and isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
        return value[lo:hi]
    return value


def output_of(out: Any) -> torch.Tensor | list[torch.Tensor]:
    """Diffusion models return a tensor, a tuple whose first item is the prediction, an object with ``sample``, or
    (ComfyUI 0.33's LTX-2, as ComfyUI's ``_apply_model`` reads it) a list of several tensors: one per stream."""
    if isinstance(out, (tuple, list)) and len(out) > 1 and all(isinstance(o, torch.Tensor) for o in out):
        return list(out)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "sample", out)


def _to_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to("cpu") if device.type != "cpu" else t


def _answer(out: torch.Tensor | list[torch.Tensor], device: torch.device) -> tuple[dict, Tensors]:
    """The reply payload entries and tensors of a forward's output: ``out``, or ``out.i`` per stream."""
    if isinstance(out, list):
        return {"streams": len(out)}, {f"out.{i}": _to_host(t, device) for i, t in enumerate(out)}
    return {}, {"out": _to_host(out, device)}


@dataclass
class StepInputs:
    """One forward's inputs on this rank: its rows ``[lo, hi)`` of the batch (``empty``: it has none and runs a
    forward on row 0 only to stay in FSDP's collectives), whether it answers with them, and the split."""

    args: list
    kwargs: dict
    batch: int
    lo: int
    hi: int
    answers: bool
    empty: bool
    layout: Layout


def step_inputs(ctx: RankContext, entry: dict, payload: dict, tensors: Tensors) -> StepInputs:
    """Resolve a forward's references (``ShardedModule.forward``'s payload) to this rank's rows, on its device,
    after updating the model's context cache: the best split for the batch among the loaded degrees, or every rank
    the whole batch when ``split`` is off."""
    cache: dict[str, torch.Tensor] = entry["cache"]  # per model: each host handle mirrors its own LRU
    for digest in payload.get("cache_drop", ()):
        cache.pop(digest, None)
    for digest, name in payload.get("cache_put", {}).items():
        cache[digest] = tensors[name].to(ctx.torch_device, copy=True)  # the shm view is overwritten next call

    batch = payload["batch"]
    layouts: Layouts = entry["layouts"]
    split = payload.get("split", True)
    layout = layouts.for_rows(batch) if split else Layout(ctx.world_size, 1)
    layouts.use(layout)
    lo, hi, answers = rank_rows(batch, layout, ctx.rank, split)
    empty = lo == hi
    if empty:
        lo, hi = 0, 1  # a forward on one row keeps this rank in the all-gathers; its output is dropped
    batched = set(payload.get("batched", ()))
    rows = (batch, lo, hi)
    args = [_rows(_resolve(r, tensors, cache, ctx.torch_device, rows), batch, lo, hi, f"arg{i}" in batched)
            for i, r in enumerate(payload["args"])]
    kwargs = {k: _rows(_resolve(r, tensors, cache, ctx.torch_device, rows), batch, lo, hi, k in batched)
              for k, r in payload["kwargs"].items()}
    return StepInputs(args, kwargs, batch, lo, hi, answers and not empty, empty, layout)


def forward(ctx: RankContext, payload: dict, tensors: Tensors) -> tuple[dict, Tensors]:
    entry = ctx.objects[payload["handle"]]
    step = step_inputs(ctx, entry, payload, tensors)
    try:
        with torch.no_grad():   # not inference_mode: FSDP2 bumps version counters (crashes at world size 1)
            out = output_of(entry["model"](*step.args, **step.kwargs))
    except Exception:
        clean_after_failed_forward(ctx, entry)
        raise
    return answer(step, out, ctx.torch_device)


def answer(step: StepInputs, out: torch.Tensor | list[torch.Tensor], device: torch.device) -> tuple[dict, Tensors]:
    """The reply of a forward: the rows this rank answers for (none when another rank of its group answers)."""
    split = [step.layout.cfg, step.layout.sp]
    if not step.answers:
        return {"rows": [0, 0], "layout": split}, {}
    extra, outputs = _answer(out, device)
    return {"rows": [step.lo, step.hi], "layout": split, **extra}, outputs


def call(ctx: RankContext, payload: dict, tensors: Tensors) -> tuple[dict, Tensors]:
    """Run ``payload["method"]`` of the model on the whole input, the root unit's parameters gathered for it (its
    FSDP hooks only run around ``forward``), then resharded as before; rank 0 answers."""
    entry = ctx.objects[payload["handle"]]
    model = entry["model"]
    whole = (0, 0, 0)
    args = [_resolve(r, tensors, {}, ctx.torch_device, whole) for r in payload["args"]]
    kwargs = {k: _resolve(r, tensors, {}, ctx.torch_device, whole) for k, r in payload["kwargs"].items()}
    model.unshard()
    try:
        with torch.no_grad():
            out = getattr(model, payload["method"])(*args, **kwargs)
    finally:
        model.reshard()
    if ctx.rank != 0:
        return {}, {}
    if isinstance(out, torch.Tensor):
        return {}, {"out": _to_host(out, ctx.torch_device)}
    return {"out": out}, {}


def clean_after_failed_forward(ctx: RankContext, entry: dict) -> None:
    """A forward that raised (a cancel between blocks, CUDA OOM, bad input) leaves blocks gathered, a prefetched
    all-gather pending and FSDP's forward marked as running, and memory cached; the pool survives an error every
    rank raised, so reset FSDP (the next forward, after a LoRA change too, gathers the current shards) and give the
    memory back before the caller retries, and drop the cached context (the host forgets its mirror of it on any
    failure)."""
    reset_after_failed_forward(entry["model"])
    entry["cache"].clear()
    if ctx.torch_device.type == "cuda":
        # The dropped all-gather buffers may still be written by NCCL on its stream, or read by a copy-out: the
        # reset's waits are GPU-side, and empty_cache() with expandable segments unmaps freed pages at once.
        torch.cuda.synchronize(ctx.torch_device)
        torch.cuda.empty_cache()


def release_cached_memory(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Sampling ended: give this rank's cached working memory back to the device. The caching allocator keeps what
    the steps used (activations, all-gather buffers) reserved, and the host process (VAE decode, the next prompt's
    text encoder) cannot use it. What stays: the shard, and the gathered blocks of a model that keeps them
    (``reshard_after_forward`` False); a model that reshards has any unit still gathered resharded first. The next
    forward reserves again. Reports the bytes released (0 on a cpu rank: it has no caching allocator)."""
    import gc

    entry = ctx.objects.get(payload["handle"])
    if entry is not None and entry["reshard_after_forward"]:
        for module in entry["model"].modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    if ctx.torch_device.type != "cuda":
        return {"device": ctx.device, "released_bytes": 0, "reserved_bytes": 0}
    gc.collect()   # working tensors only reference cycles still hold
    torch.cuda.synchronize(ctx.torch_device)
    before = torch.cuda.memory_reserved(ctx.torch_device)
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved(ctx.torch_device)
    return {"device": ctx.device, "released_bytes": before - after, "reserved_bytes": after}


def describe(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    entry = ctx.objects[payload["handle"]]
    return {"local_param_bytes": _local_bytes(entry["model"]),
            "gathered_bytes_per_forward": _gathered_bytes(entry["model"], entry["param_dtype"]),
            "cached_tensors": len(entry["cache"]), "world_size": ctx.world_size, "layout": entry["layouts"].describe()}


SIMULATED_FREE_ENV = "MGPU_SIMULATE_RANK_FREE"


def memory(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """This rank's device memory now, which a loader weighs another model against: cuda, the driver's free memory
    plus what this process's allocator caches unused; cpu, the host's available RAM (shared by every cpu rank).
    ``MGPU_SIMULATE_RANK_FREE`` (a size such as 1GiB) is reported as the free memory instead, to see the decisions
    a smaller machine makes (tests use it to force two models to take turns)."""
    import os

    import psutil

    from mgpu.planning.devices import parse_bytes

    if ctx.torch_device.type == "cuda":
        free, total = torch.cuda.mem_get_info(ctx.torch_device)
        free += torch.cuda.memory_reserved(ctx.torch_device) - torch.cuda.memory_allocated(ctx.torch_device)
    else:
        ram = psutil.virtual_memory()
        free, total = ram.available, ram.total
    simulated = os.environ.get(SIMULATED_FREE_ENV)
    if simulated:
        free = parse_bytes(simulated)
    return {"device": ctx.device, "free_bytes": int(free), "total_bytes": int(total), "simulated": bool(simulated)}
