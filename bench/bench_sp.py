"""Benchmark of Ulysses sequence parallelism (issue 10): one cfg-1 step of a DiT on N cpu ranks splitting its tokens
against the same step on 1 rank, printed as ratios from one run. ``--model wan`` (default): diffusers' Wan DiT
(``mgpu.demo``); ``--model ltx2``: ComfyUI 0.33's own LTX-2 network (``LTXAVModel``, ``mgpu.families.ltxav``: the
video tokens split, the audio whole on every rank, the audio queries' video keys/values all-gathered).

    python bench/bench_sp.py [--ranks 2 --dim 256 --heads 4 --layers 2 --frames 4 --height 64 --width 64 --steps 3]
    python bench/bench_sp.py --quick            # a small size, for tests/test_bench_scripts.py
    COMFYUI_PATH=/path/to/ComfyUI-0.33 python bench/bench_sp.py --model ltx2 [--frames 4 --height 32 --width 32
        --audio-tokens 256] [--quick]          # under a Python with ComfyUI's requirements

Both go through the real path (RankPool, ShardedModule, FSDP2, the model's ``mgpu.families`` adapter), with the gathered
weights kept between steps (``reshard_after_forward=False``) so that the step is compute, not all-gathers, and with
the same threads per rank (cores / N: a rank stands for one device). Both pools are loaded at once and their timed
steps alternate, so that both see the same load from whatever else runs on the machine. Prints:

- step time N / 1 (target <= 0.7) and the split the ranks took (1 x N); the CPU time per step of each rank: the
  work split, which the other load of a shared machine leaves alone where it changes the wall-clock ratio;
- bytes each rank received per step from the other ranks, counted on the ranks by wrapping torch.distributed's
  ``all_to_all_single`` (the q/k/v/output exchanges), ``all_gather`` (the output gather; on LTX-2 those made inside
  the adapter's video-to-audio attention are counted apart: the video keys/values of the audio queries) and FSDP2's
  ``all_gather_single`` / ``all_gather_into_tensor``: the all-gathers of a step with the weights kept (none) and of
  one with them resharded after each forward (FSDP's default, measured on a second load of the model);
- per-rank activation memory against N = 1: the peak of live tensor bytes created during one forward
  (``bench/memprobe.py``'s ``LiveBytes``, at the operator level, what calibrate_memory.py measures), and the rise of
  the process's peak RSS (``VmHWM`` reset through ``/proc/self/clear_refs`` before the forward, after ``malloc_trim``);
- the largest difference between the N-rank and 1-rank outputs (LTX-2: of each stream, video and audio).

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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mgpu.demo import FACTORY, DemoConfig, make_checkpoint  # noqa: E402
from mgpu.planning.devices import format_bytes  # noqa: E402

FORWARD_OP = "mgpu.sharding.model_ops:forward"
KINDS = {"all_to_all_single": "all_to_all", "all_gather": "output_gather", "all_gather_single": "fsdp_all_gather",
         "all_gather_into_tensor": "fsdp_all_gather"}
KV_GATHER = "kv_all_gather"   # LTX-2: the all-gathers inside the adapter's video-to-audio attention
_counts: dict[str, dict[str, int]] = {}
_scope: list[str] = []        # the kind the all-gathers made now count as, when not KINDS'


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
        kind = _scope[-1] if _scope and name == "all_gather" else KINDS[name]
        entry = _counts.setdefault(kind, {"calls": 0, "buffer_bytes": 0, "from_other_ranks": 0})
        entry["calls"] += 1
        entry["buffer_bytes"] += buffer
        entry["from_other_ranks"] += others
        return original(*args, **kwargs)
    call.counted = True
    return call


def _scoped(kind: str, original: Callable) -> Callable:
    """``original``, with the all-gathers made inside it counted as ``kind``."""
    def call(*args, **kwargs):
        _scope.append(kind)
        try:
            return original(*args, **kwargs)
        finally:
            _scope.pop()
    call.counted = True
    return call


def count_collectives(ctx, payload: dict, tensors: dict) -> dict:
    """Wrap the collectives once per rank process; return what was counted since the last call, and reset."""
    from mgpu.families.ltxav import _AvSpForward

    for name in KINDS:
        original = getattr(dist, name, None)
        if original is not None and not getattr(original, "counted", False):
            setattr(dist, name, _counted(name, original))
    if not getattr(_AvSpForward.gathered_attention, "counted", False):   # looked up at each forward
        _AvSpForward.gathered_attention = _scoped(KV_GATHER, _AvSpForward.gathered_attention)
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


def warm_ltx2(ctx, payload: dict, tensors: dict) -> dict:
    """Import ComfyUI's LTX-2 code, so that load time and RSS measure the weights, not the import of ComfyUI."""
    _import_comfyui()
    import comfy.ldm.lightricks.av_model  # noqa: F401

    return {}


