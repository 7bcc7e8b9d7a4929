"""A Wan-shaped DiT in plain torch, for bench/gpu_check.py where neither ComfyUI nor diffusers is installed.

Per block it makes the tensors ComfyUI's WanModel makes, in the same dtypes and order: a modulated LayerNorm input,
RMS-normed q and k rotated in fp32 (then cast back), sdpa self-attention, cross-attention to the text context, a
tanh-GELU FFN and gated residual adds. Random weights: it is for memory, speed and sharding checks, not for images.
The rank processes build it by name (``dit_standin:wan_standin``) with this folder on their path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rope_table(frames: int, rows: int, cols: int, head_dim: int, device: torch.device | str) -> torch.Tensor:
    """fp32 rotation matrices [1, tokens, 1, head_dim / 2, 2, 2]: Wan splits a head between the frame, row and
    column positions (head_dim - 4 (head_dim // 6), then 2 (head_dim // 6) twice)."""
    sixth = head_dim // 6
    angles = []
    for length, width, axis in ((frames, head_dim - 4 * sixth, 0), (rows, 2 * sixth, 1), (cols, 2 * sixth, 2)):
        inv = 1.0 / 10000 ** (torch.arange(0, width, 2, device=device, dtype=torch.float64) / width)
        a = torch.outer(torch.arange(length, device=device, dtype=torch.float64), inv)
        shape = [frames, rows, cols, a.shape[1]]
        view = [1, 1, 1, a.shape[1]]
        view[axis] = length
        angles.append(a.view(view).expand(shape))
    theta = torch.cat(angles, dim=-1).reshape(-1, head_dim // 2)
    cos, sin = theta.cos(), theta.sin()
    table = torch.stack([cos, -sin, sin, cos], dim=-1).view(-1, head_dim // 2, 2, 2)
    return table.float().unsqueeze(0).unsqueeze(2)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate [B, N, heads, head_dim] pairs in fp32 (one fp32 copy and one fp32 result, accumulated in place)
    and cast back, as ComfyUI's Wan does."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    out = table[..., 0] * pairs[..., 0]
    out.addcmul_(table[..., 1], pairs[..., 1])
    return out.reshape(x.shape).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, dtype=dtype) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=1e-6, dtype=dtype)
        self.norm_k = nn.RMSNorm(dim, eps=1e-6, dtype=dtype)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: torch.Tensor | None = None) -> torch.Tensor:
        b, n, dim = x.shape
        src = x if context is None else context
        q = self.norm_q(self.q(x)).view(b, n, self.heads, -1)
        if rope is not None:
            q = apply_rope(q, rope)
        k = self.norm_k(self.k(src)).view(b, src.shape[1], self.heads, -1)
        if rope is not None:
            k = apply_rope(k, rope)
        v = self.v(src).view(b, src.shape[1], self.heads, -1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).reshape(b, n, dim))


class WanBlock(nn.Module):
    def __init__(self, dim: int, ffn: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.self_attn = Attention(dim, heads, dtype)
        self.norm3 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype)
        self.cross_attn = Attention(dim, heads, dtype)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn, dtype=dtype), nn.GELU(approximate="tanh"),
                                 nn.Linear(ffn, dim, dtype=dtype))
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim, dtype=dtype))

    def forward(self, x: torch.Tensor, e: torch.Tensor, rope: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        e = (self.modulation + e).chunk(6, dim=1)
        y = self.self_attn(torch.addcmul(e[0], self.norm1(x), 1 + e[1]), rope=rope)
        x = torch.addcmul(x, y, e[2])
        del y
        x = x + self.cross_attn(self.norm3(x), context=context)
        y = self.ffn(torch.addcmul(e[3], self.norm2(x), 1 + e[4]))
        return torch.addcmul(x, y, e[5])


class WanStandin(nn.Module):
    """Patch embedding (1x2x2), text and time embeddings, ``layers`` blocks, head; forward(x, timestep, context)."""

    def __init__(self, dim: int, ffn: int, heads: int, layers: int, in_ch: int = 16, text_dim: int = 4096,
                 freq_dim: int = 256, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dim, self.heads, self.in_ch, self.freq_dim = dim, heads, in_ch, freq_dim
        self.patch_embedding = nn.Conv3d(in_ch, dim, (1, 2, 2), stride=(1, 2, 2), dtype=torch.float32)
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim, dtype=dtype), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim, dtype=dtype))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim, dtype=dtype), nn.SiLU(),
                                            nn.Linear(dim, dim, dtype=dtype))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, dtype=dtype))
        self.blocks = nn.ModuleList(WanBlock(dim, ffn, heads, dtype) for _ in range(layers))
        self.head_norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.head = nn.Linear(dim, in_ch * 4, dtype=dtype)
        self.head_modulation = nn.Parameter(torch.zeros(1, 2, dim, dtype=dtype))

    def _timestep(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.pow(10000, -torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = torch.outer(t.float().flatten(), freqs)
        return torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, c, frames, height, width = x.shape
        dtype = self.head.weight.dtype
        h = self.patch_embedding(x.float()).to(dtype)
        rows, cols = h.shape[3], h.shape[4]
        h = h.flatten(2).transpose(1, 2)
        rope = rope_table(frames, rows, cols, self.dim // self.heads, x.device)
        e = self.time_embedding(self._timestep(timestep, dtype))
        e0 = self.time_projection(e).unflatten(1, (6, self.dim))
        context = self.text_embedding(context.to(dtype))
        for block in self.blocks:
            h = block(h, e0, rope, context)
        shift, scale = (self.head_modulation + e.unsqueeze(1)).chunk(2, dim=1)
        h = self.head(torch.addcmul(shift, self.head_norm(h), 1 + scale))
        h = h.view(b, frames, rows, cols, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
        return h.reshape(b, c, frames, rows * 2, cols * 2).to(x.dtype)


def wan_standin(dim: int, ffn: int, heads: int, layers: int, in_ch: int = 16, text_dim: int = 4096,
                dtype: str = "bf16") -> WanStandin:
    """The FSDP factory (``ModelSpec.factory = "dit_standin:wan_standin"``)."""
    return WanStandin(dim, ffn, heads, layers, in_ch=in_ch, text_dim=text_dim, dtype=DTYPES[dtype])


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights of a sensible scale (outputs neither 0 nor inf): N(0, 1/fan_in) matrices, unit norms, zero biases."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "modulation" not in name:
            fan_in = math.prod(p.shape[1:])
            p.copy_(torch.randn(p.shape, generator=g, device=p.device) * fan_in ** -0.5)
        elif "modulation" in name:
            p.copy_(torch.randn(p.shape, generator=g, device=p.device) * 0.02)
        elif name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.zero_()
    return model


def rank_memory(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op (``dit_standin:rank_memory``): device memory outside PyTorch's allocator (CUDA context, NCCL)."""
    if ctx.torch_device.type != "cuda":
        return {"device": ctx.device}
    free, total = torch.cuda.mem_get_info(ctx.torch_device)
    reserved = torch.cuda.memory_reserved(ctx.torch_device)
    return {"device": ctx.device, "used": total - free, "reserved": reserved, "outside_torch": total - free - reserved,
            "max_allocated": torch.cuda.max_memory_allocated(ctx.torch_device)}
