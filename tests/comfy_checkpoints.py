"""Tiny random checkpoints in the exact key layouts ComfyUI 0.3.64 detects.

Shape tables are written out here (no ComfyUI import), so the same files can feed CI tests of our own
safetensors sizing code where ComfyUI is absent; `test_comfyui_smoke.py` proves the tables match
ComfyUI's own classes key for key whenever a checkout is present.

What ComfyUI's detection reads (comfy/model_detection.py, comfy/sd.py at 0.3.64):
- Wan 2.1 DiT: `head.modulation` marks it; dim from its last axis, num_heads = dim // 128 (so dim must be a
  multiple of 128), ffn from `blocks.0.ffn.0.weight`, layers by counting `blocks.N.`, in_dim from
  `patch_embedding.weight`, out_dim = `head.head.weight`.shape[0] // 4 (out_dim 48 would mean Wan 2.2).
  text_dim (4096) and freq_dim (256) are NOT read: they must keep the real values.
- LTX-Video DiT: `adaln_single.emb.timestep_embedder.linear_1.bias` marks it; head_dim =
  `transformer_blocks.0.attn2.to_k.weight`.shape[0] // 32 (32 heads fixed), cross_attention_dim = its
  shape[1] (must equal 32 * head_dim), layers by counting. in_channels (128) and caption_channels (4096) are
  fixed.
- Wan 2.1 VAE: `decoder.middle.0.residual.0.gamma` marks it and ComfyUI always builds dim=96, z_dim=16, so a
  loadable file is full size (126.9 M params, 254 MB in bf16). No smaller one is accepted.
- UMT5-XXL text encoder: `encoder.block.23.layer.1.DenseReluDense.wi_1.weight` with 4096 columns, and the
  model is always built from the fixed umt5_config_xxl.json (5.7 B params), so no tiny one exists.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
from safetensors.torch import save_file

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class WanDiTConfig:
    """Wan 2.1 T2V DiT. Real 14B: dim 5120, ffn 13824, 40 layers; 1.3B: 1536, 8960, 30."""

    dim: int = 128
    ffn_dim: int = 256
    num_layers: int = 2
    in_dim: int = 16
    out_dim: int = 16
    text_dim: int = 4096
    freq_dim: int = 256

    def __post_init__(self) -> None:
        if self.dim % 128:
            raise ValueError(f"Wan dim must be a multiple of 128 (ComfyUI sets num_heads = dim // 128), got {self.dim}")


@dataclass(frozen=True)
class LTXVDiTConfig:
    """LTX-Video DiT. Real 2B: head_dim 64 (inner 2048), 28 layers; 13B: head_dim 128, 48 layers."""

    head_dim: int = 4
    num_layers: int = 2
    num_heads: int = 32
    in_channels: int = 128
    caption_channels: int = 4096

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class WanVAEConfig:
    """Wan 2.1 VAE. ComfyUI only loads the defaults (dim 96, z_dim 16)."""

    dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)


def _linear(out: dict, name: str, n_out: int, n_in: int, bias: bool = True) -> None:
    out[f"{name}.weight"] = (n_out, n_in)
    if bias:
        out[f"{name}.bias"] = (n_out,)


def wan21_dit_shapes(cfg: WanDiTConfig = WanDiTConfig()) -> Shapes:
    """Key -> shape of a Wan 2.1 T2V DiT as stored in Comfy-Org's repacks (bare keys)."""
    d, s = cfg.dim, {}
    s["patch_embedding.weight"] = (d, cfg.in_dim, 1, 2, 2)
    s["patch_embedding.bias"] = (d,)
    _linear(s, "text_embedding.0", d, cfg.text_dim)
    _linear(s, "text_embedding.2", d, d)
    _linear(s, "time_embedding.0", d, cfg.freq_dim)
    _linear(s, "time_embedding.2", d, d)
    _linear(s, "time_projection.1", 6 * d, d)
    for i in range(cfg.num_layers):
        p = f"blocks.{i}"
        s[f"{p}.modulation"] = (1, 6, d)
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                _linear(s, f"{p}.{attn}.{proj}", d, d)
            s[f"{p}.{attn}.norm_q.weight"] = (d,)
            s[f"{p}.{attn}.norm_k.weight"] = (d,)
        s[f"{p}.norm3.weight"] = (d,)
        s[f"{p}.norm3.bias"] = (d,)
        _linear(s, f"{p}.ffn.0", cfg.ffn_dim, d)
        _linear(s, f"{p}.ffn.2", d, cfg.ffn_dim)
    s["head.modulation"] = (1, 2, d)
    _linear(s, "head.head", cfg.out_dim * 4, d)
    return s


