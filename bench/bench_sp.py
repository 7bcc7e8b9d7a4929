"""Benchmark of Ulysses sequence parallelism (issue 10): one cfg-1 step of diffusers' Wan DiT (``mgpu.demo``) on N
cpu ranks splitting its tokens against the same step on 1 rank, printed as ratios from one run.

    python bench/bench_sp.py [--ranks 2 --dim 256 --heads 4 --layers 2 --frames 4 --height 64 --width 64 --steps 3]
    python bench/bench_sp.py --quick            # a small size, for tests/test_bench_scripts.py

Both go through the real path (RankPool, ShardedModule, FSDP2, ``mgpu.families.wan_diffusers``), with the gathered
weights kept between steps (``reshard_after_forward=False``) so that the step is compute, not all-gathers, and with
the same threads per rank (cores / N: a rank stands for one device). Both pools are loaded at once and their timed
steps alternate, so that both see the same load from whatever else runs on the machine. Prints:

- step time N / 1 (target <= 0.7) and the split the ranks took (1 x N); the CPU time per step of each rank: the
  work split, which the other load of a shared machine leaves alone where it changes the wall-clock ratio;
- bytes each rank received per step from the other ranks, counted on the ranks by wrapping torch.distributed's
  ``all_to_all_single`` (the q/k/v/output exchanges), ``all_gather`` (the output gather) and FSDP2's
  ``all_gather_single`` / ``all_gather_into_tensor``: the all-gathers of a step with the weights kept (none) and of
  one with them resharded after each forward (FSDP's default, measured on a second load of the model);
- per-rank activation memory against N = 1: the peak of live tensor bytes created during one forward
  (``bench/memprobe.py``'s ``LiveBytes``, at the operator level, what calibrate_memory.py measures), and the rise of
  the process's peak RSS (``VmHWM`` reset through ``/proc/self/clear_refs`` before the forward, after ``malloc_trim``);
- the largest difference between the N-rank and 1-rank outputs.

``--json FILE`` also writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mgpu.demo import FACTORY, DemoConfig, make_checkpoint  # noqa: E402
from mgpu.planning.devices import format_bytes  # noqa: E402

FORWARD_OP = "mgpu.sharding.model_ops:forward"
KINDS = {"all_to_all_single": "all_to_all", "all_gather": "output_gather", "all_gather_single": "fsdp_all_gather",
         "all_gather_into_tensor": "fsdp_all_gather"}
_counts: dict[str, dict[str, int]] = {}


# ------------------------------------------------------------------------------------------------ rank ops

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _received(name: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(buffer bytes, bytes from the other ranks) of one collective call, from the tensors passed to it."""
    if name == "all_to_all_single":
        output = args[0]
        sizes = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        group = kwargs.get("group", args[4] if len(args) > 4 else None)
        me, world = dist.get_rank(group), dist.get_world_size(group)
        row = _nbytes(output) // max(1, output.shape[0]) if output.dim() else _nbytes(output)
        own = (sizes[me] if sizes else output.shape[0] // world) * row
        return _nbytes(output), _nbytes(output) - own
    if name == "all_gather":
        outputs, mine = args[0], args[1]
        total = sum(_nbytes(t) for t in outputs)
        return total, total - _nbytes(mine)
    output, mine = args[0], args[1]
    return _nbytes(output), _nbytes(output) - _nbytes(mine)


def _counted(name: str, original):
    def call(*args, **kwargs):
        buffer, others = _received(name, args, kwargs)
        entry = _counts.setdefault(KINDS[name], {"calls": 0, "buffer_bytes": 0, "from_other_ranks": 0})
        entry["calls"] += 1
        entry["buffer_bytes"] += buffer
        entry["from_other_ranks"] += others
        return original(*args, **kwargs)
    call.counted = True
    return call


def count_collectives(ctx, payload: dict, tensors: dict) -> dict:
    """Wrap the collectives once per rank process; return what was counted since the last call, and reset."""
    for name in KINDS:
        original = getattr(dist, name, None)
        if original is not None and not getattr(original, "counted", False):
            setattr(dist, name, _counted(name, original))
    counted = {k: dict(v) for k, v in _counts.items()}
    _counts.clear()
    return counted


def cpu_seconds(ctx, payload: dict, tensors: dict) -> dict:
    """CPU time this rank process has used (all its threads): what a step costs it, whatever else runs here."""
    return {"seconds": time.process_time()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


_last: dict = {}


def probed_forward(ctx, payload: dict, tensors: dict):
    """The rank op ``forward``, measuring this rank's activation memory (``last_memory`` returns it): the peak of the
    live tensor bytes created during it, and the rise of the peak RSS over the RSS before it."""
    from memprobe import LiveBytes

    from mgpu.sharding import model_ops

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:   # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")
    rss = _status_kib("VmRSS")
    probe = LiveBytes()
    with probe:
        reply, out = model_ops.forward(ctx, payload, tensors)
    _last["memory"] = {"live_peak_bytes": probe.peak, "rss_rise_bytes": (_status_kib("VmHWM") - rss) * 1024}
    return reply, out


def last_memory(ctx, payload: dict, tensors: dict) -> dict:
    return {"memory": _last.get("memory")}


# ------------------------------------------------------------------------------------------------ host side

def step_inputs(cfg: DemoConfig) -> dict:
    """One cfg-1 step: a single batch row."""
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(1, cfg.channels, cfg.frames, cfg.height, cfg.width, generator=g),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, cfg.text_tokens, cfg.text_dim, generator=g)}


