"""Checkpoint layouts of the supported model families, in their real key naming, and writers for them: what
``python -m mgpu plan --example`` plans from (header-only files of full-size models), and what the tests build
their checkpoints from.

A layout maps tensor name -> (shape, safetensors dtype). Full-size layouts match the files users download
(checked against ComfyUI 0.3.64's model classes in test_sizing.py); ``*_tiny`` ones keep the key structure at a
size small enough to hold real data. ``write_safetensors(..., sparse=True)`` writes only the header and
``truncate()``s to full size, so a 28 GB checkpoint costs a few hundred KB of disk.

Shapes were read off ComfyUI's modules (comfy/ldm/wan/model.py, vae.py, vae2_2.py, comfy/ldm/lightricks/,
comfy/text_encoders/t5.py) and transformers' Gemma 3 naming.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

Shape = tuple[int, ...]
Layout = dict[str, tuple[Shape, str]]

DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "I16": 16, "U16": 16, "F16": 16,
              "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64}
FLOATS = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}


class _Builder:
    """Collects entries; ``lin`` adds a Linear's weight and bias, the commonest pair in every family."""

    def __init__(self, dtype: str, prefix: str = ""):
        self.dtype, self.prefix, self.out = dtype, prefix, {}

    def add(self, key: str, *shape: int, dtype: str | None = None) -> None:
        self.out[self.prefix + key] = (tuple(shape), dtype or self.dtype)

    def lin(self, key: str, out_f: int, in_f: int, bias: bool = True) -> None:
        self.add(f"{key}.weight", out_f, in_f)
        if bias:
            self.add(f"{key}.bias", out_f)


# -------------------------------------------------------------------------------------------- Wan DiT

def wan_dit(dim: int, ffn: int, layers: int, in_ch: int = 16, out_ch: int = 16, i2v: bool = False,
            dtype: str = "BF16", prefix: str = "") -> Layout:
    """comfy.ldm.wan.model.WanModel: patch 1x2x2, text_dim 4096, freq_dim 256, CLIP image dim 1280."""
    b = _Builder(dtype, prefix)
    b.add("patch_embedding.weight", dim, in_ch, 1, 2, 2)
    b.add("patch_embedding.bias", dim)
    b.lin("text_embedding.0", dim, 4096)
    b.lin("text_embedding.2", dim, dim)
    b.lin("time_embedding.0", dim, 256)
    b.lin("time_embedding.2", dim, dim)
    b.lin("time_projection.1", 6 * dim, dim)
    for i in range(layers):
        p = f"blocks.{i}."
        b.add(p + "modulation", 1, 6, dim)
        for attn in ("self_attn", "cross_attn"):
            for proj in "qkvo":
                b.lin(f"{p}{attn}.{proj}", dim, dim)
            b.add(f"{p}{attn}.norm_q.weight", dim)
            b.add(f"{p}{attn}.norm_k.weight", dim)
        if i2v:
            b.lin(p + "cross_attn.k_img", dim, dim)
            b.lin(p + "cross_attn.v_img", dim, dim)
            b.add(p + "cross_attn.norm_k_img.weight", dim)
        b.add(p + "norm3.weight", dim)
        b.add(p + "norm3.bias", dim)
        b.lin(p + "ffn.0", ffn, dim)
        b.lin(p + "ffn.2", dim, ffn)
    b.add("head.modulation", 1, 2, dim)
    b.lin("head.head", out_ch * 4, dim)
    if i2v:
        b.add("img_emb.proj.0.weight", 1280)
        b.add("img_emb.proj.0.bias", 1280)
        b.lin("img_emb.proj.1", 1280, 1280)
        b.lin("img_emb.proj.3", dim, 1280)
        b.add("img_emb.proj.4.weight", dim)
        b.add("img_emb.proj.4.bias", dim)
    return b.out


def wan21_t2v_14b(dtype: str = "BF16", prefix: str = "") -> Layout:
    return wan_dit(5120, 13824, 40, dtype=dtype, prefix=prefix)


def wan21_i2v_14b(dtype: str = "BF16", prefix: str = "") -> Layout:
    return wan_dit(5120, 13824, 40, in_ch=36, i2v=True, dtype=dtype, prefix=prefix)


