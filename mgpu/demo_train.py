"""`python -m mgpu demo --train`: train a LoRA over rank processes on a small random Wan DiT, against one device.

The demo's model and checkpoint (``mgpu.demo``: diffusers' Wan code, random weights, stored as ``--weights`` says:
fp32/bf16, fp8, scaled fp8, GGUF), sharded with FSDP2 and frozen in its stored form; a rank-``--rank`` LoRA on every
block's attention projections (``mgpu.training.adapters.OutputLoRA``: diffusers has no ComfyUI casting layers) trained
with AdamW on a flow-matching loss over random latents, each optimizer step's rows split over the ranks
(``mgpu.training``, as MGPU Train LoRA runs it), or with ``--parallel sp`` one row's tokens split over every rank in
forward and backward. The same training runs on one device with the same adapters, data and
noise; printed: the loss per step on both, the difference of the trained LoRAs, bytes per step by kind (FSDP's
all-gathers in forward and again in backward, the network's output and its gradient between host and ranks, the
adapters' gradient all-reduce, beside what DDP of the whole model would all-reduce) and the memory of each rank.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from mgpu.demo import (FACTORY, GATHERED_OP, GGUF_TYPES, LORA_TARGETS, Checkpoint, DemoConfig, check_weights,
                       make_checkpoint, rank_devices, wan_transformer, work_dir)
from mgpu.errors import MgpuError
from mgpu.planning.devices import format_bytes, inventory

ADAPTERS = "mgpu.training.adapters:build_output_loras"


@dataclass
class TrainConfig:
    rank: int = 16
    learning_rate: float = 1e-3
    rows: int = 4                  # per optimizer step, split over the ranks
    checkpointing: bool = True     # gradient checkpointing per block


@dataclass
class Trained:
    lora: dict[str, torch.Tensor]
    losses: list[float]
    seconds: list[float]


def first_lora(cfg: DemoConfig, rank: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Rank-``rank`` adapters on every block's attention projections, initialised as ComfyUI's Train LoRA does
    (``down`` Kaiming-uniform, ``up`` zero: the first step's output equals the base's), alpha = rank."""
    g = torch.Generator().manual_seed(cfg.seed + 3)
    specs, first = [], {}
    for i in range(cfg.layers):
        for target in LORA_TARGETS:
            layer = f"blocks.{i}.{target}"
            bound = (6 / ((1 + 5) * cfg.dim)) ** 0.5   # kaiming_uniform_(a=sqrt(5)) over dim inputs
            specs.append({"key": f"{layer}.weight", "kind": "adapter"})
            first[f"{layer}.lora_down.weight"] = (torch.rand(rank, cfg.dim, generator=g) * 2 - 1) * bound
            first[f"{layer}.lora_up.weight"] = torch.zeros(cfg.dim, rank)
            first[f"{layer}.alpha"] = torch.tensor(float(rank))
    return specs, first


def dataset(cfg: DemoConfig, rows: int) -> dict[str, torch.Tensor]:
    """Random clean latents and text contexts, one per row: what VAE Encode and CLIP Text Encode would give."""
    g = torch.Generator().manual_seed(cfg.seed + 4)
    return {"latents": torch.randn(rows, cfg.channels, cfg.frames, cfg.height, cfg.width, generator=g),
            "context": torch.randn(rows, cfg.text_tokens, cfg.text_dim, generator=g)}


