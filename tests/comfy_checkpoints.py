"""Tiny random checkpoints in the exact key layouts ComfyUI 0.3.64 detects.

Shape tables come from ``ckpt_layouts`` (no ComfyUI import), the same layouts the sizing tests use;
`test_comfyui_smoke.py` proves they match ComfyUI's own classes key for key whenever a checkout is present.

What ComfyUI's detection reads (comfy/model_detection.py, comfy/sd.py at 0.3.64):
- Wan 2.1 DiT: `head.modulation` marks it; dim from its last axis, num_heads = dim // 128 (so dim must be a
  multiple of 128), ffn from `blocks.0.ffn.0.weight`, layers by counting `blocks.N.`, in_dim from
  `patch_embedding.weight`, out_dim = `head.head.weight`.shape[0] // 4 (out_dim 48 would mean Wan 2.2).
  text_dim (4096) and freq_dim (256) are NOT read: they must keep the real values.
- LTX-Video DiT: `adaln_single.emb.timestep_embedder.linear_1.bias` marks it; head_dim =
  `transformer_blocks.0.attn2.to_k.weight`.shape[0] // 32 (32 heads fixed), cross_attention_dim = its
  shape[1] (must equal 32 * head_dim), layers by counting. in_channels (128) and caption_channels (4096) are
  fixed.
- LTX-2 DiT (ComfyUI 0.33 only): LTX-Video's keys plus `audio_adaln_single.linear.weight` make it LTXAV; the
  dims its shapes do not give (heads, the audio stream's, the text connectors') come from the file's metadata
  `config` ("transformer"), as in the real files, so a tiny one carries them there. ComfyUI 0.3.64 takes it for LTXV.
- Wan 2.1 VAE: `decoder.middle.0.residual.0.gamma` marks it and ComfyUI always builds dim=96, z_dim=16, so a
  loadable file is full size (126.9 M params, 254 MB in bf16). No smaller one is accepted.
- UMT5-XXL text encoder: `encoder.block.23.layer.1.DenseReluDense.wi_1.weight` with 4096 columns, and the
  model is always built from the fixed umt5_config_xxl.json (5.7 B params), so no tiny one exists.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

import ckpt_layouts as L

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class WanDiTConfig:
    """Wan 2.1 T2V DiT. Real 14B: dim 5120, ffn 13824, 40 layers; 1.3B: 1536, 8960, 30."""

    dim: int = 128
    ffn_dim: int = 256
    num_layers: int = 2
    in_dim: int = 16
    out_dim: int = 16

    def __post_init__(self) -> None:
        if self.dim % 128:
            raise ValueError(f"Wan dim must be a multiple of 128 (ComfyUI sets num_heads = dim // 128), got {self.dim}")


@dataclass(frozen=True)
class LTXVDiTConfig:
    """LTX-Video DiT. Real 2B: head_dim 64 (inner 2048), 28 layers; 13B: head_dim 128, 48 layers."""

    head_dim: int = 4
    num_layers: int = 2
    in_channels: int = 128
    caption_channels: int = 4096


def _shapes(layout: L.Layout) -> Shapes:
    return {key: shape for key, (shape, _) in layout.items()}


def wan21_dit_shapes(cfg: WanDiTConfig = WanDiTConfig()) -> Shapes:
    """Key -> shape of a Wan 2.1 T2V DiT as stored in Comfy-Org's repacks (bare keys)."""
    return _shapes(L.wan_dit(cfg.dim, cfg.ffn_dim, cfg.num_layers, in_ch=cfg.in_dim, out_ch=cfg.out_dim))


def ltxv_dit_shapes(cfg: LTXVDiTConfig = LTXVDiTConfig()) -> Shapes:
    """Key -> shape of an LTX-Video (0.9.x) DiT without its prefix."""
    return _shapes(L.ltxv_dit(cfg.head_dim, cfg.num_layers, in_ch=cfg.in_channels, caption_ch=cfg.caption_channels))


def wan21_vae_shapes() -> Shapes:
    """Key -> shape of the Wan 2.1 VAE (ComfyUI builds only dim 96, z 16)."""
    return _shapes(L.wan_vae("2.1"))


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


def write_tiny_ltx2(path: str | Path, *, prefix: str = "model.diffusion_model.", seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """ComfyUI 0.33 detects this as LTXAV (LTX-2: comfy.ldm.lightricks.av_model.LTXAVModel); its dims are not
    ComfyUI's defaults, so the metadata ``config`` carries them, as the real files carry theirs. ComfyUI 0.3.64 has
    no LTX-2: it would take the file for LTX-Video."""
    shapes = _shapes(L.ltx2_tiny(prefix=""))
    metadata = {"config": json.dumps({"transformer": L.ltx2_tiny_config()})}
    return save_checkpoint(path, random_state_dict(shapes, seed, dtype), prefix, metadata)


def write_wan21_vae(path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Full-size random Wan 2.1 VAE (~254 MB bf16): ComfyUI builds this architecture whatever the file holds."""
    return save_checkpoint(path, random_state_dict(wan21_vae_shapes(), seed, dtype))


# What ComfyUI's own loaders report for each writer (model_config class, model_base class, network class).
EXPECTED_DETECTION = {
    "wan21_t2v": ("WAN21_T2V", "WAN21", "WanModel"),
    "ltxv": ("LTXV", "LTXV", "LTXVModel"),
    "ltx2": ("LTXAV", "LTXAV", "LTXAVModel"),   # ComfyUI 0.33 only
    "wan21_vae": ("WanVAE",),
}


def wan21_vace_dit_shapes(cfg: WanDiTConfig = WanDiTConfig(), vace_layers: int = 2) -> Shapes:
    """Key -> shape of a Wan 2.1 VACE DiT (bare keys). ComfyUI runs VACE block n after main block
    n x (layers // vace_layers) and indexes past its VACE blocks unless ``vace_layers`` divides the layers."""
    if cfg.num_layers % vace_layers:
        raise ValueError(f"{vace_layers} VACE blocks must divide the {cfg.num_layers} layers (ComfyUI's "
                         "vace_layers_mapping would index past the VACE blocks)")
    return _shapes(L.wan_vace_dit(cfg.dim, cfg.ffn_dim, cfg.num_layers, vace_layers, in_ch=cfg.in_dim,
                                  out_ch=cfg.out_dim))


def write_tiny_wan21_vace(path: str | Path, cfg: WanDiTConfig = WanDiTConfig(), vace_layers: int = 2, *,
                          prefix: str = "", seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """ComfyUI detects this as WAN21_Vace (model_base.WAN21_Vace, comfy.ldm.wan.model.VaceWanModel)."""
    return save_checkpoint(path, random_state_dict(wan21_vace_dit_shapes(cfg, vace_layers), seed, dtype), prefix)