def wan21_t2v_1_3b(dtype: str = "BF16", prefix: str = "") -> Layout:
    return wan_dit(1536, 8960, 30, dtype=dtype, prefix=prefix)


def wan22_ti2v_5b(dtype: str = "BF16", prefix: str = "") -> Layout:
    return wan_dit(3072, 14336, 30, in_ch=48, out_ch=48, dtype=dtype, prefix=prefix)


def wan_dit_tiny(layers: int = 3, i2v: bool = False, dtype: str = "BF16", prefix: str = "") -> Layout:
    """Loadable by ComfyUI's WanModel (heads = dim // 128 = 2); ~4 M params (8 MB bf16) without i2v."""
    return wan_dit(256, 512, layers, in_ch=36 if i2v else 16, i2v=i2v, dtype=dtype, prefix=prefix)


# ------------------------------------------------------------------------------------------- LTXV DiT

def ltxv_dit(head_dim: int = 64, layers: int = 28, in_ch: int = 128, cross_dim: int | None = None,
             caption_ch: int = 4096, dtype: str = "BF16", prefix: str = "") -> Layout:
    """comfy.ldm.lightricks.model.LTXVModel: 32 heads, GELU FFN 4x, cross-attention to projected T5."""
    hidden = 32 * head_dim
    cross = cross_dim or hidden
    b = _Builder(dtype, prefix)
    b.add("scale_shift_table", 2, hidden)
    b.lin("patchify_proj", hidden, in_ch)
    b.lin("adaln_single.emb.timestep_embedder.linear_1", hidden, 256)
    b.lin("adaln_single.emb.timestep_embedder.linear_2", hidden, hidden)
    b.lin("adaln_single.linear", 6 * hidden, hidden)
    b.lin("caption_projection.linear_1", hidden, caption_ch)
    b.lin("caption_projection.linear_2", hidden, hidden)
    for i in range(layers):
        p = f"transformer_blocks.{i}."
        b.add(p + "scale_shift_table", 6, hidden)
        for attn, kv_in in (("attn1", hidden), ("attn2", cross)):
            b.add(f"{p}{attn}.q_norm.weight", hidden)
            b.add(f"{p}{attn}.k_norm.weight", hidden)
            b.lin(f"{p}{attn}.to_q", hidden, hidden)
            b.lin(f"{p}{attn}.to_k", hidden, kv_in)
            b.lin(f"{p}{attn}.to_v", hidden, kv_in)
            b.lin(f"{p}{attn}.to_out.0", hidden, hidden)
        b.lin(p + "ff.net.0.proj", 4 * hidden, hidden)
        b.lin(p + "ff.net.2", hidden, 4 * hidden)
    b.lin("proj_out", in_ch, hidden)
    return b.out


def ltxv_2b(dtype: str = "BF16", prefix: str = "") -> Layout:
    return ltxv_dit(64, 28, dtype=dtype, prefix=prefix)


def ltxv_13b(dtype: str = "BF16", prefix: str = "") -> Layout:
    return ltxv_dit(128, 48, cross_dim=4096, dtype=dtype, prefix=prefix)


def ltxv_tiny(layers: int = 3, dtype: str = "BF16", prefix: str = "") -> Layout:
    return ltxv_dit(8, layers, dtype=dtype, prefix=prefix)


# -------------------------------------------------------------------------------- LTX-2 (audio + video) DiT

def _adaln(b: _Builder, key: str, dim: int, coefficient: int) -> None:
    """comfy.ldm.lightricks.model.AdaLayerNormSingle: a 256-wide timestep embedder, then ``coefficient`` x dim."""
    b.lin(key + ".emb.timestep_embedder.linear_1", dim, 256)
    b.lin(key + ".emb.timestep_embedder.linear_2", dim, dim)
    b.lin(key + ".linear", coefficient * dim, dim)


def _ltx_attention(b: _Builder, key: str, query: int, context: int, inner: int) -> None:
    """comfy.ldm.lightricks.model.CrossAttention (RMS q/k norms over all heads, biased projections)."""
    b.add(key + ".q_norm.weight", inner)
    b.add(key + ".k_norm.weight", inner)
    b.lin(key + ".to_q", inner, query)
    b.lin(key + ".to_k", inner, context)
    b.lin(key + ".to_v", inner, context)
    b.lin(key + ".to_out.0", query, inner)


