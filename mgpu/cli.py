"""`python -m mgpu devices | plan | demo | export-lora`: the runtime from a shell, without ComfyUI.

Bad input exits with code 2 and one line on stderr; a plan that cannot fit exits with code 3 and the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys

from mgpu.errors import MgpuError, PlanError
from mgpu.planning import examples
from mgpu.planning.training import CHECKPOINTING, DTYPE_BYTES, OPTIMIZER_STATES


def _add_devices_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", metavar="SPEC",
                   help="simulate devices instead of reading the live ones, e.g. 2x24GiB, cuda:0=80GiB,cuda:1=24GiB, "
                        "4x16GiB:pcie (default: env MGPU_DEVICES, else NVML / torch.cuda)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mgpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="list the GPUs and the host with their free memory and links")
    _add_devices_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("plan", help="decide where the text encoder, DiT and VAE live for a workload")
    p.add_argument("--example", metavar="NAME", help="plan a full-size example instead of your files (their headers, "
                   "written to a temporary folder; nothing downloaded): "
                   + ", ".join(examples.EXAMPLES) + f"; devices {examples.DEVICES} unless --devices")
    p.add_argument("--dit", metavar="FILE", help="diffusion transformer (.safetensors, .gguf or sharded folder)")
    p.add_argument("--dit-low-noise", metavar="FILE",
                   help="a second expert on the same devices (Wan 2.2 A14B: --dit is then the high-noise one); "
                        "planned both resident if memory allows, else one at a time with the cost of each switch")
    p.add_argument("--text-encoder", metavar="FILE")
    p.add_argument("--vae", metavar="FILE")
    p.add_argument("--dit-weight-dtype", metavar="DTYPE", help="run the DiT in this weight dtype (e.g. fp8_e4m3fn, bf16)")
    p.add_argument("--text-encoder-dtype", metavar="DTYPE")
    _add_devices_arg(p)
    p.add_argument("--width", type=int, help="default 832 (an example: its template's)")
    p.add_argument("--height", type=int, help="default 480 (an example: its template's)")
    p.add_argument("--frames", type=int, help="default 81 (an example: its template's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cfg", action=argparse.BooleanOptionalAction, default=True,
                   help="classifier-free guidance (cond + uncond per step); --no-cfg for distilled models")
    p.add_argument("--reserve", default="512MiB", metavar="BYTES", help="memory kept free on every GPU (default 512MiB)")
    p.add_argument("--offload", action="store_true", help="allow CPU offload of the DiT weights (slow)")
    p.add_argument("--speed", action="store_true", help="shard over all GPUs even when fewer would fit")
    p.add_argument("--no-sp", dest="sequence_parallel", action="store_false",
                   help="no sequence parallelism: split only the batch (CFG) rows over the ranks")
    p.add_argument("--keep-text-encoder", action="store_true",
                   help="keep the text encoder loaded while sampling (default: freed before sampling)")
    p.add_argument("--json", action="store_true", help="print the Plan as JSON")
    t = p.add_argument_group("training (MGPU Train LoRA)", "--train plans a LoRA training step instead of sampling: "
                             "the size is one dataset item's, --batch the rows per step; no CFG")
    t.add_argument("--train", action="store_true", help="plan training, not sampling")
    t.add_argument("--lora-rank", type=int, default=8, help="the LoRA's rank (default 8, MGPU Train LoRA's)")
    t.add_argument("--optimizer", default="AdamW", choices=list(OPTIMIZER_STATES))
    t.add_argument("--checkpointing", default="auto", choices=list(CHECKPOINTING),
                   help="gradient checkpointing; auto: off when it fits, else on (default)")
    t.add_argument("--grad-accumulation", type=int, default=1, help="forwards per optimizer step (default 1)")
    t.add_argument("--training-dtype", default="bf16", choices=list(DTYPE_BYTES))
    t.add_argument("--lora-dtype", default="bf16", choices=list(DTYPE_BYTES))
    t.add_argument("--dataset", type=int, default=1, help="latents in the dataset, held in host RAM (default 1)")

    p = sub.add_parser("demo", help="shard a small random Wan DiT over rank processes and compare with one device")
    from mgpu.demo import add_arguments

    add_arguments(p)

    p = sub.add_parser("export-lora", help="write a MGPU Train LoRA checkpoint's LoRA as one safetensors file")
    p.add_argument("checkpoint", help="a checkpoint folder: <ComfyUI>/output/mgpu_training/<run>/step_<N>")
    p.add_argument("out", help="the LoRA file to write (.safetensors), for Load LoRA / LoraLoaderModelOnly")
    p.add_argument("--key-dir", metavar="DIR", help="the folder of the signing key (default: <ComfyUI>/user/"
                   "comfy-mgpu, found from the checkpoint's place in ComfyUI's output folder)")
    return parser


def _cmd_export_lora(args: argparse.Namespace) -> int:
    """Only a checkpoint this machine's ComfyUI signed is read (its metadata is a pickle)."""
    from pathlib import Path

    from mgpu.training import checkpoints

    folder = Path(args.checkpoint).resolve()
    comfyui = folder.parents[3] if len(folder.parents) > 3 else folder   # <ComfyUI>/output/mgpu_training/<run>/...
    key_dir = Path(args.key_dir) if args.key_dir else comfyui / "user" / "comfy-mgpu"
    if not (key_dir / checkpoints.KEY_FILE).is_file():
        raise MgpuError(f"no signing key in {key_dir}: pass --key-dir <ComfyUI>/user/comfy-mgpu (the ComfyUI whose "
                        "MGPU Train LoRA wrote the checkpoint)")
    if not args.out.endswith(".safetensors"):
        raise MgpuError(f"{args.out}: the LoRA is written as safetensors: name it *.safetensors")
    keys = checkpoints.export_lora(folder, checkpoints.signing_key(key_dir), args.out)
    print(f"{args.out}: {len(keys)} tensors of the LoRA in {folder}")
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    from mgpu.planning.devices import format_bytes, inventory

    devices = inventory(args.devices)
    if args.json:
        print(json.dumps([d.to_dict() for d in devices], indent=2))
        return 0
    for d in devices:
        extra = []
        if d.capability:
            extra.append(f"sm {d.capability[0]}.{d.capability[1]}")
        if d.pcie_gen:
            extra.append(f"PCIe {d.pcie_gen} x{d.pcie_width}")
        if d.links:
            extra.append("links " + ", ".join(f"cuda:{i} {kind}" for i, kind in d.links))
        if d.simulated:
            extra.append("simulated")
        print(f"{d.id:8} {d.name:32} free {format_bytes(d.free_bytes):>10} of {format_bytes(d.total_bytes):>10}"
              + (f"  ({'; '.join(extra)})" if extra else ""))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    """``--example``: the example's files, workload and devices fill what the command line leaves out."""
    if args.example is None:
        if args.dit is None:
            raise MgpuError("give the DiT with --dit FILE, or plan an example with --example "
                            + "|".join(examples.EXAMPLES))
        for name, default in (("width", 832), ("height", 480), ("frames", 81)):
            setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
        return _plan_files(args)
    example = examples.EXAMPLES.get(args.example)
    if example is None:
        raise MgpuError(f"--example {args.example!r} is not an example; pick one of {', '.join(examples.EXAMPLES)}")
    for name in ("width", "height", "frames"):
        setattr(args, name, getattr(example, name) if getattr(args, name) is None else getattr(args, name))
    args.devices = args.devices or examples.DEVICES
    args.dit_weight_dtype = args.dit_weight_dtype or example.dit_weight_dtype
    print(f"example: {example.title}; devices {args.devices}", file=sys.stderr if args.json else sys.stdout)
    with examples.example_files(args.example) as files:
        for role, path in files.items():   # the roles are the options' names: --dit, --text-encoder, ...
            setattr(args, role, path)
        return _plan_files(args)


