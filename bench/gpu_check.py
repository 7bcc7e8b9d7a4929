"""GPU check: one unattended run on a lent GPU that prints one JSON report (issue 7, part 4).

    python bench/gpu_check.py [--deadline 420] [--json report.json] [--tmpdir DIR]
    python bench/gpu_check.py --dry-run        # CPU, tiny sizes, a gloo cpu rank: the same code paths

Needs torch, safetensors, nvidia-ml-py, psutil, xxhash, accelerate; no ComfyUI, no diffusers, nothing downloaded.
Sections, each in try/except (its error goes into the report and the run moves on), skipped when too little of the
deadline is left:

  environment      torch, CUDA, NCCL, the GPUs
  inventory        ``mgpu.planning.devices.inventory()`` (NVML) against torch.cuda: count, names, total and free memory
  fsdp             a one-rank pool (NCCL on a GPU) loads a real-dimension Wan-shaped stand-in (bench/dit_standin.py,
                   Wan 14B block size) slice by slice and runs a CFG step, compared with the model run directly; then
                   the ranks' reserved memory before and after the release ComfyUI's cleanup runs when sampling ends
  calibration      peak memory of one real-dimension Wan block forward at several token counts (up to a 720p
                   video's 75,600) against ``mgpu.planning.estimates.dit_activation_bytes``; ComfyUI's own WanModel when
                   COMFYUI_PATH is set, else the stand-in
  fp8              float8_e4m3fn weights with bf16 compute (upcast), and ``torch._scaled_mm`` (capability >= 8.9)
  load_throughput  a few-GB safetensors file loaded by a rank, cold (page cache dropped) and warm

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mgpu.ranks.pool import RankPool
    from mgpu.sharding.sharded import ShardedModule

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE), str(HERE.parent)) if p not in sys.path]

import torch  # noqa: E402

from memprobe import fit_line, forward_peak  # noqa: E402

GRACE_S = 20          # the watchdog's margin past the deadline: sections stop themselves first
KILL_WAIT_S = 5       # SIGTERM, then this long, then SIGKILL
FACTORY = "dit_standin:wan_standin"


@dataclass(frozen=True)
class Sizes:
    """What the checks run at: real dimensions on a GPU, tiny ones for --dry-run."""
    device: str
    dim: int
    ffn: int
    heads: int
    text_dim: int
    text_len: int
    fsdp_layers: int
    step_grid: tuple[int, int, int]                  # latent frames, patch rows, patch columns of the step
    calibration_grids: tuple[tuple[int, int, int], ...]
    fp8_shape: tuple[int, int, int]                  # tokens, in features, out features
    load_layers: int                                 # blocks of the load-throughput file
    min_seconds: dict                                # time a section needs left to start


GPU = Sizes("cuda:0", dim=5120, ffn=13824, heads=40, text_dim=4096, text_len=512, fsdp_layers=2,
            step_grid=(4, 16, 32), calibration_grids=((1, 32, 128), (4, 32, 128), (8, 32, 128), (21, 45, 80)),
            fp8_shape=(16384, 5120, 13824), load_layers=5,
            min_seconds={"inventory": 5, "fsdp": 90, "calibration": 60, "fp8": 20, "load_throughput": 90})
DRY = Sizes("cpu", dim=128, ffn=256, heads=2, text_dim=64, text_len=16, fsdp_layers=2, step_grid=(2, 4, 8),
            calibration_grids=((1, 4, 8), (2, 4, 8), (4, 4, 8)), fp8_shape=(64, 128, 256), load_layers=3,
            min_seconds={})


class Run:
    """Deadline, sizes, scratch folder and the report, shared by the sections."""

    def __init__(self, sizes: Sizes, deadline: float, tmp: Path, report: dict, write_report: Callable[[], None]):
        self.sizes, self.deadline, self.tmp = sizes, deadline, tmp
        self.report, self.write_report = report, write_report

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def model_kwargs(self, layers: int) -> dict:
        s = self.sizes
        return dict(dim=s.dim, ffn=s.ffn, heads=s.heads, layers=layers, text_dim=s.text_dim)

    @contextlib.contextmanager
    def pool(self):
        """A one-rank pool on the device, closed on the way out; its calls time out at the deadline."""
        from mgpu.ranks.pool import PoolConfig, RankPool

        left = max(10.0, self.left())
        pool = RankPool(PoolConfig(devices=[self.sizes.device], extra_sys_path=[str(HERE)], call_timeout_s=left,
                                   start_timeout_s=min(120.0, left)))
        try:
            pool.start()
            yield pool
        finally:
            pool.close()


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


# --------------------------------------------------------------------------------------------------- sections

def environment(run: Run) -> dict:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cpus": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
            "comfyui_path": os.environ.get("COMFYUI_PATH"), "device": run.sizes.device}
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


def write_checkpoint(run: Run, name: str, layers: int) -> tuple[Path, int, float]:
    """A random-weight stand-in of ``layers`` blocks saved as bf16 safetensors, on disk (fsynced)."""
    from safetensors.torch import save_file

    from dit_standin import randomize, wan_standin

    path = run.tmp / f"{name}.safetensors"
    t0 = time.perf_counter()
    with torch.device(run.sizes.device):
        model = randomize(wan_standin(**run.model_kwargs(layers)))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    del model
    save_file(state, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return path, sum(v.nbytes for v in state.values()), time.perf_counter() - t0


def step_inputs(s: Sizes, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One CFG step's inputs (cond and uncond as one batch of 2), bf16 as ComfyUI casts them."""
    g = torch.Generator().manual_seed(0)
    t, r, c = s.step_grid
    x = torch.randn(batch, 16, t, 2 * r, 2 * c, generator=g).to(torch.bfloat16)
    context = torch.randn(batch, s.text_len, s.text_dim, generator=g).to(torch.bfloat16)
    return x, torch.full((batch,), 500.0), context