# ------------------------------------------------------------------------------------------------ LTX-2 (ComfyUI 0.33)

AUDIO_CHANNELS, FREQ_BINS = 8, 16   # LTX-2's audio latent (ComfyUI fixes both): 128 values per audio token


@dataclass(frozen=True)
class Ltx2Config:
    """A small LTX-2 network and one cfg-1 step of it: video heads x head_dim (the heads split over the ranks),
    audio heads x audio_head_dim, FFNs 4 x dim (ComfyUI's); video latent patch 1, so frames x height x width tokens."""

    heads: int = 4
    head_dim: int = 64
    audio_heads: int = 4
    audio_head_dim: int = 32
    layers: int = 2
    channels: int = 16
    caption: int = 64           # text channels of each stream's half of the context
    frames: int = 4
    height: int = 32
    width: int = 32
    audio_tokens: int = 256
    text_tokens: int = 32

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width

    @property
    def factory_kwargs(self) -> dict:
        return dict(heads=self.heads, head_dim=self.head_dim, audio_heads=self.audio_heads,
                    audio_head_dim=self.audio_head_dim, layers=self.layers, channels=self.channels,
                    caption=self.caption)


def _import_comfyui() -> None:
    """ComfyUI (COMFYUI_PATH) importable here as calibrate_memory.py makes it: on the CPU, pytorch (sdpa) attention
    as on NVIDIA GPUs, the checkout before the pack (whose ``nodes`` must not shadow ComfyUI's), tests/ beside."""
    from calibrate_memory import import_comfyui

    import_comfyui(os.environ["COMFYUI_PATH"])


def ltx2_network(heads: int, head_dim: int, audio_heads: int, audio_head_dim: int, layers: int, channels: int,
                 caption: int) -> torch.nn.Module:
    """ComfyUI's own LTXAVModel at a chosen size with LTX-2.3's options (text cross-attention AdaLN, gated attention,
    split rope on token middles, the keyframe position embedding), as tests/sp_ltxv_models.py's ``tiny_ltxav``; the
    ranks call it by name, under meta."""
    _import_comfyui()
    import comfy.ops
    from comfy.ldm.lightricks.av_model import LTXAVModel

    return LTXAVModel(in_channels=channels, audio_in_channels=AUDIO_CHANNELS * FREQ_BINS,
                      cross_attention_dim=heads * head_dim, audio_cross_attention_dim=audio_heads * audio_head_dim,
                      attention_head_dim=head_dim, audio_attention_head_dim=audio_head_dim, num_attention_heads=heads,
                      audio_num_attention_heads=audio_heads, caption_channels=caption, num_layers=layers,
                      cross_attention_adaln=True, apply_gated_attention=True, rope_type="split",
                      use_middle_indices_grid=True, use_keyframes_abs_pos_embedding=True,
                      connector_num_attention_heads=2, connector_attention_head_dim=8, connector_num_layers=1,
                      operations=comfy.ops.disable_weight_init)


def ltx2_checkpoint(cfg: Ltx2Config, folder: str) -> tuple[str, int]:
    """Seeded weights in ComfyUI's key layout (``model.diffusion_model.``), as the tests write them."""
    import tiny_models as tm

    path = os.path.join(folder, "ltx2.safetensors")
    tm.save_checkpoint(tm.seeded_init(ltx2_network(**cfg.factory_kwargs)), path)
    return path, os.path.getsize(path)


