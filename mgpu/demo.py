"""`python -m mgpu demo`: shard a small random-weight Wan DiT over rank processes and check it against one device.

What it does, end to end, with nothing downloaded: build diffusers' ``WanTransformer3DModel`` (real Wan model code)
with random weights, save it as safetensors (or GGUF), plan for this machine's devices, load it sharded with FSDP2
(each rank reads its own slice), run a few flow-matching Euler steps, run the same steps on one device, and print the
plan, the largest difference, the split of each step, step times, bytes all-gathered per step and the memory each
rank holds. Without a GPU it uses 2 cpu ranks over gloo.

``--parallel`` picks how the ranks share a step (``mgpu.families``): ``cfg`` (default) runs CFG and puts cond and
uncond on different ranks; ``sp`` runs without CFG (one row per step) and splits each step's tokens over every rank
(Ulysses sequence parallelism); ``cfg+sp`` runs CFG on 2 groups of ranks that each split their tokens (2 x 2 on
``--ranks 4``).

``--weights`` picks how the checkpoint stores the blocks' Linear weights (the bulk of a real DiT): ``fp32``/``bf16``
(every tensor), ``fp8`` (float8_e4m3fn, ``mgpu.weights.quant.Fp8Weight``), ``fp8-scaled`` (fp8 with one float32
scale per weight, replicated, multiplied after the gather), ``gguf-q8_0`` / ``gguf-q4_k`` (a GGUF file,
``mgpu.weights.gguf.GGUFWeight``; the other tensors F32). Quantized weights are sharded and all-gathered as stored and
dequantized after the gather; the one-device reference holds the same dequantized values. ``--lora`` adds a random
rank-8 LoRA on the attention projections (``mgpu.weights.lora.PatchSet``): patched in the ranks' rows of plain
weights, in the forward for quantized ones; the reference merges it in fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from mgpu.planning.devices import format_bytes, gpus, inventory
from mgpu.ranks import shm
from mgpu.errors import MgpuError

if TYPE_CHECKING:
    from mgpu.weights.lora import PatchSet

FACTORY = "mgpu.demo:wan_transformer"
GATHERED_OP = "mgpu.demo:gathered_bytes"
PARALLEL = ("cfg", "sp", "cfg+sp")
WEIGHTS = ("fp32", "bf16", "fp8", "fp8-scaled", "gguf-q8_0", "gguf-q4_k")
GGUF_TYPES = {"gguf-q8_0": "Q8_0", "gguf-q4_k": "Q4_K"}
FP8 = torch.float8_e4m3fn
PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}
LORA_RANK = 8
LORA_TARGETS = tuple(f"attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0"))


def wan_transformer(dim: int, layers: int, heads: int, ffn: int, text_dim: int, channels: int,
                    weights: str = "fp32"):
    """diffusers' Wan DiT at a chosen size (the rank processes call this by name, under meta), its parameters in
    ``weights``' storage: bf16, or the blocks' Linear weights fp8 / scaled fp8 (GGUF weights are wrapped by the
    loader, ``mgpu.weights.gguf.wrap_gguf_parameters``)."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as e:  # pragma: no cover - the test extra installs diffusers
        raise MgpuError("the demo needs diffusers for its Wan model code: pip install diffusers") from e
    from mgpu.weights.quant import store_as, store_scaled

    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=dim // heads,
                                  in_channels=channels, out_channels=channels, text_dim=text_dim, freq_dim=64,
                                  ffn_dim=ffn, num_layers=layers, rope_max_seq_len=256)
    if weights == "bf16":   # the parameters only: the rotary tables (buffers) stay float32, as in the reference
        for sub in model.modules():
            for name, p in sub._parameters.items():
                if p is not None:
                    sub._parameters[name] = nn.Parameter(p.data.to(torch.bfloat16), requires_grad=False)
    elif weights == "fp8":
        store_as(model.blocks, FP8)
    elif weights == "fp8-scaled":
        store_scaled(model.blocks, FP8)
    return model


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
    weights: str = "fp32"     # storage, one of WEIGHTS

    @property
    def tokens(self) -> int:
        """Tokens per batch row after the (1, 2, 2) patch embedding."""
        return self.frames * (self.height // 2) * (self.width // 2)

    @property
    def factory_kwargs(self) -> dict:
        return dict(dim=self.dim, layers=self.layers, heads=self.heads, ffn=self.ffn, text_dim=self.text_dim,
                    channels=self.channels, weights=self.weights)


@dataclass
class Checkpoint:
    """The demo's checkpoint file and what it holds."""

    path: str
    values: dict[str, torch.Tensor]      # every tensor as the file holds it, dequantized to float32: the reference
    quantized: list[str]                 # the block weights stored fp8 / GGUF-quantized (the rest: plain tensors)
    plain_dtype: torch.dtype             # the dtype the ranks hold the other tensors in
    weight_error: float                  # relative RMS error of the quantized weights vs the float32 originals
    nbytes: int = field(init=False)      # the file's size (taken when written: the file is temporary)

    def __post_init__(self) -> None:
        self.nbytes = os.path.getsize(self.path)


def random_state(cfg: DemoConfig) -> dict[str, torch.Tensor]:
    """Random float32 weights of a sensible scale (so the output is neither 0 nor inf), in diffusers' key layout."""
    torch.manual_seed(cfg.seed)
    model = wan_transformer(**{**cfg.factory_kwargs, "weights": "fp32"})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def is_block_linear(name: str, t: torch.Tensor) -> bool:
    """A block's Linear weight (attention projections, FFN): what quantized checkpoints quantize."""
    return name.startswith("blocks.") and name.endswith(".weight") and t.ndim == 2


def _relative_rms(original: dict[str, torch.Tensor], held: dict[str, torch.Tensor], names: list[str]) -> float:
    if not names:
        return 0.0
    err = sum(float((held[n] - original[n]).square().sum()) for n in names)
    return (err / sum(float(original[n].square().sum()) for n in names)) ** 0.5


def check_weights(cfg: DemoConfig) -> None:
    """Refuse a GGUF type whose blocks do not divide the model's rows, naming the flags to change."""
    qtype = GGUF_TYPES.get(cfg.weights)
    if qtype is None:
        return
    from mgpu.weights.gguf import QUANTIZED

    block = QUANTIZED[qtype][0]
    bad = [f"--{flag} {value}" for flag, value in (("dim", cfg.dim), ("ffn", cfg.ffn)) if value % block]
    if bad:
        raise MgpuError(f"--weights {cfg.weights}: {qtype} stores rows of whole {block}-value blocks, and "
                        f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of {block}; "
                        f"use multiples of {block} (e.g. --dim {block} --ffn {2 * block})")


def make_checkpoint(cfg: DemoConfig, directory: str) -> Checkpoint:
    """Write the random model in ``cfg.weights``' storage; the Checkpoint says what the file holds."""
    state = random_state(cfg)
    blocks = [n for n, t in state.items() if is_block_linear(n, t)]
    if cfg.weights in GGUF_TYPES:
        from mgpu.weights.gguf_write import write_gguf

        path = os.path.join(directory, "wan_demo.gguf")
        types = {n: GGUF_TYPES[cfg.weights] if n in blocks else "F32" for n in state}
        values = write_gguf(path, state, types, arch="wan")
        return Checkpoint(path, values, blocks, torch.float32, _relative_rms(state, values, blocks))
    from safetensors.torch import save_file

    path = os.path.join(directory, "wan_demo.safetensors")
    if cfg.weights in PLAIN:
        saved = {n: t.to(PLAIN[cfg.weights]) for n, t in state.items()}
        save_file(saved, path)
        return Checkpoint(path, {n: t.float() for n, t in saved.items()}, [], PLAIN[cfg.weights], 0.0)
    saved, values = dict(state), dict(state)
    for n in blocks:
        if cfg.weights == "fp8-scaled":
            from mgpu.weights.quant import SCALE_KEY, quantize_scaled

            saved[n], scale = quantize_scaled(state[n], FP8)
            saved[n.removesuffix("weight") + SCALE_KEY] = scale
            values[n] = saved[n].float() * scale
        else:
            saved[n] = state[n].to(FP8)
            values[n] = saved[n].float()
    save_file(saved, path)
    return Checkpoint(path, values, blocks, torch.float32, _relative_rms(state, values, blocks))


# ------------------------------------------------------------------------------------------ LoRA

@dataclass
class Lora:
    """A random LoRA as the ranks get it, and as the one-device reference merges it."""

    patch_set: PatchSet
    deltas: dict[str, torch.Tensor]     # weight name -> scale * up @ down, float32


def random_lora(cfg: DemoConfig, values: dict[str, torch.Tensor], rank: int = LORA_RANK) -> Lora:
    """Rank-``rank`` adapters on every block's attention projections (alpha = rank: scale 1), with deltas about half
    the size of the weights, so the output changes visibly."""
    from mgpu.weights.lora import PatchSet

    g = torch.Generator().manual_seed(cfg.seed + 2)
    patches, tensors, deltas = {}, {}, {}
    for i in range(cfg.layers):
        for target in LORA_TARGETS:
            name = f"blocks.{i}.{target}.weight"
            out_features, in_features = values[name].shape
            up = torch.randn(out_features, rank, generator=g) * 0.5 * rank ** -0.5
            down = torch.randn(rank, in_features, generator=g) * in_features ** -0.5
            tensors[f"{name}.up"], tensors[f"{name}.down"] = up, down
            patches[name] = [{"kind": "lora", "up": f"{name}.up", "down": f"{name}.down", "scale": 1.0}]
            deltas[name] = up @ down
    return Lora(PatchSet(patches, tensors, key=("demo-lora", cfg.seed, rank)), deltas)


def merged(ckpt: Checkpoint, lora: Lora) -> dict[str, torch.Tensor]:
    """The reference's weights with the LoRA merged in fp32; a weight the ranks hold as a plain tensor is patched in
    its rows and rounded to its dtype there (``mgpu.weights.lora``), so it is rounded here too; quantized ones get
    the LoRA in the forward, unrounded."""
    out = dict(ckpt.values)
    for name, delta in lora.deltas.items():
        w = ckpt.values[name] + delta
        out[name] = w if name in ckpt.quantized else w.to(ckpt.plain_dtype).float()
    return out


# ------------------------------------------------------------------------------------------ sampling

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


def sample(model, cfg: DemoConfig, dtype: torch.dtype, device: str = "cpu", guidance: bool = True,
           after_step: Callable[[], None] | None = None) -> Sampled:
    """Flow-matching Euler: with ``guidance`` one forward per step on the batch [cond, uncond], as ComfyUI batches
    them; without (cfg 1), one row per step. ``after_step`` runs after each step, outside its time."""
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
        if after_step is not None:
            after_step()
    out.latent = x
    return out


# ------------------------------------------------------------------------------------------ gathered bytes

_GATHERED: dict[str, int] = {}   # on a rank: all-gather output bytes per unit kind since the last GATHERED_OP
_UNIT: list[str] = ["?"]         # the FSDP unit unsharding now (set by the wrapped FSDPParamGroup.unshard)


def gathered_bytes(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: the bytes this rank's all-gathers produced since the last call, by unit ("blocks", "root"), then
    zero (the first call installs the count). Counted at the process group (each collective's output buffer),
    whatever FSDP thinks it gathers."""
    _count_all_gathers()
    counted = dict(_GATHERED)
    _GATHERED.clear()
    return counted


def _count_all_gathers() -> None:
    """Wrap the collectives FSDP2 all-gathers with (torch 2.13: all_gather_single; 2.11: all_gather_into_tensor),
    and FSDP2's unshard to know whose parameters they carry (private API: without it, every byte counts as "?")."""
    import torch.distributed as dist

    if getattr(dist, "_mgpu_demo_counted", False):
        return
    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is not None:
            def counted(output, *args, _original=original, **kwargs):
                _GATHERED[_UNIT[0]] = _GATHERED.get(_UNIT[0], 0) + output.numel() * output.element_size()
                return _original(output, *args, **kwargs)
            setattr(dist, name, counted)
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:   # pragma: no cover - a torch that moved it: totals only
        FSDPParamGroup = None
    if FSDPParamGroup is not None and hasattr(FSDPParamGroup, "unshard"):
        unshard = FSDPParamGroup.unshard

        def labelled(self, *args, **kwargs):
            fqn = getattr(self, "_module_fqn", None)
            _UNIT[0] = "?" if fqn is None else "blocks" if fqn.startswith("blocks.") else "root"
            try:
                return unshard(self, *args, **kwargs)
            finally:
                _UNIT[0] = "?"
        FSDPParamGroup.unshard = labelled
    dist._mgpu_demo_counted = True


# ------------------------------------------------------------------------------------------ the command

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
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (and the weights' "
                   "storage unless --weights says otherwise)")
    p.add_argument("--weights", choices=WEIGHTS, default=None,
                   help="checkpoint storage: fp32/bf16 every tensor; fp8, fp8-scaled (one scale per weight), "
                        "gguf-q8_0 or gguf-q4_k the blocks' Linear weights, gathered as stored (default: --dtype)")
    p.add_argument("--lora", action="store_true",
                   help=f"add a random rank-{LORA_RANK} LoRA on the attention projections")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per pool call before a rank counts as hung")
    t = p.add_argument_group("training (--train)")
    t.add_argument("--train", action="store_true",
                   help="train a LoRA over the ranks instead of sampling (--steps optimizer steps), against one device")
    t.add_argument("--rank", type=int, default=16, help="LoRA rank")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    t.add_argument("--rows", type=int, default=0, help="rows per optimizer step, split over the ranks (default 2 "
                   "per rank; with --parallel sp 1, its tokens split)")
    t.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute each block in backward instead of keeping its activations")


def rank_devices(machine: list, requested: int) -> list[str]:
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


def _what_is_stored(cfg: DemoConfig, ckpt: Checkpoint, compute: str) -> str:
    n = len(ckpt.quantized)
    rest = f"the other tensors {str(ckpt.plain_dtype).removeprefix('torch.')}"
    if cfg.weights in GGUF_TYPES:
        how = (f"GGUF: {n} block Linear weights {GGUF_TYPES[cfg.weights]} (gathered as blocks, dequantized "
               f"after), {rest}")
    elif cfg.weights == "fp8":
        how = f"{n} block Linear weights float8_e4m3fn (gathered as fp8 bytes, upcast after), {rest}"
    elif cfg.weights == "fp8-scaled":
        how = (f"{n} block Linear weights float8_e4m3fn with one float32 scale each (replicated on every rank; "
               f"w * scale after the gather), {rest}")
    else:
        how = f"every tensor {cfg.weights}"
    error = f"; quantized vs the fp32 originals: relative RMS {ckpt.weight_error:.2e}" if ckpt.quantized else ""
    return f"weights {cfg.weights}: {how}; compute {compute}{error}"


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


def _single_device(cfg: DemoConfig, values: dict[str, torch.Tensor], device: str, dtype: torch.dtype,
                   guidance: bool, threads: int) -> Sampled:
    """The plain module holding ``values`` on one device, as ComfyUI would run it; on the CPU with ``threads``
    threads, one cpu rank's share of the cores (the pool gives each rank cores / ranks), so the step times compare a
    device with N of them."""
    reference = wan_transformer(**{**cfg.factory_kwargs, "weights": "fp32"})
    reference.load_state_dict(values)
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


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """max |a - b| and that over max |b|."""
    diff = (a.cpu() - b.cpu()).abs().max().item()
    return diff, diff / max(b.abs().max().item(), 1e-12)


def _gathered_lines(gathered: int, measured: list[dict[str, int]], ckpt: Checkpoint, n: int,
                    compute: str) -> list[str]:
    """All-gathered bytes per step, by the ranks' load reply and as counted at the process group, each beside what
    the same parameters take in bf16 storage."""
    bf16 = 2 * sum(t.numel() for t in ckpt.values.values())
    blocks_bf16 = 2 * sum(t.numel() for name, t in ckpt.values.items() if name.startswith("blocks."))
    lines = [f"all-gathered per step (ranks' load reply: every parameter once, as gathered): {format_bytes(gathered)}"
             f" = {gathered / bf16:.3f} x the model in bf16 ({format_bytes(bf16)}); "
             f"{format_bytes(gathered * (n - 1) // n)} received by each rank; model file {format_bytes(ckpt.nbytes)}"]
    if measured:
        mean = {k: sum(m.get(k, 0) for m in measured) // len(measured) for k in set().union(*measured)}
        total = sum(mean.values())
        line = (f"measured at the process group (a rank's all-gather outputs, mean of {len(measured)} steps): "
                f"{format_bytes(total)} = {total / bf16:.3f} x the model in bf16")
        if "blocks" in mean:
            line += (f"; the blocks {format_bytes(mean['blocks'])} = {mean['blocks'] / blocks_bf16:.3f} x the "
                     f"blocks in bf16 ({format_bytes(blocks_bf16)}), the root unit (every parameter outside the "
                     f"blocks, gathered in {compute}) {format_bytes(mean.get('root', 0))}")
        lines.append(line)
    return lines


@contextlib.contextmanager
def work_dir():
    """The folder of the demo's checkpoint, removed however the demo ends. A private folder of the rank pool's kind
    (``mgpu.ranks.shm.private_dir``), so a demo killed by SIGKILL leaves nothing that the next pool start (this
    demo's or ComfyUI's) does not sweep; SIGTERM, which would end the process without any cleanup, ends it through
    this ``finally`` and the pool's (ranks stopped, segments removed) with status 143."""
    path = shm.private_dir(tempfile.gettempdir())
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum)) if main else None
    try:
        yield path
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        shm.remove_private_dir(path)


def run(args: argparse.Namespace) -> int:
    from mgpu.ranks.pool import PoolConfig, RankPool
    from mgpu.sharding.sharded import ModelSpec, ShardedModule
    from mgpu.planning.sizing import size_component
    from mgpu.weights.lora import PatchedModule

    if args.dim % args.heads:
        raise MgpuError(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.train:
        from mgpu import demo_train

        return demo_train.run(args)
    cfg = DemoConfig(dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn, steps=args.steps,
                     weights=args.weights or args.dtype)
    check_weights(cfg)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    guidance = args.parallel != "sp"
    machine = inventory()
    devices = rank_devices(machine, args.ranks)
    n = len(devices)
    with work_dir() as tmp:
        ckpt = make_checkpoint(cfg, tmp)
        size = size_component(ckpt.path)
        print(f"model: diffusers WanTransformer3DModel, dim {cfg.dim}, {cfg.layers} blocks, {cfg.heads} heads, "
              f"{format_bytes(ckpt.nbytes)} ({size.family}); {cfg.tokens} tokens per row")
        print(_what_is_stored(cfg, ckpt, args.dtype))
        print(_what_runs(args.parallel, devices, cfg.steps))
        if devices[0] != "cpu":
            _print_plan(cfg, size, machine, args.dtype, guidance)
        threads = max(1, (os.cpu_count() or 1) // n)   # what the pool gives each cpu rank
        lora = random_lora(cfg, ckpt.values) if args.lora else None
        single = _single_device(cfg, merged(ckpt, lora) if lora else ckpt.values, devices[0], dtype, guidance,
                                threads)
        base = _single_device(cfg, ckpt.values, devices[0], dtype, guidance, threads) if lora else None

        pool = RankPool(PoolConfig(devices=devices, call_timeout_s=args.timeout))
        try:
            t0 = time.perf_counter()
            pool.start()
            started = time.perf_counter() - t0
            spec = ModelSpec(factory=FACTORY, checkpoint=ckpt.path, factory_kwargs=cfg.factory_kwargs,
                             param_dtype=args.dtype, cached_inputs=("encoder_hidden_states",),
                             sp_degree=_sp_degree(args.parallel, n))
            model = PatchedModule(pool, spec) if lora else ShardedModule(pool, spec)
            t0 = time.perf_counter()
            loads = model.load()
            loaded = time.perf_counter() - t0
            patched = []
            if lora:
                model.set_patches(lora.patch_set)
                patched = model.sync_patches()
            pool.call(GATHERED_OP)   # installs the count; nothing gathered yet
            measured: list[dict[str, int]] = []
            sharded = sample(model, cfg, dtype, guidance=guidance,
                             after_step=lambda: measured.append(pool.call(GATHERED_OP)[0].payload))
            described = model.describe()
            stats = [r.payload for r in pool.call("stats")]
        finally:
            pool.close()

    diff, relative = _max_diff(sharded.latent, single.latent)
    scale = single.latent.abs().max().item()
    layout = loads[0].get("layout", {})
    print(f"ranks: {n} on {', '.join(devices)}; pool start {started:.1f} s, sharded load {loaded:.1f} s")
    if lora:
        changed, changed_rel = _max_diff(single.latent, base.latent)
        reply = patched[0]
        print(f"LoRA: rank {LORA_RANK} on the {len(lora.deltas)} attention projections, "
              f"{format_bytes(lora.patch_set.nbytes)} sent to the ranks (each received "
              f"{format_bytes(reply['received_bytes'])}): {reply['patched']} weights patched in their rows, "
              f"{reply['at_forward']} in the forward ({format_bytes(reply['forward_bytes'])} of fp32 adapters per "
              f"rank); it changes the one-device output by {changed:.3g} (relative {changed_rel:.2e})")
    print(f"max |sharded - single| = {diff:.3g} (output scale {scale:.3g}, relative {relative:.2e})")
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
    for line in _gathered_lines(described[0]["gathered_bytes_per_forward"], measured, ckpt, n, args.dtype):
        print(line)
    for load, st in zip(loads, stats):
        mem = st["max_allocated"] if st["max_allocated"] is not None else st["rss"]
        kind = "peak allocated" if st["max_allocated"] is not None else "RSS"
        print(f"  rank {st['rank']} ({st['device']}): holds {format_bytes(load['local_param_bytes'])} of parameters, "
              f"read {format_bytes(load['report']['bytes_read'])} from disk, {kind} {format_bytes(mem)}")
    ok = diff <= (1e-4 if dtype == torch.float32 else 5e-2) * max(scale, 1.0)
    print("OK: sharded matches one device" if ok else "MISMATCH: sharded differs from one device")
    return 0 if ok else 1