def _ltx_ff(b: _Builder, key: str, dim: int) -> None:
    b.lin(key + ".net.0.proj", 4 * dim, dim)
    b.lin(key + ".net.2", dim, 4 * dim)


def ltx2_av_dit(heads: int = 32, head_dim: int = 128, audio_heads: int = 32, audio_head_dim: int = 64,
                layers: int = 48, caption_ch: int = 3840, connector_heads: int = 30, connector_head_dim: int = 128,
                connector_layers: int = 2, registers: int = 128, in_ch: int = 128, audio_in_ch: int = 128,
                dtype: str = "BF16", prefix: str = "") -> Layout:
    """comfy.ldm.lightricks.av_model.LTXAVModel (ComfyUI 0.33; LTX-2 19B by default): a video stream (32 x 128) and
    an audio stream (32 x 64) per block, each with self-, text- and cross-stream attention and a GELU FFN 4x; the two
    text connectors (Embeddings1DConnector, 30 x 128 = Gemma 3's 3840) turn the text encoder's output into each
    stream's context. The text cross-attention reads the projected caption at the stream's width."""
    video, audio, conn = heads * head_dim, audio_heads * audio_head_dim, connector_heads * connector_head_dim
    b = _Builder(dtype, prefix)
    b.lin("patchify_proj", video, in_ch)
    _adaln(b, "adaln_single", video, 6)
    b.lin("caption_projection.linear_1", video, caption_ch)
    b.lin("caption_projection.linear_2", video, video)
    b.lin("audio_patchify_proj", audio, audio_in_ch)
    _adaln(b, "audio_adaln_single", audio, 6)   # its presence makes ComfyUI's detection say "ltxav"
    _adaln(b, "av_ca_video_scale_shift_adaln_single", video, 4)
    _adaln(b, "av_ca_a2v_gate_adaln_single", video, 1)
    _adaln(b, "av_ca_audio_scale_shift_adaln_single", audio, 4)
    _adaln(b, "av_ca_v2a_gate_adaln_single", audio, 1)
    b.lin("audio_caption_projection.linear_1", audio, caption_ch)
    b.lin("audio_caption_projection.linear_2", audio, audio)
    for stream in ("audio", "video"):
        p = f"{stream}_embeddings_connector."
        for i in range(connector_layers):
            _ltx_attention(b, f"{p}transformer_1d_blocks.{i}.attn1", conn, conn, conn)
            _ltx_ff(b, f"{p}transformer_1d_blocks.{i}.ff", conn)
        b.add(p + "learnable_registers", registers, conn)
    for i in range(layers):
        p = f"transformer_blocks.{i}."
        _ltx_attention(b, p + "attn1", video, video, video)
        _ltx_attention(b, p + "audio_attn1", audio, audio, audio)
        _ltx_attention(b, p + "attn2", video, video, video)
        _ltx_attention(b, p + "audio_attn2", audio, audio, audio)
        _ltx_attention(b, p + "audio_to_video_attn", video, audio, audio)   # q: video, k/v: audio
        _ltx_attention(b, p + "video_to_audio_attn", audio, video, audio)   # q: audio, k/v: video
        _ltx_ff(b, p + "ff", video)
        _ltx_ff(b, p + "audio_ff", audio)
        b.add(p + "scale_shift_table", 6, video)
        b.add(p + "audio_scale_shift_table", 6, audio)
        b.add(p + "scale_shift_table_a2v_ca_audio", 5, audio)
        b.add(p + "scale_shift_table_a2v_ca_video", 5, video)
    b.add("scale_shift_table", 2, video)
    b.lin("proj_out", in_ch, video)
    b.add("audio_scale_shift_table", 2, audio)
    b.lin("audio_proj_out", audio_in_ch, audio)
    return b.out


def ltx2_19b(dtype: str = "BF16", prefix: str = "model.diffusion_model.") -> Layout:
    """The LTX-2 19B DiT as its checkpoints store it (under ``model.diffusion_model.``)."""
    return ltx2_av_dit(dtype=dtype, prefix=prefix)