def _per_step(counted: dict, steps: int) -> dict:
    return {kind: {k: v // steps for k, v in c.items()} for kind, c in counted.items()}


class _Probed:
    """Routes the ShardedModule's next forwards to ``probed_forward`` (the rank op with the memory probe)."""

    def __init__(self, pool):
        self.pool, self.call = pool, pool.call

    def __enter__(self):
        def call(op, *args, **kwargs):
            return self.call("bench_sp:probed_forward" if op == FORWARD_OP else op, *args, **kwargs)
        self.pool.call = call
        return self

    def __exit__(self, *exc):
        del self.pool.call   # the method again


class Ranks:
    """A pool of ``n`` cpu ranks with the model loaded at sequence degree ``n``, gathered weights kept."""

    def __init__(self, n: int, threads: int, path: str, cfg: DemoConfig):
        from mgpu.ranks.pool import PoolConfig, RankPool
        from mgpu.sharding.sharded import ModelSpec, ShardedModule

        self.n, self.inputs = n, step_inputs(cfg)
        self.pool = RankPool(PoolConfig(devices=["cpu"] * n, extra_sys_path=[HERE], call_timeout_s=1800,
                                        env={"OMP_NUM_THREADS": str(threads)}))
        self.spec = ModelSpec(factory=FACTORY, checkpoint=path, factory_kwargs=cfg.factory_kwargs, sp_degree=n,
                              cached_inputs=("encoder_hidden_states",), reshard_after_forward=False)
        self.times: list[float] = []
        try:
            self.pool.start()
            self.pool.call("bench_ops:warm", {"factory": FACTORY})
            self.counted()
            self.model = ShardedModule(self.pool, self.spec)
            self.model.load()
            self.output = self.step()   # records the prefetch order; gathers every unit once, then keeps them
            self.first_step = self.counted()
        except BaseException:
            self.pool.close()
            raise

    def step(self) -> torch.Tensor:
        return self.model(**self.inputs, return_dict=False)

    def timed_step(self) -> None:
        t0 = time.perf_counter()
        self.step()
        self.times.append(time.perf_counter() - t0)

    def cpu(self) -> list[float]:
        return [r.payload["seconds"] for r in self.pool.call("bench_sp:cpu_seconds")]

    def counted(self) -> list[dict]:
        """Per rank: the bytes counted at the collectives since the last call."""
        return [r.payload for r in self.pool.call("bench_sp:count_collectives")]

    def memory(self) -> list[dict]:
        """Per rank: the activation memory of one more step."""
        with _Probed(self.pool):
            self.step()
        return [r.payload["memory"] for r in self.pool.call("bench_sp:last_memory")]

    def resharded_step(self) -> list[dict]:
        """Per rank: the bytes of a step of the same model resharded after each forward (FSDP's default)."""
        from mgpu.sharding.sharded import ModelSpec, ShardedModule

        model = ShardedModule(self.pool, ModelSpec(**{**self.spec.__dict__, "reshard_after_forward": True}),
                              handle="resharded")
        model(**self.inputs, return_dict=False)
        self.counted()
        model(**self.inputs, return_dict=False)
        counted = self.counted()
        model.free()
        return counted


def measure(n: int, threads: int, path: str, cfg: DemoConfig, steps: int) -> tuple[dict, dict]:
    """1 rank and ``n`` ranks, both loaded at once; their timed steps alternate, so that both see the same load
    from whatever else runs on the machine."""
    one = many = None
    try:
        one = Ranks(1, threads, path, cfg)
        many = Ranks(n, threads, path, cfg)
        cpu_before = [one.cpu(), many.cpu()]
        for _ in range(steps):
            one.timed_step()
            many.timed_step()
        cpu = [[(b - a) / steps for a, b in zip(before, ranks.cpu())] for before, ranks in zip(cpu_before, (one, many))]
        kept = [_per_step(c, steps) for c in many.counted()]
        results = []
        for ranks, cpu_per_step in zip((one, many), cpu):
            results.append({"ranks": ranks.n, "split": list(ranks.model.split or ()), "output": ranks.output,
                            "step_seconds": statistics.median(ranks.times), "cpu_seconds": cpu_per_step,
                            "step_times": [round(t, 4) for t in ranks.times], "first_step": ranks.first_step,
                            "memory": ranks.memory()})
        results[1].update(per_step_kept=kept, per_step_resharded=many.resharded_step())
        return results[0], results[1]
    finally:
        for ranks in (one, many):
            if ranks is not None:
                ranks.pool.close()


def _bytes(per_rank: list[dict], kind: str, key: str = "from_other_ranks") -> int:
    """The largest count of ``kind`` over the ranks (the busiest rank)."""
    return max(r.get(kind, {}).get(key, 0) for r in per_rank)


def report(one: dict, many: dict, ckpt: int) -> dict:
    n = many["ranks"]
    ratio = many["step_seconds"] / one["step_seconds"]
    live_one = max(m["live_peak_bytes"] for m in one["memory"])
    rss_one = max(m["rss_rise_bytes"] for m in one["memory"])
    live = [m["live_peak_bytes"] for m in many["memory"]]
    rss = [m["rss_rise_bytes"] for m in many["memory"]]
    diff = (many["output"] - one["output"]).abs().max().item() / one["output"].abs().max().item()
    return {
        "ranks": n, "split": many["split"], "checkpoint_bytes": ckpt,
        "step_seconds": {"1": round(one["step_seconds"], 4), str(n): round(many["step_seconds"], 4)},
        "step_ratio": round(ratio, 3),
        "cpu_seconds_per_step": {"1": round(one["cpu_seconds"][0], 4),
                                 str(n): [round(c, 4) for c in many["cpu_seconds"]]},
        "cpu_ratio": round(max(many["cpu_seconds"]) / one["cpu_seconds"][0], 3),
        "bytes_per_step_from_other_ranks": {
            "all_to_all": _bytes(many["per_step_kept"], "all_to_all"),
            "output_gather": _bytes(many["per_step_kept"], "output_gather"),
            "fsdp_all_gather_kept": _bytes(many["per_step_kept"], "fsdp_all_gather"),
            "fsdp_all_gather_resharded": _bytes(many["per_step_resharded"], "fsdp_all_gather"),
            "all_to_all_resharded": _bytes(many["per_step_resharded"], "all_to_all"),
            "fsdp_all_gather_first_step": _bytes(many["first_step"], "fsdp_all_gather"),
        },
        "all_to_all_calls_per_step": _bytes(many["per_step_kept"], "all_to_all", "calls"),
        "activation_bytes": {"live_peak_1": live_one, f"live_peak_{n}": live, "rss_rise_1": rss_one,
                             f"rss_rise_{n}": rss},
        "activation_ratio": {"live_peak": round(max(live) / live_one, 3), "rss_rise": round(max(rss) / rss_one, 3)},
        "max_relative_difference": diff,
    }


def print_report(r: dict, cfg: DemoConfig) -> None:
    n, b = r["ranks"], r["bytes_per_step_from_other_ranks"]
    s = r["step_seconds"]
    print(f"step (cfg 1, {cfg.tokens} tokens): 1 rank {s['1'] * 1e3:.0f} ms, {n} ranks split "
          f"{r['split'][0]}x{r['split'][1]} {s[str(n)] * 1e3:.0f} ms -> ratio {n}/1 {r['step_ratio']:.2f} "
          "(target <= 0.7)")
    c = r["cpu_seconds_per_step"]
    print(f"CPU time per step: 1 rank {c['1'] * 1e3:.0f} ms, {n} ranks "
          + ", ".join(f"{x * 1e3:.0f}" for x in c[str(n)]) + f" ms -> busiest rank / 1 rank {r['cpu_ratio']:.2f} "
          "(the work split; the wall-clock ratio also depends on what else runs on these cores)")
    print(f"received per rank per step from the other ranks: all-to-alls {format_bytes(b['all_to_all'])} "
          f"({r['all_to_all_calls_per_step']} calls), output gather {format_bytes(b['output_gather'])}; FSDP "
          f"all-gathers {format_bytes(b['fsdp_all_gather_kept'])} with the weights kept, "
          f"{format_bytes(b['fsdp_all_gather_resharded'])} resharded after each forward (the default) -> "
          f"all-to-all / all-gather {b['all_to_all'] / max(1, b['fsdp_all_gather_resharded']):.2f}; "
          f"model {format_bytes(r['checkpoint_bytes'])}")
    a = r["activation_bytes"]
    print(f"activation memory per rank, one forward: live tensors peak {format_bytes(a['live_peak_1'])} on 1 rank, "
          + ", ".join(format_bytes(x) for x in a[f"live_peak_{n}"]) + f" on {n} -> ratio "
          f"{r['activation_ratio']['live_peak']:.2f}; peak RSS rise {format_bytes(a['rss_rise_1'])} vs "
          + ", ".join(format_bytes(x) for x in a[f"rss_rise_{n}"])
          + f" -> ratio {r['activation_ratio']['rss_rise']:.2f}")
    print(f"max |{n} ranks - 1 rank| / max |1 rank| = {r['max_relative_difference']:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--frames", type=int, default=4, help="latent frames")
    ap.add_argument("--height", type=int, default=64, help="latent height (tokens: frames x height/2 x width/2)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small size that runs in about a minute (tests)")
    ap.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.heads, args.layers, args.ffn, args.frames, args.height, args.width, args.steps = (
            64, 2, 2, 128, 3, 16, 10, 1)
    if args.heads % args.ranks:
        ap.error(f"--heads {args.heads} must be a multiple of --ranks {args.ranks} (each rank attends whole heads)")
    cfg = DemoConfig(dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn, text_dim=args.dim,
                     frames=args.frames, height=args.height, width=args.width)
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load avg {os.getloadavg()[0]:.1f}; cpu ranks x {threads} threads (gloo), weights kept between steps")
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-sp-") as tmp:
        ckpt = make_checkpoint(cfg, tmp)
        print(f"model: Wan DiT dim {cfg.dim}, {cfg.heads} heads, {cfg.layers} blocks, ffn {cfg.ffn}, "
              f"{format_bytes(ckpt.nbytes)} fp32; {cfg.tokens} tokens per step, 1 row (cfg 1)")
        one, many = measure(args.ranks, threads, ckpt.path, cfg, args.steps)
    result = report(one, many, ckpt.nbytes)
    print_report(result, cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
