"""GPU check: one unattended run on a lent GPU that measures what the plan assumes and prints one JSON report
(issues 7 and 15).

    python bench/gpu_check.py [--deadline 420] [--json report.json] [--tmpdir DIR]
    python bench/gpu_check.py --dry-run        # CPU, tiny sizes, gloo cpu ranks: the same code paths

Needs torch, safetensors, nvidia-ml-py, psutil, xxhash, accelerate; no ComfyUI, no diffusers, nothing downloaded
(comfy-kitchen and gguf-py are used where they import, else their checks are skipped and say why). On a lent machine
where nothing installs, carry gguf-py as its pure-Python wheel (its other needs, numpy, pyyaml, requests and tqdm,
come with transformers): here ``pip download --no-deps -d .whl gguf``, there (``.whl`` carried)
``PYTHONPATH=$(ls .whl/*.whl | tr '\n' :) python bench/gpu_check.py --json $OUT/gpu_check.json``. The report:

  dry_run, device, deadline_s, pid    how it ran
  sections                            one entry per section below, each with ``ok`` and ``seconds`` (and ``error``
                                      with its traceback, or ``skipped`` with why)
  summary                             section -> "ok" | "skipped: ..." | "error: ..."
  watchdog                            the parent's record: killed or not, and the section running then

Sections, in order (the first five are issue 15 §5; each is skipped when less than its ``min_seconds`` is left):

  environment     torch, CUDA, NCCL, the GPUs
  inventory       ``mgpu.planning.devices.inventory()`` (NVML) against torch.cuda
  memory          §5.1: a one-rank pool (NCCL on a GPU) with a real-dimension Wan 14B-block stand-in: each rank's
                  allocated / reserved peaks, NVML's bytes for the rank process and what lies outside torch (context,
                  cuBLAS, NCCL: process bytes minus reserved) at init, per extra communicator, after the load, at the
                  first step, after ``release_cached_memory`` and during a host-side VAE decode (a conv stand-in),
                  what the host process holds on the GPU, each against the plan's figure; the step's time against
                  the plan's time model (``mgpu.planning.parallel``)
  formats         §5.2: the same one-rank pool loads a Wan 1.3B-block stand-in stored as bf16, fp8 (upcast after the
                  gather), fp8 computed by ``torch._scaled_mm``, comfy-kitchen's QuantizedTensor and GGUF Q4_K_M (Q4_K
                  and Q6_K blocks): the stored and the computed dtype each rank reports, the syncs of one step, and
                  the output against the same checkpoint run on one device
  two_ranks       §5.3: two gloo ranks on the same device (NCCL refuses two ranks on one GPU) with CUDA tensors, so
                  FSDP2's CUDA streams run; blocks executed out of definition order: the prefetch order FSDP's
                  profiler labels show against the execution order; Cancel mid-forward (the host's cancel reaches
                  a block held for it), a LoRA change, and the next step against a fresh load with the same LoRA
  step            §5.4: on those ranks, per split (cfg 2x1, sp 1x2): syncs per step (``set_sync_debug_mode`` on a
                  GPU; ops that would sync, by line, everywhere), step time against the time model, a profiler
                  summary (collective time, its overlap with compute kernels), memory at the split's first step,
                  and the per-block cancel vote's time against the block's compute
  device_mapping  §5.5: inside a rank, torch's cuda:i (UUID, PCI bus) against NVML's index and mgpu's inventory,
                  with CUDA_DEVICE_ORDER unset and set to PCI_BUS_ID
  calibration     peak memory of one real-dimension Wan block forward at several token counts against
                  ``mgpu.planning.estimates.dit_activation_bytes`` (ComfyUI's WanModel when COMFYUI_PATH is set)
  fp8_matmul      float8_e4m3fn weights with bf16 compute (upcast), and ``torch._scaled_mm`` (capability >= 8.9)
  load_throughput a few-GB safetensors file loaded by a rank, cold (page cache dropped) and warm

The checks run in a child process; this process is their watchdog: at the deadline it kills the child's whole process
group (ranks included) and prints what the child had reported, naming the section that was running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mgpu.ranks.pool import RankPool

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE), str(HERE.parent)) if p not in sys.path]

import torch  # noqa: E402

from memprobe import fit_line, forward_peak  # noqa: E402

GRACE_S = 20          # the watchdog's margin past the deadline: sections stop themselves first
KILL_WAIT_S = 5       # SIGTERM, then this long, then SIGKILL
FACTORY = "dit_standin:wan_standin"
PROBES = "rank_probes:"
FORMATS = ("bf16", "fp8", "fp8_scaled_mm", "comfy_fp8", "gguf_q4_k_m")
# A Q4_K_M file's types: most block weights Q4_K, the attention values and the FFN's down projection Q6_K.
Q6_K_LAYERS = ("self_attn.v", "cross_attn.v", "ffn.2")
BLOCK_ORDER = [0, 2, 1]   # the two-rank model runs its blocks out of definition order: prefetch must follow it
HELD_BLOCK = "blocks.1"   # the block that block 2 prefetches, where the Cancel lands
CANCEL_AFTER_S = 0.3


@dataclass(frozen=True)
class Dims:
    dim: int
    ffn: int
    heads: int
    layers: int
    text_dim: int

    def kwargs(self, **extra: Any) -> dict:
        return dict(dim=self.dim, ffn=self.ffn, heads=self.heads, layers=self.layers, text_dim=self.text_dim, **extra)


@dataclass(frozen=True)
class Sizes:
    """What the checks run at: real dimensions on a GPU, tiny ones for --dry-run."""
    device: str
    large: Dims                                      # memory, calibration, load throughput: Wan 14B blocks
    small: Dims                                      # formats, two ranks: Wan 1.3B blocks (rows of 256 for GGUF)
    text_len: int
    step_grid: tuple[int, int, int]                  # latent frames, patch rows, patch columns of a large step
    small_grid: tuple[int, int, int]
    vae_latent: tuple[int, int, int]                 # latent frames, height, width of the VAE decode
    vae_channels: int
    calibration_grids: tuple[tuple[int, int, int], ...]
    fp8_shape: tuple[int, int, int]                  # tokens, in features, out features
    load_layers: int                                 # blocks of the load-throughput file
    timed_steps: int
    min_seconds: dict                                # time a section needs left to start


GPU = Sizes("cuda:0", large=Dims(5120, 13824, 40, 2, 4096), small=Dims(1536, 8960, 12, 3, 4096), text_len=512,
            step_grid=(8, 30, 52), small_grid=(4, 16, 32), vae_latent=(4, 60, 104), vae_channels=96,
            calibration_grids=((1, 32, 128), (4, 32, 128), (8, 32, 128), (21, 45, 80)),
            fp8_shape=(16384, 5120, 13824), load_layers=5, timed_steps=3,
            min_seconds={"inventory": 5, "memory": 60, "formats": 60, "two_ranks": 45, "step": 45,
                         "device_mapping": 20, "calibration": 45, "fp8_matmul": 15, "load_throughput": 60})
DRY = Sizes("cpu", large=Dims(128, 256, 2, 2, 64), small=Dims(256, 512, 2, 3, 256), text_len=16,
            step_grid=(2, 4, 8), small_grid=(2, 4, 8), vae_latent=(1, 4, 4), vae_channels=8,
            calibration_grids=((1, 4, 8), (2, 4, 8), (4, 4, 8)), fp8_shape=(64, 128, 256), load_layers=3,
            timed_steps=2, min_seconds={})


class Run:
    """Deadline, sizes, scratch folder, the report and the pools, shared by the sections."""

    def __init__(self, sizes: Sizes, deadline: float, tmp: Path, report: dict, write_report: Callable[[], None]):
        self.sizes, self.deadline, self.tmp = sizes, deadline, tmp
        self.report, self.write_report = report, write_report
        self.pools: dict[str, RankPool] = {}
        self.shared: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def cuda(self) -> bool:
        return torch.device(self.sizes.device).type == "cuda"

    def pool(self, name: str) -> RankPool:
        """A started pool, kept for the later sections: ``one`` (one rank, NCCL on a GPU), ``two`` (two gloo ranks
        on the same device), ``pci`` (one gloo rank per GPU with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
        from mgpu.ranks.pool import PoolConfig, RankPool

        if name not in self.pools:
            left = max(10.0, self.left())
            device = self.sizes.device
            configs = {"one": dict(devices=[device]), "two": dict(devices=[device, device], backend="gloo"),
                       "pci": dict(devices=[f"cuda:{i}" for i in range(torch.cuda.device_count())] if self.cuda
                                   else ["cpu"], backend="gloo", env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})}
            pool = RankPool(PoolConfig(**configs[name], extra_sys_path=[str(HERE)], call_timeout_s=left,
                                       start_timeout_s=min(120.0, left)))
            pool.start()
            self.pools[name] = pool
        return self.pools[name]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: str, repeats: int = 5) -> float:
    """Median seconds of ``repeats`` calls after one warm-up."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def payloads(replies: list) -> list[dict]:
    return [r.payload for r in replies]


def compare(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-2) -> dict:
    """Largest difference and whether it is within ``rtol`` of the output's scale."""
    diff = (got.float().cpu() - want.float().cpu()).abs().max().item()
    scale = want.float().abs().max().item()
    matches = math.isfinite(diff) and diff <= rtol * max(scale, 1e-6)
    return {"max_abs_diff": diff, "output_scale": scale, "matches": matches}


