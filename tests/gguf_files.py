"""GGUF files for the tests, laid out as city96's ComfyUI-GGUF files are: ComfyUI's key names, big 2-D weights
quantized, small tensors F32/F16, shapes reversed on disk, ``general.architecture`` naming the family.

Written with gguf-py's ``GGUFWriter``; the blocks come from ``gguf.quants.quantize`` where gguf-py can quantize the
type, and are built directly (random bits, random finite fp16 scales) for the K-quants it can only dequantize. The
reference values of every tensor are ``gguf.quants.dequantize`` of the bytes written.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import gguf
import numpy as np
import torch
from torch import nn

from mgpu.weights.gguf import QUANTIZED

GGUF_QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16")   # gguf.quants.quantize handles these


def random_k_blocks(qtype: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` K-quant blocks of random bits whose fp16 super-block scales are finite and small (weights of
    about 0.01-0.05, like a DiT's): gguf-py cannot quantize K types, only dequantize them."""
    _, block_bytes = QUANTIZED[qtype]
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)

    def scale(at: int, low: float, high: float) -> None:
        blocks[:, at:at + 2] = rng.uniform(low, high, count).astype(np.float16).view(np.uint8).reshape(count, 2)

    if qtype == "Q6_K":
        scale(208, -4e-5, 4e-5)
    else:   # Q4_K, Q5_K: d, dmin
        scale(0, 0, 8e-5)
        scale(2, 0, 8e-5)
    return blocks


def encode(values: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """``values`` (float32, torch's shape) stored as ``qtype``: uint8 blocks for quantized and BF16 types (types
    gguf-py cannot quantize: random blocks of the same shape), else the F16/F32 array."""
    if qtype == "F32":
        return values.astype(np.float32)
    if qtype == "F16":
        return values.astype(np.float16)
    if qtype in GGUF_QUANTIZABLE:
        return gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType[qtype])
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    count = values.size // block
    if qtype in QUANTIZED:
        blocks = random_k_blocks(qtype, count, rng)
    else:   # a type comfy-mgpu does not dequantize (Q2_K, IQ4_NL, ...): random bits, for the refusals
        blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // block * block_bytes)


def decode(stored: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The reference values of stored bytes: gguf-py's own dequantization, in float32."""
    if qtype in ("F32", "F16"):
        return stored.astype(np.float32).reshape(shape)
    return gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[qtype]).reshape(shape).astype(np.float32)


def write_gguf(path: str | os.PathLike, state: dict[str, torch.Tensor], types: dict[str, str], *,
               arch: str = "wan", seed: int = 0, orig_shapes: dict[str, tuple[int, ...]] | None = None,
               ) -> dict[str, torch.Tensor]:
    """Write ``state`` with each tensor stored as ``types[name]``; returns the reference state (fp32 values) of the
    types comfy-mgpu dequantizes.

    ``orig_shapes`` stores a tensor reshaped to (numel / 256, 256) with ComfyUI-GGUF's ``comfy.gguf.orig_shape``
    entry, as its converter does for tensors whose last dim is not whole blocks.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(os.fspath(path), arch=arch)
    reference = {}
    for name, tensor in state.items():
        values = tensor.detach().float().numpy()
        qtype = types[name]
        if orig_shapes and name in orig_shapes:
            writer.add_array(f"comfy.gguf.orig_shape.{name}", list(values.shape))
            values = values.reshape(-1, 256)
        stored = encode(values, qtype, rng)
        writer.add_tensor(name, stored, raw_dtype=None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype])
        if qtype in (*QUANTIZED, "BF16", "F16", "F32"):   # others are random bits with no meaningful values
            reference[name] = torch.from_numpy(decode(stored, qtype, tuple(tensor.shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def comfy_gguf_types(state: dict[str, torch.Tensor], default: str, layout: dict[str, str] | None = None,
                     ) -> dict[str, str]:
    """``layout``'s type where it names one, else ComfyUI-GGUF's rule: 1-D, tiny (<= 1024 values) and modulation
    tensors F32, weights whose rows are whole blocks ``default``, the rest F16."""
    types = {}
    for name, t in state.items():
        if layout and name in layout:
            types[name] = layout[name]
        elif t.ndim <= 1 or t.numel() <= 1024 or "modulation" in name:
            types[name] = "F32"
        else:
            types[name] = default if t.shape[-1] % QUANTIZED[default][0] == 0 else "F16"
    return types


class QuantBlock(nn.Module):
    """A Wan-like block: modulation, norm, q/k/v/o projections and a 2-layer FFN."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.modulation = nn.Parameter(torch.empty(1, 2, dim))
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift, scale = self.modulation.to(x.dtype).unbind(1)
        h = self.norm(x) * (1 + scale) + shift
        attn = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5, dim=-1) @ self.v(h)
        x = x + self.o(attn)
        return x + self.ffn(self.norm(x))