def ltx2_checkpoint(dit: Layout, gemma_hidden: int, gemma_layers: int, caption: int) -> Layout:
    """An LTX-2 checkpoint as Lightricks ship it: the DiT under model.diffusion_model. (``dit``) and the text projection
    ComfyUI's LTX-2 text encoder loads from it (``aggregate_embed``: every Gemma layer's output and the embeddings,
    hidden x (layers + 1), to the caption width, without bias). The real file also holds VAEs, under vae. etc."""
    width = gemma_hidden * (gemma_layers + 1)
    return {**dit, "text_embedding_projection.aggregate_embed.weight": ((caption, width), "BF16")}


def ltx2_19b_file() -> Layout:
    """``ltx-2-19b-dev.safetensors``: the 19B DiT, Gemma 3 12B's text projection (3840 x 48 layers), the video VAE."""
    return {**ltx2_checkpoint(ltx2_19b(), 3840, 48, 3840), **ltxv_vae(prefix="vae.")}


# The tiny LTX-2 below is not ComfyUI's default shape, so its file says so in the metadata ``config`` ComfyUI 0.33's
# detection reads (comfy/model_detection.py: ``{"transformer": {...}}``), as the real files do.
LTX2_TINY = dict(heads=4, head_dim=16, audio_heads=4, audio_head_dim=8, layers=3, caption_ch=48, connector_heads=3,
                 connector_head_dim=16, connector_layers=2, registers=128)   # ComfyUI always builds 128


def ltx2_tiny_config(dims: dict | None = None) -> dict:
    """The ``transformer`` config of the metadata that makes ComfyUI build ``ltx2_av_dit(**dims)``."""
    d = {**LTX2_TINY, **(dims or {})}
    return {"num_attention_heads": d["heads"], "attention_head_dim": d["head_dim"],
            "cross_attention_dim": d["heads"] * d["head_dim"], "audio_num_attention_heads": d["audio_heads"],
            "audio_attention_head_dim": d["audio_head_dim"],
            "audio_cross_attention_dim": d["audio_heads"] * d["audio_head_dim"], "caption_channels": d["caption_ch"],
            "connector_num_attention_heads": d["connector_heads"],
            "connector_attention_head_dim": d["connector_head_dim"], "connector_num_layers": d["connector_layers"]}


def ltx2_tiny(dtype: str = "BF16", prefix: str = "model.diffusion_model.") -> Layout:
    return ltx2_av_dit(**LTX2_TINY, dtype=dtype, prefix=prefix)


# ------------------------------------------------------------------------------------- text encoders

def t5_encoder(vocab: int, d_model: int, d_ff: int, layers: int, heads: int = 64, d_kv: int = 64,
               umt5: bool = True, dtype: str = "BF16", prefix: str = "") -> Layout:
    """comfy.text_encoders.t5.T5 (gated GELU FFN); UMT5 has a relative-attention bias in every block."""
    inner = heads * d_kv
    b = _Builder(dtype, prefix)
    b.add("shared.weight", vocab, d_model)
    for i in range(layers):
        p = f"encoder.block.{i}.layer."
        for proj in "qkv":
            b.lin(f"{p}0.SelfAttention.{proj}", inner, d_model, bias=False)
        b.lin(f"{p}0.SelfAttention.o", d_model, inner, bias=False)
        if umt5 or i == 0:
            b.add(f"{p}0.SelfAttention.relative_attention_bias.weight", 32, heads)
        b.add(f"{p}0.layer_norm.weight", d_model)
        b.lin(f"{p}1.DenseReluDense.wi_0", d_ff, d_model, bias=False)
        b.lin(f"{p}1.DenseReluDense.wi_1", d_ff, d_model, bias=False)
        b.lin(f"{p}1.DenseReluDense.wo", d_model, d_ff, bias=False)
        b.add(f"{p}1.layer_norm.weight", d_model)
    b.add("encoder.final_layer_norm.weight", d_model)
    return b.out


def umt5_xxl(dtype: str = "BF16", prefix: str = "") -> Layout:
    return t5_encoder(256384, 4096, 10240, 24, dtype=dtype, prefix=prefix)