def batch(cfg: DemoConfig, data: dict[str, torch.Tensor], step: int, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    """Step ``step``'s network inputs and flow-matching target: x_t = (1 - s) x0 + s noise, v = noise - x0, with a
    sigma and noise per row drawn from the step's own seed (so both runs draw the same)."""
    g = torch.Generator().manual_seed(cfg.seed + 1000 + step)
    x0 = data["latents"]
    sigma = torch.rand(x0.shape[0], generator=g)
    noise = torch.randn(x0.shape, generator=g)
    s = sigma.view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * noise
    inputs = {"hidden_states": x_t.to(dtype), "timestep": sigma * 1000,
              "encoder_hidden_states": data["context"].to(dtype), "return_dict": False}
    return inputs, noise - x0


def loss_of(out, target: torch.Tensor) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return torch.nn.functional.mse_loss(out.float(), target)


def train_one_device(cfg: DemoConfig, tc: TrainConfig, ckpt: Checkpoint, specs: list[dict],
                     first: dict[str, torch.Tensor], data: dict[str, torch.Tensor], device: str,
                     dtype: torch.dtype) -> Trained:
    """The same training on one device: the model holding the checkpoint's (dequantized) values, the same adapters
    on the same layers, the same optimizer; gradient checkpointing is left out (it recomputes, it changes nothing)."""
    from mgpu.training import adapters

    model = wan_transformer(**{**cfg.factory_kwargs, "weights": "fp32"})
    model.load_state_dict(ckpt.values)
    model = model.to(device).requires_grad_(False)
    if dtype != torch.float32:
        model = model.to(dtype)
    found = adapters.build_output_loras(specs, first, "fp32", torch.device(device))
    undo = adapters.attach(model, found)
    params = adapters.trainable(found)
    opt = torch.optim.AdamW(params.values(), lr=tc.learning_rate)
    out = Trained({}, [], [])
    try:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            inputs, target = batch(cfg, data, step, dtype)
            loss = loss_of(model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                    for k, v in inputs.items()}), target.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.losses.append(loss.item())
            out.seconds.append(time.perf_counter() - t0)
        out.lora = adapters.state(found)
    finally:
        adapters.detach(undo)
    return out


def train_sharded(cfg: DemoConfig, tc: TrainConfig, sharded, specs: list[dict], first: dict[str, torch.Tensor],
                  data: dict[str, torch.Tensor], dtype: torch.dtype, after_step) -> tuple[Trained, dict]:
    """The training over the ranks: the host computes the loss, the ranks the network and its backward."""
    from mgpu.training.run import TrainingRun

    run = TrainingRun(sharded)
    out = Trained({}, [], [])
    try:
        started = run.start(specs, first, factory=ADAPTERS, mode=None, optimizer="AdamW",
                            learning_rate=tc.learning_rate, training_dtype="fp32", lora_dtype="fp32",
                            gradient_checkpointing=tc.checkpointing)
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            inputs, target = batch(cfg, data, step, dtype)
            loss = loss_of(run.network(**inputs), target)
            loss.backward()
            run.step()
            out.losses.append(loss.item())
            out.seconds.append(time.perf_counter() - t0)
            after_step()
        out.lora = run.adapters()
    finally:
        run.stop()
    return out, {**started, **run.bytes}


def _relative_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[k].float() - b[k].float()).square().sum()) for k in b)
    return (diff / max(sum(float(b[k].float().square().sum()) for k in b), 1e-30)) ** 0.5


def _check_arguments(args: argparse.Namespace) -> None:
    if args.parallel == "cfg+sp":
        raise MgpuError("--train with --parallel cfg+sp: training has no CFG; --parallel sp splits each row's tokens "
                        "over the ranks, the default splits the rows")
    if args.lora:
        raise MgpuError("--train trains a LoRA of its own: leave --lora out")
    if args.rows < 0:
        raise MgpuError(f"--rows {args.rows}: rows per optimizer step, at least 1 (0: 2 per rank)")


