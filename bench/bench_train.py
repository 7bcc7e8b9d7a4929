"""LoRA training over FSDP ranks, printed as ratios from one run on one machine (issue 17 §5).

    COMFYUI_PATH=/path/to/ComfyUI python bench/bench_train.py [--dim 512 --layers 4 --tokens 1024 --steps 3]
    COMFYUI_PATH=... python bench/bench_train.py --quick    # tiny: that it runs (the test suite), no numbers to keep

ComfyUI's own WanModel with random weights, ComfyUI's LoRA adapters (rank 16 on every layer, as its Train LoRA
makes them), one optimizer step = forward + backward + step on a global batch of 2 rows. Prints, 2 cpu ranks against
1 at the same global batch: the optimizer-step time (gathered weights kept between steps, and resharded after every
forward), the bytes per step by kind as counted at the collectives (FSDP's all-gathers in forward and again in
backward, the adapters' gradient all-reduce) beside what DDP of the whole model would all-reduce, the CPU time per
step, the peak working memory of a step per rank with gradient checkpointing and without, and the bytes gathered per
step when the file stores the blocks' matrices fp8 or Q4_K, and a checkpoint's save time (each rank writing its
shard, or rank 0 writing everything) and load time against the adapters' size. On CPU ranks each rank is one
"device" of cores / 2 threads, the single rank too: 2 ranks against 1 is then 2 devices against 1, as on GPUs (ideal
ratio 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, "tests")]

from mgpu.planning.devices import format_bytes  # noqa: E402
from mgpu.ranks.pool import PoolConfig, RankPool  # noqa: E402
from mgpu.sharding.sharded import ModelSpec, ShardedModule  # noqa: E402
from mgpu.training.run import TrainingRun  # noqa: E402

FACTORY = "bench_train:wan_network"
RANK = 16


@dataclass
class Config:
    dim: int = 512
    layers: int = 4
    tokens: int = 1024      # per row: frames x (h/2) x (w/2) patches
    text_tokens: int = 64
    steps: int = 3

    @property
    def grid(self) -> tuple[int, int, int]:
        side = int((self.tokens // 4) ** 0.5)
        return 4, 2 * side, 2 * side


def _import_comfyui() -> None:
    from calibrate_memory import import_comfyui

    import_comfyui(os.environ["COMFYUI_PATH"])


def wan_network(dim: int, layers: int, storage: str = "fp32"):
    """ComfyUI's WanModel (t2v) at ``dim``, fp32, ComfyUI's casting layers (they take the adapters); ``fp8``: the
    blocks' Linear weights kept float8_e4m3fn, as the file stores them (GGUF files are wrapped by the loader)."""
    _import_comfyui()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    model = WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=64, in_dim=16, dim=dim, ffn_dim=dim * 3,
                    freq_dim=256, text_dim=256, out_dim=16, num_heads=dim // 64, num_layers=layers,
                    operations=comfy.ops.disable_weight_init)
    if storage == "fp8":
        from mgpu.weights.quant import store_as

        store_as(model.blocks, torch.float8_e4m3fn)
    return model


STORAGES = ("fp32", "fp8", "gguf-q4_k")   # how the checkpoint stores the blocks' matrices


