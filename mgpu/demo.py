"""`python -m mgpu demo`: shard a small random-weight Wan DiT over rank processes and check it against one device.

What it does, end to end, with nothing downloaded: build diffusers' ``WanTransformer3DModel`` (real Wan model code)
with random weights, save it as safetensors, plan for this machine's devices, load it sharded with FSDP2 (each rank
reads its own slice), run a few flow-matching Euler steps, run the same steps on one device, and print the plan, the
largest difference, the split of each step, step times, bytes all-gathered per step and the memory each rank holds.
Without a GPU it uses 2 cpu ranks over gloo.

``--parallel`` picks how the ranks share a step (``mgpu.families``): ``cfg`` (default) runs CFG and puts cond and
uncond on different ranks; ``sp`` runs without CFG (one row per step) and splits each step's tokens over every rank
(Ulysses sequence parallelism); ``cfg+sp`` runs CFG on 2 groups of ranks that each split their tokens (2 x 2 on
``--ranks 4``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from mgpu.planning.devices import format_bytes, gpus, inventory
from mgpu.errors import MgpuError

FACTORY = "mgpu.demo:wan_transformer"
PARALLEL = ("cfg", "sp", "cfg+sp")


def wan_transformer(dim: int, layers: int, heads: int, ffn: int, text_dim: int, channels: int):
    """diffusers' Wan DiT at a chosen size (the rank processes call this by name, under meta)."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as e:  # pragma: no cover - the test extra installs diffusers
        raise MgpuError("the demo needs diffusers for its Wan model code: pip install diffusers") from e
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=dim // heads,
                                 in_channels=channels, out_channels=channels, text_dim=text_dim, freq_dim=64,
                                 ffn_dim=ffn, num_layers=layers, rope_max_seq_len=256)