# --------------------------------------------------------------------------------------------------- models

def step_inputs(s: Sizes, grid: tuple[int, int, int], batch: int = 2,
                text_dim: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's inputs (CFG: cond and uncond as one batch of 2), bf16 as ComfyUI casts them."""
    g = torch.Generator().manual_seed(0)
    t, r, c = grid
    x = torch.randn(batch, 16, t, 2 * r, 2 * c, generator=g).to(torch.bfloat16)
    context = torch.randn(batch, s.text_len, text_dim, generator=g).to(torch.bfloat16)
    return x, torch.full((batch,), 500.0), context


def write_checkpoint(run: Run, name: str, dims: Dims, linear: str = "bf16",
                     **extra: Any) -> tuple[Path, dict[str, torch.Tensor], float]:
    """A random-weight stand-in saved as safetensors (fsynced); (path, its state, seconds)."""
    from safetensors.torch import save_file

    from dit_standin import state_of, wan_standin

    t0 = time.perf_counter()
    state = state_of(lambda: wan_standin(**dims.kwargs(linear=linear, **extra)), run.sizes.device)
    path = run.tmp / f"{name}.safetensors"
    save_file(state, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return path, state, time.perf_counter() - t0


def reference(run: Run, dims: Dims, state: dict[str, torch.Tensor], linear: str = "bf16",
              param_dtype: str | None = "bf16") -> torch.nn.Module:
    """The stand-in on one device (this process) with ``state`` loaded (cast to the model's dtypes), computing as the
    sharded one does: with a ``param_dtype`` FSDP gathers the fp32 patch embedding in it."""
    from dit_standin import wan_standin

    with torch.device(run.sizes.device):
        model = wan_standin(**dims.kwargs(linear=linear)).eval()
    model.load_state_dict(state)
    if param_dtype == "bf16":
        model.patch_embedding.to(torch.bfloat16)
    return model


def run_reference(model: torch.nn.Module, device: str, x, t, context) -> torch.Tensor:
    with torch.no_grad():
        out = model(x.to(device), t.to(device), context.to(device)).float().cpu()
    synchronize(device)
    return out


def spec(path: Path, dims: Dims, param_dtype: str | None = "bf16", **kwargs: Any):
    from mgpu.sharding.sharded import ModelSpec

    extra = kwargs.pop("factory_kwargs", {})
    return ModelSpec(factory=FACTORY, checkpoint=str(path), factory_kwargs=dims.kwargs(**extra),
                     param_dtype=param_dtype, cached_inputs=("context",), **kwargs)


def probe(pool: RankPool, handle: str, **settings: Any) -> None:
    pool.call(PROBES + "install", {"handle": handle, **settings})


def probe_results(pool: RankPool) -> list[dict]:
    return payloads(pool.call(PROBES + "results"))


def standin_size(path: Path, dims: Dims):
    """The plan's ComponentSize of a stand-in checkpoint: from its header where mgpu's sizing recognises it as a Wan
    DiT, else from its bytes with the stand-in's dimensions."""
    from mgpu.planning.sizing import size_component, size_from_bytes

    with contextlib.suppress(Exception):
        size = size_component(path)
        if size.dims.get("hidden") == dims.dim:
            return size
    nbytes = os.path.getsize(path)
    return size_from_bytes("dit", "wan-standin", nbytes, layers=dims.layers,
                           dims=dict(hidden=dims.dim, ffn=dims.ffn, heads=dims.heads, head_dim=dims.dim // dims.heads,
                                     patch_t=1, patch_h=2, patch_w=2))


def time_model(run: Run, dims: Dims, size, ranks: int, cfg: int, sp: int, rows: int, tokens: int,
               measured_s: float) -> dict:
    """The plan's step-time estimate (``mgpu.planning.parallel.estimate``) for this split on ``ranks`` copies of this
    device (linked by NVLink: they share one), against the measured step; and the FLOP rate the step reached."""
    from mgpu.planning.devices import Device, live_gpus
    from mgpu.planning.parallel import Degrees, estimate, gpu_flops, step_flops

    live = next(iter(live_gpus()), None) if run.cuda else None
    base = live or Device(id="cpu", kind="cpu", index=0, name="cpu", total_bytes=0, free_bytes=0)
    count = max(ranks, 2)   # the estimate prices the group's slowest link: a one-rank group gets a partner
    group = [replace(base, id=f"cuda:{i}", index=i, links=tuple((j, "nvlink") for j in range(count) if j != i))
             for i in range(count)]
    params = size.params
    degrees = estimate(Degrees(ranks=ranks, cfg=cfg, sp=sp), group, params=params, weight_bytes=size.total_bytes,
                       tokens=tokens, rows=rows, hidden=dims.dim, layers=dims.layers)
    flops = step_flops(params, tokens, rows, dims.dim, dims.layers)
    return {"split": f"{cfg}x{sp}", "measured_s": measured_s, "estimated_s": degrees.step_seconds,
            "estimated_single_s": degrees.single_seconds, "plan_flops_per_s": gpu_flops(base),
            "step_flops": flops, "measured_flops_per_s": flops / measured_s if measured_s else None,
            "measured_over_estimated": measured_s / degrees.step_seconds if degrees.step_seconds else None}


# --------------------------------------------------------------------------------------------------- sections

def environment(run: Run) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cpus": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
            "comfyui_path": os.environ.get("COMFYUI_PATH"), "device": run.sizes.device,
            "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER")}
    for module in ("gguf", "comfy_kitchen", "pynvml", "diffusers"):
        try:
            __import__(module)
            info[f"has_{module}"] = True
        except Exception:  # noqa: BLE001 - any failure means absent
            info[f"has_{module}"] = False
    if torch.cuda.is_available():
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpus"] = [{"name": p.name, "capability": [p.major, p.minor], "total_bytes": p.total_memory}
                        for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]
    return info


