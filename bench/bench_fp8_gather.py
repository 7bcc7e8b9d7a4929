"""Bytes FSDP all-gathers per forward for fp8 storage vs bf16 storage (``mgpu.weights.quant.Fp8Weight``), on gloo cpu ranks.

A stack of Linear blocks (bf16 compute) is sharded over ``--ranks`` processes twice: weights stored in bf16, then in
float8_e4m3fn. Every all-gather a rank joins is counted (the output buffer's bytes), per forward, with its time.
Prints one JSON report; the ratio goes to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mgpu.sharding.fsdp import build_meta, materialize, shard  # noqa: E402
from mgpu.weights.quant import store_as  # noqa: E402
from mgpu.sharding.slice_load import load_sharded  # noqa: E402

FP8 = torch.float8_e4m3fn


class Stack(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def build(dim: int, layers: int, fp8: bool) -> nn.Module:
    model = Stack(dim, layers).to(torch.bfloat16)
    if fp8:
        store_as(model, FP8)
    return model


def count_gathers(counter: dict) -> None:
    """Wrap the collectives FSDP2 all-gathers with (torch 2.13: all_gather_single; 2.11: all_gather_into_tensor)."""
    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is not None:
            def counted(output, *args, _original=original, **kwargs):
                counter["bytes"] += output.numel() * output.element_size()
                return _original(output, *args, **kwargs)
            setattr(dist, name, counted)


@torch.no_grad()
def rank_main(rank: int, world: int, workdir: str, dim: int, layers: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    counter = {"bytes": 0}
    count_gathers(counter)
    report = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        x = torch.randn(1, 16, dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        for kind in ("bf16", "fp8"):
            model = shard(build_meta(lambda: build(dim, layers, kind == "fp8")), mesh, param_dtype=torch.bfloat16)
            materialize(model, "cpu")
            load_sharded(model, f"{workdir}/{kind}.safetensors")
            model(x)   # the first forward records the prefetch order
            counter["bytes"] = 0
            began = time.perf_counter()
            for _ in range(steps):
                model(x)
            report[kind] = {"gathered_bytes_per_forward": counter["bytes"] // steps,
                            "seconds_per_forward": round((time.perf_counter() - began) / steps, 4)}
        if rank == 0:
            with open(f"{workdir}/report.json", "w") as f:
                json.dump(report, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        model = build(args.dim, args.layers, fp8=False)
        torch.manual_seed(0)
        for p in model.parameters():
            p.data.normal_(0, p.shape[-1] ** -0.5)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{workdir}/bf16.safetensors")
        save_file({k: (v.to(FP8) if v.ndim == 2 else v).contiguous() for k, v in model.state_dict().items()},
                  f"{workdir}/fp8.safetensors")
        mp.start_processes(rank_main, args=(args.ranks, workdir, args.dim, args.layers, args.steps),
                           nprocs=args.ranks, start_method="spawn")
        with open(f"{workdir}/report.json") as f:
            report = json.load(f)
    report["fp8_over_bf16"] = round(report["fp8"]["gathered_bytes_per_forward"]
                                    / report["bf16"]["gathered_bytes_per_forward"], 4)
    report.update(vars(args), torch=torch.__version__)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
