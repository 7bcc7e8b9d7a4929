"""Rank ops of bench/gpu_check.py: what a rank holds on its device, its syncs, the time of its per-block cancel vote,
a profiler summary of one forward, FSDP's prefetch order, the stored and computed dtypes of a block, and how it maps
``cuda:i`` to NVML. The ranks import it by name (``rank_probes:memory``) with bench/ on their path.

The forward probes wrap ``mgpu.sharding.model_ops.forward`` in the rank process (``install``): the pool resolves the
op by name at every call, so ``ShardedModule`` runs unchanged and the probe reads the same step the ranks run.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import time
import traceback
import warnings
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PROBE = "gpu_check_probe"           # ctx.objects key: what the next forwards record
RESULTS = "gpu_check_probe_results"  # ctx.objects key: what the last probed forward recorded
GROUPS = "gpu_check_groups"          # ctx.objects key: communicators made to measure their memory
HOLD_WAIT_S = 10.0                   # a held block waits this long for the host's cancel
# Ops that wait for the device when their tensors are on a GPU: a value read back, a shape that depends on data, a
# tensor made from host values (``torch.tensor(list)``), a copy between the host and the device.
SYNC_PRONE = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "lift_fresh", "unique",
              "_unique2", "repeat_interleave", "masked_scatter"}
HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------------------------------------ memory

def _hex(uuid: str) -> str:
    return re.sub(r"[^0-9a-f]", "", str(uuid).lower().removeprefix("gpu-").removeprefix("mig-"))


def _nvml():
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def nvml_index(cuda_index: int) -> int | None:
    """The NVML index of torch's ``cuda:cuda_index``, by UUID (None without NVML)."""
    try:
        nv = _nvml()
        want = _hex(torch.cuda.get_device_properties(cuda_index).uuid)
        return next((i for i in range(nv.nvmlDeviceGetCount())
                     if _hex(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(i))) == want), None)
    except Exception:  # noqa: BLE001 - NVML missing or refusing: the caller reports None
        return None


def process_gpu_bytes(cuda_index: int, pid: int | None = None) -> int | None:
    """What process ``pid`` (this one) holds on ``cuda:cuda_index`` by NVML: context, cuBLAS workspaces, NCCL
    buffers and the caching allocator's segments. None where NVML cannot say (no NVML; a container whose PIDs NVML
    does not see)."""
    index = nvml_index(cuda_index)
    if index is None:
        return None
    nv = _nvml()
    pid = os.getpid() if pid is None else pid
    try:
        for p in nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByIndex(index)):
            if p.pid == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
    except Exception:  # noqa: BLE001
        return None
    return None


def device_memory(device: torch.device) -> dict:
    """This process's memory on ``device`` now: the caching allocator's counts and peaks, the device's used bytes,
    NVML's count for this process, and what lies outside torch (process bytes minus reserved)."""
    if device.type != "cuda":
        import psutil

        return {"device": str(device), "rss": psutil.Process().memory_info().rss}
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    process = process_gpu_bytes(device.index)
    return {"device": str(device), "allocated": torch.cuda.memory_allocated(device), "reserved": reserved,
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "max_reserved": torch.cuda.max_memory_reserved(device), "device_used": total - free,
            "total": total, "process_bytes": process,
            "outside_torch": None if process is None else process - reserved}


def memory(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: ``device_memory`` of this rank; ``reset_peaks`` first zeroes the allocator's peaks."""
    if payload.get("reset_peaks") and ctx.torch_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.torch_device)
    return {"rank": ctx.rank, **device_memory(ctx.torch_device)}


def communicators(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: ``count`` more communicators of the ranks' backend over all ranks (as the cfg and sequence groups
    are), each initialised by one all-reduce; the process's device bytes before and after."""
    device = ctx.torch_device
    before = device_memory(device)
    made = ctx.objects.setdefault(GROUPS, [])
    for _ in range(payload.get("count", 2)):
        group = dist.new_group(backend=ctx.backend)
        dist.all_reduce(torch.ones(1, device=device), group=group)
        made.append(group)
    after = device_memory(device)
    grown = None if before.get("process_bytes") is None else after["process_bytes"] - before["process_bytes"]
    return {"rank": ctx.rank, "backend": ctx.backend, "count": payload.get("count", 2), "before": before,
            "after": after, "process_bytes_grown": grown,
            "per_communicator": None if grown is None else grown / payload.get("count", 2)}