def inventory(run: Run) -> dict:
    """NVML's view (through mgpu) against torch's, GPU by GPU in torch's order."""
    from mgpu.planning.devices import gpus, inventory as live_inventory

    seen = gpus(live_inventory(include_cpu=False))
    torch_gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        torch_gpus.append({"index": i, "name": torch.cuda.get_device_name(i), "total_bytes": total,
                           "free_bytes": free})
    mismatches = [] if len(seen) == len(torch_gpus) else [f"mgpu lists {len(seen)} GPUs, torch {len(torch_gpus)}"]
    for d, t in zip(seen, torch_gpus):
        if d.name != t["name"]:
            mismatches.append(f"cuda:{t['index']}: mgpu says {d.name!r}, torch {t['name']!r}")
        if abs(d.total_bytes - t["total_bytes"]) > 0.02 * t["total_bytes"]:
            mismatches.append(f"cuda:{t['index']}: total {d.total_bytes} (mgpu) vs {t['total_bytes']} (torch)")
        if abs(d.free_bytes - t["free_bytes"]) > 0.05 * t["total_bytes"] + (1 << 30):
            mismatches.append(f"cuda:{t['index']}: free {d.free_bytes} (mgpu) vs {t['free_bytes']} (torch)")
    return {"mgpu": [d.to_dict() for d in seen], "torch": torch_gpus, "agree": not mismatches,
            "mismatches": mismatches}


def host_memory(run: Run, sync: bool = True) -> dict:
    """What this (host) process holds on the device; ``sync`` False asks NVML only, so no CUDA context is made."""
    from rank_probes import device_memory, process_gpu_bytes

    if not run.cuda:
        return device_memory(torch.device("cpu"))
    if not sync:
        return {"process_bytes": process_gpu_bytes(torch.device(run.sizes.device).index)}
    return device_memory(torch.device(run.sizes.device))


def vae_decode(run: Run) -> dict:
    """A conv VAE decoder stand-in decodes on this process's device: its peaks and NVML's bytes for this process."""
    from dit_standin import VaeDecoderStandin

    dev = run.sizes.device
    t, h, w = run.sizes.vae_latent
    with torch.device(dev):
        vae = VaeDecoderStandin(run.sizes.vae_channels).eval()
    z = torch.randn(1, 16, t, h, w, device=dev, dtype=torch.bfloat16)
    if run.cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    peak = forward_peak(lambda: vae(z), dev)
    seconds = time.perf_counter() - t0
    out = {"latent": list(z.shape), "seconds": seconds, "peak_above_weights_bytes": peak.bytes,
           "reserved_peak_bytes": peak.reserved, "host": host_memory(run)}
    del vae, z
    if run.cuda:
        torch.cuda.empty_cache()
    return out