def _plan_files(args: argparse.Namespace) -> int:
    from mgpu.planning.devices import inventory, parse_bytes
    from mgpu.planning.estimates import Workload, weight_bytes
    from mgpu.planning.partition import Component, Policy, make_plan
    from mgpu.planning.sizing import size_component

    for name in ("width", "height", "frames", "batch"):
        if getattr(args, name) < 1:
            raise MgpuError(f"--{name} must be at least 1, got {getattr(args, name)}")
    components = [Component("dit", size_component(args.dit), args.dit_weight_dtype)]
    if args.dit_low_noise:
        components.append(Component("dit_low_noise", size_component(args.dit_low_noise), args.dit_weight_dtype))
    if args.text_encoder:
        components.append(Component("text_encoder", size_component(args.text_encoder), args.text_encoder_dtype))
    if args.vae:
        components.append(Component("vae", size_component(args.vae)))
    for c in components:  # a bad dtype is bad input: say so before reading any device
        weight_bytes(c.size, c.weight_dtype)
    devices = inventory(args.devices)
    train = None
    if args.train:
        from mgpu.planning.training import Training

        train = Training(lora_rank=args.lora_rank, optimizer=args.optimizer, checkpointing=args.checkpointing,
                         training_dtype=args.training_dtype, lora_dtype=args.lora_dtype, dataset=args.dataset,
                         grad_accumulation=args.grad_accumulation)
    workload = Workload(width=args.width, height=args.height, frames=args.frames, batch=args.batch,
                        cfg=args.cfg and not args.train, train=train)
    policy = Policy(reserve_bytes=parse_bytes(args.reserve), allow_offload=args.offload, prefer_speed=args.speed,
                    sequence_parallel=args.sequence_parallel,
                    free_text_encoder_before_sampling=not args.keep_text_encoder)
    for c in components:
        for w in c.size.warnings:
            print(f"warning: {c.size.path}: {w}", file=sys.stderr)
    plan = make_plan(components, devices, workload, policy)
    print(plan.to_json() if args.json else plan.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "devices":
            return _cmd_devices(args)
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "export-lora":
            return _cmd_export_lora(args)
        from mgpu.demo import run

        return run(args)
    except PlanError as e:
        print(f"error: no plan fits: {e}", file=sys.stderr)
        return 3
    except MgpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl+C: the ranks and files are already cleaned up on the way out
        print("interrupted", file=sys.stderr)
        return 130