def ltxv_dit_shapes(cfg: LTXVDiTConfig = LTXVDiTConfig()) -> Shapes:
    """Key -> shape of an LTX-Video (0.9.x) DiT without its prefix."""
    d, s = cfg.inner_dim, {}
    s["scale_shift_table"] = (2, d)
    _linear(s, "patchify_proj", d, cfg.in_channels)
    _linear(s, "adaln_single.emb.timestep_embedder.linear_1", d, 256)
    _linear(s, "adaln_single.emb.timestep_embedder.linear_2", d, d)
    _linear(s, "adaln_single.linear", 6 * d, d)
    _linear(s, "caption_projection.linear_1", d, cfg.caption_channels)
    _linear(s, "caption_projection.linear_2", d, d)
    for i in range(cfg.num_layers):
        p = f"transformer_blocks.{i}"
        s[f"{p}.scale_shift_table"] = (6, d)
        for attn in ("attn1", "attn2"):
            s[f"{p}.{attn}.q_norm.weight"] = (d,)
            s[f"{p}.{attn}.k_norm.weight"] = (d,)
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                _linear(s, f"{p}.{attn}.{proj}", d, d)
        _linear(s, f"{p}.ff.net.0.proj", 4 * d, d)
        _linear(s, f"{p}.ff.net.2", d, 4 * d)
    _linear(s, "proj_out", cfg.in_channels, d)
    return s


def _residual(s: dict, p: str, cin: int, cout: int) -> None:
    s[f"{p}.residual.0.gamma"] = (cin, 1, 1, 1)
    s[f"{p}.residual.2.weight"] = (cout, cin, 3, 3, 3)
    s[f"{p}.residual.2.bias"] = (cout,)
    s[f"{p}.residual.3.gamma"] = (cout, 1, 1, 1)
    s[f"{p}.residual.6.weight"] = (cout, cout, 3, 3, 3)
    s[f"{p}.residual.6.bias"] = (cout,)
    if cin != cout:
        s[f"{p}.shortcut.weight"] = (cout, cin, 1, 1, 1)
        s[f"{p}.shortcut.bias"] = (cout,)


def _middle(s: dict, p: str, c: int) -> None:
    _residual(s, f"{p}.middle.0", c, c)
    s[f"{p}.middle.1.norm.gamma"] = (c, 1, 1)
    s[f"{p}.middle.1.to_qkv.weight"] = (3 * c, c, 1, 1)
    s[f"{p}.middle.1.to_qkv.bias"] = (3 * c,)
    s[f"{p}.middle.1.proj.weight"] = (c, c, 1, 1)
    s[f"{p}.middle.1.proj.bias"] = (c,)
    _residual(s, f"{p}.middle.2", c, c)