def memory(run: Run) -> dict:
    """§5.1: each phase's memory on the rank, and what the plan counts for it."""
    from mgpu.planning.estimates import (ACTIVATION_SAFETY, GPU_PROCESS_GUESSES, dit_activation_bytes,
                                         fsdp_buffer_bytes, nccl_communicator_bytes, rank_process_bytes)
    from mgpu.sharding.sharded import ShardedModule

    s = run.sizes
    host_start = host_memory(run, sync=False)
    pool = run.pool("one")
    phases: dict[str, Any] = {"init": payloads(pool.call(PROBES + "memory"))}
    comms = payloads(pool.call(PROBES + "communicators", {"count": 2}))
    path, state, write_s = write_checkpoint(run, "memory", s.large)
    tensor_bytes = sum(v.nbytes for v in state.values())
    del state
    x, timestep, context = step_inputs(s, s.step_grid, text_dim=s.large.text_dim)
    model = ShardedModule(pool, spec(path, s.large))
    t0 = time.perf_counter()
    load = model.load(timeout=max(10.0, run.left()))[0]
    load_s = time.perf_counter() - t0
    phases["after_load"] = payloads(pool.call(PROBES + "memory", {"reset_peaks": True}))
    t0 = time.perf_counter()
    first = model(x, timestep, context=context)
    first_s = time.perf_counter() - t0
    phases["first_step"] = payloads(pool.call(PROBES + "memory"))
    step_s = timed(lambda: model(x, timestep, context=context), "cpu", repeats=s.timed_steps)
    released = model.release_cached_memory()
    phases["after_release"] = payloads(pool.call(PROBES + "memory"))
    decode = vae_decode(run)
    phases["vae_decode"] = {"ranks": payloads(pool.call(PROBES + "memory")), "host_decode": decode}
    again = model(x, timestep, context=context)
    model.free()

    size = standin_size(path, s.large)
    tokens = math.prod(s.step_grid)
    rank0 = {k: v[0] if isinstance(v, list) else v for k, v in phases.items()}
    planned = {"guesses": dict(GPU_PROCESS_GUESSES), "rank_process_bytes": rank_process_bytes(1, s.large.heads, 1),
               "nccl_communicator_bytes_2_ranks": nccl_communicator_bytes(2),
               "shard_bytes": load["local_param_bytes"],
               "fsdp_buffer_bytes": fsdp_buffer_bytes(size, gather_itemsize=2),
               "activation_bytes": math.ceil(ACTIVATION_SAFETY * dit_activation_bytes(size, tokens, batch=2))}
    outside = {phase: rank0[phase].get("outside_torch") for phase in ("init", "first_step", "after_release")}
    after_comms = comms[0]["after"].get("outside_torch")
    measured = {"outside_torch_bytes": outside,
                # GPU_PROCESS_GUESSES' entries as measured: the context before any kernel ran, what the first step
                # added beyond the extra communicators (cuBLAS & co.), and one communicator (of one rank here)
                "cuda_context": outside["init"], "libraries": _minus(outside["first_step"], after_comms),
                "nccl_communicator_one_rank": comms[0].get("per_communicator"),
                "allocated_after_load_bytes": rank0["after_load"].get("allocated"),
                "step_peak_above_load_bytes": _minus(rank0["first_step"].get("max_allocated"),
                                                     rank0["after_load"].get("allocated")),
                "step_reserved_peak_bytes": rank0["first_step"].get("max_reserved"),
                "reserved_after_release_bytes": rank0["after_release"].get("reserved"),
                "host_process_bytes_at_start": host_start.get("process_bytes"),
                "host_process_bytes_during_decode": decode["host"].get("process_bytes")}
    within = {"outside_torch": _within(outside["first_step"], planned["rank_process_bytes"]),
              "step_working": _within(measured["step_peak_above_load_bytes"],
                                      planned["fsdp_buffer_bytes"] + planned["activation_bytes"])}
    return {"checkpoint_bytes": tensor_bytes, "write_seconds": write_s, "load_seconds": load_s,
            "load_report": load["report"], "gathered_bytes_per_forward": load["gathered_bytes_per_forward"],
            "first_step_seconds": first_s, "step_seconds": step_s, "phases": phases, "communicators": comms,
            "released": released, "step_after_release": compare(again, first), "plan": planned,
            "measured": measured, "within_plan": within,
            "time_model": time_model(run, s.large, size, 1, 1, 1, rows=2, tokens=tokens, measured_s=step_s)}


def _minus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def _within(measured: int | None, planned: int) -> bool | None:
    return None if measured is None else measured <= planned


def _format_checkpoint(run: Run, fmt: str) -> tuple[Path, dict, str, str | None]:
    """(file, the state a one-device reference loads, the reference's linear format, the sharded param_dtype)."""
    from safetensors.torch import save_file

    from dit_standin import state_of, wan_standin, write_gguf_standin

    dims = run.sizes.small
    if fmt == "gguf_q4_k_m":
        state = state_of(lambda: wan_standin(**dims.kwargs()), run.sizes.device)
        types = {k: "Q6_K" if k.rsplit(".", 1)[0].split(".", 2)[-1] in Q6_K_LAYERS else "Q4_K"
                 for k, v in state.items() if k.startswith("blocks.") and v.ndim == 2}
        path = run.tmp / f"{fmt}.gguf"
        return path, write_gguf_standin(str(path), state, types), "bf16", "bf16"
    linear = fmt
    state = state_of(lambda: wan_standin(**dims.kwargs(linear=linear)), run.sizes.device)
    path = run.tmp / f"{fmt}.safetensors"
    save_file(state, str(path))
    if fmt == "fp8":   # the one-device model computes with the same values in bf16
        return path, {k: v.to(torch.bfloat16) if v.dtype == torch.float8_e4m3fn else v for k, v in state.items()}, \
            "bf16", "bf16"
    return path, state, linear, "bf16" if fmt == "bf16" else None


