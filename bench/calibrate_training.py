"""Training memory of ComfyUI's own Wan blocks, measured beside the plan's estimate (issue 18 §1).

    COMFYUI_PATH=/path/to/ComfyUI python bench/calibrate_training.py [--tokens 256 512] [--families ...]
                                                                     [--rank 32] [--json out.json]

For each family: ComfyUI's network with one and with two real-dimension blocks (bf16 weights, random values), MGPU
Train LoRA's adapters in every layer (the host's ``first_adapters``, the ranks' ``build`` and ``attach``: ComfyUI's
weight adapters, bf16), run as a rank runs a training step: bf16 autocast, a forward with gradients on, then the
backward of a mean-square loss, with gradient checkpointing per block (the ranks' ``torch.utils.checkpoint``) and
without. ``memprobe.LiveBytes`` counts the storages created: what the forward leaves saved for the backward, and the
peak over forward + backward (the weights themselves are not counted; the adapters' gradients are). Two blocks minus
one isolate a block; two token counts give bytes per token and the fixed part. Printed as a markdown table beside
``mgpu.planning.training``'s formula for the same network: the formula must cover every measured peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from calibrate_memory import FAMILIES, forward_inputs, one_block_network, start_comfyui, write_header_only
from memprobe import LiveBytes, fit_line

TRAINABLE = ("wan2.1-t2v-1.3b", "wan2.2-ti2v-5b", "wan2.1-t2v-14b")   # LTX-Video is not trainable (NOT_TRAINABLE)


@dataclass
class Measured:
    """One network (``blocks`` blocks) at ``tokens`` tokens, batch 1: bytes created and alive."""
    blocks: int
    tokens: int
    checkpointing: bool
    saved: int    # alive when the forward returns (the output included)
    peak: int     # the most alive at once over forward and backward


@dataclass
class Row:
    family: str
    hidden: int
    ffn: int
    layers: int
    block_params: int
    lora_rank: int
    measured: list[dict]
    # per block, from two blocks minus one: (bytes per token, fixed bytes) of a line over the token counts
    saved_per_block: tuple[float, float]              # no checkpointing: what one block keeps for its backward
    checkpointed_per_block: tuple[float, float]       # checkpointing: what one block keeps (its inputs)
    backward_extra: tuple[float, float]               # no checkpointing: the peak above all that is saved
    checkpointed_backward_extra: tuple[float, float]  # checkpointing: the peak above all that is saved
    at_layers: dict                                   # tokens -> {"measured_*": the lines at all layers, "estimate_*"}
    seconds: float


def _adapted(path: Path, rank: int) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """ComfyUI's network for ``path`` with MGPU Train LoRA's adapters installed as the ranks install them."""
    from loaders.rank_factory import detect
    from loaders.train_adapters import build, training_mode
    from loaders.training import TrainSettings, first_adapters
    from mgpu.training import adapters as adapter_mod

    model = one_block_network(path)
    config, sd, _ = detect(str(path))
    base = config.get_model(sd, "", device="meta")
    torch.manual_seed(0)
    specs, first, _ = first_adapters(base, TrainSettings(rank=rank), {})
    found = build(specs, first, "bf16", torch.device("cpu"))
    with torch.no_grad():   # create_train's up starts at zero: give the backward real values to carry
        for adapter in found.values():
            for p in adapter.parameters():
                if p.requires_grad:
                    p.normal_(0, 0.02)
    adapter_mod.attach(model, found)
    training_mode(True)   # ComfyUI 0.33's rope and attention paths with autograd formulas, as its Train LoRA sets
    model.requires_grad_(False)
    params = list(adapter_mod.trainable(found).values())
    for p in params:
        p.requires_grad_(True)
    return model.train(), params


def _measure(model: torch.nn.Module, params: list, run, blocks: int, tokens: int, checkpointing: bool) -> Measured:
    undo = []
    if checkpointing:
        for block in model.blocks:
            inner = block.forward

            def checkpointed(*args, _inner=inner, **kwargs):
                return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

            block.forward = checkpointed
            undo.append(block)
    probe = LiveBytes()
    with probe, torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(model)
        saved = probe.current
        out.float().pow(2).mean().backward()
        del out
    for block in undo:
        del block.forward
    for p in params:
        p.grad = None
    return Measured(blocks, tokens, checkpointing, saved, probe.peak)


def family_row(name: str, folder: Path, tokens: list[int], rank: int) -> Row:
    from mgpu.planning.sizing import size_component
    from mgpu.planning.training import train_activation_bytes

    began = time.perf_counter()
    fam = FAMILIES[name]
    size = size_component(write_header_only(folder, name, fam.builder, layers=fam.layers, **fam.dims))
    runs: list[Measured] = []
    block_params = 0
    for blocks in (1, 2):
        model, params = _adapted(write_header_only(folder, f"{name}-{blocks}", fam.builder, layers=blocks, **fam.dims),
                                 rank)
        block_params = sum(p.numel() for p in model.blocks[0].parameters())
        for count in tokens:
            run = forward_inputs(size, count)
            for checkpointing in (False, True):
                runs.append(_measure(model, params, run, blocks, count, checkpointing))
        del model, params

    def pick(blocks: int, checkpointing: bool, what: str) -> list[int]:
        return [getattr(m, what) for m in runs if m.blocks == blocks and m.checkpointing == checkpointing]

    def line(values: list[float]) -> tuple[float, float]:
        return fit_line(tokens, values) if len(tokens) > 1 else (values[0] / tokens[0], 0.0)

    def diff(checkpointing: bool, what: str) -> list[int]:
        return [b - a for a, b in zip(pick(1, checkpointing, what), pick(2, checkpointing, what))]

    def extra(checkpointing: bool) -> list[int]:
        return [p - s for p, s in zip(pick(2, checkpointing, "peak"), pick(2, checkpointing, "saved"))]

    at_layers = {}
    layers = size.dims["layers"]
    for i, count in enumerate(tokens):
        out = {}
        for ckpt, key in ((False, "off"), (True, "on")):
            per_block = diff(ckpt, "saved")[i]
            out[f"measured_{key}"] = pick(1, ckpt, "saved")[i] + (layers - 1) * per_block + extra(ckpt)[i]
            out[f"estimate_{key}"] = train_activation_bytes(size, count, 1, act_bytes=2, checkpointing=ckpt)
        at_layers[count] = out
    return Row(family=name, hidden=size.dims["hidden"], ffn=size.dims["ffn"], layers=layers,
               block_params=block_params, lora_rank=rank, measured=[asdict(m) for m in runs],
               saved_per_block=line(diff(False, "saved")), checkpointed_per_block=line(diff(True, "saved")),
               backward_extra=line(extra(False)), checkpointed_backward_extra=line(extra(True)),
               at_layers=at_layers, seconds=time.perf_counter() - began)


def markdown(report: dict) -> str:
    lines = [f"ComfyUI {report['comfyui_version']}, torch {report['torch']}, LoRA rank {report['rank']}, bf16, "
             "batch 1; U = hidden x 2 bytes, F = ffn x 2 bytes, W = one block's weights in bf16",
             "",
             "| DiT | per block saved (U/token; fixed W) | checkpointed per block (U/token) | backward above saved, "
             "off / on (U/token; fixed W) | tokens | all layers, measured off / on | estimate off / on | "
             "estimate / measured |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        unit, weights = 2 * r["hidden"], 2 * r["block_params"]

        def u(pair):
            return f"{pair[0] / unit:.2f}; {pair[1] / weights:.2f}"

        for count, at in r["at_layers"].items():
            ratio = f"{at['estimate_off'] / at['measured_off']:.2f} / {at['estimate_on'] / at['measured_on']:.2f}"
            lines.append(f"| {r['family']} | {u(r['saved_per_block'])} | {r['checkpointed_per_block'][0] / unit:.2f} "
                         f"| {u(r['backward_extra'])} / {u(r['checkpointed_backward_extra'])} | {count} | "
                         f"{at['measured_off'] / 2**20:,.0f} / {at['measured_on'] / 2**20:,.0f} MiB | "
                         f"{at['estimate_off'] / 2**20:,.0f} / {at['estimate_on'] / 2**20:,.0f} MiB | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--families", nargs="+", default=list(TRAINABLE[:1]), choices=list(TRAINABLE))
    ap.add_argument("--rank", type=int, default=32, help="the LoRA's rank")
    ap.add_argument("--json", help="also write every number to this file")
    args = ap.parse_args(argv)
    comfyui, version = start_comfyui()
    if comfyui is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="mgpu-calibrate-train-") as tmp:
        rows = [asdict(family_row(name, Path(tmp), args.tokens, args.rank)) for name in args.families]
    report = {"comfyui_version": version, "torch": torch.__version__, "rank": args.rank, "rows": rows}
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
