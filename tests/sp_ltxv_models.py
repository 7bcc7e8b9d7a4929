"""ComfyUI's own LTXVModel at test size for the sequence-parallel tests (factories the ranks import by path), its
inputs as ComfyUI's LTXV BaseModel passes them, and rank ops that look inside a sharded forward."""

from __future__ import annotations

import torch

import tiny_models as tm

CHANNELS, TEXT, CAPTION = 8, 6, 24
FRAMES, HEIGHT, WIDTH = 3, 3, 5      # latent, patch 1: 45 tokens, 23/22 over 2 ranks, 12/11/11/11 over 4
TOKENS = FRAMES * HEIGHT * WIDTH
PER_FRAME = HEIGHT * WIDTH
DROPPED = 3                          # guide tokens the guide's mask drops (denoise mask < 0): 45 + 15 - 3 = 57 tokens
SCALE = (8, 32, 32)                  # LTXV's VAE: latent -> pixel coordinates


def ltxv_class():
    tm._import_comfy()
    from comfy.ldm.lightricks.model import LTXVModel

    return LTXVModel


def has_ltx2() -> bool:
    """ComfyUI >= 0.3.7x: LTXVModel builds LTX-2's video network too (cross-attention AdaLN, split rope, guide
    attention masks, the keyframe position embedding)."""
    tm._import_comfy()
    import comfy.ldm.lightricks.model as ltx

    return hasattr(ltx, "GuideAttentionMask")


def tiny_ltxv(heads: int = 4, ltx2: bool = False) -> torch.nn.Module:
    """comfy.ldm.lightricks.model.LTXVModel, 2 layers of ``heads`` x 8; random weights come from the file. ``ltx2``:
    LTX-2's video-only options (ComfyUI with ``has_ltx2``)."""
    network = ltxv_class()
    import comfy.ops

    extra = dict(cross_attention_adaln=True, rope_type="split", use_middle_indices_grid=True,
                 use_keyframes_abs_pos_embedding=True) if ltx2 else {}
    return network(in_channels=CHANNELS, cross_attention_dim=8 * heads, attention_head_dim=8, num_attention_heads=heads,
                   caption_channels=CAPTION, num_layers=2, operations=comfy.ops.disable_weight_init, **extra)


def ltxv_inputs(batch: int, seed: int = 0, per_token: bool = False) -> dict:
    """What ComfyUI's LTXV BaseModel passes: latent, timestep (sigma per sample, or per token [B, tokens, 1] as
    ``process_timestep`` makes it from a denoise mask), text context and its mask (the last text token of the
    second sample masked out)."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.rand(batch, generator=g)
    timestep = sigma[:, None, None] * torch.rand(batch, TOKENS, 1, generator=g) if per_token else sigma
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[1:, -1] = 0
    return {"x": torch.randn(batch, CHANNELS, FRAMES, HEIGHT, WIDTH, generator=g), "timestep": timestep,
            "context": torch.randn(batch, TEXT, CAPTION, generator=g), "attention_mask": mask}


def guide_inputs(batch: int, seed: int = 0, strength: float = 0.5) -> dict:
    """LTXVAddGuide's conditioning: one guide latent frame appended to the latent, its pixel coordinates
    (``keyframe_idxs``), a denoise mask that keeps the guide clean, and the per-token timestep made from that mask.
    With ``has_ltx2``, the mask also drops ``DROPPED`` of the guide's tokens and a guide entry's strength makes a
    GuideAttentionMask (older ComfyUI ignores both and takes start coordinates only)."""
    inputs = ltxv_inputs(batch, seed)
    g = torch.Generator().manual_seed(seed + 100)
    inputs["x"] = torch.cat([inputs["x"], torch.randn(batch, CHANNELS, 1, HEIGHT, WIDTH, generator=g)], dim=2)
    denoise = torch.ones(batch, 1, FRAMES + 1, HEIGHT, WIDTH)
    denoise[:, :, -1] = 0.0
    denoise[:, :, -1, 0, :DROPPED] = -1.0
    inputs["denoise_mask"] = denoise
    inputs["timestep"] = (denoise.flatten(2).transpose(1, 2) * inputs["timestep"][:, None, None]).clamp(min=0)
    h, w = torch.meshgrid(torch.arange(HEIGHT), torch.arange(WIDTH), indexing="ij")
    start = torch.stack([torch.zeros(PER_FRAME), h.flatten(), w.flatten()]) * torch.tensor(SCALE)[:, None]
    coords = torch.stack([start, start + torch.tensor(SCALE)[:, None]], dim=-1)       # [3, tokens, (start, end)]
    keyframes = coords if has_ltx2() else coords[..., 0]
    inputs["keyframe_idxs"] = keyframes.expand(batch, *keyframes.shape).clone()
    inputs["guide_attention_entries"] = [{"pre_filter_count": PER_FRAME, "strength": strength, "pixel_mask": None,
                                          "latent_shape": [1, HEIGHT, WIDTH]}]
    return inputs


def _use_layout(entry: dict, rows: int) -> None:
    entry["layouts"].use(entry["layouts"].for_rows(rows))


def self_attention_tokens(ctx, payload: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Rank op: run the model on ``tensors`` with the split the rank op would take for their rows, and report the
    tokens its first self-attention was given."""
    entry = ctx.objects[payload["handle"]]
    model = entry["model"]
    _use_layout(entry, tensors["x"].shape[0])
    seen: list[int] = []
    hook = model.transformer_blocks[0].attn1.register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            model(**{k: v.clone() for k, v in tensors.items()})
    finally:
        hook.remove()
    return {"tokens": seen}