def _format_skip(run: Run, fmt: str) -> str | None:
    from dit_standin import kitchen_available

    if fmt == "fp8_scaled_mm" and run.cuda and torch.cuda.get_device_capability(run.sizes.device) < (8, 9):
        return "torch._scaled_mm needs compute capability 8.9"
    if fmt == "comfy_fp8":
        return kitchen_available()
    if fmt == "gguf_q4_k_m":
        try:
            import gguf  # noqa: F401
        except ImportError:
            return ("gguf-py is not installed: mgpu reads GGUF headers with it (mgpu.planning.sizing.gguf_types; "
                    "pip install -r requirements.txt)")
    return None


def formats(run: Run) -> dict:
    """§5.2: every stored format through the real pre/post all-gather extensions, against one device."""
    s = run.sizes
    pool = run.pool("one")
    x, timestep, context = step_inputs(s, s.small_grid, text_dim=s.small.text_dim)
    out = {}
    for fmt in FORMATS:
        why = _format_skip(run, fmt)
        if why or run.left() < 15:
            out[fmt] = {"skipped": why or f"deadline: {run.left():.0f} s left"}
            continue
        try:
            out[fmt] = _one_format(run, pool, fmt, x, timestep, context)
        except Exception as exc:  # noqa: BLE001 - recorded per format, the others still run
            out[fmt] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        log(f"formats {fmt}: {out[fmt].get('matches', out[fmt].get('error'))}")
    ran = [f for f, r in out.items() if "matches" in r]
    return {"formats": out, "gguf_on_device": gguf_on_device(run), "ran": ran,
            "all_match": bool(ran) and all(out[f]["matches"] for f in ran),
            "errors": [f for f, r in out.items() if "error" in r]}


def _one_format(run: Run, pool: RankPool, fmt: str, x, timestep, context) -> dict:
    from mgpu.sharding.sharded import ShardedModule

    s = run.sizes
    path, ref_state, ref_linear, param_dtype = _format_checkpoint(run, fmt)
    linear = "bf16" if fmt == "gguf_q4_k_m" else fmt
    model = ShardedModule(pool, spec(path, s.small, param_dtype, factory_kwargs={"linear": linear}))
    try:
        load = model.load(timeout=max(10.0, run.left()))[0]
        stored = payloads(pool.call(PROBES + "stored", {"handle": model.handle}))[0]["stored"]
        model(x, timestep, context=context)   # the first forward records the execution order
        probe(pool, model.handle, syncs=True, seen_weights=True)
        sharded = model(x, timestep, context=context)
        probed = probe_results(pool)[0]
        probe(pool, model.handle)
    finally:
        model.free()
    ref = reference(run, s.small, ref_state, ref_linear, param_dtype)
    direct = run_reference(ref, s.device, x, timestep, context)
    del ref
    return {"checkpoint_bytes": os.path.getsize(path), "param_dtype": param_dtype, "stored": stored,
            "computed_with": probed.get("seen_weights"), "local_param_bytes": load["local_param_bytes"],
            "gathered_bytes_per_forward": load["gathered_bytes_per_forward"],
            "cuda_sync_warnings": probed.get("cuda_sync_warnings"), "cuda_sync_at": probed.get("cuda_sync_at"),
            "sync_prone_ops": probed.get("sync_prone_ops"), **compare(sharded, direct, rtol=2e-2)}


def gguf_on_device(run: Run) -> dict:
    """GGUF's all-gather extension after the gather, on this device, without a file (so without gguf-py): Q4_K and
    Q6_K blocks of a Wan 1.3B FFN weight through ``GGUFWeight.fsdp_post_all_gather``, against the CPU's
    dequantization (bit for bit), with the syncs it makes and its time."""
    from dit_standin import random_k_blocks
    from mgpu.weights.gguf import GGUFWeight, dequantize
    from rank_probes import SyncProne, cuda_sync_warnings

    dims, dev = run.sizes.small, torch.device(run.sizes.device)
    out = {}
    for qtype in ("Q4_K", "Q6_K"):
        blocks = random_k_blocks(qtype, dims.ffn, dims.dim, dims.dim ** -0.5, torch.Generator().manual_seed(2))
        gathered = blocks.to(dev)   # what the all-gather hands the extension: every rank's rows of blocks
        weight = GGUFWeight(gathered, qtype, (dims.dim,), torch.bfloat16)

        def gather() -> torch.Tensor:
            return weight.fsdp_post_all_gather((gathered,), dims.ffn, torch.bfloat16)[1][0]

        values = gather()   # the first call on a device makes its constants
        counter = SyncProne()
        with cuda_sync_warnings(dev) as syncs, counter:
            values = gather()
        seconds = timed(gather, run.sizes.device, repeats=3)
        want = dequantize(blocks, qtype, torch.bfloat16).view(dims.ffn, dims.dim)
        out[qtype] = {"shape": list(values.shape), "equal_to_cpu": torch.equal(values.cpu(), want),
                      "cuda_sync_warnings": None if dev.type != "cuda" else len(syncs),
                      "sync_prone_ops": counter.summary(), "seconds": seconds,
                      "gb_per_s": blocks.numel() / seconds / 1e9}
    return out


def _two_rank_model(run: Run, name: str):
    """A PatchedModule of the small stand-in on the two gloo ranks, both splits loaded (sp degree 2), blocks
    executed out of definition order; one checkpoint for every model of the section."""
    from mgpu.weights.lora import PatchedModule

    s = run.sizes
    if "two_rank_checkpoint" not in run.shared:
        run.shared["two_rank_checkpoint"] = write_checkpoint(run, "two_ranks", s.small)[0]
    model = PatchedModule(run.pool("two"), spec(run.shared["two_rank_checkpoint"], s.small,
                                                factory_kwargs={"block_order": BLOCK_ORDER}, sp_degree=2),
                          handle=name)
    model.load(timeout=max(10.0, run.left()))
    return model