# ------------------------------------------------------------------------------------------------ syncs

def _location() -> str:
    """The innermost caller outside this module and torch's own files (else the innermost outside this module)."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != HERE]
    outside = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename] or frames
    f = outside[-1]
    return f"{os.sep.join(f.filename.split(os.sep)[-3:])}:{f.lineno}"


class SyncProne(TorchDispatchMode):
    """Counts the ops that would make the host wait for a GPU (``SYNC_PRONE``, and copies between the host and a
    device), by op and by the line that called them; on a CPU rank too, where nothing waits, so a CPU run names the
    same lines a GPU run would."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name in SYNC_PRONE or name in ("_to_copy", "copy_") and self._crosses(args, out):
            device = next((t.device.type for t in tree_flatten((out, args))[0] if isinstance(t, torch.Tensor)), "?")
            self.calls[(name, device, _location())] += 1
        return out

    @staticmethod
    def _crosses(args: tuple, out: Any) -> bool:
        devices = {t.device.type for t in tree_flatten((args, out))[0] if isinstance(t, torch.Tensor)}
        return len(devices - {"meta"}) > 1

    def summary(self) -> list[dict]:
        return [{"op": op, "device": device, "at": at, "count": n}
                for (op, device, at), n in self.calls.most_common()]


@contextlib.contextmanager
def cuda_sync_warnings(device: torch.device):
    """``torch.cuda.set_sync_debug_mode("warn")`` around the block; yields the list the warnings' locations go in
    (CPU: yields an empty list, nothing is counted)."""
    found: list[str] = []
    if device.type != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += [f"{os.sep.join(w.filename.split(os.sep)[-3:])}:{w.lineno}" for w in caught
              if "synchroniz" in str(w.message)]


# ------------------------------------------------------------------------------------------------ profile

def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for start, end in a:
        for s, e in b:
            total += max(0.0, min(end, e) - max(start, s))
    return total


COMM = re.compile(r"nccl|allgather|all_gather|alltoall|all_to_all|allreduce|all_reduce|gloo", re.IGNORECASE)


def profile_summary(prof) -> dict:
    """Collective vs compute time of one profiled forward: GPU kernels where there are any (NCCL's all-gather and
    all-to-all kernels, their overlap with compute kernels), else the CPU ops of the collectives (gloo); and FSDP's
    pre-forward and prefetch order, from its ``record_function`` labels."""
    events = list(prof.events())
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    out: dict[str, Any] = {"events": len(events)}
    if kernels:
        comm = _union([(e.time_range.start, e.time_range.end) for e in kernels if COMM.search(e.name)])
        compute = _union([(e.time_range.start, e.time_range.end) for e in kernels
                          if not COMM.search(e.name) and not re.search(r"memcpy|memset", e.name, re.IGNORECASE)])
        comm_us = sum(b - a for a, b in comm)
        out.update(kind="cuda kernels", collective_us=comm_us, compute_us=sum(b - a for a, b in compute),
                   overlap_us=_overlap(comm, compute),
                   overlap_share=_overlap(comm, compute) / comm_us if comm_us else None,
                   collective_kernels=sorted({e.name[:80] for e in kernels if COMM.search(e.name)})[:10])
    else:
        ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        comm = [e for e in ops if COMM.search(e.name) and not e.name.startswith("FSDP::")]
        out.update(kind="cpu ops", collective_us=sum(e.cpu_time_total for e in comm if e.cpu_parent is None
                                                     or not COMM.search(e.cpu_parent.name)),
                   collective_ops=sorted({e.name for e in comm})[:10], overlap_us=None, overlap_share=None)
    out.update(prefetch_order(events))
    return out


def prefetch_order(events: list) -> dict:
    """Which unit each FSDP unit prefetched in its pre-forward, in execution order."""
    labelled = sorted((e.time_range.start, e.name) for e in events if e.name.startswith("FSDP::"))
    ran, prefetched = [], {}
    for _, name in labelled:
        pre = re.fullmatch(r"FSDP::pre_forward \((.*)\)", name)
        if pre:
            ran.append(pre.group(1))
        fetch = re.fullmatch(r"FSDP::forward_prefetch for (.*)", name)
        if fetch and ran:
            prefetched.setdefault(ran[-1], fetch.group(1))
    follows = all(prefetched.get(a) == b for a, b in zip(ran, ran[1:]))
    return {"execution_order": ran, "prefetched": prefetched,
            "prefetch_follows_execution": bool(ran) and len(ran) > 1 and follows}


