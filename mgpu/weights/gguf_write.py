"""Writing GGUF files of a state dict (the demo's quantized checkpoints): gguf-py's ``GGUFWriter`` and its
quantizers where it has one, and a Q4_K quantizer of ours, since gguf-py can dequantize K types but not quantize them.

Q4_K (GGML's ``block_q4_K``, 144 bytes per 256 values): an fp16 ``d`` and ``dmin`` per super-block, eight 6-bit
scales and eight 6-bit mins (one per 32-value sub-block) packed in 12 bytes, then 4-bit values; a value is
``d * scale * q - dmin * min``. ``quantize_q4_k`` picks the mins and scales so that each sub-block's range is covered
(rounded outwards), then rounds each value to the nearest of its 16 levels: simpler than llama.cpp's search over
scales, within half a step of every value. tests/test_gguf_write.py checks it against ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import torch

Q4_K_BLOCK, Q4_K_BYTES = 256, 144
# Types gguf-py's own ``gguf.quants.quantize`` writes (it refuses the K types).
GGUF_PY_QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16")


def _fp16_at_least(x: np.ndarray) -> np.ndarray:
    """``x`` (>= 0) as fp16, rounded up where rounding to nearest went below it (so a 6-bit multiple still reaches)."""
    h = x.astype(np.float16)
    low = h.astype(np.float32) < x
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _pack_6bit(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block (n, 8) -> GGML's 12 bytes: the low 6 bits of the first four in bytes
    0-3 (scales) and 4-7 (mins), their top 2 bits carrying the last four's high bits, whose low nibbles fill 8-11."""
    sc, m = scales.astype(np.uint8), mins.astype(np.uint8)
    out = np.empty((len(sc), 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return out


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """float values, last dim whole super-blocks of 256 -> uint8 Q4_K blocks, last dim in bytes (144 per 256)."""
    values = np.asarray(values, dtype=np.float32)
    if values.shape[-1] % Q4_K_BLOCK:
        raise ValueError(f"Q4_K needs rows of whole 256-value super-blocks; the last dim is {values.shape[-1]}")
    x = values.reshape(-1, 8, 32)
    n = len(x)
    offset = np.maximum(-x.min(axis=2), 0)                       # (n, 8): how far below 0 each sub-block reaches
    dmin = _fp16_at_least(offset.max(axis=1) / 63)
    dmin32 = dmin.astype(np.float32)[:, None]
    mins = np.ceil(np.divide(offset, dmin32, out=np.zeros_like(offset), where=dmin32 > 0)).clip(0, 63)
    low = dmin32 * mins                                           # the level of q = 0, <= each sub-block's minimum
    span = np.maximum(x.max(axis=2) + low, 0) / 15                # the step that reaches each sub-block's maximum
    d = _fp16_at_least(span.max(axis=1) / 63)
    d32 = d.astype(np.float32)[:, None]
    scales = np.ceil(np.divide(span, d32, out=np.zeros_like(span), where=d32 > 0)).clip(0, 63)
    step = (d32 * scales)[:, :, None]
    q = np.divide(x + low[:, :, None], step, out=np.zeros_like(x), where=step > 0)
    q = np.rint(q).clip(0, 15).astype(np.uint8)                   # (n, 8, 32)
    blocks = np.empty((n, Q4_K_BYTES), dtype=np.uint8)
    blocks[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    blocks[:, 4:16] = _pack_6bit(scales, mins)
    pairs = q.reshape(n, 4, 2, 32)                                # sub-blocks 2c (low nibbles) and 2c+1 (high)
    blocks[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // Q4_K_BLOCK * Q4_K_BYTES)


def encode(values: np.ndarray, qtype: str) -> np.ndarray:
    """float32 ``values`` (torch's shape) as stored for GGML type ``qtype``: an F32/F16 array or uint8 blocks."""
    if qtype == "F32":
        return values.astype(np.float32)
    if qtype == "F16":
        return values.astype(np.float16)
    if qtype == "Q4_K":
        return quantize_q4_k(values)
    if qtype in GGUF_PY_QUANTIZABLE:
        return gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType[qtype])
    raise ValueError(f"cannot write GGML type {qtype}: supported {('F32', 'F16', 'Q4_K', *GGUF_PY_QUANTIZABLE)}")


def decode(stored: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The values of stored bytes by gguf-py's own dequantization (not ours), float32."""
    if qtype in ("F32", "F16"):
        values = stored.astype(np.float32)
    else:
        values = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(values.reshape(shape)))


def write_gguf(path: str | os.PathLike, state: dict[str, torch.Tensor], types: dict[str, str],
               arch: str = "wan") -> dict[str, torch.Tensor]:
    """Write ``state`` with each tensor stored as ``types[name]``; returns the values the file holds (gguf-py's
    dequantization, float32), the state a one-device reference should load."""
    writer = gguf.GGUFWriter(os.fspath(path), arch=arch)
    values_held = {}
    for name, tensor in state.items():
        qtype = types[name]
        stored = encode(tensor.detach().float().numpy(), qtype)
        writer.add_tensor(name, stored, raw_dtype=None if qtype in ("F32", "F16") else gguf.GGMLQuantizationType[qtype])
        values_held[name] = decode(stored, qtype, tuple(tensor.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values_held