def wan21_vae_shapes(cfg: WanVAEConfig = WanVAEConfig()) -> Shapes:
    """Key -> shape of the Wan 2.1 VAE (mirrors comfy/ldm/wan/vae.py Encoder3d/Decoder3d, no attention scales)."""
    s: Shapes = {}
    mult, n_res = list(cfg.dim_mult), cfg.num_res_blocks
    dims = [cfg.dim * u for u in [1] + mult]
    s["encoder.conv1.weight"] = (dims[0], 3, 3, 3, 3)
    s["encoder.conv1.bias"] = (dims[0],)
    idx = 0
    for i, (cin, cout) in enumerate(pairwise(dims)):
        for _ in range(n_res):
            _residual(s, f"encoder.downsamples.{idx}", cin, cout)
            cin, idx = cout, idx + 1
        if i != len(mult) - 1:
            s[f"encoder.downsamples.{idx}.resample.1.weight"] = (cout, cout, 3, 3)
            s[f"encoder.downsamples.{idx}.resample.1.bias"] = (cout,)
            if cfg.temporal_downsample[i]:
                s[f"encoder.downsamples.{idx}.time_conv.weight"] = (cout, cout, 3, 1, 1)
                s[f"encoder.downsamples.{idx}.time_conv.bias"] = (cout,)
            idx += 1
    _middle(s, "encoder", dims[-1])
    s["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    s["encoder.head.2.weight"] = (2 * cfg.z_dim, dims[-1], 3, 3, 3)
    s["encoder.head.2.bias"] = (2 * cfg.z_dim,)
    s["conv1.weight"] = (2 * cfg.z_dim, 2 * cfg.z_dim, 1, 1, 1)
    s["conv1.bias"] = (2 * cfg.z_dim,)
    s["conv2.weight"] = (cfg.z_dim, cfg.z_dim, 1, 1, 1)
    s["conv2.bias"] = (cfg.z_dim,)

    dims = [cfg.dim * u for u in [mult[-1]] + mult[::-1]]
    temporal_up = list(cfg.temporal_downsample[::-1])
    s["decoder.conv1.weight"] = (dims[0], cfg.z_dim, 3, 3, 3)
    s["decoder.conv1.bias"] = (dims[0],)
    _middle(s, "decoder", dims[0])
    idx = 0
    for i, (cin, cout) in enumerate(pairwise(dims)):
        if i in (1, 2, 3):
            cin //= 2
        for _ in range(n_res + 1):
            _residual(s, f"decoder.upsamples.{idx}", cin, cout)
            cin, idx = cout, idx + 1
        if i != len(mult) - 1:
            s[f"decoder.upsamples.{idx}.resample.1.weight"] = (cout // 2, cout, 3, 3)
            s[f"decoder.upsamples.{idx}.resample.1.bias"] = (cout // 2,)
            if temporal_up[i]:
                s[f"decoder.upsamples.{idx}.time_conv.weight"] = (2 * cout, cout, 3, 1, 1)
                s[f"decoder.upsamples.{idx}.time_conv.bias"] = (2 * cout,)
            idx += 1
    s["decoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    s["decoder.head.2.weight"] = (3, dims[-1], 3, 3, 3)
    s["decoder.head.2.bias"] = (3,)
    return s


def random_state_dict(shapes: Shapes, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Seeded weights with sane scales, so a forward stays finite: each tensor depends only on (seed, key).

    Norm scales are 1, biases and modulation tables small, matrices ~ N(0, 1/fan_in).
    """
    out = {}
    for key, shape in shapes.items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "gamma" or ("norm" in key and leaf == "weight" and len(shape) == 1):
            t = torch.ones(shape)
        elif leaf == "bias" or "modulation" in key or "scale_shift_table" in key:
            t = torch.randn(shape, generator=gen) * 0.02
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
            t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
        out[key] = t.to(dtype).contiguous()
    return out


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], prefix: str = "",
                    metadata: dict[str, str] | None = None) -> Path:
    """Write safetensors with an optional key prefix (ComfyUI strips `model.diffusion_model.` itself)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def write_tiny_wan21_t2v(path: str | Path, cfg: WanDiTConfig = WanDiTConfig(), *, prefix: str = "",
                         seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """ComfyUI detects this as WAN21_T2V (model_base.WAN21, comfy.ldm.wan.model.WanModel)."""
    return save_checkpoint(path, random_state_dict(wan21_dit_shapes(cfg), seed, dtype), prefix)


def write_tiny_ltxv(path: str | Path, cfg: LTXVDiTConfig = LTXVDiTConfig(), *,
                    prefix: str = "model.diffusion_model.", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """ComfyUI detects this as LTXV (comfy.ldm.lightricks.model.LTXVModel); real files carry the prefix."""
    return save_checkpoint(path, random_state_dict(ltxv_dit_shapes(cfg), seed, dtype), prefix)


def write_wan21_vae(path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Full-size random Wan 2.1 VAE (~254 MB bf16): ComfyUI builds this architecture whatever the file holds."""
    return save_checkpoint(path, random_state_dict(wan21_vae_shapes(), seed, dtype))


# What ComfyUI's own loaders report for each writer (model_config class, model_base class, network class).
EXPECTED_DETECTION = {
    "wan21_t2v": ("WAN21_T2V", "WAN21", "WanModel"),
    "ltxv": ("LTXV", "LTXV", "LTXVModel"),
    "wan21_vae": ("WanVAE",),
}
