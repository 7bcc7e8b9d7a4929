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