def t5_xxl(dtype: str = "BF16", prefix: str = "") -> Layout:
    return t5_encoder(32128, 4096, 10240, 24, umt5=False, dtype=dtype, prefix=prefix)


def t5_tiny(umt5: bool = True, dtype: str = "BF16", prefix: str = "") -> Layout:
    return t5_encoder(1000, 64, 128, 3, heads=4, d_kv=16, umt5=umt5, dtype=dtype, prefix=prefix)


_GEMMA_ROOTS = {  # text root, vision root, projector root
    "hf": ("language_model.model.", "vision_tower.vision_model.", "multi_modal_projector."),  # google/gemma-3-*-it
    "hf_new": ("model.language_model.", "model.vision_tower.vision_model.", "model.multi_modal_projector."),
    "comfy": ("model.", None, None),  # comfy.text_encoders.llama (text only)
}


def gemma3(hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int = 256,
           vocab: int = 262208, vision: tuple[int, int, int, int] | None = (1152, 4304, 27, 4096),
           naming: str = "hf", dtype: str = "BF16") -> Layout:
    """Gemma 3 (text + optional SigLIP vision tower given as (hidden, mlp, layers, positions)).

    naming: "hf" as in the google/gemma-3-*-it files, "hf_new" as transformers 4.5x saves it, "comfy" text only.
    """
    text, vis, proj = _GEMMA_ROOTS[naming]
    b = _Builder(dtype)
    b.add(text + "embed_tokens.weight", vocab, hidden)
    for i in range(layers):
        p = f"{text}layers.{i}."
        b.lin(p + "self_attn.q_proj", heads * head_dim, hidden, bias=False)
        b.lin(p + "self_attn.k_proj", kv_heads * head_dim, hidden, bias=False)
        b.lin(p + "self_attn.v_proj", kv_heads * head_dim, hidden, bias=False)
        b.lin(p + "self_attn.o_proj", hidden, heads * head_dim, bias=False)
        b.add(p + "self_attn.q_norm.weight", head_dim)
        b.add(p + "self_attn.k_norm.weight", head_dim)
        b.lin(p + "mlp.gate_proj", ffn, hidden, bias=False)
        b.lin(p + "mlp.up_proj", ffn, hidden, bias=False)
        b.lin(p + "mlp.down_proj", hidden, ffn, bias=False)
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            b.add(f"{p}{norm}_layernorm.weight", hidden)
    b.add(text + "norm.weight", hidden)
    if vision and vis:
        vh, vmlp, vlayers, positions = vision
        b.add(vis + "embeddings.patch_embedding.weight", vh, 3, 14, 14)
        b.add(vis + "embeddings.patch_embedding.bias", vh)
        b.add(vis + "embeddings.position_embedding.weight", positions, vh)
        for i in range(vlayers):
            p = f"{vis}encoder.layers.{i}."
            for proj_name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                b.lin(f"{p}self_attn.{proj_name}", vh, vh)
            for norm in ("layer_norm1", "layer_norm2"):
                b.add(f"{p}{norm}.weight", vh)
                b.add(f"{p}{norm}.bias", vh)
            b.lin(p + "mlp.fc1", vmlp, vh)
            b.lin(p + "mlp.fc2", vh, vmlp)
        b.add(vis + "post_layernorm.weight", vh)
        b.add(vis + "post_layernorm.bias", vh)
        b.add(proj + "mm_input_projection_weight", vh, hidden)
        b.add(proj + "mm_soft_emb_norm.weight", vh)
    return b.out


def gemma3_12b(naming: str = "hf", dtype: str = "BF16") -> Layout:
    return gemma3(3840, 15360, 48, 16, 8, naming=naming, dtype=dtype)


def gemma3_tiny(naming: str = "hf", dtype: str = "BF16") -> Layout:
    return gemma3(64, 128, 3, 2, 1, head_dim=32, vocab=1000, vision=(32, 64, 2, 16), naming=naming, dtype=dtype)


# ----------------------------------------------------------------------------------------------- VAEs