def _lora(dims: Dims, key: str):
    """A random rank-4 LoRA on every Linear of the held block (row-patched: its weights are bf16)."""
    from mgpu.weights.lora import PatchSet

    g = torch.Generator().manual_seed(1)
    shapes = {"self_attn.q": (dims.dim, dims.dim), "self_attn.v": (dims.dim, dims.dim),
              "ffn.0": (dims.ffn, dims.dim), "ffn.2": (dims.dim, dims.ffn)}
    patches, tensors = {}, {}
    for layer, (rows, cols) in shapes.items():
        name = f"{HELD_BLOCK}.{layer}.weight"
        tensors[f"{name}.up"] = torch.randn(rows, 4, generator=g) * 0.1
        tensors[f"{name}.down"] = torch.randn(4, cols, generator=g) * cols ** -0.5
        patches[name] = [{"kind": "lora", "up": f"{name}.up", "down": f"{name}.down", "scale": 1.0}]
    return PatchSet(patches, tensors, key=key)


def two_ranks(run: Run) -> dict:
    """§3: FSDP2's streams and prefetch order on two ranks of one device, and Cancel -> LoRA change -> next step."""
    from mgpu.errors import CallCancelled

    s = run.sizes
    x, timestep, context = step_inputs(s, s.small_grid, text_dim=s.small.text_dim)
    model = _two_rank_model(run, "two-ranks-a")
    run.shared["two_rank_model"] = model
    pool = model.pool
    base = model(x, timestep, context=context)           # records the execution order
    probe(pool, model.handle, profile=True)
    model(x, timestep, context=context)
    profiles = [r.get("profile", {}) for r in probe_results(pool)]
    probe(pool, model.handle, hold_at=HELD_BLOCK)
    began = time.monotonic()
    cancel: dict[str, Any] = {"held_block": HELD_BLOCK}
    try:
        model(x, timestep, context=context, cancelled=lambda: time.monotonic() - began > CANCEL_AFTER_S)
        cancel["cancelled"] = False
    except CallCancelled as exc:
        cancel.update(cancelled=True, pool_kept=exc.pool_kept, message=str(exc).splitlines()[0])
    cancel["seconds"] = time.monotonic() - began
    probe(pool, model.handle)
    model.set_patches(_lora(s.small, "lora-1"))
    after = model(x, timestep, context=context)
    fresh_model = _two_rank_model(run, "two-ranks-fresh")
    fresh_model.set_patches(_lora(s.small, "lora-1"))
    fresh = fresh_model(x, timestep, context=context)
    fresh_model.free()
    same = compare(after, fresh, rtol=1e-6)
    order = [f"blocks.{i}" for i in BLOCK_ORDER]
    return {"devices": pool.config.devices, "backend": "gloo", "execution_order": order,
            "prefetch": profiles, "prefetch_follows_execution": all(p.get("prefetch_follows_execution")
                                                                    and p.get("execution_order") == order
                                                                    for p in profiles),
            "cancel": cancel, "lora_changed_output": compare(after, base)["max_abs_diff"] > 0,
            "after_cancel_vs_fresh": same,
            "cancel_path_ok": bool(cancel.get("cancelled") and cancel.get("pool_kept") and same["matches"])}


def step(run: Run) -> dict:
    """§4: per split on the two ranks: syncs, step time against the time model, profile, first-step memory, and
    the cancel vote per block against the block."""
    s = run.sizes
    from mgpu.weights.lora import PatchSet

    model = run.shared.get("two_rank_model") or _two_rank_model(run, "two-ranks-a")
    pool = model.pool
    model.set_patches(PatchSet())
    size = standin_size(run.shared["two_rank_checkpoint"], s.small)
    splits = {}
    for rows in (2, 1):
        x, timestep, context = step_inputs(s, s.small_grid, batch=rows, text_dim=s.small.text_dim)
        pool.call(PROBES + "memory", {"reset_peaks": True})
        model(x, timestep, context=context)
        split = f"{model.split[0]}x{model.split[1]}"
        memory_first = payloads(pool.call(PROBES + "memory"))
        probe(pool, model.handle, syncs=True)
        model(x, timestep, context=context)
        syncs = probe_results(pool)
        probe(pool, model.handle, profile=True)
        model(x, timestep, context=context)
        profile = [r.get("profile") for r in probe_results(pool)]
        probe(pool, model.handle, block_times=True)
        model(x, timestep, context=context)
        votes = [r.get("cancel_vote") for r in probe_results(pool)]
        probe(pool, model.handle)
        step_s = timed(lambda: model(x, timestep, context=context), "cpu", repeats=s.timed_steps)
        splits[split] = {"rows": rows, "step_seconds": step_s, "memory_at_first_step": memory_first,
                         "syncs": [{k: r.get(k) for k in ("rank", "cuda_sync_warnings", "cuda_sync_at",
                                                          "sync_prone_ops")} for r in syncs],
                         "profile": profile, "cancel_vote": votes,
                         "time_model": time_model(run, s.small, size, 2, model.split[0], model.split[1], rows=rows,
                                                  tokens=math.prod(s.small_grid), measured_s=step_s)}
    votes = payloads(pool.call(PROBES + "time_votes", {"count": 200}))
    model.free()
    return {"devices": pool.config.devices, "splits": splits, "vote_alone": votes}


def device_mapping(run: Run) -> dict:
    """§5: how each rank maps cuda:i to NVML and to mgpu's inventory, in the default order and PCI_BUS_ID's."""
    default = payloads(run.pool("one").call(PROBES + "device_mapping"))
    pci = payloads(run.pool("pci").call(PROBES + "device_mapping"))
    uuids = [[t["uuid"] for t in r["torch"]] for r in (default[0], pci[0])]
    return {"default": default, "pci_bus_id": pci, "same_cuda_order": uuids[0] == uuids[1],
            "nvml_index_is_cuda_index": {label: [t["nvml_index"] == t["cuda"] for t in r[0]["torch"]]
                                         for label, r in (("default", default), ("pci_bus_id", pci))},
            "mgpu_agrees_with_torch": all(r["mgpu_agrees_with_torch"] for r in default + pci)}