# ------------------------------------------------------------------------------------------------ forward probe

def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]


def _timed_votes(ctx, times: list[float]):
    vote = type(ctx).raise_if_cancelled

    def timed() -> None:
        t0 = time.perf_counter()
        try:
            vote(ctx)
        finally:
            times.append(time.perf_counter() - t0)
    return timed


def _block_timer(device: torch.device, record: list[dict]):
    """Forward pre/post hooks timing each block: CUDA events on a GPU (the block's kernels), wall time on a CPU."""
    def pre(module, args) -> None:
        start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if start is not None:
            start.record()
        module._gpu_check_t0 = (time.perf_counter(), start)

    def post(module, args, out) -> None:
        t0, start = module._gpu_check_t0
        end = torch.cuda.Event(enable_timing=True) if start is not None else None
        if end is not None:
            end.record()
        record.append({"cpu_s": time.perf_counter() - t0, "events": (start, end)})
    return pre, post


def _seen_weights(model: nn.Module, record: dict):
    """Pre-hooks on the first block's layers (after the layers' own) noting the weight each computes with."""
    handles = []
    first = next((m for _, m in _blocks(model)), None)
    for name, layer in (first.named_modules() if first is not None else ()):
        weight = layer._parameters.get("weight") if hasattr(layer, "_parameters") else None
        if weight is None or weight.ndim != 2:
            continue

        def seen(module, args, name=name) -> None:
            w = module.weight
            record.setdefault(name, f"{type(w).__name__}[{str(w.dtype).removeprefix('torch.')}]")
        handles.append(layer.register_forward_pre_hook(seen))
    return handles


