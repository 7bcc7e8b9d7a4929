"""Benchmark of the FSDP engine, printed as ratios from one run on one machine (issue: rank pool and FSDP2 DiT).

    python bench/bench_fsdp.py [--dim 1024 --layers 8 --ranks 2 --steps 5]
    python bench/bench_fsdp.py --quick      # tiny model, 2 steps: that it runs (the test suite), no numbers to keep

Prints: single-device vs sharded step time; CFG batch split vs unsplit sharded; bytes all-gathered per step vs
model bytes; per-rank parameter RSS vs checkpoint size; load time of per-rank slices vs rank-0 load + broadcast;
host<->rank overhead of one step's 10 MB latent. Model: diffusers' Wan DiT with random weights (mgpu.demo).
On CPU ranks each rank gets cores/ranks threads, so that N ranks do not fight over the same cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import psutil
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mgpu.demo import FACTORY, DemoConfig, make_checkpoint, wan_transformer  # noqa: E402
from mgpu.planning.devices import format_bytes  # noqa: E402
from mgpu.ranks.pool import PoolConfig, RankPool  # noqa: E402
from mgpu.sharding.sharded import ModelSpec, ShardedModule  # noqa: E402


def step_inputs(cfg: DemoConfig) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(2, cfg.channels, cfg.frames, cfg.height, cfg.width, generator=g),
            "timestep": torch.tensor([500.0, 500.0]),
            "encoder_hidden_states": torch.randn(2, cfg.text_tokens, cfg.text_dim, generator=g)}


def timed(fn, steps: int) -> float:
    """Median seconds of ``steps`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rss(pool: RankPool) -> list[int]:
    return [r.payload["rss"] for r in pool.call("stats")]


def read_chars(pool: RankPool) -> list[int]:
    """Bytes each rank has read so far as the kernel counts them (/proc/PID/io rchar), not as the loader reports."""
    return [psutil.Process(r.payload["pid"]).io_counters().read_chars for r in pool.call("ping")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="dim 64, 2 blocks, 2 steps: a smoke run, not a measurement")
    args = ap.parse_args()
    if args.quick:
        args.dim, args.layers, args.ffn, args.steps = 128, 2, 256, 2
    cfg = DemoConfig(dim=args.dim, layers=args.layers, heads=args.dim // 128, ffn=args.ffn, text_dim=1024,
                     frames=2, height=16, width=16, text_tokens=64)
    n = args.ranks
    threads = max(1, (os.cpu_count() or 1) // n)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{format_bytes(psutil.virtual_memory().total)} RAM, torch {torch.__version__}, load avg "
          f"{os.getloadavg()[0]:.1f}; {n} cpu ranks x {threads} threads (gloo)")

    with tempfile.TemporaryDirectory(prefix="mgpu-bench-") as tmp:
        checkpoint = make_checkpoint(cfg, tmp)
        path, ckpt = checkpoint.path, checkpoint.nbytes
        print(f"model: Wan DiT dim {cfg.dim}, {cfg.layers} blocks, checkpoint {format_bytes(ckpt)} fp32")
        inputs = step_inputs(cfg)

        from safetensors.torch import load_file

        torch.set_num_threads(threads)  # the same per-process compute as one rank gets
        single = wan_transformer(**cfg.factory_kwargs)
        single.load_state_dict(load_file(path))
        single.eval()
        with torch.inference_mode():
            t_single = timed(lambda: single(**inputs, return_dict=False), args.steps)
        del single

        config = PoolConfig(devices=["cpu"] * n, extra_sys_path=[HERE], call_timeout_s=900)
        pool = RankPool(config)
        try:
            pool.start()
            pool.call("bench_ops:warm", {"factory": FACTORY})
            before = rss(pool)
            spec = ModelSpec(factory=FACTORY, checkpoint=path, factory_kwargs=cfg.factory_kwargs,
                             cached_inputs=("encoder_hidden_states",))
            model = ShardedModule(pool, spec)
            io_before = read_chars(pool)
            t0 = time.perf_counter()
            loads = model.load()
            t_slices = time.perf_counter() - t0
            disk_read = [a - b for a, b in zip(read_chars(pool), io_before)]
            after = rss(pool)
            t_split = timed(lambda: model(**inputs, return_dict=False), args.steps)
            unsplit = ShardedModule(pool, ModelSpec(**{**spec.__dict__, "split_batch": False}), handle="unsplit")
            t_unsplit = timed(lambda: unsplit(**inputs, return_dict=False), args.steps)
            gathered = model.describe()[0]["gathered_bytes_per_forward"]
            peak = rss(pool)
            unsplit.free()
            model.free()
            # Memory allowing, the plan keeps gathered weights between steps: no all-gather after the first step.
            kept = {}
            for split in (True, False):
                m = ShardedModule(pool, ModelSpec(**{**spec.__dict__, "reshard_after_forward": False,
                                                     "split_batch": split}), handle=f"kept-{split}")
                kept[split] = timed(lambda: m(**inputs, return_dict=False), args.steps)
                m.free()

            latent = torch.randn(2, 16, 21, 45, 80).to(torch.bfloat16)  # ~10 MB: a 720p x 81 Wan latent, CFG batch
            t_echo = timed(lambda: pool.call("bench_ops:echo", tensors={"x": latent}), 20)
            t_ping = timed(lambda: pool.call("ping"), 20)
        finally:
            pool.close()

        pool = RankPool(config)  # a fresh pool, so the broadcast load starts from the same RSS
        try:
            pool.start()
            pool.call("bench_ops:warm", {"factory": FACTORY})
            bc_before = rss(pool)
            t0 = time.perf_counter()
            pool.call("bench_ops:load_broadcast", {"handle": "bc", "factory": FACTORY, "checkpoint": path,
                                                   "factory_kwargs": cfg.factory_kwargs})
            t_broadcast = time.perf_counter() - t0
            bc_rss = rss(pool)
        finally:
            pool.close()

    grown = [a - b for a, b in zip(after, before)]
    print(f"step time: single device {t_single * 1e3:.0f} ms, sharded x{n} with CFG split {t_split * 1e3:.0f} ms "
          f"-> ratio sharded/single {t_split / t_single:.2f}")
    print(f"CFG batch split: {t_split * 1e3:.0f} ms vs unsplit sharded {t_unsplit * 1e3:.0f} ms "
          f"-> ratio {t_split / t_unsplit:.2f} (target <= 0.65); with gathered weights kept between steps "
          f"{kept[True] * 1e3:.0f} vs {kept[False] * 1e3:.0f} ms -> ratio {kept[True] / kept[False]:.2f}")
    print(f"all-gathered per step: {format_bytes(gathered)} = {gathered / ckpt:.2f} x model "
          f"({format_bytes(gathered * (n - 1) // n)} received per rank)")
    print(f"parameter RSS added by the load, all ranks: {format_bytes(sum(grown))} = {sum(grown) / ckpt:.2f} x "
          f"checkpoint (target <= 1.25); per rank " + ", ".join(format_bytes(g) for g in grown)
          + "; resident params per rank " + ", ".join(format_bytes(r["local_param_bytes"]) for r in loads)
          + f" (1/{n} of model = {format_bytes(ckpt // n)})")
    print("peak RSS per rank after sampling: " + ", ".join(format_bytes(p) for p in peak))
    print(f"load: per-rank slices {t_slices:.2f} s vs rank-0 load + broadcast {t_broadcast:.2f} s -> ratio "
          f"{t_slices / t_broadcast:.2f}; read per rank, counted by the kernel (rchar) "
          + ", ".join(f"{format_bytes(b)} ({b / ckpt:.3f} x file)" for b in disk_read)
          + ", by the loader " + ", ".join(format_bytes(r["report"]["bytes_read"]) for r in loads)
          + "; RSS added per rank by rank-0 load + broadcast "
          + ", ".join(format_bytes(a - b) for a, b in zip(bc_rss, bc_before)))
    print(f"host<->rank overhead: 10 MB latent round trip {t_echo * 1e3:.2f} ms (target <= 5 ms), "
          f"empty call {t_ping * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