@dataclass
class DemoConfig:
    dim: int = 256
    layers: int = 4
    heads: int = 4
    ffn: int = 1024
    text_dim: int = 256
    channels: int = 16
    frames: int = 5           # latent frames
    height: int = 16          # latent height
    width: int = 16           # latent width
    text_tokens: int = 32
    steps: int = 4
    cfg: float = 5.0
    seed: int = 0

    @property
    def tokens(self) -> int:
        """Tokens per batch row after the (1, 2, 2) patch embedding."""
        return self.frames * (self.height // 2) * (self.width // 2)

    @property
    def factory_kwargs(self) -> dict:
        return dict(dim=self.dim, layers=self.layers, heads=self.heads, ffn=self.ffn, text_dim=self.text_dim,
                    channels=self.channels)


def make_checkpoint(cfg: DemoConfig, path: str) -> int:
    """Random weights of a sensible scale (so the output is neither 0 nor inf), saved in diffusers' key layout."""
    from safetensors.torch import save_file

    torch.manual_seed(cfg.seed)
    model = wan_transformer(**cfg.factory_kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, path)
    return sum(v.numel() * v.element_size() for v in state.values())


def inputs(cfg: DemoConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    latent = torch.randn(1, cfg.channels, cfg.frames, cfg.height, cfg.width, generator=g)
    cond = torch.randn(1, cfg.text_tokens, cfg.text_dim, generator=g)
    uncond = torch.zeros_like(cond)
    return latent, cond.to(dtype), uncond.to(dtype)


@dataclass
class Sampled:
    latent: torch.Tensor
    seconds: list[float]                       # per step
    splits: list[tuple[int, int] | None]       # per step: (CFG groups, sequence-parallel ranks); None on one device


def sample(model, cfg: DemoConfig, dtype: torch.dtype, device: str = "cpu", guidance: bool = True) -> Sampled:
    """Flow-matching Euler: with ``guidance`` one forward per step on the batch [cond, uncond], as ComfyUI batches
    them; without (cfg 1), one row per step."""
    x, cond, uncond = (t.to(device) for t in inputs(cfg, dtype))
    context = torch.cat([cond, uncond]) if guidance else cond
    rows = context.shape[0]
    sigmas = torch.linspace(1.0, 0.0, cfg.steps + 1)
    out = Sampled(x, [], [])
    for i in range(cfg.steps):
        t0 = time.perf_counter()
        xin = torch.cat([x] * rows).to(dtype)
        timestep = torch.full((rows,), float(sigmas[i] * 1000), device=device)
        v = model(hidden_states=xin, timestep=timestep, encoder_hidden_states=context, return_dict=False)
        v = (v[0] if isinstance(v, (tuple, list)) else v).float()
        if guidance:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + cfg.cfg * (v_cond - v_uncond)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
        out.seconds.append(time.perf_counter() - t0)
        out.splits.append(getattr(model, "split", None))
    out.latent = x
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--dim", type=int, default=d.dim, help="hidden size of the DiT")
    p.add_argument("--layers", type=int, default=d.layers, help="number of transformer blocks")
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--ffn", type=int, default=d.ffn)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--ranks", type=int, default=0, help="rank processes (default: every GPU, or 2 cpu ranks)")
    p.add_argument("--parallel", choices=PARALLEL, default="cfg",
                   help="cfg: CFG with cond and uncond on different ranks; sp: no CFG, each step's tokens split over "
                        "every rank (sequence parallel); cfg+sp: CFG on 2 groups of ranks that split their tokens "
                        "(2 x 2 with --ranks 4)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weight and compute dtype")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per pool call before a rank counts as hung")


def _rank_devices(machine: list, requested: int) -> list[str]:
    found = gpus(machine)
    if found:
        n = requested or len(found)
        if n > len(found):
            raise MgpuError(f"--ranks {n} asks for more GPUs than this machine has ({len(found)})")
        return [d.id for d in found[:n]]
    return ["cpu"] * (requested or 2)


def _sp_degree(mode: str, ranks: int) -> int:
    """The sequence-parallel degree asked of the ranks: every rank for ``sp`` (one row per step), each of 2 CFG
    groups for ``cfg+sp``; the ranks still pick the split per step from its rows (``mgpu.families.Layouts``)."""
    return {"cfg": 1, "sp": ranks, "cfg+sp": max(1, ranks // 2)}[mode]


def _what_runs(mode: str, devices: list[str], steps: int) -> str:
    n = len(devices)
    where = "cpu ranks (gloo; no GPU here) " if devices[0] == "cpu" else f"GPUs ({', '.join(devices)}, nccl) "
    how = {"cfg": f"with cond and uncond split between them, {steps} CFG steps",
           "sp": f"with each step's tokens split over all {n} (Ulysses sequence parallelism), {steps} steps "
                 "without CFG (one row per step)",
           "cfg+sp": f"with cond and uncond on 2 groups of {n // 2} ranks, each group splitting its tokens, {steps} "
                     "CFG steps"}[mode]
    return f"demo: the DiT sharded with FSDP over {n} {where}{how}, against the same model on one device ({devices[0]})"


def _print_plan(cfg: DemoConfig, size, machine: list, dtype_arg: str, guidance: bool) -> None:
    """What MGPU Plan would do with this model here (GPUs only); the demo shards regardless."""
    from mgpu.planning.estimates import Workload
    from mgpu.planning.partition import Component, Policy, make_plan

    wl = Workload(width=cfg.width * 8, height=cfg.height * 8, frames=(cfg.frames - 1) * 4 + 1, cfg=guidance)
    try:
        plan = make_plan([Component("dit", size, "bf16" if dtype_arg == "bf16" else None)], machine, wl,
                         Policy(prefer_speed=True))
        print("MGPU Plan for this model on this machine:\n" + plan.table())
    except MgpuError as e:
        print(f"MGPU Plan for this model on this machine: {e}")


def _single_device(cfg: DemoConfig, path: str, device: str, dtype: torch.dtype, guidance: bool,
                   threads: int) -> Sampled:
    """The plain module on one device, as ComfyUI would run it; on the CPU with ``threads`` threads, one cpu rank's
    share of the cores (the pool gives each rank cores / ranks), so the step times compare a device with N of them."""
    from safetensors.torch import load_file

    reference = wan_transformer(**cfg.factory_kwargs)
    reference.load_state_dict(load_file(path))
    reference = reference.to(device).eval()
    if dtype != torch.float32:
        reference = reference.to(dtype)
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            return sample(reference, cfg, dtype, device, guidance)
    finally:
        torch.set_num_threads(before)


def _mean_ms(seconds: list[float]) -> float:
    """Mean step time without the first step (it records the prefetch order and warms the kernels)."""
    rest = seconds[1:] or seconds
    return 1e3 * sum(rest) / len(rest)


def _splits(splits: list[tuple[int, int] | None]) -> str:
    return ", ".join("?" if s is None else f"{s[0]}x{s[1]}" for s in splits)


def run(args: argparse.Namespace) -> int:
    from mgpu.ranks.pool import PoolConfig, RankPool
    from mgpu.sharding.sharded import ModelSpec, ShardedModule
    from mgpu.planning.sizing import size_component

    if args.dim % args.heads:
        raise MgpuError(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    cfg = DemoConfig(dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn, steps=args.steps)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    guidance = args.parallel != "sp"
    machine = inventory()
    devices = _rank_devices(machine, args.ranks)
    n = len(devices)
    with tempfile.TemporaryDirectory(prefix="mgpu-demo-") as tmp:
        path = os.path.join(tmp, "wan_demo.safetensors")
        nbytes = make_checkpoint(cfg, path)
        size = size_component(path)
        print(f"model: diffusers WanTransformer3DModel, dim {cfg.dim}, {cfg.layers} blocks, {cfg.heads} heads, "
              f"{format_bytes(nbytes)} ({size.family}); {cfg.tokens} tokens per row")
        print(_what_runs(args.parallel, devices, cfg.steps))
        if devices[0] != "cpu":
            _print_plan(cfg, size, machine, args.dtype, guidance)
        threads = max(1, (os.cpu_count() or 1) // n)   # what the pool gives each cpu rank
        single = _single_device(cfg, path, devices[0], dtype, guidance, threads)

        pool = RankPool(PoolConfig(devices=devices, call_timeout_s=args.timeout))
        try:
            t0 = time.perf_counter()
            pool.start()
            started = time.perf_counter() - t0
            model = ShardedModule(pool, ModelSpec(factory=FACTORY, checkpoint=path, factory_kwargs=cfg.factory_kwargs,
                                                  param_dtype=args.dtype if args.dtype == "bf16" else None,
                                                  cached_inputs=("encoder_hidden_states",),
                                                  sp_degree=_sp_degree(args.parallel, n)))
            t0 = time.perf_counter()
            loads = model.load()
            loaded = time.perf_counter() - t0
            sharded = sample(model, cfg, dtype, guidance=guidance)
            described = model.describe()
            stats = [r.payload for r in pool.call("stats")]
        finally:
            pool.close()

    diff = (sharded.latent.cpu() - single.latent.cpu()).abs().max().item()
    scale = single.latent.abs().max().item()
    gathered = described[0]["gathered_bytes_per_forward"]
    layout = loads[0].get("layout", {})
    print(f"ranks: {n} on {', '.join(devices)}; pool start {started:.1f} s, sharded load {loaded:.1f} s")
    print(f"max |sharded - single| = {diff:.3g} (output scale {scale:.3g}, relative {diff / max(scale, 1e-12):.2e})")
    print(f"split per step (CFG groups x sequence-parallel ranks, {'2 rows' if guidance else '1 row'} per step): "
          f"{_splits(sharded.splits)}")
    if layout.get("note"):
        print(f"note: {layout['note']}")
    if args.parallel == "cfg+sp" and max(layout.get("degrees", [1])) == 1:
        print(f"note: cfg+sp on {n} ranks leaves no ranks to split the tokens of each CFG group; use --ranks 4 for "
              "2 x 2")
    single_ms, sharded_ms = _mean_ms(single.seconds), _mean_ms(sharded.seconds)
    per_device = f"; one device = one rank's {threads} of {os.cpu_count()} cores" if devices[0] == "cpu" else ""
    print(f"step time: single {single_ms:.1f} ms, sharded {sharded_ms:.1f} ms (first step excluded{per_device}) -> "
          f"sharded/single {sharded_ms / single_ms:.2f}")
    print(f"all-gathered per step: {format_bytes(gathered)} in total, {format_bytes(gathered * (n - 1) // n)} "
          f"received by each rank; model {format_bytes(nbytes)}")
    for load, st in zip(loads, stats):
        mem = st["max_allocated"] if st["max_allocated"] is not None else st["rss"]
        kind = "peak allocated" if st["max_allocated"] is not None else "RSS"
        print(f"  rank {st['rank']} ({st['device']}): holds {format_bytes(load['local_param_bytes'])} of parameters, "
              f"read {format_bytes(load['report']['bytes_read'])} from disk, {kind} {format_bytes(mem)}")
    ok = diff <= (1e-4 if dtype == torch.float32 else 5e-2) * max(scale, 1.0)
    print("OK: sharded matches one device" if ok else "MISMATCH: sharded differs from one device")
    return 0 if ok else 1