def dense_mask_error(ctx, payload: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Rank op: the forward with a dense [1, 1, tokens, tokens] self-attention mask, as a future ComfyUI could
    build it; returns the error it raised (None if it ran)."""
    from mgpu.sharding.model_ops import clean_after_failed_forward

    entry = ctx.objects[payload["handle"]]
    model = entry["model"]
    _use_layout(entry, tensors["x"].shape[0])
    model._build_guide_self_attention_mask = lambda x, options, args: torch.zeros(1, 1, x.shape[1], x.shape[1])
    try:
        with torch.no_grad():
            model(**{k: v.clone() for k, v in tensors.items()})
        return {"error": None}
    except Exception as exc:   # noqa: BLE001 - the test reads its type and message
        clean_after_failed_forward(ctx, entry)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        del model._build_guide_self_attention_mask


# ------------------------------------------------------------------ LTX-2 (ComfyUI 0.33's LTXAVModel): video + audio

AUDIO_CHANNELS, FREQ_BINS = 8, 16    # LTX-2's audio latent (ComfyUI fixes both): 128 values per audio token
AUDIO_TOKENS = 7                     # whole on every rank


def has_ltxav() -> bool:
    """ComfyUI >= 0.3.7x: LTX-2's audio + video network (comfy.ldm.lightricks.av_model.LTXAVModel)."""
    import importlib.util

    tm._import_comfy()
    return importlib.util.find_spec("comfy.ldm.lightricks.av_model") is not None


def tiny_ltxav(heads: int = 4) -> torch.nn.Module:
    """comfy.ldm.lightricks.av_model.LTXAVModel, 2 layers: video ``heads`` x 8, audio 2 x 8, with LTX-2.3's options
    (text cross-attention AdaLN, gated attention, split rope on token middles, the keyframe position embedding)."""
    tm._import_comfy()
    import comfy.ops
    from comfy.ldm.lightricks.av_model import LTXAVModel

    return LTXAVModel(in_channels=CHANNELS, audio_in_channels=AUDIO_CHANNELS * FREQ_BINS,
                      cross_attention_dim=8 * heads, audio_cross_attention_dim=16, attention_head_dim=8,
                      audio_attention_head_dim=8, num_attention_heads=heads, audio_num_attention_heads=2,
                      caption_channels=CAPTION, num_layers=2, cross_attention_adaln=True, apply_gated_attention=True,
                      rope_type="split", use_middle_indices_grid=True, use_keyframes_abs_pos_embedding=True,
                      connector_num_attention_heads=2, connector_attention_head_dim=8, connector_num_layers=1,
                      operations=comfy.ops.disable_weight_init)


def ltxav_inputs(batch: int, seed: int = 0, mask: str | None = None) -> dict:
    """What ComfyUI's LTXAV BaseModel passes: [video, audio] latents, (video, audio) timesteps, the connectors'
    context (video and audio halves) and its text mask. Every row has the same timesteps, as CFG's cond and uncond
    do (LTX-2's cross-stream gates take the max over the whole batch, so rows split apart must agree). ``mask``: a
    denoise mask, per token as ``process_timestep`` makes it: "frame" keeps the first latent frame clean and the
    second half-noised (ComfyUI keeps one timestep per frame), "spatial" part of the first (one per token); the audio
    then gets a per-token timestep too."""
    g = torch.Generator().manual_seed(seed)
    sigma = torch.rand(1, generator=g).expand(batch)
    v_timestep = a_timestep = sigma
    inputs = {}
    if mask is not None:
        denoise = torch.ones(batch, 1, FRAMES, HEIGHT, WIDTH)
        denoise[:, :, 0, :(HEIGHT if mask == "frame" else 1)] = 0.0
        denoise[:, :, 1] = 0.5   # a frame conditioned at strength 0.5: every frame's timestep differs
        inputs["denoise_mask"] = denoise
        v_timestep = denoise.flatten(2).transpose(1, 2) * sigma[:, None, None]
        a_timestep = torch.rand(1, AUDIO_TOKENS, 1, generator=g) * sigma[:, None, None]
    text = torch.ones(batch, TEXT, dtype=torch.long)
    text[1:, -1] = 0
    video = torch.randn(batch, CHANNELS, FRAMES, HEIGHT, WIDTH, generator=g)
    audio = torch.randn(batch, AUDIO_CHANNELS, AUDIO_TOKENS, FREQ_BINS, generator=g)
    return {"x": [video, audio], "timestep": (v_timestep, a_timestep),
            "context": torch.randn(batch, TEXT, 2 * CAPTION, generator=g), "attention_mask": text, **inputs}


def ltxav_guide_inputs(batch: int, seed: int = 0) -> dict:
    """LTXVAddGuide's conditioning on LTX-2 (``guide_inputs``: a guide frame at strength 0.5 with 3 tokens dropped,
    so a GuideAttentionMask), beside the audio."""
    inputs = guide_inputs(batch, seed)
    av = ltxav_inputs(batch, seed)
    inputs["x"] = [inputs["x"], av["x"][1]]
    inputs["timestep"] = (inputs["timestep"], av["timestep"][1])
    inputs["context"] = av["context"]
    return inputs


def ltxav_attention_tokens(ctx, payload: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Rank op: a batch-1 forward (``ltxav_inputs(1)``) with the split the rank op would take, reporting the tokens
    each block's video and audio self-attention were given."""
    entry = ctx.objects[payload["handle"]]
    model = entry["model"]
    _use_layout(entry, 1)
    seen: dict[str, list[int]] = {"video": [], "audio": []}
    hooks = [block.attn1.register_forward_pre_hook(lambda m, args: seen["video"].append(args[0].shape[1]))
             for block in model.transformer_blocks]
    hooks += [block.audio_attn1.register_forward_pre_hook(lambda m, args: seen["audio"].append(args[0].shape[1]))
              for block in model.transformer_blocks]
    try:
        with torch.no_grad():
            model(**ltxav_inputs(1))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def ltxav_dense_mask_error(ctx, payload: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Rank op: a batch-1 forward whose video self-attention gets a dense [1, 1, tokens, tokens] mask, as a future
    ComfyUI could build it; returns the error it raised (None if it ran)."""
    from mgpu.sharding.model_ops import clean_after_failed_forward

    entry = ctx.objects[payload["handle"]]
    model = entry["model"]
    _use_layout(entry, 1)
    model._build_guide_self_attention_mask = lambda x, options, args: torch.zeros(1, 1, x[0].shape[1], x[0].shape[1])
    try:
        with torch.no_grad():
            model(**ltxav_inputs(1))
        return {"error": None}
    except Exception as exc:   # noqa: BLE001 - the test reads its type and message
        clean_after_failed_forward(ctx, entry)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        del model._build_guide_self_attention_mask