def _wan_res(b: _Builder, p: str, cin: int, cout: int) -> None:
    b.add(p + "residual.0.gamma", cin, 1, 1, 1)
    b.add(p + "residual.2.weight", cout, cin, 3, 3, 3)
    b.add(p + "residual.2.bias", cout)
    b.add(p + "residual.3.gamma", cout, 1, 1, 1)
    b.add(p + "residual.6.weight", cout, cout, 3, 3, 3)
    b.add(p + "residual.6.bias", cout)
    if cin != cout:
        b.add(p + "shortcut.weight", cout, cin, 1, 1, 1)
        b.add(p + "shortcut.bias", cout)


def _wan_resample(b: _Builder, p: str, c: int, mode: str, halve: bool) -> None:
    out = c // 2 if mode.startswith("up") and halve else c
    b.add(p + "resample.1.weight", out, c, 3, 3)
    b.add(p + "resample.1.bias", out)
    if mode.endswith("3d"):
        tc = 2 * c if mode.startswith("up") else c
        b.add(p + "time_conv.weight", tc, c, 3, 1, 1)
        b.add(p + "time_conv.bias", tc)


def _wan_middle(b: _Builder, p: str, c: int) -> None:
    _wan_res(b, p + "middle.0.", c, c)
    b.add(p + "middle.1.norm.gamma", c, 1, 1)
    b.add(p + "middle.1.to_qkv.weight", 3 * c, c, 1, 1)
    b.add(p + "middle.1.to_qkv.bias", 3 * c)
    b.add(p + "middle.1.proj.weight", c, c, 1, 1)
    b.add(p + "middle.1.proj.bias", c)
    _wan_res(b, p + "middle.2.", c, c)


def _wan_head(b: _Builder, p: str, cin: int, cout: int) -> None:
    b.add(p + "head.0.gamma", cin, 1, 1, 1)
    b.add(p + "head.2.weight", cout, cin, 3, 3, 3)
    b.add(p + "head.2.bias", cout)


def wan_vae(version: str = "2.1", dim: int | None = None, z_dim: int | None = None, dtype: str = "BF16",
            prefix: str = "") -> Layout:
    """comfy.ldm.wan.vae.WanVAE (2.1: dim 96, z 16) or vae2_2.WanVAE (2.2: dim 160, decoder 256, z 48)."""
    wan22 = version == "2.2"
    dim = dim or (160 if wan22 else 96)
    z = z_dim or (48 if wan22 else 16)
    down_3d, up_3d = [False, True, True], [True, True, False]
    b = _Builder(dtype, prefix)
    enc = [dim * u for u in (1, 1, 2, 4, 4)]
    b.add("encoder.conv1.weight", dim, 12 if wan22 else 3, 3, 3, 3)
    b.add("encoder.conv1.bias", dim)
    idx = 0
    for i, (cin, cout) in enumerate(zip(enc, enc[1:])):
        stage = f"encoder.downsamples.{i}.downsamples." if wan22 else "encoder.downsamples."
        j = 0 if wan22 else idx
        for _ in range(2):
            _wan_res(b, f"{stage}{j}.", cin, cout)
            cin, j = cout, j + 1
        if i != 3:
            _wan_resample(b, f"{stage}{j}.", cout, "down3d" if down_3d[i] else "down2d", halve=False)
            j += 1
        idx = j
    _wan_middle(b, "encoder.", enc[-1])
    _wan_head(b, "encoder.", enc[-1], 2 * z)
    b.add("conv1.weight", 2 * z, 2 * z, 1, 1, 1)
    b.add("conv1.bias", 2 * z)
    b.add("conv2.weight", z, z, 1, 1, 1)
    b.add("conv2.bias", z)

    dec = [(256 if wan22 else dim) * u for u in (4, 4, 4, 2, 1)]
    b.add("decoder.conv1.weight", dec[0], z, 3, 3, 3)
    b.add("decoder.conv1.bias", dec[0])
    _wan_middle(b, "decoder.", dec[0])
    idx = 0
    for i, (cin, cout) in enumerate(zip(dec, dec[1:])):
        if not wan22 and i in (1, 2, 3):
            cin //= 2  # 2.1's upsample convs halve the channels
        stage = f"decoder.upsamples.{i}.upsamples." if wan22 else "decoder.upsamples."
        j = 0 if wan22 else idx
        for _ in range(3):
            _wan_res(b, f"{stage}{j}.", cin, cout)
            cin, j = cout, j + 1
        if i != 3:
            _wan_resample(b, f"{stage}{j}.", cout, "up3d" if up_3d[i] else "up2d", halve=not wan22)
            j += 1
        idx = j
    _wan_head(b, "decoder.", dec[-1], 12 if wan22 else 3)
    return b.out