def install(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: what the next forwards record (``syncs``, ``profile``, ``block_times``, ``seen_weights``, and
    ``hold_at``: a block whose first pre-hook waits for the host's cancel of that call, so a Cancel lands mid-forward
    at a known block). Wraps model_ops.forward once."""
    from mgpu.sharding import model_ops

    if not getattr(model_ops.forward, "gpu_check_probe", False):
        model_ops.forward = _probed(model_ops.forward)
    ctx.objects[PROBE] = dict(payload)
    hold = payload.get("hold_at")
    if hold:
        model = ctx.objects[payload["handle"]]["model"]
        model.get_submodule(hold).register_forward_pre_hook(_hold(ctx, hold), prepend=True)
    return {"rank": ctx.rank}


def _hold(ctx, fqn: str):
    def wait_for_cancel(module, args) -> None:
        if ctx.objects.get(PROBE, {}).get("hold_at") != fqn:
            return
        ctx.objects[PROBE]["hold_at"] = None   # once
        stop = time.monotonic() + HOLD_WAIT_S
        while int.from_bytes(ctx.cancel_flag[:8], "little") != ctx.call and time.monotonic() < stop:
            time.sleep(0.001)
    return wait_for_cancel


def _probed(forward):
    def probed(ctx, payload: dict, tensors: dict):
        probe = ctx.objects.get(PROBE, {})
        model = ctx.objects[payload["handle"]]["model"]
        device = ctx.torch_device
        results: dict[str, Any] = {}
        votes: list[float] = []
        blocks: list[dict] = []
        seen: dict[str, str] = {}
        handles = _seen_weights(model, seen) if probe.get("seen_weights") else []
        if probe.get("block_times"):
            ctx.raise_if_cancelled = _timed_votes(ctx, votes)
            pre, post = _block_timer(device, blocks)
            for _, unit in _blocks(model):
                handles += [unit.register_forward_pre_hook(pre), unit.register_forward_hook(post)]
        counter = SyncProne()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities) if probe.get("profile") else contextlib.nullcontext()
        began = time.perf_counter()
        try:
            with contextlib.ExitStack() as stack:
                prof = stack.enter_context(profiler)
                cuda_syncs = stack.enter_context(cuda_sync_warnings(device)) if probe.get("syncs") else None
                if probe.get("syncs"):
                    stack.enter_context(counter)
                reply = forward(ctx, payload, tensors)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            for h in handles:
                h.remove()
            ctx.__dict__.pop("raise_if_cancelled", None)
        results["seconds"] = time.perf_counter() - began
        if probe.get("syncs"):
            results["cuda_sync_warnings"] = None if device.type != "cuda" else len(cuda_syncs)
            results["cuda_sync_at"] = dict(Counter(cuda_syncs)) if cuda_syncs is not None else None
            results["sync_prone_ops"] = counter.summary()
        if probe.get("profile"):
            try:
                results["profile"] = profile_summary(prof)
            except Exception as exc:  # noqa: BLE001 - a profiler that reads differently: say so, keep the step
                results["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
        if probe.get("block_times"):
            results["cancel_vote"] = _vote_summary(votes, blocks)
        if seen:
            results["seen_weights"] = seen
        ctx.objects[RESULTS] = results
        return reply
    probed.gpu_check_probe = True
    return probed


def _vote_summary(votes: list[float], blocks: list[dict]) -> dict:
    gpu = [s.elapsed_time(e) / 1e3 for s, e in (b["events"] for b in blocks) if s is not None]
    cpu = [b["cpu_s"] for b in blocks]
    block_s = statistics.median(gpu or cpu) if (gpu or cpu) else None
    vote_s = statistics.median(votes) if votes else None
    return {"votes": len(votes), "vote_median_s": vote_s, "vote_max_s": max(votes) if votes else None,
            "block_median_s": block_s, "block_timing": "cuda events" if gpu else "wall clock",
            "block_cpu_median_s": statistics.median(cpu) if cpu else None,
            "vote_over_block": vote_s / block_s if vote_s and block_s else None}


def results(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: what the last probed forward recorded."""
    return {"rank": ctx.rank, **ctx.objects.get(RESULTS, {})}


def time_votes(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: ``count`` cancel votes back to back (every rank calls it): the vote's own cost."""
    count = payload.get("count", 200)
    t0 = time.perf_counter()
    for _ in range(count):
        ctx.raise_if_cancelled()
    return {"rank": ctx.rank, "count": count, "seconds_per_vote": (time.perf_counter() - t0) / count}


# ------------------------------------------------------------------------------------------------ weights, devices

def stored(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: how the first block's 2-D weights are stored on this rank (the local shard's class and dtype)."""
    model = ctx.objects[payload["handle"]]["model"]
    first = next(m for _, m in _blocks(model))
    out = {}
    for name, p in first.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if p.ndim == 2:
            qtype = getattr(local, "qtype", None)
            out[name] = f"{type(local).__name__}[{qtype or str(local.dtype).removeprefix('torch.')}]"
    return {"rank": ctx.rank, "stored": out}


def device_mapping(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: this rank's view of the GPUs: torch's ``cuda:i`` (name, UUID, PCI bus), NVML's (index, UUID, PCI
    bus), the NVML index each ``cuda:i`` has by UUID, and mgpu's inventory (``live_gpus``) against torch's."""
    from mgpu.planning.devices import live_gpus

    env = {k: os.environ.get(k) for k in ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES")}
    out: dict[str, Any] = {"rank": ctx.rank, "device": ctx.device, "env": env, "torch": [], "nvml": []}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["torch"].append({"cuda": i, "name": p.name, "uuid": _hex(p.uuid), "total": p.total_memory,
                             "pci_bus": getattr(p, "pci_bus_id", None), "nvml_index": nvml_index(i)})
    try:
        nv = _nvml()
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            pci = nv.nvmlDeviceGetPciInfo(h)
            out["nvml"].append({"index": i, "name": nv.nvmlDeviceGetName(h), "uuid": _hex(nv.nvmlDeviceGetUUID(h)),
                                "pci_bus": int(pci.bus)})
    except Exception as exc:  # noqa: BLE001 - no NVML: the torch side still maps
        out["nvml_error"] = f"{type(exc).__name__}: {exc}"
    seen = live_gpus()
    out["mgpu"] = [{"id": d.id, "name": d.name, "total": d.total_bytes} for d in seen]
    by_id = {d["id"]: d for d in out["mgpu"]}
    out["mgpu_agrees_with_torch"] = len(seen) == len(out["torch"]) and all(
        by_id.get(f"cuda:{t['cuda']}", {}).get("name") == t["name"]
        and abs(by_id[f"cuda:{t['cuda']}"]["total"] - t["total"]) <= 0.02 * t["total"] for t in out["torch"])
    if ctx.torch_device.type == "cuda":
        out["own"] = out["torch"][ctx.torch_device.index]
    return out
