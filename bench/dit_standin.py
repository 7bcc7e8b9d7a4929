"""A Wan-shaped DiT and a conv VAE decoder in plain torch, for bench/gpu_check.py where neither ComfyUI nor diffusers
is installed.

Per block the DiT makes the tensors ComfyUI's WanModel makes, in the same dtypes and order: a modulated LayerNorm
input, RMS-normed q and k rotated in fp32 (then cast back), sdpa self-attention, cross-attention to the text context,
a tanh-GELU FFN and gated residual adds. Its class is named ``WanModel`` and its modules take the arguments
ComfyUI's take (``block(x, e, freqs, context, transformer_options)``, ``self_attn(x, freqs, transformer_options)``
calling ``optimized_attention_override`` when one is set, ``head(x, e)``, ``num_heads``), so
``mgpu.families.wan``'s sequence-parallel hooks run on it as they run on ComfyUI's. Random weights: it is for
memory, speed and sharding checks, not for images. The ranks build it by name (``dit_standin:wan_standin``) with
this folder on their path.

``linear`` picks how the blocks' Linear layers store and compute (the stored formats gpu_check runs through FSDP):
``bf16``; ``fp8`` (float8_e4m3fn weights upcast to bf16 after the gather, ``mgpu.weights.quant.Fp8Weight``);
``fp8_scaled_mm`` (fp8 weights with a per-tensor scale, computed by ``torch._scaled_mm`` as ComfyUI does on sm_89+);
``comfy_fp8`` (comfy-kitchen's ``QuantizedTensor`` around the gathered fp8 bytes, ComfyUI 0.33's quantized layers).
GGUF files need no variant: the loader wraps their quantized weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
LINEAR_FORMATS = ("bf16", "fp8", "fp8_scaled_mm", "comfy_fp8")


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """sdpa over [B, N, heads x head_dim] inputs, as ComfyUI's ``optimized_attention`` takes and returns them."""
    b, n, inner = q.shape
    split = [t.view(b, t.shape[1], heads, inner // heads).transpose(1, 2) for t in (q, k, v)]
    return F.scaled_dot_product_attention(*split).transpose(1, 2).reshape(b, n, inner)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dtype: torch.dtype):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, dtype=dtype) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=1e-6, dtype=dtype)
        self.norm_k = nn.RMSNorm(dim, eps=1e-6, dtype=dtype)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None = None, context: torch.Tensor | None = None,
                transformer_options: dict | None = None) -> torch.Tensor:
        b, n, dim = x.shape
        src = x if context is None else context
        q, k, v = self.norm_q(self.q(x)), self.norm_k(self.k(src)), self.v(src)
        if freqs is not None:
            q = apply_rope(q.view(b, n, self.heads, -1), freqs).flatten(2)
            k = apply_rope(k.view(b, n, self.heads, -1), freqs).flatten(2)
        override = (transformer_options or {}).get("optimized_attention_override")
        out = attention(q, k, v, heads=self.heads) if override is None else \
            override(attention, q, k, v, heads=self.heads)
        return self.o(out)


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

    def forward(self, x: torch.Tensor, e: torch.Tensor, freqs: torch.Tensor, context: torch.Tensor,
                transformer_options: dict | None = None) -> torch.Tensor:
        e = (self.modulation + e).chunk(6, dim=1)
        y = self.self_attn(torch.addcmul(e[0], self.norm1(x), 1 + e[1]), freqs=freqs,
                           transformer_options=transformer_options if transformer_options is not None else {})
        x = torch.addcmul(x, y, e[2])
        del y
        x = x + self.cross_attn(self.norm3(x), context=context)
        y = self.ffn(torch.addcmul(e[3], self.norm2(x), 1 + e[4]))
        return torch.addcmul(x, y, e[5])


class Head(nn.Module):
    def __init__(self, dim: int, out: int, dtype: torch.dtype):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.head = nn.Linear(dim, out, dtype=dtype)
        self.modulation = nn.Parameter(torch.zeros(1, 2, dim, dtype=dtype))

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation + e.unsqueeze(1)).chunk(2, dim=1)
        return self.head(torch.addcmul(shift, self.norm(x), 1 + scale))


