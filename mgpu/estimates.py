"""Working-memory estimates: what a component needs on its device beyond its weights.

Each function is one documented formula over ``ComponentSize.dims`` (read from tensor shapes), so the planner
can reason before anything is loaded. They are deliberately simple upper-ish bounds, not simulations: they
count the tensors that are alive at the peak of one forward and add a fixed allowance for what PyTorch does
not show (CUDA context, library workspaces, allocator fragmentation).

Sanity numbers (Wan2.1 T2V 14B, 1280x720x81 -> 75,600 tokens, bf16 activations, sdpa):
CFG batch 2 ~ 19.8 GiB, batch 1 ~ 10.5 GiB (each including the 1 GiB allowance) on top of 26.6 GiB of bf16
weights (13.3 GiB as fp8). Wan 2.1 VAE decode of that video: ~12.4 GiB untiled, ~4.9 GiB tiled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mgpu.errors import SizingError
from mgpu.sizing import ComponentSize

GiB = 1024**3

# CUDA context (~0.3-0.5 GiB with cuBLAS/cuDNN handles), kernel workspaces and allocator fragmentation.
# Measured contexts vary by driver and GPU; 1 GiB is a round figure that covers them with some headroom.
CUDA_OVERHEAD_BYTES = 1 * GiB

ATTENTION_BACKENDS = ("sdpa", "flash", "math")

# Weight dtypes a user may ask for -> bytes per element.
WEIGHT_ITEMSIZE = {
    "fp8_e4m3fn": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "F8_E4M3": 1, "F8_E5M2": 1, "int8": 1,
    "bf16": 2, "bfloat16": 2, "BF16": 2, "fp16": 2, "float16": 2, "F16": 2,
    "fp32": 4, "float32": 4, "F32": 4,
}


@dataclass(frozen=True)
class Workload:
    """One generation: output size in pixels and frames, videos per prompt, and whether CFG doubles the batch."""
    width: int = 832
    height: int = 480
    frames: int = 81
    batch: int = 1
    cfg: bool = True

    def __post_init__(self):
        if min(self.width, self.height, self.frames, self.batch) < 1:
            raise SizingError(f"Workload {self}: width, height, frames and batch must all be >= 1.")

    @property
    def dit_batch(self) -> int:
        """ComfyUI runs cond and uncond as one batch of 2 when CFG > 1 (if it fits)."""
        return self.batch * (2 if self.cfg else 1)


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


def dit_working_bytes(size: ComponentSize, wl: Workload, *, batch: int | None = None, act_bytes: int = 2,
                      attention: str = "sdpa") -> int:
    """Peak activations of one DiT forward over ``batch`` (default: the workload's CFG batch) plus the allowance.

    With U = batch x tokens x hidden x act_bytes, blocks run one after another, so only one block's transients
    are alive at once:
      residual stream    2U                    x and the block output being formed (x + gate * y)
      attention phase    5U + 3U(fp32)         modulated input, q, k, v, attention output; RoPE rotates q/k in
                                               fp32 with ~3 full-size fp32 temporaries (counted at 4 bytes)
      FFN phase          U + 2 x B*N*ffn*a     modulated input, FFN hidden before and after the activation
      attention extra    sdpa/flash: B*heads*N*4 (fp32 log-sum-exp, O(tokens));
                         math: 2 x B*N*N*4, the fp32 score and softmax matrices of one head at a time
                         (head-chunked attention; an unchunked math kernel would need heads times more)
      RoPE table         N x head_dim x 8      fp32 cos/sin pairs
    Cross-attention to the short text context is smaller than the self-attention phase and is not added.
    Total = 2U + max(attention phase + extra, FFN phase) + RoPE table + CUDA_OVERHEAD_BYTES.
    """
    if attention not in ATTENTION_BACKENDS:
        raise SizingError(f"attention={attention!r} is not one of {ATTENTION_BACKENDS}.")
    hidden, ffn, heads, head_dim = _dims(size, "dit", "hidden", "ffn", "heads", "head_dim")
    b = wl.dit_batch if batch is None else batch
    n = dit_tokens(size, wl)
    unit = b * n * hidden * act_bytes
    extra = 2 * b * n * n * 4 if attention == "math" else b * heads * n * 4
    attention_phase = 5 * unit + 3 * b * n * hidden * 4 + extra
    ffn_phase = unit + 2 * b * n * ffn * act_bytes
    return 2 * unit + max(attention_phase, ffn_phase) + n * head_dim * 8 + CUDA_OVERHEAD_BYTES


def text_encoder_working_bytes(size: ComponentSize, tokens: int = 512, batch: int = 2, act_bytes: int = 2) -> int:
    """Peak activations of one text-encoder forward (T5/UMT5/Gemma) plus the allowance.

    With U = batch x tokens x hidden x act_bytes and I = heads x head_dim:
      residual 2U; attention: U (normed input) + 4 x B*T*I*a (q, k, v expanded to all heads, output)
      + 2 x B*heads*T*T*4 (T5's position bias / masks rule out flash kernels: fp32 scores and softmax);
      FFN: U + 3 (gated: gate, up, product; else 2) x B*T*ffn*a.
    Total = 2U + max(attention, FFN) + CUDA_OVERHEAD_BYTES.
    """
    hidden, ffn, heads, head_dim = _dims(size, "text_encoder", "hidden", "ffn", "heads", "head_dim")
    unit = batch * tokens * hidden * act_bytes
    attention = unit + 4 * batch * tokens * heads * head_dim * act_bytes + 2 * batch * heads * tokens**2 * 4
    ffn_phase = unit + (3 if size.dims.get("gated_ffn", 1) else 2) * batch * tokens * ffn * act_bytes
    return 2 * unit + max(attention, ffn_phase) + CUDA_OVERHEAD_BYTES


# Full-resolution tensors alive in the decoder's last stage, in units of (pixels x its channel width):
# ~2 for the 2x-wide upsampled input of the last resample, ~6.5 inside a residual block (input, norm, activation,
# padded copy, conv output, sum), rounded up. Causal decoders (Wan) also keep 2 frames per conv of the last two
# stages as a cache: ~6 more relative to a 4-frame step. For Wan 2.1 at 720p this gives ~6,100 elements per output
# pixel per step; ComfyUI 0.3.64 reserves 7,000 for the same decode, so the two agree within 15%.
VAE_LIVE_TENSORS = 10
VAE_CAUSAL_CACHE_TENSORS = 6


def vae_decode_bytes(size: ComponentSize, wl: Workload, *, tiled: bool, act_bytes: int = 2,
                     tile_px: int = 512, tile_frames: int = 64) -> int:
    """Peak memory of decoding the workload's latent to pixels.

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
    return work + output + latent + CUDA_OVERHEAD_BYTES


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