def _calibration_model(run: Run) -> tuple[torch.nn.Module, object, Callable, str]:
    """(network, its ComponentSize, inputs builder, which) for one real-dimension block."""
    from mgpu.planning.sizing import size_from_bytes

    s = run.sizes
    comfyui = os.environ.get("COMFYUI_PATH")
    if comfyui:
        import calibrate_memory as cm
        from mgpu.planning.sizing import size_component

        cm.import_comfyui(comfyui, cpu=torch.device(s.device).type == "cpu")
        path = cm.write_header_only(run.tmp, "wan-1block", "wan_dit", dim=s.large.dim, ffn=s.large.ffn, layers=1)
        model = cm.one_block_network(path, s.device)
        size = size_component(path)
        return model, size, lambda grid: cm.forward_inputs(size, grid, s.device), "comfyui WanModel"
    from dit_standin import randomize, wan_standin

    dims = replace(s.large, layers=1)
    with torch.device(s.device):
        model = randomize(wan_standin(**dims.kwargs())).eval()
    nbytes = sum(p.nbytes for p in model.parameters())
    size = size_from_bytes("dit", "wan-standin", nbytes, layers=1,
                           dims=dict(hidden=dims.dim, ffn=dims.ffn, heads=dims.heads, head_dim=dims.dim // dims.heads,
                                     patch_t=1, patch_h=2, patch_w=2))

    def inputs(grid: tuple[int, int, int]) -> Callable:
        t, r, c = grid

        def forward(m: torch.nn.Module) -> object:
            x = torch.randn(1, 16, t, 2 * r, 2 * c, device=s.device, dtype=torch.bfloat16)
            context = torch.randn(1, s.text_len, dims.text_dim, device=s.device, dtype=torch.bfloat16)
            return m(x, torch.full((1,), 500.0, device=s.device), context)
        return forward

    return model, size, inputs, "plain-torch stand-in (bench/dit_standin.py)"


def calibration(run: Run) -> dict:
    """Measured peak above the weights vs the calibrated formula, per token count."""
    from mgpu.planning.estimates import ACTIVATION_SAFETY, dit_activation_bytes

    model, size, inputs, which = _calibration_model(run)
    points = []
    for grid in run.sizes.calibration_grids:
        if run.left() < 10:
            points.append({"grid": list(grid), "skipped": "deadline"})
            continue
        tokens = math.prod(grid)
        forward = inputs(grid)
        peak = forward_peak(lambda: forward(model), run.sizes.device)
        ours = dit_activation_bytes(size, tokens)
        point = {"grid": list(grid), "tokens": tokens, "measured_bytes": peak.bytes, "ours_bytes": ours,
                 "measured_over_ours": peak.bytes / ours, "ours_with_safety": math.ceil(ACTIVATION_SAFETY * ours)}
        if peak.reserved is not None:
            point.update(reserved_bytes=peak.reserved,
                         reserved_over_ours_with_safety=peak.reserved / (ACTIVATION_SAFETY * ours))
        points.append(point)
        log(f"calibration {tokens} tokens: measured {peak.bytes / 2**30:.2f} GiB, ours {ours / 2**30:.2f} GiB")
    done = [p for p in points if "tokens" in p]
    result = {"model": which, "hidden": size.dims["hidden"], "ffn": size.dims["ffn"], "points": points}
    if len(done) >= 2:   # per token: the fixed part (text context, embeddings) drops out
        xs = [p["tokens"] for p in done]
        measured, _ = fit_line(xs, [p["measured_bytes"] for p in done])
        ours, _ = fit_line(xs, [p["ours_bytes"] for p in done])
        result.update(measured_bytes_per_token=measured, ours_bytes_per_token=ours, covered=measured <= ours)
    return result


def fp8_matmul(run: Run) -> dict:
    """fp8 storage with bf16 compute, and fp8 tensor-core matmuls where the GPU has them."""
    n, k, m = run.sizes.fp8_shape
    dev = run.sizes.device
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(m, k, generator=g, device=dev) * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(n, k, generator=g, device=dev).to(torch.bfloat16)
    exact = x.float() @ w.float().t()

    def rel(y: torch.Tensor) -> float:
        return ((y.float() - exact).norm() / exact.norm()).item()

    w8 = w.to(torch.float8_e4m3fn)
    flops = 2 * n * k * m
    bf16_s = timed(lambda: x @ w.t(), dev)
    upcast_s = timed(lambda: x @ w8.to(torch.bfloat16).t(), dev)
    out = {"shape": [n, k, m], "weight_bytes_bf16": w.nbytes, "weight_bytes_fp8": w8.nbytes,
           "bf16_rel_error": rel(x @ w.t()), "upcast_rel_error": rel(x @ w8.to(torch.bfloat16).t()),
           "bf16_tflops": flops / bf16_s / 1e12, "upcast_tflops": flops / upcast_s / 1e12}
    capability = torch.cuda.get_device_capability(dev) if run.cuda else None
    if capability is not None and capability < (8, 9):
        out["scaled_mm"] = f"skipped: compute capability {capability[0]}.{capability[1]} < 8.9"
        return out
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    sx = (x.abs().max().float() / fp8_max).reshape(())
    sw = (w.abs().max().float() / fp8_max).reshape(())
    x8, ws8 = (x / sx).to(torch.float8_e4m3fn), (w / sw).to(torch.float8_e4m3fn)

    def scaled() -> torch.Tensor:
        return torch._scaled_mm(x8, ws8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)

    scaled_s = timed(scaled, dev)
    out.update(scaled_mm_rel_error=rel(scaled()), scaled_mm_tflops=flops / scaled_s / 1e12)
    return out