def ltx2_inputs(cfg: Ltx2Config) -> dict:
    """One cfg-1 step as ComfyUI's LTXAV BaseModel passes it: [video, audio] latents, their timesteps, the context
    (video and audio halves) and its text mask."""
    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([0.5])
    return {"x": [torch.randn(1, cfg.channels, cfg.frames, cfg.height, cfg.width, generator=g),
                  torch.randn(1, AUDIO_CHANNELS, cfg.audio_tokens, FREQ_BINS, generator=g)],
            "timestep": (sigma, sigma), "context": torch.randn(1, cfg.text_tokens, 2 * cfg.caption, generator=g),
            "attention_mask": torch.ones(1, cfg.text_tokens, dtype=torch.long)}


def require_ltx2() -> None:
    """Exit naming what to do unless COMFYUI_PATH is a ComfyUI with LTX-2's network (0.33) that imports here."""
    path = os.environ.get("COMFYUI_PATH")
    how = ("run it as COMFYUI_PATH=/path/to/ComfyUI-0.33 .venv-comfyui-0.33.0/bin/python bench/bench_sp.py "
           "--model ltx2 (a Python with that ComfyUI's requirements)")
    if not path or not os.path.isfile(os.path.join(path, "comfy", "ldm", "lightricks", "av_model.py")):
        where = f"COMFYUI_PATH={path} has no" if path else "COMFYUI_PATH is not set, so there is no"
        sys.exit(f"bench_sp.py --model ltx2 needs ComfyUI 0.33 or later: {where} comfy/ldm/lightricks/av_model.py "
                 f"(LTXAVModel); {how}")
    try:
        _import_comfyui()
        import comfy.ldm.lightricks.av_model  # noqa: F401
    except ImportError as e:
        sys.exit(f"bench_sp.py --model ltx2: ComfyUI at {path} does not import under {sys.executable} ({e}); {how}")


# ------------------------------------------------------------------------------------------------ host side