def checkpoint(cfg: Config, folder: str, storage: str = "fp32") -> tuple[str, int]:
    """The random WanModel as a file: fp32; ``fp8``: the blocks' matrices float8_e4m3fn (a plain fp8 file);
    ``gguf-q4_k``: a GGUF file with the blocks' matrices Q4_K where their rows are whole 256-value blocks."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = wan_network(cfg.dim, cfg.layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) / (p[0].numel() ** 0.5 if p.ndim > 1 else 10))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    blocks = {k for k, v in sd.items() if k.startswith("blocks.") and v.ndim == 2}
    if storage == "gguf-q4_k":
        from mgpu.weights.gguf_write import write_gguf

        path = os.path.join(folder, "wan-Q4_K.gguf")
        write_gguf(path, sd, {k: "Q4_K" if k in blocks and v.shape[1] % 256 == 0 else "F32" for k, v in sd.items()})
    else:
        path = os.path.join(folder, f"wan-{storage}.safetensors")
        save_file({k: v.to(torch.float8_e4m3fn) if storage == "fp8" and k in blocks else v for k, v in sd.items()},
                  path)
    return path, sum(v.numel() for v in sd.values())


def first_adapters(cfg: Config, rank: int = RANK) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """ComfyUI's LoRA on every 2-D layer (its create_train: up random, down zero) and a zero difference on every
    bias: what MGPU Train LoRA sends."""
    from comfy.weight_adapter import adapter_maps

    with torch.device("meta"):
        meta = wan_network(cfg.dim, cfg.layers)
    specs, first = [], {}
    for name, module in meta.named_modules():
        if not hasattr(module, "weight_function") or getattr(module, "weight", None) is None:
            continue
        if module.weight.ndim >= 2:
            standin = type("W", (), {"shape": module.weight.shape, "device": torch.device("cpu")})
            adapter = adapter_maps["LoRA"].create_train(standin, rank=rank, alpha=1.0)
            specs.append({"key": f"{name}.weight", "kind": "adapter"})
            first.update({f"{name}.{k}": v.detach() for k, v in adapter.named_parameters()})
        if getattr(module, "bias", None) is not None:
            specs.append({"key": f"{name}.bias", "kind": "diff"})
            first[f"{name}.diff_b"] = torch.zeros(module.bias.shape)
    return specs, first


def inputs(cfg: Config) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    f, h, w = cfg.grid
    x = {"x": torch.randn(2, 16, f, h, w, generator=g), "timestep": torch.tensor([300.0, 700.0]),
         "context": torch.randn(2, cfg.text_tokens, 256, generator=g)}
    return x, torch.randn(2, 16, f, h, w, generator=g)


_PROBES: list = []   # on a rank: the open peak measurement (peak_start .. peak_stop)


def peak_start(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: start counting this rank's working memory (a GPU's allocator peak, or on the CPU the storages
    created from now on, ``memprobe.LiveBytes``), across the calls of one optimizer step."""
    if ctx.torch_device.type == "cuda":
        torch.cuda.synchronize(ctx.torch_device)
        torch.cuda.reset_peak_memory_stats(ctx.torch_device)
        _PROBES.append(torch.cuda.memory_allocated(ctx.torch_device))
    else:
        from memprobe import LiveBytes

        probe = LiveBytes()
        probe.__enter__()   # the mode stays on this rank's thread until peak_stop
        _PROBES.append(probe)
    return {}