def run(args: argparse.Namespace) -> int:
    from mgpu.ranks.pool import PoolConfig, RankPool
    from mgpu.sharding.sharded import ModelSpec, ShardedModule

    _check_arguments(args)
    cfg = DemoConfig(dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn, steps=args.steps,
                     weights=args.weights or args.dtype)
    check_weights(cfg)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    devices = rank_devices(inventory(), args.ranks)
    n = len(devices)
    sp = args.parallel == "sp"   # one row's tokens over every rank, in forward and backward
    tc = TrainConfig(rank=args.rank, learning_rate=args.lr, rows=args.rows or (1 if sp else 2 * n),
                     checkpointing=args.gradient_checkpointing)
    specs, first = first_lora(cfg, tc.rank)
    data = dataset(cfg, tc.rows)
    with work_dir() as tmp:
        ckpt = make_checkpoint(cfg, tmp)
        stored = (f"{len(ckpt.quantized)} block Linear weights {GGUF_TYPES.get(cfg.weights, cfg.weights)}"
                  if ckpt.quantized else f"every tensor {cfg.weights}")
        print(f"model: diffusers WanTransformer3DModel, dim {cfg.dim}, {cfg.layers} blocks, "
              f"{format_bytes(ckpt.nbytes)} ({stored}), frozen; {cfg.tokens} tokens per row")
        where = "cpu ranks (gloo; no GPU here)" if devices[0] == "cpu" else f"GPUs ({', '.join(devices)}, nccl)"
        how = f"each row's tokens split over {n} {where}" if sp else f"split over {n} {where}"
        print(f"demo --train: a rank-{tc.rank} LoRA on the {len(specs)} attention projections, AdamW lr "
              f"{tc.learning_rate:g}, {cfg.steps} optimizer steps of {tc.rows} row{'s' if tc.rows > 1 else ''}, {how}; "
              f"gradient checkpointing {'on' if tc.checkpointing else 'off'}; against one device ({devices[0]})")
        single = train_one_device(cfg, tc, ckpt, specs, first, data, devices[0], dtype)

        pool = RankPool(PoolConfig(devices=devices, call_timeout_s=args.timeout))
        try:
            spec = ModelSpec(factory=FACTORY, checkpoint=ckpt.path, factory_kwargs=cfg.factory_kwargs,
                             param_dtype=args.dtype, cached_inputs=("encoder_hidden_states",),
                             sp_degree=n if sp else 1)
            sharded = ShardedModule(pool, spec)
            loads = sharded.load()
            pool.call(GATHERED_OP)   # installs the count
            gathered: list[dict[str, int]] = []   # per step: bytes by unit kind ("blocks", "root")
            trained, sent = train_sharded(cfg, tc, sharded, specs, first, data, dtype,
                                          lambda: gathered.append(pool.call(GATHERED_OP)[0].payload))
            split = sharded.split
            stats = [r.payload for r in pool.call("stats")]
        finally:
            pool.close()

    diff = _relative_l2(trained.lora, single.lora)
    moved = _relative_l2(single.lora, first)
    print("loss per step, ranks:      " + "  ".join(f"{x:.5f}" for x in trained.losses))
    print("loss per step, one device: " + "  ".join(f"{x:.5f}" for x in single.losses))
    print(f"split per network call (batch groups x sequence-parallel ranks): {split[0]}x{split[1]}")
    print(f"trained LoRA, ranks vs one device: relative L2 {diff:.2e} (training moved it {moved:.2e} from its "
          f"first values)")
    steps = cfg.steps
    params = sum(t.numel() for t in ckpt.values.values())
    per_step = sum(sum(g.values()) for g in gathered) // len(gathered)
    blocks = sum(g.get("blocks", 0) for g in gathered) // len(gathered)
    print(f"bytes per optimizer step: FSDP all-gathers (forward, and again in backward) {format_bytes(per_step)} "
          f"per rank (the blocks {format_bytes(blocks)}, the rest in {args.dtype} {format_bytes(per_step - blocks)}); "
          f"network output to the host {format_bytes(sent['outputs'] // steps)}, "
          f"its gradient back {format_bytes(sent['output_grads'] // steps)}; adapter gradients all-reduced "
          f"{format_bytes(sent['adapter_reduce'] // steps)} (the adapters: {format_bytes(sent['adapter_bytes'])}); "
          f"DDP of the whole model would all-reduce {format_bytes(params * 4)}")
    rest = trained.seconds[1:] or trained.seconds
    one = single.seconds[1:] or single.seconds
    print(f"optimizer step: ranks {1e3 * sum(rest) / len(rest):.0f} ms, one device {1e3 * sum(one) / len(one):.0f} ms "
          f"(first step excluded)")
    for load, st in zip(loads, stats):
        mem = st["max_allocated"] if st["max_allocated"] is not None else st["rss"]
        kind = "peak allocated" if st["max_allocated"] is not None else "RSS"
        print(f"  rank {st['rank']} ({st['device']}): holds {format_bytes(load['local_param_bytes'])} of the base, "
              f"{kind} {format_bytes(mem)}")
    ok = diff <= (1e-4 if dtype == torch.float32 else 2e-2) and moved > 0
    print("OK: the ranks trained the one-device LoRA" if ok else "MISMATCH: the ranks' LoRA differs from one device's")
    return 0 if ok else 1
