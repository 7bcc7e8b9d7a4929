"""ComfyUI's own WanModel at test size for the sequence-parallel tests (factories the ranks import by path), its
inputs, and a rank op that reports how many tokens a rank's self-attention sees."""

from __future__ import annotations

import torch

import tiny_models as tm

FRAMES, HEIGHT, WIDTH = 3, 6, 10     # latent; patch (1, 2, 2) -> 3 x 3 x 5 = 45 tokens: 23/22 over 2, 12/11/11/11 over 4
TOKENS = FRAMES * (HEIGHT // 2) * (WIDTH // 2)


def tiny_wan(heads: int = 4, dim: int = 64) -> torch.nn.Module:
    """comfy.ldm.wan.model.WanModel, 2 layers of ``heads`` x ``dim // heads``, random weights come from the file."""
    tm._import_comfy()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    return WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=6, in_dim=4, dim=dim, ffn_dim=2 * dim,
                    freq_dim=16, text_dim=24, out_dim=4, num_heads=heads, num_layers=2,
                    operations=comfy.ops.disable_weight_init)


def wan_inputs(batch: int, seed: int = 0, per_token: bool = False) -> dict[str, torch.Tensor]:
    """What ComfyUI's BaseModel passes: latent, timestep ([B], or [B, tokens] as Wan 2.2 TI2V does), text context."""
    g = torch.Generator().manual_seed(seed)
    timestep = torch.rand((batch, TOKENS) if per_token else (batch,), generator=g) * 1000
    return {"x": torch.randn(batch, 4, FRAMES, HEIGHT, WIDTH, generator=g), "timestep": timestep,
            "context": torch.randn(batch, 6, 24, generator=g)}


def self_attention_tokens(ctx, payload: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Rank op: run the model on ``tensors`` with the split the rank op would take for their rows, and report the
    tokens its first self-attention was given."""
    entry = ctx.objects[payload["handle"]]
    model = entry["model"]
    entry["layouts"].use(entry["layouts"].for_rows(tensors["x"].shape[0]))
    seen: list[int] = []
    hook = model.blocks[0].self_attn.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            model(**{k: v.clone() for k, v in tensors.items()})
    finally:
        hook.remove()
    return {"tokens": seen}


# ------------------------------------------------------------------ Wan subclasses (mgpu.families.ADAPTERS)

VACE_CHANNELS = 8   # ComfyUI's VACE files have 96 (16 inactive + 16 reactive latent channels + the 64 mask values)


def wan_subclasses() -> dict[str, type]:
    """Every subclass of ComfyUI's WanModel in this checkout's comfy.ldm.wan modules, by class name."""
    import importlib
    import pkgutil

    tm._import_comfy()
    import comfy.ldm.wan as package
    from comfy.ldm.wan.model import WanModel

    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        for name, value in vars(importlib.import_module(f"comfy.ldm.wan.{info.name}")).items():
            if isinstance(value, type) and issubclass(value, WanModel) and value is not WanModel:
                found[name] = value
    return found


def subclass_model(name: str, heads: int = 2, **config) -> torch.nn.Module:
    """ComfyUI's Wan subclass ``name``, 4 layers of ``heads`` x 16, the same small dims as ``tiny_wan``."""
    network = wan_subclasses()[name]   # imports ComfyUI
    import comfy.ops

    dims = {"patch_size": (1, 2, 2), "text_len": 6, "in_dim": 4, "dim": 16 * heads, "ffn_dim": 32 * heads,
            "freq_dim": 16, "text_dim": 24, "out_dim": 4, "num_heads": heads, "num_layers": 4}
    return network(**dims, **config, operations=comfy.ops.disable_weight_init)


def tiny_vace_wan(heads: int = 2) -> torch.nn.Module:
    """VaceWanModel with 2 VACE blocks, after main blocks 0 and 2 (ComfyUI's ``vace_layers_mapping``)."""
    return subclass_model("VaceWanModel", heads, vace_layers=2, vace_in_dim=VACE_CHANNELS)


def tiny_camera_wan(heads: int = 2) -> torch.nn.Module:
    """CameraWanModel as Wan 2.2 Fun Camera builds it (text-to-video cross-attention, camera adapter of 24 channels)."""
    return subclass_model("CameraWanModel", heads, model_type="camera_2.2")


def tiny_scail_wan(heads: int = 2, version: int = 1) -> torch.nn.Module:
    """SCAILWanModel (SCAIL-2 with ``version`` 2: its identity-mask stream too); ComfyUI 0.33 only."""
    if version == 1:
        return subclass_model("SCAILWanModel", heads)
    return subclass_model("SCAIL2WanModel", heads, mask_in_dim=VACE_CHANNELS)


def has_scail() -> bool:
    """ComfyUI 0.33 has SCAIL (and SCAIL-2); 0.3.64 has neither."""
    return "SCAIL2WanModel" in wan_subclasses()


def subclass_inputs(name: str, batch: int, seed: int = 0) -> dict:
    """``wan_inputs`` plus what ComfyUI's BaseModel adds for ``name`` (its ``extra_conds``): VACE two contexts with
    their strengths, the camera conditions at pixel size, SCAIL a reference frame and pose latents (105 tokens)."""
    g = torch.Generator().manual_seed(1000 + seed)
    inputs = wan_inputs(batch, seed)

    def latent(channels: int, frames: int = FRAMES, scale: int = 1) -> torch.Tensor:
        return torch.randn(batch, channels, frames, HEIGHT * scale, WIDTH * scale, generator=g)

    if name == "VaceWanModel":
        inputs["vace_context"] = torch.stack([latent(VACE_CHANNELS), latent(VACE_CHANNELS)], dim=1)
        inputs["vace_strength"] = [1.0, 0.6]
    elif name == "CameraWanModel":
        inputs["camera_conditions"] = latent(24, scale=8)   # Plücker embedding per pixel, 8 x the latent's size
    else:   # SCAILWanModel, SCAIL2WanModel
        inputs["reference_latent"] = latent(4, frames=1)
        inputs["pose_latents"] = latent(4)
        if name == "SCAIL2WanModel":
            inputs["ref_mask_latents"] = latent(VACE_CHANNELS, frames=FRAMES + 1)
            inputs["sam_latents"] = latent(VACE_CHANNELS)
    return inputs