def peak_stop(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: the peak bytes above the start, since ``peak_start``."""
    probe = _PROBES.pop()
    if isinstance(probe, int):
        torch.cuda.synchronize(ctx.torch_device)
        return {"peak": torch.cuda.max_memory_allocated(ctx.torch_device) - probe}
    probe.__exit__(None, None, None)
    return {"peak": probe.peak}


def run(n: int, cfg: Config, path: str, reshard: bool, threads: int, checkpointing: bool = True,
        steps: int | None = None, storage: str = "fp32") -> dict:
    """One pool of ``n`` cpu ranks: seconds per optimizer step (median after a warm-up), bytes by kind per step, and
    the peak working memory of one more step (activations, gathered blocks, gradients; the largest rank's)."""
    steps = cfg.steps if steps is None else steps
    pool = RankPool(PoolConfig(devices=["cpu"] * n, extra_sys_path=[HERE, os.path.join(ROOT, "tests")],
                               call_timeout_s=900, env={"OMP_NUM_THREADS": str(threads)}))
    try:
        kwargs = {"dim": cfg.dim, "layers": cfg.layers, "storage": storage}
        sharded = ShardedModule(pool, ModelSpec(factory=FACTORY, checkpoint=path, reshard_after_forward=reshard,
                                                param_dtype="fp32", factory_kwargs=kwargs))
        sharded.load()
        specs, first = first_adapters(cfg)
        x, target = inputs(cfg)
        training = TrainingRun(sharded)
        training.start(specs, first, factory="loaders.train_adapters:build",
                       mode="loaders.train_adapters:training_mode", optimizer="AdamW", learning_rate=1e-4,
                       training_dtype="fp32", lora_dtype="fp32", gradient_checkpointing=checkpointing)

        def step() -> float:
            t0 = time.perf_counter()
            torch.nn.functional.mse_loss(training.network(**x), target).backward()
            training.step()
            return time.perf_counter() - t0

        step()
        pool.call("bench_sp:count_collectives")   # wraps the collectives; counts from here
        cpu0 = sum(r.payload["seconds"] for r in pool.call("bench_sp:cpu_seconds"))
        times = [step() for _ in range(steps)]
        cpu1 = sum(r.payload["seconds"] for r in pool.call("bench_sp:cpu_seconds"))
        counted = pool.call("bench_sp:count_collectives")[0].payload
        reduced = training.bytes["adapter_reduce"] // (steps + 1)
        pool.call("bench_train:peak_start")
        step()
        peak = max(r.payload["peak"] for r in pool.call("bench_train:peak_stop"))
        training.stop()
        return {"ranks": n, "reshard_after_forward": reshard, "gradient_checkpointing": checkpointing,
                "step_seconds": statistics.median(times), "cpu_seconds_per_step": (cpu1 - cpu0) / steps,
                "fsdp_all_gather_per_step": counted.get("fsdp_all_gather", {}).get("from_other_ranks", 0) // steps,
                "adapter_all_reduce_per_step": reduced if n > 1 else 0,
                "adapter_bytes": training.started["adapter_bytes"], "peak_step_bytes": peak}
    finally:
        pool.close()


def planned_working(cfg: Config, path: str, ranks: int, checkpointing: bool) -> int:
    """What the plan counts per rank for one step of this run (``partition.rank_need``'s working memory: the
    activations with the safety factor, FSDP2's gathered blocks, the adapter, its gradient and AdamW's state), for the
    same model file, rows, tokens and LoRA, in fp32 on ``ranks`` cpu ranks."""
    from mgpu.planning.devices import inventory
    from mgpu.planning.estimates import Workload
    from mgpu.planning.partition import Component, rank_need
    from mgpu.planning.sizing import size_component
    from mgpu.planning.training import Training

    f, h, w = cfg.grid   # latent frames x patches: Wan's VAE steps 4 frames and 8 pixels, its patches 1 x 2 x 2
    train = Training(lora_rank=RANK, optimizer="AdamW", checkpointing="on" if checkpointing else "off",
                     training_dtype="fp32", lora_dtype="fp32")
    wl = Workload(width=w * 8, height=h * 8, frames=(f - 1) * 4 + 1, batch=2, cfg=False, train=train)
    host = [d for d in inventory("cpu=64GiB") if d.kind == "cpu"]
    return rank_need(Component("dit", size_component(path)), host * ranks, wl).working


def save_from_rank0(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: the run's checkpoint written by rank 0 alone (every tensor whole and replicated, DCP told to give
    each to the lowest rank): what a trainer that gathers to rank 0 does, against ``save_state``'s shards."""
    import torch.distributed.checkpoint as dcp
    from mgpu.training import ops

    state = ops.checkpoint_tensors(ctx.objects[payload["handle"]][ops.RUN])
    dcp.save(state, storage_writer=dcp.FileSystemWriter(payload["path"]),
             planner=dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    return {}


def checkpoint_times(cfg: Config, path: str, folder: str, threads: int, ranks: tuple[int, ...]) -> list[dict]:
    """Per LoRA rank, on 2 ranks after one AdamW step: seconds to save the checkpoint with every rank writing its
    shard, with rank 0 writing everything, and to load it (median of 3), and its size on disk."""
    found = []
    pool = RankPool(PoolConfig(devices=["cpu"] * 2, extra_sys_path=[HERE, os.path.join(ROOT, "tests")],
                               call_timeout_s=900, env={"OMP_NUM_THREADS": str(threads)}))
    try:
        sharded = ShardedModule(pool, ModelSpec(factory=FACTORY, checkpoint=path, param_dtype="fp32",
                                                factory_kwargs={"dim": cfg.dim, "layers": cfg.layers}))
        sharded.load()
        x, target = inputs(cfg)
        for rank in ranks:
            specs, first = first_adapters(cfg, rank)
            training = TrainingRun(sharded)
            training.start(specs, first, factory="loaders.train_adapters:build",
                           mode="loaders.train_adapters:training_mode", optimizer="AdamW", learning_rate=1e-4,
                           training_dtype="fp32", lora_dtype="fp32", gradient_checkpointing=True)
            torch.nn.functional.mse_loss(training.network(**x), target).backward()
            training.step()

            def timed(fn, name: str) -> float:
                times = []
                for i in range(3):
                    where = os.path.join(folder, f"{name}-{rank}-{i}")
                    t0 = time.perf_counter()
                    fn(where if name != "load" else os.path.join(folder, f"shards-{rank}-0"))
                    times.append(time.perf_counter() - t0)
                return statistics.median(times)

            shards = timed(training.save, "shards")
            rank0 = timed(lambda where: pool.call("bench_train:save_from_rank0",
                                                  {"handle": sharded.handle, "path": where}), "rank0")
            load = timed(training.load, "load")
            on_disk = sum(os.path.getsize(os.path.join(folder, f"shards-{rank}-0", f))
                          for f in os.listdir(os.path.join(folder, f"shards-{rank}-0")))
            found.append({"lora_rank": rank, "adapter_bytes": training.started["adapter_bytes"],
                          "checkpoint_bytes": on_disk, "save_shards_seconds": shards, "save_rank0_seconds": rank0,
                          "load_seconds": load})
            training.stop()
    finally:
        pool.close()
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="dim 128, 2 layers, 64 tokens, 1 step: that it runs")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args(argv)
    if not os.environ.get("COMFYUI_PATH"):
        print("set COMFYUI_PATH to a ComfyUI checkout: the model is ComfyUI's own WanModel", file=sys.stderr)
        return 2
    cfg = Config(128, 2, 64, 16, 1) if args.quick else Config(args.dim, args.layers, args.tokens, 64, args.steps)
    _import_comfyui()
    cores = os.cpu_count() or 1
    half = max(1, cores // 2)
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-train-") as folder:
        path, params = checkpoint(cfg, folder)
        one = run(1, cfg, path, reshard=False, threads=half)
        kept = run(2, cfg, path, reshard=False, threads=half)
        resharded = run(2, cfg, path, reshard=True, threads=half)
        no_checkpointing = run(2, cfg, path, reshard=True, threads=half, checkpointing=False, steps=1)
        stored = {"fp32": resharded["fsdp_all_gather_per_step"]}
        for storage in STORAGES[1:]:
            quantized, _ = checkpoint(cfg, folder, storage)
            stored[storage] = run(2, cfg, quantized, reshard=True, threads=half, steps=1,
                                  storage=storage)["fsdp_all_gather_per_step"]
        saves = checkpoint_times(cfg, path, folder, half, (4, 16) if args.quick else (16, 64, 128))
        plan = {"one_rank": planned_working(cfg, path, 1, True),
                "two_ranks_resharded": planned_working(cfg, path, 2, True),
                "two_ranks_resharded_no_checkpointing": planned_working(cfg, path, 2, False)}
    ddp = params * 4   # DDP of the whole model: every parameter's fp32 gradient all-reduced per step
    report = {"config": asdict(cfg), "model_params": params, "one_rank": one, "two_ranks_kept": kept,
              "two_ranks_resharded": resharded, "two_ranks_resharded_no_checkpointing": no_checkpointing,
              "step_ratio_kept": kept["step_seconds"] / one["step_seconds"],
              "step_ratio_resharded": resharded["step_seconds"] / one["step_seconds"],
              "peak_ratio_checkpointing": resharded["peak_step_bytes"] / no_checkpointing["peak_step_bytes"],
              "all_gather_per_step_by_storage": stored, "checkpoints": saves,
              "ddp_whole_model_all_reduce_per_step": ddp, "planned_working": plan,
              "plan_over_measured": {k: v / report_peak for k, v in plan.items()
                                     if (report_peak := {"one_rank": one, "two_ranks_resharded": resharded,
                                                         "two_ranks_resharded_no_checkpointing": no_checkpointing
                                                         }[k]["peak_step_bytes"])}}
    print(f"LoRA training, ComfyUI WanModel dim {cfg.dim} x {cfg.layers} layers ({params:,} params), rank {RANK}, "
          f"2 rows x {cfg.tokens} tokens per step, gradient checkpointing on, {cores} cores: "
          f"{half} thread{'s' if half > 1 else ''} per rank")
    print(f"optimizer step: 1 rank {one['step_seconds']:.2f} s; 2 ranks, gathered weights kept "
          f"{kept['step_seconds']:.2f} s (ratio 2/1 {report['step_ratio_kept']:.2f}); resharded after every forward "
          f"{resharded['step_seconds']:.2f} s (ratio 2/1 {report['step_ratio_resharded']:.2f})")
    print(f"bytes per step per rank from the other rank: FSDP all-gathers (kept) "
          f"{format_bytes(kept['fsdp_all_gather_per_step'])}, (resharded: forward + backward) "
          f"{format_bytes(resharded['fsdp_all_gather_per_step'])}; adapter gradients all-reduced "
          f"{format_bytes(kept['adapter_all_reduce_per_step'])} (the adapters: {format_bytes(kept['adapter_bytes'])}); "
          f"DDP of the whole model would all-reduce {format_bytes(ddp)}")
    print(f"CPU seconds per step, all ranks: 1 rank {one['cpu_seconds_per_step']:.2f}, 2 ranks kept "
          f"{kept['cpu_seconds_per_step']:.2f}")
    print(f"peak working memory of a step per rank (activations, gathered blocks, gradients; 2 ranks, resharded): "
          f"checkpointing on {format_bytes(resharded['peak_step_bytes'])}, off "
          f"{format_bytes(no_checkpointing['peak_step_bytes'])} (ratio on/off {report['peak_ratio_checkpointing']:.2f})"
          f"; 1 rank with both rows, on: {format_bytes(one['peak_step_bytes'])}")
    print("the plan's working memory per rank against these peaks (activations x the safety factor, gathered "
          "blocks, adapter with gradient and AdamW state): " + ", ".join(
              f"{k.replace('_', ' ')} {format_bytes(plan[k])} ({v:.2f}x)"
              for k, v in report["plan_over_measured"].items()))
    bf16 = stored["fp32"] / 2   # every parameter gathered once in forward and once in backward, 2 bytes each
    print("all-gathered per rank per step by the base's storage (forward + backward), against bf16 storage ("
          f"{format_bytes(int(bf16))}, the fp32 count halved): " + ", ".join(
              f"{k} {format_bytes(v)} ({v / bf16:.2f})" for k, v in stored.items()))
    for c in saves:
        print(f"checkpoint, LoRA rank {c['lora_rank']} ({format_bytes(c['adapter_bytes'])} of adapters, "
              f"{format_bytes(c['checkpoint_bytes'])} on disk with AdamW's state): "
              f"save {c['save_shards_seconds']:.3f} s "
              f"with each rank writing its shard, {c['save_rank0_seconds']:.3f} s with rank 0 writing everything "
              f"(ratio {c['save_shards_seconds'] / c['save_rank0_seconds']:.2f}); load {c['load_seconds']:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