class QuantStack(nn.Module):
    """Embedding, ``layers`` QuantBlocks, a 2-row head (an empty shard on the third of 3 ranks)."""

    def __init__(self, in_dim: int = 32, dim: int = 256, ffn: int = 512, layers: int = 2, out_dim: int = 2,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim, dtype=dtype)
        self.blocks = nn.ModuleList(QuantBlock(dim, ffn) for _ in range(layers))
        if dtype is not None:
            self.blocks.to(dtype)
        self.head = nn.Linear(dim, out_dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def quant_stack(**kwargs) -> QuantStack:
    return QuantStack(**kwargs)


def wan13b_stack() -> QuantStack:
    """Two blocks at Wan 2.1 1.3B's sizes: dim 1536, ffn 8960 (2987/2987/2986 rows over 3 ranks)."""
    return QuantStack(in_dim=64, dim=1536, ffn=8960, layers=2)


def stack_inputs(in_dim: int = 32, batch: int = 2, tokens: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, tokens, in_dim, generator=torch.Generator().manual_seed(seed))


# Every supported quantized type in the tiny stack, two blocks: each block layer gets another type.
ALL_TYPES_LAYOUT = {
    "blocks.0.q.weight": "Q8_0", "blocks.0.k.weight": "Q4_K", "blocks.0.v.weight": "Q5_K", "blocks.0.o.weight": "Q6_K",
    "blocks.0.ffn.0.weight": "Q4_0", "blocks.0.ffn.2.weight": "Q4_1",
    "blocks.1.q.weight": "Q5_0", "blocks.1.k.weight": "Q5_1", "blocks.1.v.weight": "BF16", "blocks.1.o.weight": "F16",
    "blocks.1.ffn.0.weight": "Q6_K", "blocks.1.ffn.2.weight": "Q8_0",
    "embed.weight": "F16", "head.weight": "Q8_0",
}


def seeded_state(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic values of a DiT's scale: matrices ~ 0.5/sqrt(fan_in), norms ~ 1, the rest ~ 0.05."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.state_dict().items():
        noise = torch.randn(p.shape, generator=g)
        if p.ndim >= 2 and "modulation" not in name:
            state[name] = noise * 0.5 / p[0].numel() ** 0.5
        elif "norm" in name and name.endswith("weight"):
            state[name] = 1 + 0.1 * noise
        else:
            state[name] = 0.05 * noise
    return state


def write_stack(path: str | os.PathLike, model: nn.Module, layout: dict[str, str], default: str = "Q8_0",
                seed: int = 0) -> dict[str, torch.Tensor]:
    """A GGUF of ``model``'s keys with seeded values; ``layout`` names types, other weights ``default``."""
    state = seeded_state(model, seed)
    return write_gguf(path, state, comfy_gguf_types(state, default, layout), seed=seed)


def reference_model(factory: Callable[[], nn.Module], reference: dict[str, torch.Tensor]) -> nn.Module:
    """The single-device model holding the reference-dequantized weights in fp32."""
    model = factory().float()
    model.load_state_dict(reference)
    return model.eval()


def city96_types(layout: dict[str, tuple[tuple[int, ...], str]], qtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A safetensors layout (tests/ckpt_layouts.py) as city96's Wan/LTXV GGUFs store it: the blocks' 2-D weights
    ``qtype``, other 2-D+ tensors F16, 1-D tensors and modulations F32."""
    block = QUANTIZED[qtype][0]
    out = {}
    for name, (shape, _) in layout.items():
        if len(shape) == 2 and "blocks." in name and shape[-1] % block == 0:
            out[name] = (shape, qtype)
        elif len(shape) >= 2 and "modulation" not in name and "scale_shift_table" not in name:
            out[name] = (shape, "F16")
        else:
            out[name] = (shape, "F32")
    return out


def write_sparse_gguf(path: str | os.PathLike, layout: dict[str, tuple[tuple[int, ...], str]], arch: str = "wan",
                      ) -> int:
    """A GGUF header for ``layout`` (name -> (torch shape, GGML type)) and a hole up to the full size: a 15 GB
    model costs a few KB of disk. Returns the file size."""
    writer = gguf.GGUFWriter(os.fspath(path), arch=arch)
    for name, (shape, qtype) in layout.items():
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        nbytes = int(np.prod(shape)) // block * block_bytes
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    end = writer.fout[0].tell()
    writer.close()
    data = -(-end // 32) * 32 + sum(-(-ti.nbytes // 32) * 32 for ti in writer.tensors[0].values())
    with open(path, "r+b") as f:
        f.truncate(data)
    return data