@dataclass
class Workload:
    """What the ranks run: a model (factory + checkpoint), one cfg-1 step's inputs and how the model is called."""

    factory: str
    factory_kwargs: dict
    inputs: Callable[[], dict]           # fresh inputs for each pool
    tokens: str                          # the tokens of a step, in words
    cached_inputs: tuple[str, ...]
    warm: tuple[str, dict]               # the rank op that imports the model code before the load
    call_kwargs: dict = field(default_factory=dict)
    streams: tuple[str, ...] = ("output",)

    def outputs(self, out: torch.Tensor | list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's output by stream (Wan: one tensor; LTX-2: video, audio), each compared to 1 rank's."""
        tensors = [out] if isinstance(out, torch.Tensor) else list(out)
        return dict(zip(self.streams, tensors, strict=True))


def step_inputs(cfg: DemoConfig) -> dict:
    """One cfg-1 step: a single batch row."""
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(1, cfg.channels, cfg.frames, cfg.height, cfg.width, generator=g),
            "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": torch.randn(1, cfg.text_tokens, cfg.text_dim, generator=g)}


def wan_workload(cfg: DemoConfig) -> Workload:
    return Workload(FACTORY, cfg.factory_kwargs, lambda: step_inputs(cfg), f"{cfg.tokens} tokens",
                    ("encoder_hidden_states",), ("bench_ops:warm", {"factory": FACTORY}), {"return_dict": False})


def ltx2_workload(cfg: Ltx2Config) -> Workload:
    return Workload("bench_sp:ltx2_network", cfg.factory_kwargs, lambda: ltx2_inputs(cfg),
                    f"{cfg.tokens} video + {cfg.audio_tokens} audio tokens", ("context",), ("bench_sp:warm_ltx2", {}),
                    streams=("video", "audio"))


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

    def __init__(self, n: int, threads: int, path: str, work: Workload):
        from mgpu.ranks.pool import PoolConfig, RankPool
        from mgpu.sharding.sharded import ModelSpec, ShardedModule

        self.n, self.work, self.inputs = n, work, work.inputs()
        self.pool = RankPool(PoolConfig(devices=["cpu"] * n, extra_sys_path=[HERE], call_timeout_s=1800,
                                        env={"OMP_NUM_THREADS": str(threads)}))
        self.spec = ModelSpec(factory=work.factory, checkpoint=path, factory_kwargs=work.factory_kwargs, sp_degree=n,
                              cached_inputs=work.cached_inputs, reshard_after_forward=False)
        self.times: list[float] = []
        try:
            self.pool.start()
            self.pool.call(*work.warm)
            self.counted()
            self.model = ShardedModule(self.pool, self.spec)
            self.model.load()
            self.output = work.outputs(self.step())   # records the prefetch order; gathers every unit once, keeps them
            self.first_step = self.counted()
        except BaseException:
            self.pool.close()
            raise

    def step(self) -> torch.Tensor | list[torch.Tensor]:
        return self.model(**self.inputs, **self.work.call_kwargs)

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
        model(**self.inputs, **self.work.call_kwargs)
        self.counted()
        model(**self.inputs, **self.work.call_kwargs)
        counted = self.counted()
        model.free()
        return counted


def measure(n: int, threads: int, path: str, work: Workload, steps: int) -> tuple[dict, dict]:
    """1 rank and ``n`` ranks, both loaded at once; their timed steps alternate, so that both see the same load
    from whatever else runs on the machine."""
    one = many = None
    try:
        one = Ranks(1, threads, path, work)
        many = Ranks(n, threads, path, work)
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
    diffs = {name: (many["output"][name] - ref).abs().max().item() / ref.abs().max().item()
             for name, ref in one["output"].items()}
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
            "kv_all_gather": _bytes(many["per_step_kept"], KV_GATHER),
        },
        "all_to_all_calls_per_step": _bytes(many["per_step_kept"], "all_to_all", "calls"),
        "kv_all_gather_calls_per_step": _bytes(many["per_step_kept"], KV_GATHER, "calls"),
        "activation_bytes": {"live_peak_1": live_one, f"live_peak_{n}": live, "rss_rise_1": rss_one,
                             f"rss_rise_{n}": rss},
        "activation_ratio": {"live_peak": round(max(live) / live_one, 3), "rss_rise": round(max(rss) / rss_one, 3)},
        "max_relative_difference": max(diffs.values()),
        "relative_difference_per_stream": diffs,
    }


def print_report(r: dict, tokens: str) -> None:
    n, b = r["ranks"], r["bytes_per_step_from_other_ranks"]
    s = r["step_seconds"]
    print(f"step (cfg 1, {tokens}): 1 rank {s['1'] * 1e3:.0f} ms, {n} ranks split "
          f"{r['split'][0]}x{r['split'][1]} {s[str(n)] * 1e3:.0f} ms -> ratio {n}/1 {r['step_ratio']:.2f} "
          "(target <= 0.7)")
    c = r["cpu_seconds_per_step"]
    print(f"CPU time per step: 1 rank {c['1'] * 1e3:.0f} ms, {n} ranks "
          + ", ".join(f"{x * 1e3:.0f}" for x in c[str(n)]) + f" ms -> busiest rank / 1 rank {r['cpu_ratio']:.2f} "
          "(the work split; the wall-clock ratio also depends on what else runs on these cores)")
    kv = (f", video keys/values of the audio queries {format_bytes(b['kv_all_gather'])} "
          f"({r['kv_all_gather_calls_per_step']} all-gathers)" if r["kv_all_gather_calls_per_step"] else "")
    print(f"received per rank per step from the other ranks: all-to-alls {format_bytes(b['all_to_all'])} "
          f"({r['all_to_all_calls_per_step']} calls), output gather {format_bytes(b['output_gather'])}{kv}; FSDP "
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
    streams = r["relative_difference_per_stream"]
    each = f" ({', '.join(f'{k} {v:.2e}' for k, v in streams.items())})" if len(streams) > 1 else ""
    print(f"max |{n} ranks - 1 rank| / max |1 rank| = {r['max_relative_difference']:.2e}{each}")


def wan_setup(args: argparse.Namespace, folder: str) -> tuple[Workload, str, int]:
    """The Wan workload, its checkpoint written in ``folder`` (path, bytes)."""
    cfg = DemoConfig(dim=args.dim, layers=args.layers, heads=args.heads, ffn=args.ffn, text_dim=args.dim,
                     frames=args.frames, height=args.height, width=args.width)
    ckpt = make_checkpoint(cfg, folder)
    print(f"model: Wan DiT dim {cfg.dim}, {cfg.heads} heads, {cfg.layers} blocks, ffn {cfg.ffn}, "
          f"{format_bytes(ckpt.nbytes)} fp32; {cfg.tokens} tokens per step, 1 row (cfg 1)")
    return wan_workload(cfg), ckpt.path, ckpt.nbytes


def ltx2_setup(args: argparse.Namespace, folder: str) -> tuple[Workload, str, int]:
    """The LTX-2 workload, its checkpoint written in ``folder`` (path, bytes)."""
    cfg = Ltx2Config(heads=args.heads, head_dim=args.dim // args.heads, audio_heads=args.audio_heads,
                     audio_head_dim=args.audio_dim // args.audio_heads, layers=args.layers, frames=args.frames,
                     height=args.height, width=args.width, audio_tokens=args.audio_tokens)
    path, nbytes = ltx2_checkpoint(cfg, folder)
    work = ltx2_workload(cfg)
    print(f"model: ComfyUI LTXAVModel (LTX-2) video {cfg.heads} heads x {cfg.head_dim}, audio {cfg.audio_heads} x "
          f"{cfg.audio_head_dim}, {cfg.layers} blocks, FFNs 4 x dim, {format_bytes(nbytes)} fp32; {work.tokens} per "
          "step, 1 row (cfg 1)")
    return work, path, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("wan", "ltx2"), default="wan",
                    help="wan: diffusers' Wan DiT; ltx2: ComfyUI 0.33's LTXAVModel (COMFYUI_PATH, its requirements)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256, help="hidden size (ltx2: of the video stream)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (ltx2: of the video stream)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=1024, help="wan only (LTX-2's FFNs are 4 x dim)")
    ap.add_argument("--audio-dim", type=int, default=128, help="ltx2: the audio stream's hidden size")
    ap.add_argument("--audio-heads", type=int, default=4, help="ltx2: the audio stream's heads (whole on every rank)")
    ap.add_argument("--audio-tokens", type=int, default=256, help="ltx2: audio latent frames, one token each")
    ap.add_argument("--frames", type=int, default=4, help="latent frames")
    ap.add_argument("--height", type=int, help="latent height (default: wan 64, patch 2: tokens frames x height/2 x "
                    "width/2; ltx2 32, patch 1: tokens frames x height x width)")
    ap.add_argument("--width", type=int)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a small size that runs in about a minute (tests)")
    ap.add_argument("--json", metavar="FILE", help="also write the numbers as JSON")
    args = ap.parse_args()
    ltx2 = args.model == "ltx2"
    args.height = args.height or (32 if ltx2 else 64)
    args.width = args.width or (32 if ltx2 else 64)
    if args.quick:
        args.dim, args.heads, args.layers, args.ffn, args.frames, args.height, args.width, args.steps = (
            64, 2, 2, 128, 3, 16, 10, 1)
        if ltx2:   # 120 video tokens as for wan (patch 1), 16 audio tokens of 2 x 8
            args.dim, args.height, args.width = 32, 4, 10
            args.audio_dim, args.audio_heads, args.audio_tokens = 16, 2, 16
    if args.heads % args.ranks:
        ap.error(f"--heads {args.heads} must be a multiple of --ranks {args.ranks} (each rank attends whole heads)")
    if ltx2:
        require_ltx2()
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load avg {os.getloadavg()[0]:.1f}; cpu ranks x {threads} threads (gloo), weights kept between steps")
    with tempfile.TemporaryDirectory(prefix="mgpu-bench-sp-") as tmp:
        work, path, nbytes = (ltx2_setup if ltx2 else wan_setup)(args, tmp)
        one, many = measure(args.ranks, threads, path, work, args.steps)
    result = report(one, many, nbytes)
    print_report(result, work.tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