def fsdp(run: Run) -> dict:
    """Load through RankPool + ShardedModule, one CFG step, compared with the same checkpoint run directly."""
    from safetensors.torch import load_file

    from dit_standin import wan_standin
    from mgpu.sharding.sharded import ModelSpec, ShardedModule

    s = run.sizes
    path, nbytes, write_s = write_checkpoint(run, "fsdp", s.fsdp_layers)
    x, timestep, context = step_inputs(s)
    with run.pool() as pool:
        before = pool.call("dit_standin:rank_memory")[0].payload
        model = ShardedModule(pool, ModelSpec(factory=FACTORY, checkpoint=str(path),
                                              factory_kwargs=run.model_kwargs(s.fsdp_layers),
                                              cached_inputs=("context",)))
        t0 = time.perf_counter()
        load = model.load(timeout=max(10.0, run.left()))[0]
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sharded = model(x, timestep, context=context)
        first_step_s = time.perf_counter() - t0
        step_s = timed(lambda: model(x, timestep, context=context), "cpu", repeats=2)
        stats = pool.call("stats")[0].payload
        after = pool.call("dit_standin:rank_memory")[0].payload
        release = cache_release(pool, model, lambda: model(x, timestep, context=context), sharded)
    with torch.device(s.device):
        reference = wan_standin(**run.model_kwargs(s.fsdp_layers))
    reference.load_state_dict(load_file(str(path), device=s.device))
    with torch.inference_mode():
        direct = reference(x.to(s.device), timestep.to(s.device), context.to(s.device)).float().cpu()
    del reference
    diff = (sharded.float() - direct).abs().max().item()
    scale = direct.abs().max().item()
    return {"checkpoint_bytes": nbytes, "write_seconds": write_s, "load_seconds": load_s,
            "load_report": load["report"], "local_param_bytes": load["local_param_bytes"],
            "first_step_seconds": first_step_s, "step_seconds": step_s, "output_shape": list(sharded.shape),
            "max_abs_diff": diff, "output_scale": scale, "matches": diff <= 1e-2 * max(scale, 1.0),
            "rank_stats": stats, "rank_memory_before_load": before, "rank_memory_after_step": after,
            "cache_release": release}


def cache_release(pool: RankPool, model: ShardedModule, step: Callable[[], torch.Tensor],
                  expected: torch.Tensor) -> dict:
    """What ComfyUI's cleanup has the ranks do when sampling ends (``ShardedModule.release_cached_memory``): each
    rank's reserved memory before and after (what the host's VAE decode gets back), and a step after it, which
    reserves again and must give the same output."""
    reserved = [r.payload["reserved"] for r in pool.call("stats")]
    released = model.release_cached_memory()
    again = step()
    return {"ranks": [{"device": r["device"], "reserved_before_bytes": b, "released_bytes": r["released_bytes"],
                       "reserved_after_bytes": r["reserved_bytes"]} for b, r in zip(reserved, released)],
            "step_after_max_abs_diff": (again.float() - expected.float()).abs().max().item(),
            "reserved_after_next_step_bytes": [r.payload["reserved"] for r in pool.call("stats")]}


