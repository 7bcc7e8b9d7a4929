"""Working-memory estimates: what a component needs on its device beyond its weights, and the budget rule.

Each estimate is a documented formula over ``ComponentSize.dims`` (read from tensor shapes), so the planner can
reason before anything is loaded. The DiT formula is *calibrated*: its coefficients come from the live-tensor peak
of ComfyUI's own Wan and LTXV networks (one real-dimension block, 512-4096 tokens, ComfyUI 0.3.64 and 0.33.0,
``bench/calibrate_memory.py``; table in bench/RESULTS.md), rounded up to cover every family on both versions.

The budget rule (what the partitioner reserves beside the weights):

* ours = ``ACTIVATION_SAFETY`` x the calibrated activations. The factor covers what a live-tensor count on the CPU
  cannot see on a GPU: kernel workspaces and the caching allocator's fragmentation (reserved over allocated).
  ``bench/gpu_check.py`` measures both on a GPU.
* Where ComfyUI runs the component (a single-device DiT, a text encoder, an untiled VAE decode), its own
  reservation also has to fit, or ComfyUI loads the weights only partly (lowvram) and streams them every step: the
  need is ``max(ours, ComfyUI's reservation)``. ComfyUI reserves ``max(minimum_inference_memory(), memory_required
  + extra_reserved_memory())`` (comfy/model_management.py ``load_models_gpu``); those constants and the rules of
  ``BaseModel.memory_required`` and ``VAE.memory_used_decode`` are restated below and checked against ComfyUI by
  tests/test_bench_scripts.py. The text encoder and VAE formulas are hand counts, not measured.
* On FSDP ranks ComfyUI reserves nothing (the loader reports ``memory_required`` 0 and ComfyUI cannot see the
  ranks), so the need is ours plus FSDP2's all-gather buffers (``fsdp_buffer_bytes``).
* What a process keeps on a GPU outside PyTorch's caching allocator (CUDA context, library workspaces, NCCL
  communicators) stays for as long as the process lives: ``empty_cache`` gives none of it back. Where ComfyUI runs a
  component, its working memory adds ``CUDA_OVERHEAD_BYTES``; an FSDP rank's is counted in every phase instead
  (``rank_process_bytes``). The figures are the unmeasured guesses of ``GPU_PROCESS_GUESSES``.

Sanity numbers (Wan2.1 T2V 14B, 1280x720x81 -> 75,600 tokens, bf16 activations, sdpa), per batch item: ComfyUI's
network peaks at 9.1-9.5 U per token (U: one bf16 hidden-size vector; 6.6-6.9 GiB); the formula says 9.75 U
(7.0 GiB), ours 8.4 GiB with the safety factor; ComfyUI reserves 14.0 GiB (memory_required 13.6 GiB). So one GPU
keeps 15.0 GiB beside 26.6 GiB of bf16 weights; an FSDP rank 9.4 GiB plus 2.1 GiB of all-gather buffers (bf16;
1.2 GiB for fp8), and in every phase its CUDA context, libraries and NCCL communicators (1.5 GiB on 2
ranks). Wan 2.1 VAE decode of that video: 11.4 GiB ours, 12.4 GiB ComfyUI's,
so 13.4 GiB untiled; 4.9 GiB tiled.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mgpu.errors import SizingError
from mgpu.planning.sizing import ComponentSize, gguf_types

if TYPE_CHECKING:
    from mgpu.planning.training import Training

MiB = 1024**2
GiB = 1024**3

# What a process keeps on each GPU it uses outside PyTorch's caching allocator, for as long as it lives (empty_cache,
# the ranks' release_cached_memory, frees none of it). UNMEASURED guesses, all in this one table: bench/gpu_check.py
# measures them on a GPU (process memory minus reserved, at init, after load, per phase) and its numbers replace these.
GPU_PROCESS_GUESSES = {
    # the driver's context with torch's kernels, loaded lazily (CUDA_MODULE_LOADING=LAZY, torch's default): 0.3-0.5 GiB
    "cuda_context": 512 * MiB,
    # cuBLAS/cuBLASLt and cuDNN handles and cuBLAS workspaces per stream (FSDP2 computes and gathers on several)
    "libraries": 512 * MiB,
    # each NCCL communicator: its fixed part, plus its buffers per ring neighbour (1 at 2 ranks, 2 from 3 on). A torch
    # all-reduce on 4 x A100 NVLink took 544 MB per 2-rank group and 688 MB per larger one (NVIDIA/nccl#964); PCIe
    # machines use fewer channels, so less
    "nccl_communicator": 400 * MiB,
    "nccl_ring_neighbour": 144 * MiB,
    # each NCCL communicator on an NVSwitch machine with NVLink SHARP (Hopper and later), NVLS on by default: its
    # multicast buffers (NVIDIA's containers turn NVLS off to save this memory)
    "nccl_nvls": 1 * GiB,
}
CUDA_CONTEXT_BYTES = GPU_PROCESS_GUESSES["cuda_context"]
# Where ComfyUI runs a component its working memory adds its process's context and libraries on that GPU.
CUDA_OVERHEAD_BYTES = CUDA_CONTEXT_BYTES + GPU_PROCESS_GUESSES["libraries"]

# ours = ACTIVATION_SAFETY x the calibrated activations: the CPU count misses GPU kernel workspaces and the caching
# allocator's fragmentation (how far max_memory_reserved exceeds max_memory_allocated; bench/gpu_check.py reports both).
ACTIVATION_SAFETY = 1.2

# Calibrated DiT phase sizes, in hidden-size tensors (U = batch x tokens x hidden x act_bytes). Measured maxima
# over Wan 1.3B/5B/14B and LTXV 2B/13B on ComfyUI 0.3.64 and 0.33.0, rounded up (bench/RESULTS.md):
#   FFN phase: 4.25 U + the FFN hidden twice (before and after the activation). The 4 U are the residual stream
#              (the caller's x and the block's new x), the modulated input and a normalisation temporary.
#   attention: 9.5 U: residual, modulated input, q, k, v, attention output and the fp32 copy RoPE rotates q/k in.
DIT_FFN_PHASE_U = 4.25
DIT_ATTENTION_PHASE_U = 9.5

ATTENTION_BACKENDS = ("sdpa", "flash", "math")

# ComfyUI's reservations (identical in 0.3.64 and 0.33.0; comfy/model_management.py): extra_reserved_memory() is
# 400 MiB (600-700 MiB on Windows, or --reserve-vram), minimum_inference_memory() is 0.8 GiB more.
COMFYUI_EXTRA_RESERVED_BYTES = 400 * MiB
COMFYUI_MIN_INFERENCE_BYTES = int(0.8 * GiB) + COMFYUI_EXTRA_RESERVED_BYTES

# Weight dtypes a user may ask for -> bytes per element.
WEIGHT_ITEMSIZE = {
    "fp8_e4m3fn": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "F8_E4M3": 1, "F8_E5M2": 1, "int8": 1,
    "bf16": 2, "bfloat16": 2, "BF16": 2, "fp16": 2, "float16": 2, "F16": 2,
    "fp32": 4, "float32": 4, "F32": 4,
}


@dataclass(frozen=True)
class Workload:
    """One generation: output size in pixels and frames, videos per prompt, and whether CFG doubles the batch. Or,
    with ``train``, one LoRA training step (MGPU Train LoRA): the size is one dataset item's, ``batch`` the rows of
    each step (the node's batch_size), and there is no CFG."""
    width: int = 832
    height: int = 480
    frames: int = 81
    batch: int = 1
    cfg: bool = True
    train: Training | None = None

    def __post_init__(self):
        if min(self.width, self.height, self.frames, self.batch) < 1:
            raise SizingError(f"Workload {self}: width, height, frames and batch must all be >= 1.")

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        """A workload as a plan keeps it (``Plan.workload``, ``asdict``): its training part back as ``Training``."""
        from mgpu.planning.training import Training

        train = d.get("train")
        return cls(**{**d, "train": Training(**train) if train else None})

    @property
    def dit_batch(self) -> int:
        """ComfyUI runs cond and uncond as one batch of 2 when CFG > 1 (if it fits); a training step runs its rows."""
        return self.batch * (2 if self.cfg and self.train is None else 1)


def _dims(size: ComponentSize, kind: str, *names: str) -> list[int]:
    missing = [n for n in names if n not in size.dims]
    if size.kind != kind or missing:
        raise SizingError(f"{size.path or size.family}: a {kind} estimate needs a recognised {kind} "
                          f"(got kind {size.kind!r}, family {size.family!r}, missing dims {missing}); "
                          "pick the right component or give its dims with size_from_bytes(..., dims=...).")
    return [size.dims[n] for n in names]


def latent_shape(size: ComponentSize, wl: Workload) -> tuple[int, int, int]:
    """(frames, height, width) of the latent: causal video VAEs keep the first frame, then compress by vae_t."""
    vae_t, vae_s = size.dims["vae_t"], size.dims["vae_s"]
    if wl.width < vae_s or wl.height < vae_s:
        raise SizingError(f"{wl.width}x{wl.height} is smaller than one latent pixel ({vae_s}x{vae_s}) of "
                          f"{size.family}; use a larger width/height.")
    return (wl.frames - 1) // vae_t + 1, wl.height // vae_s, wl.width // vae_s


def dit_tokens(size: ComponentSize, wl: Workload) -> int:
    """Sequence length of one DiT forward: latent frames x latent h x latent w, divided into patches.

    Partial patches are padded (ComfyUI's pad_to_patch_size), hence ceil. Wan: 4x8x8 VAE then 1x2x2 patches,
    1280x720x81 -> 21 x 45 x 80 = 75,600 tokens.
    """
    pt, ph, pw = _dims(size, "dit", "patch_t", "patch_h", "patch_w")
    t, h, w = latent_shape(size, wl)
    return math.ceil(t / pt) * math.ceil(h / ph) * math.ceil(w / pw)


def _rope_table_bytes(size: ComponentSize, tokens: int, act_bytes: int) -> int:
    """Per-forward rotary table: Wan keeps fp32 cos/sin pairs per head dim (tokens x head_dim x 8 bytes); LTXV keeps
    cos and sin at full hidden width in the activation dtype (2 x tokens x hidden x act_bytes)."""
    if size.family.startswith("ltxv"):
        return 2 * tokens * size.dims["hidden"] * act_bytes
    return tokens * size.dims["head_dim"] * 8


def dit_activation_bytes(size: ComponentSize, tokens: int, batch: int = 1, *, act_bytes: int = 2,
                         attention: str = "sdpa") -> int:
    """Calibrated live-tensor peak of one DiT forward over ``batch`` x ``tokens``: no safety factor, no overhead.

    With U = batch x tokens x hidden x act_bytes and F = batch x tokens x ffn x act_bytes, blocks run one after
    another, so only one block's transients are alive at once:
      FFN phase          DIT_FFN_PHASE_U x U + 2F         (the FFN hidden before and after its activation)
      attention phase    DIT_ATTENTION_PHASE_U x U + extra
      attention extra    sdpa/flash: B x heads x N x 4 (fp32 log-sum-exp, O(tokens));
                         math: 2 x B x N x N x 4, the fp32 score and softmax matrices of one head at a time
      RoPE table         ``_rope_table_bytes`` (per forward, shared by the batch)
    Total = max(attention phase, FFN phase) + RoPE table. Cross-attention to the short text context is smaller than
    the self-attention phase and is not added.
    """
    if attention not in ATTENTION_BACKENDS:
        raise SizingError(f"attention={attention!r} is not one of {ATTENTION_BACKENDS}.")
    hidden, ffn, heads = _dims(size, "dit", "hidden", "ffn", "heads")
    unit = batch * tokens * hidden * act_bytes
    extra = 2 * batch * tokens * tokens * 4 if attention == "math" else batch * heads * tokens * 4
    attention_phase = DIT_ATTENTION_PHASE_U * unit + extra
    ffn_phase = DIT_FFN_PHASE_U * unit + 2 * batch * tokens * ffn * act_bytes
    return math.ceil(max(attention_phase, ffn_phase)) + _rope_table_bytes(size, tokens, act_bytes)


def comfyui_memory_usage_factor(size: ComponentSize) -> float | None:
    """ComfyUI's ``memory_usage_factor`` for the family (comfy/supported_models.py, same in 0.3.64 and 0.33.0):
    Wan dim / 2222 (x 1.2 for VACE), LTXV cross_attention_dim / 2048 x 5.5; None for a family it is not known for."""
    if size.family.startswith("ltxv"):
        return size.dims.get("cross_dim", size.dims["hidden"]) / 2048 * 5.5
    if size.family.startswith("wan") and "hidden" in size.dims:
        return size.dims["hidden"] / 2222 * (1.2 if "vace" in size.family else 1.0)
    return None


def comfyui_memory_required(size: ComponentSize, wl: Workload, batch: int, act_bytes: int = 2) -> int:
    """What ComfyUI's ``BaseModel.memory_required`` returns on a GPU for ``batch`` latents of the workload: batch x
    latent frames x height x width (channels not counted) x dtype bytes x 0.01 MiB x the family's factor (the
    pytorch-attention/xformers branch, comfy/model_base.py; same rule in 0.3.64 and 0.33.0)."""
    factor = comfyui_memory_usage_factor(size)
    if factor is None:
        raise SizingError(f"{size.path or size.family}: ComfyUI's memory rule for family {size.family!r} is not "
                          "known here; only Wan and LTX-Video DiTs are calibrated.")
    area = batch * math.prod(latent_shape(size, wl))
    return math.ceil(area * act_bytes * 0.01 * factor * MiB)


def comfyui_reservation_bytes(memory_required: int) -> int:
    """Free memory ComfyUI keeps beside a model it loads fully (``load_models_gpu``): at least the minimum
    inference memory, else the model's memory_required plus the extra reserve."""
    return max(COMFYUI_MIN_INFERENCE_BYTES, memory_required + COMFYUI_EXTRA_RESERVED_BYTES)


# Families whose sequence parallelism does not cut the per-rank activations by the degree. LTX-2: measured 0.79 of
# one rank's live activation peak at 2 ranks (bench/bench_sp.py --model ltx2, bench/RESULTS.md), Wan 0.57-0.61.
SP_KEEPS_ACTIVATIONS = ("ltx2",)


def dit_working_bytes(size: ComponentSize, wl: Workload, *, batch: int | None = None, act_bytes: int = 2,
                      attention: str = "sdpa", comfyui: bool = True, sp: int = 1) -> int:
    """Working memory of the DiT over ``batch`` (default: the workload's CFG batch), by the budget rule.

    ``comfyui``: ComfyUI runs it (single device), so its reservation for that batch must fit too (families ComfyUI's
    rule is known for), and its process's ``CUDA_OVERHEAD_BYTES``; False on FSDP ranks, whose buffers
    ``fsdp_buffer_bytes`` adds and whose process memory ``rank_process_bytes`` counts in every phase. ``sp``: the sequence-parallel
    degree; each rank holds 1/sp of the tokens (in attention all tokens of 1/sp of the heads: the same bytes).
    Not for LTX-2 (``SP_KEEPS_ACTIVATIONS``): its ranks keep the audio stream and much of the video's per-token
    state whole, so its activations are counted as on one rank.
    """
    b = wl.dit_batch if batch is None else batch
    tokens = math.ceil(dit_tokens(size, wl) / (1 if size.family.startswith(SP_KEEPS_ACTIVATIONS) else sp))
    ours = math.ceil(ACTIVATION_SAFETY * dit_activation_bytes(size, tokens, b, act_bytes=act_bytes,
                                                              attention=attention))
    if comfyui and comfyui_memory_usage_factor(size) is not None:
        ours = max(ours, comfyui_reservation_bytes(comfyui_memory_required(size, wl, b, act_bytes)))
    return ours + (CUDA_OVERHEAD_BYTES if comfyui else 0)


def text_encoder_activation_bytes(size: ComponentSize, tokens: int = 512, batch: int = 2, act_bytes: int = 2) -> int:
    """Peak activations of one text-encoder forward (T5/UMT5/Gemma); not calibrated (the encoder runs once per
    prompt and is freed before sampling), so ComfyUI's floor usually decides (``text_encoder_working_bytes``).

    With U = batch x tokens x hidden x act_bytes and I = heads x head_dim:
      residual 2U; attention: U (normed input) + 4 x B*T*I*a (q, k, v expanded to all heads, output)
      + 2 x B*heads*T*T*4 (T5's position bias / masks rule out flash kernels: fp32 scores and softmax);
      FFN: U + 3 (gated: gate, up, product; else 2) x B*T*ffn*a.
    Total = 2U + max(attention, FFN).
    """
    hidden, ffn, heads, head_dim = _dims(size, "text_encoder", "hidden", "ffn", "heads", "head_dim")
    unit = batch * tokens * hidden * act_bytes
    attention = unit + 4 * batch * tokens * heads * head_dim * act_bytes + 2 * batch * heads * tokens**2 * 4
    ffn_phase = unit + (3 if size.dims.get("gated_ffn", 1) else 2) * batch * tokens * ffn * act_bytes
    return 2 * unit + max(attention, ffn_phase)


def text_encoder_working_bytes(size: ComponentSize, tokens: int = 512, batch: int = 2, act_bytes: int = 2) -> int:
    """Working memory of the text encoder by the budget rule. ComfyUI loads UMT5/T5 with no estimate of its own,
    so it keeps its minimum inference memory free: max(ours, that) + CUDA_OVERHEAD_BYTES."""
    ours = math.ceil(ACTIVATION_SAFETY * text_encoder_activation_bytes(size, tokens, batch, act_bytes))
    return max(ours, COMFYUI_MIN_INFERENCE_BYTES) + CUDA_OVERHEAD_BYTES


# Full-resolution tensors alive in the decoder's last stage, in units of (pixels x its channel width):
# ~2 for the 2x-wide upsampled input of the last resample, ~6.5 inside a residual block (input, norm, activation,
# padded copy, conv output, sum), rounded up. Causal decoders (Wan) also keep 2 frames per conv of the last two
# stages as a cache: ~6 more relative to a 4-frame step. For Wan 2.1 at 720p this gives ~6,100 elements per output
# pixel per step; ComfyUI reserves 7,000 for the same decode, so the two agree within 15%. Not measured.
VAE_LIVE_TENSORS = 10
VAE_CAUSAL_CACHE_TENSORS = 6

# ComfyUI's ``VAE.memory_used_decode`` (comfy/sd.py) per VAE family: (bytes per latent pixel and dtype byte,
# whether latent frames count). Wan 2.1: 7000 x 64 per latent h x w (0.33.0: 2200 for <= 4 latent frames);
# Wan 2.2: 8000 x 256; LTXV: 1200 x 512 per latent t x h x w in 0.33.0 (900 x 512 in 0.3.64): the larger is kept.
COMFYUI_VAE_DECODE = {"wan-vae": (7000 * 64, False), "wan2.2-vae": (8000 * 256, False), "ltxv-vae": (1200 * 512, True)}


def comfyui_vae_decode_bytes(size: ComponentSize, wl: Workload, act_bytes: int = 2) -> int | None:
    """What ComfyUI's ``VAE.memory_used_decode`` gives for one video of the workload; None for other VAEs."""
    rule = COMFYUI_VAE_DECODE.get(size.family)
    if rule is None:
        return None
    per_pixel, frames = rule
    t, h, w = latent_shape(size, wl)
    return per_pixel * (t if frames else 1) * h * w * act_bytes


def vae_activation_bytes(size: ComponentSize, wl: Workload, *, tiled: bool, act_bytes: int = 2,
                         tile_px: int = 512, tile_frames: int = 64) -> int:
    """Peak memory of decoding the workload's latent to pixels, without the overhead.

    The decoder's last stage dominates: dec_channels wide, at (H / out_patch) x (W / out_patch). A causal
    decoder (Wan) decodes one latent frame = vae_t output frames per step; LTXV decodes all frames at once
    (or ``tile_frames`` when tiled). Tiled decode works on ``tile_px`` squares (ComfyUI's VAEDecodeTiled default
    512). Both add the fp32 output video (3 x frames x H x W x 4 per video, kept whole) and the fp32 latent.
    work = frames_per_step x (h / p) x (w / p) x dec_channels x live tensors x act_bytes.
    """
    z, vae_t, vae_s, channels, patch, causal = _dims(size, "vae", "z_channels", "vae_t", "vae_s", "dec_channels",
                                                     "out_patch", "causal")
    lat_t, lat_h, lat_w = latent_shape(size, wl)
    h, w = (min(wl.height, tile_px), min(wl.width, tile_px)) if tiled else (wl.height, wl.width)
    frames_per_step = vae_t if causal else (min(wl.frames, tile_frames) if tiled else wl.frames)
    live = VAE_LIVE_TENSORS + (VAE_CAUSAL_CACHE_TENSORS if causal else 0)
    work = frames_per_step * math.ceil(h / patch) * math.ceil(w / patch) * channels * live * act_bytes
    output = wl.batch * 3 * wl.frames * wl.height * wl.width * 4
    latent = wl.batch * z * lat_t * lat_h * lat_w * 4
    return work + output + latent


def vae_decode_bytes(size: ComponentSize, wl: Workload, *, tiled: bool, act_bytes: int = 2, **tiles: int) -> int:
    """Working memory of the decode by the budget rule, plus the overhead.

    Untiled, ComfyUI runs the whole decode and keeps its reservation for it free, so the need is the larger of
    ours and that. Tiled, ComfyUI still reserves the untiled figure, but only to decide how much of the (small) VAE
    weights stays loaded: ours alone. ``tiles``: ``tile_px`` / ``tile_frames`` of ``vae_activation_bytes``.
    """
    ours = vae_activation_bytes(size, wl, tiled=tiled, act_bytes=act_bytes, **tiles)
    comfyui = None if tiled else comfyui_vae_decode_bytes(size, wl, act_bytes)
    if comfyui is not None:
        ours = max(ours, comfyui_reservation_bytes(comfyui))
    return ours + CUDA_OVERHEAD_BYTES


# Live-tensor peak of decoding one Wan 2.1 VAE tile of 8 latent frames (29 frames) at px x px, fp32 on the CPU,
# measured with bench/memprobe.py's LiveBytes (the weights' own storages not counted): ComfyUI 0.3.64, the larger;
# 0.33.0's decoder, which steps two latent frames at a time, peaks at 57, 226, 509 and 906 MB. Both grow with the
# pixels only (0.3.64: 17.5 KB per pixel). vae_tile_bytes x ACTIVATION_SAFETY says 1.75x these.
MEASURED_WAN21_TILE_PEAKS = {64: 72_254_464, 128: 287_810_560, 192: 646_710_144, 256: 1_148_887_936}


def vae_tile_bytes(size: ComponentSize, wl: Workload, *, act_bytes: int = 2, tile_px: int = 512,
                   tile_frames: int = 64) -> int:
    """Peak memory of decoding one tile of ComfyUI's tiled decode (VAEDecodeTiled's ``tile_size`` = ``tile_px``,
    ``temporal_size`` = ``tile_frames``) on the device that decodes it; no weights, no safety factor, no overhead.

    A tile is ``tile_px`` squared (the frame, if smaller) and max(2, tile_frames // vae_t) latent frames, which
    decode to 1 + vae_t x (latent frames - 1) frames (the video's, if fewer). Per tile:
      work     as vae_activation_bytes: a causal decoder (Wan) steps through vae_t frames at a time, a non-causal
               one (LTXV) takes the tile's frames at once
      output   the decoded tile twice in act_bytes (the steps' outputs and their concatenation) and once in fp32
               (ComfyUI casts it before it leaves the device)
      latent   the tile's latent in fp32
    Measured against ComfyUI's Wan 2.1 decoder: ``MEASURED_WAN21_TILE_PEAKS``.
    """
    z, vae_t, vae_s, channels, patch, causal = _dims(size, "vae", "z_channels", "vae_t", "vae_s", "dec_channels",
                                                     "out_patch", "causal")
    lat_t = min(latent_shape(size, wl)[0], max(2, tile_frames // vae_t))
    frames = min(wl.frames, 1 + vae_t * (lat_t - 1))
    h, w = min(wl.height, tile_px), min(wl.width, tile_px)
    frames_per_step = min(frames, vae_t) if causal else frames
    live = VAE_LIVE_TENSORS + (VAE_CAUSAL_CACHE_TENSORS if causal else 0)
    work = frames_per_step * math.ceil(h / patch) * math.ceil(w / patch) * channels * live * act_bytes
    output = 3 * frames * h * w * (2 * act_bytes + 4)
    latent = z * lat_t * math.ceil(h / vae_s) * math.ceil(w / vae_s) * 4
    return work + output + latent


def vae_parallel_decode_bytes(size: ComponentSize, wl: Workload, *, weight_dtype: str | None = None,
                              act_bytes: int = 2, tile_px: int = 512, tile_frames: int = 64) -> int:
    """What each device of MGPU VAE Decode needs: its own copy of the VAE weights (``weight_dtype`` as in
    ``weight_bytes``), one tile at a time (``vae_tile_bytes`` x ACTIVATION_SAFETY) and the CUDA overhead.

    The devices take ComfyUI's tiles in turn and each decoded tile leaves its device at once, for host RAM, where
    the video is assembled: so this does not grow with the video, unlike ``vae_decode_bytes``, which keeps the
    whole output on the one decoding device.
    """
    tile = vae_tile_bytes(size, wl, act_bytes=act_bytes, tile_px=tile_px, tile_frames=tile_frames)
    return weight_bytes(size, weight_dtype) + math.ceil(ACTIVATION_SAFETY * tile) + CUDA_OVERHEAD_BYTES


def weight_bytes(size: ComponentSize, dtype: str | None) -> int:
    """Bytes of the weights on device when stored as ``dtype`` (None: as in the file).

    Only floating tensors with >= 2 dims are recast (what ComfyUI's fp8 weight dtypes do); norms, biases and
    scalars such as fp8 scales keep their stored bytes.
    """
    if dtype is None:
        return size.total_bytes
    if dtype not in WEIGHT_ITEMSIZE:
        raise SizingError(f"weight dtype {dtype!r} is not known; use one of "
                          f"{', '.join(sorted(set(WEIGHT_ITEMSIZE)))} (or None to keep the stored dtype).")
    return size.total_bytes - size.matrix_bytes + size.matrix_params * WEIGHT_ITEMSIZE[dtype]


def gathered_size(size: ComponentSize) -> ComponentSize:
    """``size`` as a rank holds it with every block gathered: GGUF-quantized tensors are dequantized after the gather
    (to a 2-byte compute dtype), so they count as bf16 matrices; every other format gathers as stored. Used for the
    weights kept gathered between steps. Blocks and the rest scale with the total."""
    blocks = {name: (values, nbytes) for name, values, nbytes in gguf_types().values()
              if name not in ("F32", "F16", "BF16", "F64")}
    quantized = {t: n for t, n in size.bytes_by_dtype.items() if t in blocks}
    if not quantized:
        return size
    params = sum(n // blocks[t][1] * blocks[t][0] for t, n in quantized.items())
    total = size.total_bytes - sum(quantized.values()) + 2 * params
    scale = total / size.total_bytes if size.total_bytes else 1.0
    by_dtype = {t: n for t, n in size.bytes_by_dtype.items() if t not in quantized}
    by_dtype["BF16"] = by_dtype.get("BF16", 0) + 2 * params
    groups = [dataclasses.replace(g, bytes_per_block=[round(b * scale) for b in g.bytes_per_block]) for g in size.blocks]
    return dataclasses.replace(size, total_bytes=total, bytes_by_dtype=by_dtype, blocks=groups,
                               bytes_outside_blocks=round(size.bytes_outside_blocks * scale),
                               matrix_params=size.matrix_params + params, matrix_bytes=size.matrix_bytes + 2 * params)


def weight_itemsize(size: ComponentSize, dtype: str | None) -> int:
    """Bytes per element of the weights' matrices when stored as ``dtype`` (None: the file's main dtype)."""
    if dtype is None:
        dtype = max(size.bytes_by_dtype.items(), key=lambda kv: kv[1])[0] if size.bytes_by_dtype else "BF16"
    return WEIGHT_ITEMSIZE.get(dtype, 2)


def nccl_communicators(ranks: int, heads: int | None, sp_degree: int) -> list[int]:
    """The sizes of the NCCL communicators each of ``ranks`` ranks joins: WORLD (FSDP's all-gathers), plus one group
    per sequence degree d > 1 the load sets up (d divides the ranks and the heads, up to ``sp_degree``; each rank is
    in one group of each size). The gloo control group holds no GPU memory; a lone rank talks to nobody."""
    if ranks < 2:
        return []
    return [ranks] + [d for d in range(2, min(sp_degree, ranks) + 1) if ranks % d == 0 and heads and heads % d == 0]


def nccl_communicator_bytes(ranks: int, nvls: bool = False) -> int:
    """One NCCL communicator of ``ranks`` ranks on each of them: its fixed part and its buffers per ring neighbour
    (one for 2 ranks, two from 3 on), plus NVLS buffers on an NVSwitch machine (``GPU_PROCESS_GUESSES``)."""
    g = GPU_PROCESS_GUESSES
    return (g["nccl_communicator"] + g["nccl_ring_neighbour"] * min(ranks - 1, 2)
            + (g["nccl_nvls"] if nvls else 0))


def rank_process_bytes(ranks: int, heads: int | None, sp_degree: int, *, nvls: bool = False) -> int:
    """What each FSDP rank process keeps on its GPU from its start on, in every phase (encode, sample, decode) and
    between prompts: its CUDA context and libraries, and its NCCL communicators (``nccl_communicators``). The ranks'
    ``release_cached_memory`` empties only PyTorch's caching allocator."""
    comms = nccl_communicators(ranks, heads, sp_degree)
    return CUDA_OVERHEAD_BYTES + sum(nccl_communicator_bytes(n, nvls) for n in comms)


def largest_block_params(size: ComponentSize) -> float:
    """Parameters of the largest repeated block (its bytes over the file's mean bytes per parameter)."""
    per_param = size.total_bytes / size.params if size.params else 2
    return max((max(g.bytes_per_block) for g in size.blocks if g.bytes_per_block), default=0) / per_param


def fsdp_buffer_bytes(size: ComponentSize, *, gather_itemsize: int, compute_itemsize: int = 2,
                      gathered_blocks: int = 2) -> int:
    """What FSDP2 holds on each rank beside its shard and the activations while it samples.

    All-gather, prefetch 1: ``gathered_blocks`` blocks gathered (the one computing and the one prefetched), plus the
    prefetched block's all-gather output buffer, alive until it is copied out into the block's parameters:
    (gathered_blocks + 1) x the largest block, at ``gather_itemsize`` bytes per parameter (the storage dtype on GPUs:
    fp8 weights travel as fp8). When the weights are narrower than the compute dtype, ComfyUI's ops cast one layer at
    a time: the largest, hidden x ffn, in ``compute_itemsize``. NCCL's communicators: ``rank_process_bytes``.
    """
    block = math.ceil(largest_block_params(size) * gather_itemsize)
    cast = size.dims["hidden"] * size.dims["ffn"] * compute_itemsize if gather_itemsize < compute_itemsize else 0
    return (gathered_blocks + 1) * block + cast
