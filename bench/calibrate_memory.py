"""Memory estimates beside ComfyUI's own reservations and a measured peak, per supported family (issue 7, part 3).

    COMFYUI_PATH=/path/to/ComfyUI python bench/calibrate_memory.py [--tokens 512 1024 2048 4096] [--json out.json]

Runs on the CPU, under a Python that has ComfyUI's requirements, in a few minutes on 2 cores. For each DiT family:

* ComfyUI's reservation: its ``BaseModel``, built on the meta device from a header-only checkpoint of the real size
  (``loaders.rank_factory.detect``), answers ``memory_required`` for the family's reference video, on the GPU branch
  (pytorch attention); ComfyUI then keeps ``max(minimum_inference_memory(), that + extra_reserved_memory())`` free.
* measured: ComfyUI's own network with one real-dimension block, in bf16 with pytorch (sdpa) attention, runs a
  forward at a few token counts; the peak of live tensor bytes minus the weights (``memprobe.LiveBytes``) gives
  bytes per token (a least-squares line), extrapolated to the reference video.
* ours: ``mgpu.planning.estimates.dit_activation_bytes`` at the same token counts (per-token slope) and at the reference
  video, with and without the budget rule.

VAEs: ComfyUI's ``VAE.memory_used_decode`` (built on meta) beside ``vae_decode_bytes``. Text encoders: ComfyUI keeps
``minimum_inference_memory()`` for UMT5/T5 beside ``text_encoder_activation_bytes``. Prints a markdown table;
``--json`` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

import torch  # noqa: E402

from memprobe import fit_line, forward_peak  # noqa: E402

GiB = 1 << 30


@dataclass(frozen=True)
class Family:
    """A supported DiT: how to write its layout (tests/ckpt_layouts.py) and the video it is usually run at."""
    builder: str            # ckpt_layouts function taking **dims and layers
    dims: dict
    layers: int
    video: tuple[int, int, int]   # width, height, frames
    vae: str | None = None  # VAE measured at the same video


FAMILIES = {
    "wan2.1-t2v-1.3b": Family("wan_dit", dict(dim=1536, ffn=8960), 30, (832, 480, 81)),
    "wan2.1-t2v-14b": Family("wan_dit", dict(dim=5120, ffn=13824), 40, (1280, 720, 81), vae="wan2.1-vae"),
    "wan2.2-ti2v-5b": Family("wan_dit", dict(dim=3072, ffn=14336, in_ch=48, out_ch=48), 30, (1280, 704, 121),
                             vae="wan2.2-vae"),
    "ltxv-2b": Family("ltxv_dit", dict(head_dim=64), 28, (768, 512, 97), vae="ltxv-vae"),
    "ltxv-13b": Family("ltxv_dit", dict(head_dim=128, cross_dim=4096), 48, (1216, 704, 121)),
}
VAES = {"wan2.1-vae": ("wan_vae", {}), "wan2.2-vae": ("wan_vae", {"version": "2.2"}), "ltxv-vae": ("ltxv_vae", {})}
TEXT_ENCODERS = {"umt5-xxl": "umt5_xxl", "t5-xxl": "t5_xxl"}


@dataclass
class DitRow:
    family: str
    video: str
    tokens: int
    hidden: int
    comfyui_memory_required: int        # BaseModel.memory_required, batch 1, GPU branch
    restated_memory_required: int       # mgpu.planning.estimates.comfyui_memory_required: must equal the above
    comfyui_reservation: int            # what load_models_gpu keeps free beside the weights
    ours_activations: int               # dit_activation_bytes at the video, batch 1
    ours_working_single: int            # dit_working_bytes(batch=1): the budget rule on one GPU (with overhead)
    ours_working_fsdp: int              # dit_working_bytes(batch=1, comfyui=False) (FSDP buffers not included)
    measured_tokens: list[int] = field(default_factory=list)
    measured_peaks: list[int] = field(default_factory=list)
    measured_bytes_per_token: float = 0.0
    measured_fixed_bytes: float = 0.0
    ours_bytes_per_token: float = 0.0
    measured_at_video: int = 0           # the measured line extrapolated to the video's tokens
    seconds: float = 0.0


def import_comfyui(comfyui: str, cpu: bool = True) -> None:
    """Make ComfyUI importable here as the ranks do: the checkout first (the pack's ``nodes`` must not shadow
    ComfyUI's), pytorch (sdpa) attention as on NVIDIA GPUs."""
    for path in (str(ROOT / "tests"), str(ROOT), comfyui):
        if path not in sys.path:
            sys.path.insert(0, path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = cpu
    comfy.cli_args.args.use_pytorch_cross_attention = True
    import comfy.model_management  # noqa: F401  (reads the flags above)


def start_comfyui() -> tuple[str | None, str]:
    """The ComfyUI of COMFYUI_PATH imported for a calibration on every core, and its version; (None, why printed)
    when the variable names no ComfyUI checkout."""
    comfyui = os.environ.get("COMFYUI_PATH")
    if not comfyui or not os.path.isfile(os.path.join(comfyui, "comfy", "model_base.py")):
        print("set COMFYUI_PATH to a ComfyUI checkout (the folder with comfy/model_base.py) and run this under a "
              "Python that has ComfyUI's requirements", file=sys.stderr)
        return None, ""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    import_comfyui(comfyui)
    try:
        from comfyui_version import __version__ as version
    except ImportError:
        version = "unknown"
    return comfyui, version


def write_header_only(folder: Path, name: str, builder: str, **kwargs) -> Path:
    import ckpt_layouts as L

    return L.write_safetensors(folder / f"{name}.safetensors", getattr(L, builder)(**kwargs), sparse=True)


def gpu_memory_required(base_model, shape: list[int]) -> int:
    """``BaseModel.memory_required`` as on an NVIDIA GPU: its flash/xformers branch, whatever this machine is."""
    import comfy.model_management as mm

    with mock.patch.object(mm, "pytorch_attention_flash_attention", return_value=True):
        return int(base_model.memory_required(shape))


def one_block_network(path: Path, device: str = "cpu") -> torch.nn.Module:
    """ComfyUI's own network for a one-block checkpoint, in bf16 on ``device``, random weights."""
    from loaders.rank_factory import detect
    from mgpu.sharding.fsdp import build_meta, materialize

    config, sd, _ = detect(str(path))
    config.set_inference_dtype(torch.bfloat16, None)
    model = materialize(build_meta(lambda: config.get_model(sd, "").diffusion_model), device).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def token_grid(tokens: int) -> tuple[int, int, int]:
    """(frames, rows, columns) of patches with that many tokens: 16 x 32 per frame from 512 tokens up."""
    if tokens >= 512 and tokens % 512 == 0:
        return tokens // 512, 16, 32
    if tokens % 8:
        raise ValueError(f"{tokens} tokens: use a multiple of 8 (of 512 from 512 up)")
    return 1, 8, tokens // 8


def forward_inputs(size, tokens: int | tuple[int, int, int],
                   device: str = "cpu") -> Callable[[torch.nn.Module], object]:
    """A closure running one forward at ``tokens`` tokens (or a (frames, rows, columns) patch grid) with the
    family's input layout, batch 1."""
    d = size.dims
    t, h, w = token_grid(tokens) if isinstance(tokens, int) else tokens
    shape = (1, d["in_channels"], t * d["patch_t"], h * d["patch_h"], w * d["patch_w"])
    ltxv = size.family.startswith("ltxv")

    def run(model: torch.nn.Module) -> object:
        x = torch.randn(shape, dtype=torch.bfloat16, device=device)
        context = torch.randn(1, d["text_len"], d["text_dim"], dtype=torch.bfloat16, device=device)
        if ltxv:
            mask = torch.ones(1, d["text_len"], dtype=torch.int64, device=device)
            return model(x, torch.tensor([0.5], device=device), context, mask, frame_rate=25)
        return model(x, torch.tensor([500.0], device=device), context)

    return run


def dit_row(name: str, fam: Family, folder: Path, tokens: list[int]) -> DitRow:
    from mgpu.planning.estimates import (Workload, comfyui_memory_required, comfyui_reservation_bytes, dit_activation_bytes,
                                dit_tokens, dit_working_bytes, latent_shape)
    from mgpu.planning.sizing import size_component
    from loaders.rank_factory import detect

    began = time.perf_counter()
    full = write_header_only(folder, name, fam.builder, layers=fam.layers, **fam.dims)
    size = size_component(full)
    wl = Workload(*fam.video, batch=1, cfg=False)
    config, sd, _ = detect(str(full))
    config.set_inference_dtype(torch.bfloat16, None)
    base = config.get_model(sd, "", device="meta")
    shape = [1, size.dims["z_channels"], *latent_shape(size, wl)]
    required = gpu_memory_required(base, shape)
    n = dit_tokens(size, wl)
    row = DitRow(family=name, video="x".join(map(str, fam.video)), tokens=n, hidden=size.dims["hidden"],
                 comfyui_memory_required=required, restated_memory_required=comfyui_memory_required(size, wl, 1),
                 comfyui_reservation=comfyui_reservation_bytes(required),
                 ours_activations=dit_activation_bytes(size, n), ours_working_single=dit_working_bytes(size, wl),
                 ours_working_fsdp=dit_working_bytes(size, wl, comfyui=False))
    if tokens:
        model = one_block_network(write_header_only(folder, name + "-1block", fam.builder, layers=1, **fam.dims))
        for count in tokens:
            run = forward_inputs(size, count)
            row.measured_peaks.append(forward_peak(lambda: run(model), "cpu").bytes)
            row.measured_tokens.append(count)
        del model
        if len(tokens) > 1:
            row.measured_bytes_per_token, row.measured_fixed_bytes = fit_line(row.measured_tokens, row.measured_peaks)
            row.ours_bytes_per_token, _ = fit_line(tokens, [dit_activation_bytes(size, c) for c in tokens])
            row.measured_at_video = int(row.measured_bytes_per_token * n + row.measured_fixed_bytes)
    row.seconds = time.perf_counter() - began
    return row


def vae_rows(folder: Path) -> list[dict]:
    """ComfyUI's decode reservation (bf16) beside ours, each VAE at the video of the DiT it decodes for."""
    import comfy.sd
    from loaders.rank_factory import meta_state_dict
    from mgpu.planning.estimates import (Workload, comfyui_reservation_bytes, comfyui_vae_decode_bytes, latent_shape,
                                vae_activation_bytes, vae_decode_bytes)
    from mgpu.planning.sizing import size_component

    rows = []
    for fam in FAMILIES.values():
        if fam.vae is None:
            continue
        builder, kwargs = VAES[fam.vae]
        path = write_header_only(folder, fam.vae, builder, **kwargs)
        size = size_component(path)
        wl = Workload(*fam.video, batch=1, cfg=False)
        with torch.device("meta"):
            vae = comfy.sd.VAE(sd=meta_state_dict(str(path)))
        used = int(vae.memory_used_decode([1, vae.latent_channels, *latent_shape(size, wl)], torch.bfloat16))
        rows.append({"vae": fam.vae, "video": "x".join(map(str, fam.video)), "comfyui_memory_used_decode": used,
                     "restated_memory_used_decode": comfyui_vae_decode_bytes(size, wl),
                     "comfyui_reservation": comfyui_reservation_bytes(used),
                     "ours_activations": vae_activation_bytes(size, wl, tiled=False),
                     "need_untiled": vae_decode_bytes(size, wl, tiled=False),
                     "need_tiled": vae_decode_bytes(size, wl, tiled=True)})
    return rows


def text_encoder_rows(folder: Path) -> list[dict]:
    import comfy.model_management as mm
    from mgpu.planning.estimates import text_encoder_activation_bytes, text_encoder_working_bytes
    from mgpu.planning.sizing import size_component

    rows = []
    for name, builder in TEXT_ENCODERS.items():
        size = size_component(write_header_only(folder, name, builder))
        rows.append({"text_encoder": name, "tokens": 512, "batch": 1,
                     "comfyui_reservation": int(mm.minimum_inference_memory()),
                     "ours_activations": text_encoder_activation_bytes(size, batch=1),
                     "ours_working": text_encoder_working_bytes(size, batch=1)})
    return rows


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def markdown(report: dict) -> str:
    lines = [f"ComfyUI {report['comfyui_version']} ({report['comfyui_path']}), torch {report['torch']}; "
             f"minimum_inference_memory {gib(report['minimum_inference_memory'])} GiB, extra_reserved_memory "
             f"{report['extra_reserved_memory'] / 2**20:.0f} MiB",
             "",
             "| DiT | video | tokens | measured B/token (U) | ours B/token (U) | measured at video | ours (x safety) "
             "| ComfyUI memory_required | ComfyUI reservation | need on one GPU | need per FSDP rank* |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    from mgpu.planning.estimates import ACTIVATION_SAFETY

    for r in report["dits"]:
        unit = 2 * r["hidden"]
        meas = (f"{r['measured_bytes_per_token']:,.0f} ({r['measured_bytes_per_token'] / unit:.2f})"
                if r["measured_bytes_per_token"] else "-")
        ours = (f"{r['ours_bytes_per_token']:,.0f} ({r['ours_bytes_per_token'] / unit:.2f})"
                if r["ours_bytes_per_token"] else "-")
        lines.append(f"| {r['family']} | {r['video']} | {r['tokens']:,} | {meas} | {ours} | "
                     f"{gib(r['measured_at_video']) if r['measured_at_video'] else '-'} | "
                     f"{gib(r['ours_activations'] * ACTIVATION_SAFETY)} | {gib(r['comfyui_memory_required'])} | "
                     f"{gib(r['comfyui_reservation'])} | {gib(r['ours_working_single'])} | "
                     f"{gib(r['ours_working_fsdp'])} |")
    lines += ["", "GiB per batch item, bf16; U = hidden x 2 bytes per token. Needs include the 1 GiB CUDA overhead; "
              "*FSDP rank: before FSDP/NCCL buffers.", "",
              "| VAE | video | ComfyUI memory_used_decode | ComfyUI reservation | ours untiled | need untiled "
              "| need tiled |",
              "|---|---|---|---|---|---|---|"]
    for r in report["vaes"]:
        lines.append(f"| {r['vae']} | {r['video']} | {gib(r['comfyui_memory_used_decode'])} | "
                     f"{gib(r['comfyui_reservation'])} | {gib(r['ours_activations'])} | {gib(r['need_untiled'])} | "
                     f"{gib(r['need_tiled'])} |")
    lines += ["", "| text encoder | tokens x batch | ComfyUI reservation | ours activations | ours working |",
              "|---|---|---|---|---|"]
    for r in report["text_encoders"]:
        lines.append(f"| {r['text_encoder']} | {r['tokens']} x {r['batch']} | {gib(r['comfyui_reservation'])} | "
                     f"{gib(r['ours_activations'])} | {gib(r['ours_working'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[512, 1024, 2048, 4096],
                    help="token counts of the measured forwards (none: skip the measurement)")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--json", help="also write every number to this file")
    args = ap.parse_args(argv)
    try:
        [token_grid(t) for t in args.tokens]
    except ValueError as e:
        ap.error(f"--tokens: {e}")
    comfyui, version = start_comfyui()
    if comfyui is None:
        return 2
    import comfy.model_management as mm

    with tempfile.TemporaryDirectory(prefix="mgpu-calibrate-") as tmp:
        folder = Path(tmp)
        report = {"comfyui_path": comfyui, "comfyui_version": version, "torch": torch.__version__,
                  "minimum_inference_memory": int(mm.minimum_inference_memory()),
                  "extra_reserved_memory": int(mm.extra_reserved_memory()),
                  "dits": [asdict(dit_row(name, FAMILIES[name], folder, args.tokens)) for name in args.families],
                  "vaes": vae_rows(folder), "text_encoders": text_encoder_rows(folder)}
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