def _calibration_model(run: Run) -> tuple[torch.nn.Module, object, Callable, str]:
    """(network, its ComponentSize, inputs builder, which) for one real-dimension block."""
    from mgpu.planning.sizing import size_from_bytes

    s = run.sizes
    comfyui = os.environ.get("COMFYUI_PATH")
    if comfyui:
        import calibrate_memory as cm
        from mgpu.planning.sizing import size_component

        cm.import_comfyui(comfyui, cpu=torch.device(s.device).type == "cpu")
        path = cm.write_header_only(run.tmp, "wan-1block", "wan_dit", dim=s.dim, ffn=s.ffn, layers=1)
        model = cm.one_block_network(path, s.device)
        size = size_component(path)
        return model, size, lambda grid: cm.forward_inputs(size, grid, s.device), "comfyui WanModel"
    from dit_standin import randomize, wan_standin

    with torch.device(s.device):
        model = randomize(wan_standin(**run.model_kwargs(1))).eval()
    nbytes = sum(p.nbytes for p in model.parameters())
    dims = dict(hidden=s.dim, ffn=s.ffn, heads=s.heads, head_dim=s.dim // s.heads, patch_t=1, patch_h=2, patch_w=2)
    size = size_from_bytes("dit", "wan-standin", nbytes, dims=dims, layers=1)

    def inputs(grid: tuple[int, int, int]) -> Callable:
        t, r, c = grid

        def forward(m: torch.nn.Module) -> object:
            x = torch.randn(1, 16, t, 2 * r, 2 * c, device=s.device, dtype=torch.bfloat16)
            context = torch.randn(1, s.text_len, s.text_dim, device=s.device, dtype=torch.bfloat16)
            return m(x, torch.tensor([500.0], device=s.device), context)
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


def fp8(run: Run) -> dict:
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
    capability = torch.cuda.get_device_capability(dev) if torch.device(dev).type == "cuda" else None
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
    from mgpu.sharding.sharded import ModelSpec, ShardedModule

    s = run.sizes
    path, nbytes, write_s = write_checkpoint(run, "load", s.load_layers)
    dropped = _drop_page_cache(path)
    loads = {}
    with run.pool() as pool:
        model = ShardedModule(pool, ModelSpec(factory=FACTORY, checkpoint=str(path),
                                              factory_kwargs=run.model_kwargs(s.load_layers)))
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
    with run.pool() as pool:
        run.report["rank_pids"] = [r.payload["pid"] for r in pool.call("ping")]
        run.write_report()
        while True:
            time.sleep(1)


SECTIONS: list[tuple[str, Callable[[Run], dict]]] = [
    ("environment", environment), ("inventory", inventory), ("fsdp", fsdp), ("calibration", calibration),
    ("fp8", fp8), ("load_throughput", load_throughput)]


# ------------------------------------------------------------------------------------------------- the child

def run_checks(args: argparse.Namespace) -> int:
    sizes = DRY if args.dry_run else GPU
    report = {"dry_run": args.dry_run, "deadline_s": args.deadline, "pid": os.getpid(), "sections": {}}
    report_file = Path(args.report_file)

    def write_report() -> None:
        tmp = report_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        os.replace(tmp, report_file)

    sections = SECTIONS[:1] + [("hang", hang)] if args.simulate_hang else SECTIONS
    with tempfile.TemporaryDirectory(prefix="mgpu-gpu-check-", dir=args.tmpdir) as tmp:
        run = Run(sizes, time.monotonic() + args.deadline, Path(tmp), report, write_report)
        for name, section in sections:
            need = sizes.min_seconds.get(name, 1)
            if run.left() < need:
                report["sections"][name] = {"ok": False, "skipped": f"deadline: {run.left():.0f} s left, needs {need}"}
                continue
            report["running"] = name
            write_report()
            log(f"{name} ...")
            t0 = time.perf_counter()
            try:
                result = {"ok": True, **section(run)}
            except Exception as exc:   # noqa: BLE001 - recorded, and the run moves on
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            result["seconds"] = round(time.perf_counter() - t0, 3)
            report["sections"][name] = result
            log(f"{name}: {'ok' if result['ok'] else result.get('error')}")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        report.pop("running", None)
        write_report()
    return 0


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
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, a gloo cpu rank (no GPU needed)")
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