def _filesystem(path: Path) -> str:
    """The filesystem type holding ``path`` (tmpfs means the "disk" is RAM)."""
    best, kind = "", "unknown"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def _drop_page_cache(path: Path) -> bool:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return True
    return False


def load_throughput(run: Run) -> dict:
    """A rank reads its slices of a few-GB file: from disk (page cache dropped), then from the page cache."""
    from mgpu.sharding.sharded import ShardedModule

    s = run.sizes
    dims = replace(s.large, layers=s.load_layers)
    path, state, write_s = write_checkpoint(run, "load", dims)
    nbytes = sum(v.nbytes for v in state.values())
    del state
    dropped = _drop_page_cache(path)
    loads = {}
    model = ShardedModule(run.pool("one"), spec(path, dims))
    for label in ("cold", "warm"):
        t0 = time.perf_counter()
        report = model.load(timeout=max(10.0, run.left()))[0]["report"]
        wall = time.perf_counter() - t0
        loads[label] = {"bytes_read": report["bytes_read"], "read_seconds": report["seconds"],
                        "load_seconds": wall, "read_gb_per_s": report["bytes_read"] / report["seconds"] / 1e9}
        model.free()
    return {"checkpoint_bytes": nbytes, "write_seconds": write_s, "write_gb_per_s": nbytes / write_s / 1e9,
            "filesystem": _filesystem(path), "page_cache_dropped": dropped, **loads}


def hang(run: Run) -> dict:
    """--simulate-hang: start a rank, record its pid, then never return (the watchdog must end it all)."""
    pool = run.pool("one")
    run.report["rank_pids"] = [r.payload["pid"] for r in pool.call("ping")]
    run.write_report()
    while True:
        time.sleep(1)


SECTIONS: list[tuple[str, Callable[[Run], dict]]] = [
    ("environment", environment), ("inventory", inventory), ("memory", memory), ("formats", formats),
    ("two_ranks", two_ranks), ("step", step), ("device_mapping", device_mapping), ("calibration", calibration),
    ("fp8_matmul", fp8_matmul), ("load_throughput", load_throughput)]


# ------------------------------------------------------------------------------------------------- the child

def _status(result: dict) -> str:
    if result.get("ok"):
        return "ok"
    return f"skipped: {result['skipped']}" if "skipped" in result else f"error: {result.get('error')}"


def run_checks(args: argparse.Namespace) -> int:
    sizes = DRY if args.dry_run else GPU
    report = {"dry_run": args.dry_run, "device": sizes.device, "deadline_s": args.deadline, "pid": os.getpid(),
              "sections": {}, "summary": {}}
    report_file = Path(args.report_file)

    def write_report() -> None:
        tmp = report_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        os.replace(tmp, report_file)

    sections = SECTIONS[:1] + [("hang", hang)] if args.simulate_hang else SECTIONS
    with tempfile.TemporaryDirectory(prefix="mgpu-gpu-check-", dir=args.tmpdir) as tmp:
        run = Run(sizes, time.monotonic() + args.deadline, Path(tmp), report, write_report)
        try:
            for name, section in sections:
                need = sizes.min_seconds.get(name, 1)
                if run.left() < need and name != "hang":   # the simulated hang exists to outlive the deadline
                    result = {"ok": False, "skipped": f"deadline: {run.left():.0f} s left, needs {need}"}
                else:
                    report["running"] = name
                    write_report()
                    log(f"{name} ...")
                    result = _run_section(run, section)
                report["sections"][name] = result
                report["summary"][name] = _status(result)
                log(f"{name}: {report['summary'][name]}")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        finally:
            run.close()
        report.pop("running", None)
        write_report()
    return 0


def _run_section(run: Run, section: Callable[[Run], dict]) -> dict:
    t0 = time.perf_counter()
    try:
        result = {"ok": True, **section(run)}
    except Exception as exc:   # noqa: BLE001 - recorded, and the run moves on
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return result


# ------------------------------------------------------------------------------------------------ the parent

def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group (it and its ranks), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=KILL_WAIT_S)
            if sig == signal.SIGTERM:
                with contextlib.suppress(ProcessLookupError):   # ranks that ignored SIGTERM
                    os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the checks in a child (its own process group) and print its report; kill it past the deadline."""
    with tempfile.TemporaryDirectory(prefix="mgpu-gpu-check-report-") as tmp:
        report_file = Path(tmp) / "report.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--child", "--report-file", str(report_file)]
        if args.tmpdir is None:   # the child's files live in ours, so a child killed at the deadline leaves none
            cmd += ["--tmpdir", tmp]
        began = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=sys.stderr, start_new_session=True)
        watchdog = {"deadline_s": args.deadline, "killed": False}
        try:
            proc.wait(timeout=args.deadline + GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            watchdog["killed"] = True
        except BaseException:
            _kill_group(proc)
            raise
        watchdog.update(seconds=round(time.monotonic() - began, 1), child_exit_code=proc.returncode)
        try:
            report = json.loads(report_file.read_text())
        except (OSError, ValueError) as exc:
            report = {"sections": {}, "error": f"the child left no report ({exc})"}
    if watchdog["killed"]:
        watchdog["while_running"] = report.pop("running", None)
    report["watchdog"] = watchdog
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if watchdog["killed"]:
        return 3
    return 0 if report["sections"] and all(s["ok"] for s in report["sections"].values()) else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, gloo cpu ranks (no GPU needed)")
    ap.add_argument("--deadline", type=float, default=420.0,
                    help="seconds for all sections; the watchdog kills the run %d s later" % GRACE_S)
    ap.add_argument("--json", help="also write the report to this file")
    ap.add_argument("--tmpdir", help="where the temporary checkpoints go (default: the system's temp folder)")
    ap.add_argument("--simulate-hang", action="store_true", help="after the environment, run a section that starts "
                    "a rank and never returns, to check that the watchdog stops everything")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report-file", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        return run_checks(args)
    return supervise(args, argv)


if __name__ == "__main__":
    sys.exit(main())