def wan_vae_tiny(version: str = "2.1", dtype: str = "F32") -> Layout:
    return wan_vae(version, dim=8, dtype=dtype)


def ltxv_vae(base: int = 128, latent: int = 128, dtype: str = "BF16", prefix: str = "") -> Layout:
    """LTX-Video 0.9.5+ VideoVAE (comfy/ldm/lightricks/vae, "version 2"): 8x32x32, timestep-conditioned decoder."""
    b = _Builder(dtype, prefix)

    def conv(key: str, cout: int, cin: int, k: int = 3) -> None:
        b.add(key + ".weight", cout, cin, k, k, k)
        b.add(key + ".bias", cout)

    def res_x(p: str, c: int, n: int, timestep: bool) -> None:
        if timestep:
            b.lin(p + "time_embedder.timestep_embedder.linear_1", 4 * c, 256)
            b.lin(p + "time_embedder.timestep_embedder.linear_2", 4 * c, 4 * c)
        for i in range(n):
            if timestep:
                b.add(f"{p}res_blocks.{i}.scale_shift_table", 4, c)
            conv(f"{p}res_blocks.{i}.conv1.conv", c, c)
            conv(f"{p}res_blocks.{i}.conv2.conv", c, c)

    c = base
    conv("encoder.conv_in.conv", c, 48)
    encoder = [("res", 4), ("down", 4), ("res", 6), ("down", 2), ("res", 6), ("down", 8), ("res", 2), ("down", 8),
               ("res", 2)]  # "down" carries the stride product (space 2x2, time 2, all 2x2x2)
    for i, (what, n) in enumerate(encoder):
        if what == "res":
            res_x(f"encoder.down_blocks.{i}.", c, n, timestep=False)
        else:
            conv(f"encoder.down_blocks.{i}.conv.conv", 2 * c // n, c)
            c *= 2
    conv("encoder.conv_out.conv", latent + 1, c)

    c = base * 8
    b.add("decoder.timestep_scale_multiplier", dtype=dtype)
    b.add("decoder.last_scale_shift_table", 2, base)
    conv("decoder.conv_in.conv", c, latent)
    for i in range(7):
        if i % 2 == 0:
            res_x(f"decoder.up_blocks.{i}.", c, 5, timestep=True)
        else:
            conv(f"decoder.up_blocks.{i}.conv.conv", c * 4, c)  # depth-to-space 2x2x2, channels halve
            c //= 2
    conv("decoder.conv_out.conv", 48, base)
    b.lin("decoder.last_time_embedder.timestep_embedder.linear_1", 2 * base, 256)
    b.lin("decoder.last_time_embedder.timestep_embedder.linear_2", 2 * base, 2 * base)
    for stat in ("std-of-means", "mean-of-means", "mean-of-stds", "mean-of-stds_over_std-of-means", "channel"):
        b.add(f"per_channel_statistics.{stat}", latent)
    return b.out


# -------------------------------------------------------------------------------------------- helpers

def layout_bytes(layout: Layout) -> int:
    return sum(math.prod(shape) * DTYPE_BITS[dtype] // 8 for shape, dtype in layout.values())


def layout_params(layout: Layout) -> int:
    return sum(math.prod(shape) for shape, _ in layout.values())


def with_prefix(layout: Layout, prefix: str) -> Layout:
    return {prefix + k: v for k, v in layout.items()}


def combine(*layouts: Layout) -> Layout:
    """One checkpoint holding several components (e.g. LTXV's model.diffusion_model. + vae.)."""
    out: Layout = {}
    for layout in layouts:
        clash = out.keys() & layout.keys()
        assert not clash, f"layouts share keys: {sorted(clash)[:3]}"
        out.update(layout)
    return out


def recast(layout: Layout, dtype: str) -> Layout:
    """Floating tensors with >= 2 dims to ``dtype``; norms, biases and scalars keep theirs (as fp8 files do)."""
    return {k: (s, dtype if d in FLOATS and len(s) >= 2 else d) for k, (s, d) in layout.items()}


def header_bytes(layout: Layout, metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """A safetensors header for ``layout`` (length prefix included) and the size of its data section."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (shape, dtype) in layout.items():
        size = math.prod(shape) * DTYPE_BITS[dtype] // 8
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw, offset


def _tensor_bytes(shape: Shape, dtype: str, gen) -> bytes:
    import torch  # only the data-writing path needs torch

    tdtype = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F16": torch.float16,
              "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}.get(dtype)
    nbytes = math.prod(shape) * DTYPE_BITS[dtype] // 8
    if tdtype is None:  # integers and bools: any bit pattern is a valid value (BOOL: 0/1)
        data = torch.randint(0, 2 if dtype == "BOOL" else 256, (nbytes,), dtype=torch.uint8, generator=gen)
        return data.numpy().tobytes()
    data = (torch.randn(shape, generator=gen) * 0.02).to(tdtype)
    return data.reshape(-1).view(torch.uint8).numpy().tobytes()


def write_safetensors(path: str | Path, layout: Layout, sparse: bool = False,
                      metadata: dict[str, str] | None = None, seed: int = 0) -> Path:
    """A valid safetensors file: random N(0, 0.02) data, or (sparse) just the header and a hole to full size."""
    path = Path(path)
    head, data_size = header_bytes(layout, metadata)
    with open(path, "wb") as f:
        f.write(head)
        if sparse:
            f.truncate(len(head) + data_size)
        else:
            import torch

            gen = torch.Generator().manual_seed(seed)
            for shape, dtype in layout.values():
                f.write(_tensor_bytes(shape, dtype, gen))
    return path


def write_sharded(folder: str | Path, layout: Layout, shards: int = 2, sparse: bool = False,
                  stem: str = "model") -> Path:
    """HF-style shards ``stem-0000i-of-0000n.safetensors`` plus ``stem.safetensors.index.json``; returns the index."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    total = layout_bytes(layout)
    parts: list[Layout] = [{} for _ in range(shards)]
    done = 0
    for name, (shape, dtype) in layout.items():
        parts[min(shards - 1, done * shards // max(total, 1))][name] = (shape, dtype)
        done += math.prod(shape) * DTYPE_BITS[dtype] // 8
    weight_map = {}
    for i, part in enumerate(parts, 1):
        fname = f"{stem}-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / fname, part, sparse=sparse, seed=i)
        weight_map.update({k: fname for k in part})
    index = folder / f"{stem}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index


# -------------------------------------------------------------------------------------------- Wan VACE DiT

def wan_vace_dit(dim: int, ffn: int, layers: int, vace_layers: int, vace_in: int = 96, in_ch: int = 16,
                 out_ch: int = 16, dtype: str = "BF16", prefix: str = "") -> Layout:
    """comfy.ldm.wan.model.VaceWanModel (ComfyUI detects it by ``vace_patch_embedding``): the T2V DiT plus
    ``vace_layers`` VACE blocks in the main blocks' layout (``before_proj`` on the first, ``after_proj`` on each) and
    a patch embedding of the VACE context (96 channels: 32 latent + 64 mask). Real 14B: 40 layers, 8 VACE; 1.3B: 30,
    15. ComfyUI runs VACE block n after main block n x (layers // vace_layers)."""
    out = wan_dit(dim, ffn, layers, in_ch=in_ch, out_ch=out_ch, dtype=dtype, prefix=prefix)
    first = prefix + "blocks.0."
    block = {key[len(first):]: entry for key, entry in out.items() if key.startswith(first)}
    b = _Builder(dtype, prefix)
    for i in range(vace_layers):
        for key, (shape, stored) in block.items():
            b.add(f"vace_blocks.{i}.{key}", *shape, dtype=stored)
        if i == 0:
            b.lin("vace_blocks.0.before_proj", dim, dim)
        b.lin(f"vace_blocks.{i}.after_proj", dim, dim)
    b.add("vace_patch_embedding.weight", dim, vace_in, 1, 2, 2)
    b.add("vace_patch_embedding.bias", dim)
    return {**out, **b.out}