class WanModel(nn.Module):
    """Patch embedding (1x2x2), text and time embeddings, ``layers`` blocks run in ``block_order`` (default: as
    defined; another order checks that FSDP's prefetch follows the execution order), head;
    ``forward(x, timestep, context, transformer_options=None)``."""

    def __init__(self, dim: int, ffn: int, heads: int, layers: int, in_ch: int = 16, text_dim: int = 4096,
                 freq_dim: int = 256, dtype: torch.dtype = torch.bfloat16, block_order: list[int] | None = None):
        super().__init__()
        self.dim, self.num_heads, self.in_ch, self.freq_dim = dim, heads, in_ch, freq_dim
        self.block_order = list(range(layers)) if block_order is None else list(block_order)
        self.patch_embedding = nn.Conv3d(in_ch, dim, (1, 2, 2), stride=(1, 2, 2), dtype=torch.float32)
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim, dtype=dtype), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim, dtype=dtype))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim, dtype=dtype), nn.SiLU(),
                                            nn.Linear(dim, dim, dtype=dtype))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, dtype=dtype))
        self.blocks = nn.ModuleList(WanBlock(dim, ffn, heads, dtype) for _ in range(layers))
        self.head = Head(dim, in_ch * 4, dtype)

    def _timestep(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.pow(10000, -torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = torch.outer(t.float().flatten(), freqs)
        return torch.cat([angles.cos(), angles.sin()], dim=1).to(dtype)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                transformer_options: dict | None = None) -> torch.Tensor:
        b, c, frames, height, width = x.shape
        dtype = self.head.modulation.dtype
        h = self.patch_embedding(x.to(self.patch_embedding.weight.dtype)).to(dtype)   # fp32, or FSDP's param_dtype
        rows, cols = h.shape[3], h.shape[4]
        h = h.flatten(2).transpose(1, 2)
        freqs = rope_table(frames, rows, cols, self.dim // self.num_heads, x.device)
        e = self.time_embedding(self._timestep(timestep, dtype))
        e0 = self.time_projection(e).unflatten(1, (6, self.dim))
        context = self.text_embedding(context.to(dtype))
        options = {} if transformer_options is None else transformer_options
        for i in self.block_order:
            h = self.blocks[i](h, e0, freqs, context, transformer_options=options)
        h = self.head(h, e)
        h = h.view(b, frames, rows, cols, c, 2, 2).permute(0, 4, 1, 2, 5, 3, 6)
        return h.reshape(b, c, frames, rows * 2, cols * 2).to(x.dtype)


class ScaledMMLinear(nn.Linear):
    """An fp8 weight with a per-tensor float32 ``scale_weight``, computed as ComfyUI's fp8 ops do on sm_89+: the
    input quantized per tensor to fp8 and one ``torch._scaled_mm``. Sharded without a ``param_dtype``, so the
    gathered weight reaches it as fp8."""

    def __init__(self, fin: int, fout: int, bias: bool = True, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None):
        super().__init__(fin, fout, bias=bias, dtype=dtype, device=device)
        self.weight = nn.Parameter(self.weight.data.to(FP8), requires_grad=False)
        self.register_buffer("scale_weight", torch.ones((), dtype=torch.float32,
                                                        device="cpu" if self.weight.is_meta else device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scale = (flat.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
        x8 = (flat.float() / scale).to(FP8)
        y = torch._scaled_mm(x8, self.weight.t(), scale_a=scale, scale_b=self.scale_weight, out_dtype=x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


def kitchen_available() -> str | None:
    """None when comfy-kitchen's QuantizedTensor imports here, else why not."""
    try:
        from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "skip the format, say why"
        return f"comfy_kitchen does not import ({type(exc).__name__}: {exc})"
    return None


def _kitchen_weight(module: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The gathered fp8 rows as comfy-kitchen's QuantizedTensor with the layer's replicated scale (ComfyUI 0.33's
    ``TensorCoreFP8Layout``), no copy."""
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout

    params = TensorCoreFP8Layout.Params(scale=module.weight_scale, orig_dtype=torch.bfloat16,
                                        orig_shape=tuple(weight.shape))
    return QuantizedTensor(weight.detach(), "TensorCoreFP8Layout", params)


def _use_kitchen(layer: nn.Linear) -> None:
    from mgpu.weights.quant import view_weight_as

    layer.weight = nn.Parameter(layer.weight.data.to(FP8), requires_grad=False)
    layer.register_buffer("weight_scale", torch.ones((), dtype=torch.float32,
                                                     device="cpu" if layer.weight.is_meta else layer.weight.device))
    view_weight_as(layer, _kitchen_weight)


def _block_linears(model: WanModel) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for block in model.blocks for parent in block.modules()
            for name, child in parent.named_children() if type(child) is nn.Linear]


def use_linear_format(model: WanModel, linear: str) -> WanModel:
    """Store the blocks' Linear layers as ``linear`` (LINEAR_FORMATS); the rest of the model stays as built."""
    from mgpu.weights.quant import store_as

    if linear == "fp8":
        store_as(model.blocks, FP8)
    elif linear == "fp8_scaled_mm":
        for parent, name, child in _block_linears(model):
            setattr(parent, name, ScaledMMLinear(child.in_features, child.out_features, child.bias is not None,
                                                 child.weight.dtype, child.weight.device))
    elif linear == "comfy_fp8":
        for _, _, child in _block_linears(model):
            _use_kitchen(child)
    elif linear != "bf16":
        raise ValueError(f"linear format {linear!r}: one of {LINEAR_FORMATS}")
    return model


def wan_standin(dim: int, ffn: int, heads: int, layers: int, in_ch: int = 16, text_dim: int = 4096,
                dtype: str = "bf16", linear: str = "bf16", block_order: list[int] | None = None) -> WanModel:
    """The FSDP factory (``ModelSpec.factory = "dit_standin:wan_standin"``)."""
    model = WanModel(dim, ffn, heads, layers, in_ch=in_ch, text_dim=text_dim, dtype=DTYPES[dtype],
                     block_order=block_order)
    return use_linear_format(model, linear)


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights of a sensible scale (outputs neither 0 nor inf): N(0, 1/fan_in) matrices, unit norms, zero biases;
    fp8 weights quantized with their scale (absmax to fp8's largest value) where the layer has one."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.ndim >= 2 and name != "modulation":
                values = torch.randn(p.shape, generator=g, device=p.device) * math.prod(p.shape[1:]) ** -0.5
                scale_name = next((s for s in ("scale_weight", "weight_scale") if hasattr(module, s)), None)
                if scale_name is not None:
                    scale = values.abs().amax() / FP8_MAX
                    getattr(module, scale_name).copy_(scale)
                    values = values / scale
                p.copy_(values)
            elif name == "modulation":
                p.copy_(torch.randn(p.shape, generator=g, device=p.device) * 0.02)
            elif name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
    return model


class VaeDecoderStandin(nn.Module):
    """A conv decoder of Wan VAE's shape class: 16 latent channels up to RGB at 8x the latent's height and width
    (3D convs, three 2x spatial upsamplings), for the memory a host-side VAE decode takes beside the ranks."""

    def __init__(self, channels: int = 96, latent: int = 16, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv3d(latent, 4 * channels, 3, padding=1, dtype=dtype)]
        width = 4 * channels
        for _ in range(3):
            layers += [nn.SiLU(), nn.Upsample(scale_factor=(1, 2, 2)),
                       nn.Conv3d(width, width // 2, 3, padding=1, dtype=dtype)]
            width //= 2
        layers += [nn.SiLU(), nn.Conv3d(width, 3, 3, padding=1, dtype=dtype)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def state_of(factory: Callable[[], nn.Module], device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random-weight model's state dict on the CPU, built on ``device`` (fast on a GPU)."""
    with torch.device(device):
        model = randomize(factory(), seed)
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}


# GGML K-quant blocks of random values (gguf-py cannot quantize Q6_K): bytes per block, where the fp16 super-block
# scale(s) sit, and the largest |value| a block's codes reach per unit of its scale.
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}


def random_k_blocks(qtype: str, rows: int, cols: int, sigma: float, g: torch.Generator) -> torch.Tensor:
    """Random ``qtype`` blocks (uint8, (rows, cols / 256 * block bytes)) whose values have about ``sigma``'s scale:
    random codes and sub-block scales, the fp16 super-block scales set so no value passes ~3 sigma."""
    nbytes, scales = K_BLOCKS[qtype]
    blocks = torch.randint(0, 256, (rows * cols // 256, nbytes), generator=g, dtype=torch.uint8)
    # Q4_K: d * 63 * 15 and dmin * 63 reach 3 sigma; Q6_K: d * 127 * 32 does (its int8 sub-block scales are random)
    reach = {"Q4_K": (63 * 15, 63), "Q6_K": (127 * 32,)}[qtype]
    for at, r in zip(scales, reach):
        blocks[:, at:at + 2] = torch.tensor([3 * sigma / r], dtype=torch.float16).view(torch.uint8)
    return blocks.view(rows, -1)


def write_gguf_standin(path: str, state: dict[str, torch.Tensor], types: dict[str, str],
                       seed: int = 0) -> dict[str, torch.Tensor]:
    """A GGUF file of ``state`` (gguf-py's writer): the tensors in ``types`` as random blocks of that K type, the
    others F32; returns the values the file holds (our dequantization, which tests/test_gguf_sharded.py checks bit
    for bit against gguf-py's), the state a one-device reference loads."""
    import gguf

    from mgpu.weights.gguf import dequantize

    g = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(path, arch="wan")
    held = {}
    for name, t in state.items():
        qtype = types.get(name)
        if qtype is None:
            values = t.float()
            writer.add_tensor(name, values.numpy())
        else:
            blocks = random_k_blocks(qtype, t.shape[0], math.prod(t.shape[1:]), t.float().std().item(), g)
            writer.add_tensor(name, blocks.numpy(), raw_dtype=gguf.GGMLQuantizationType[qtype])
            values = dequantize(blocks, qtype).view(t.shape)
        held[name] = values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
