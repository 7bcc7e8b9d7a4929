"""Bytes FSDP all-gathers per forward for one model stored four ways: bf16, fp8 (``mgpu.weights.quant.Fp8Weight``),
GGUF Q8_0 and GGUF Q4_K (``mgpu.weights.gguf.GGUFWeight``), on gloo cpu ranks.

A stack of Linear blocks (dim -> 4 dim -> dim, bf16 compute) is sharded over ``--ranks`` processes once per storage:
the block weights in bf16, float8_e4m3fn, Q8_0 or Q4_K (biases bf16, F32 in the GGUF files). Every all-gather a rank
joins is counted at the process group (the output buffer's bytes), per forward, with its time. Prints one JSON report
with each storage's ratio to bf16; the numbers go to bench/RESULTS.md. The Q4_K blocks are random bits with small
scales (gguf-py cannot quantize K types): right for counting bytes, not for judging accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import gguf
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mgpu.sharding.fsdp import build_meta, materialize, shard  # noqa: E402
from mgpu.sharding.slice_load import load_sharded  # noqa: E402
from mgpu.weights.gguf import QUANTIZED, load_gguf_sharded, wrap_gguf_parameters  # noqa: E402
from mgpu.weights.quant import store_as  # noqa: E402

FP8 = torch.float8_e4m3fn
STORAGES = {"bf16": "safetensors", "fp8": "safetensors", "Q8_0": "gguf", "Q4_K": "gguf"}


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


def _loaded(kind: str, workdir: str, dim: int, layers: int, mesh) -> nn.Module:
    model = build_meta(lambda: build(dim, layers, kind == "fp8"))
    path = f"{workdir}/{kind}.{STORAGES[kind]}"
    if STORAGES[kind] == "gguf":
        wrap_gguf_parameters(model, path)
    shard(model, mesh, param_dtype=torch.bfloat16)
    materialize(model, "cpu")
    (load_gguf_sharded if STORAGES[kind] == "gguf" else load_sharded)(model, path)
    return model


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
        for kind in STORAGES:
            model = _loaded(kind, workdir, dim, layers, mesh)
            model(x)   # the first forward records the prefetch order
            counter["bytes"] = 0
            began = time.perf_counter()
            for _ in range(steps):
                model(x)
            report[kind] = {"gathered_bytes_per_forward": counter["bytes"] // steps,
                            "seconds_per_forward": round((time.perf_counter() - began) / steps, 4)}
            del model
        if rank == 0:
            with open(f"{workdir}/report.json", "w") as f:
                json.dump(report, f)
        dist.barrier()   # no rank tears gloo down while another still talks to it (SIGABRT in gloo's threads)
    finally:
        dist.destroy_process_group()


def write_gguf(path: str, state: dict[str, torch.Tensor], qtype: str, rng: np.random.Generator) -> None:
    """The block weights as ``qtype`` (Q4_K: random blocks with small scales), biases F32."""
    writer = gguf.GGUFWriter(path, arch="bench")
    for name, t in state.items():
        values = t.float().numpy()
        if t.ndim == 1:
            writer.add_tensor(name, values)
        elif qtype in ("Q8_0",):
            writer.add_tensor(name, gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype]),
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            block, block_bytes = QUANTIZED[qtype]
            blocks = rng.integers(0, 256, size=(values.size // block, block_bytes), dtype=np.uint8)
            blocks[:, :4] = rng.uniform(0, 1e-4, (len(blocks), 2)).astype(np.float16).view(np.uint8)
            writer.add_tensor(name, blocks.reshape(t.shape[0], -1), raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_checkpoints(workdir: str, dim: int, layers: int) -> None:
    model = build(dim, layers, fp8=False)
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, p.shape[-1] ** -0.5)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, f"{workdir}/bf16.safetensors")
    save_file({k: (v.to(FP8) if v.ndim == 2 else v).contiguous() for k, v in state.items()},
              f"{workdir}/fp8.safetensors")
    rng = np.random.default_rng(0)
    for qtype in ("Q8_0", "Q4_K"):
        write_gguf(f"{workdir}/{qtype}.gguf", state, qtype, rng)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024, help="a multiple of 256 (Q4_K's block)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if args.dim % 256:
        ap.error("--dim must be a multiple of 256, the Q4_K block")
    with tempfile.TemporaryDirectory() as workdir:
        write_checkpoints(workdir, args.dim, args.layers)
        mp.start_processes(rank_main, args=(args.ranks, workdir, args.dim, args.layers, args.steps),
                           nprocs=args.ranks, start_method="spawn")
        with open(f"{workdir}/report.json") as f:
            report = json.load(f)
    bf16 = report["bf16"]["gathered_bytes_per_forward"]
    report["over_bf16"] = {kind: round(report[kind]["gathered_bytes_per_forward"] / bf16, 4) for kind in STORAGES}
    report.update(vars(args), torch=torch.__version__)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
