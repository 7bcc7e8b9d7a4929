"""Our Q4_K quantizer (``mgpu.weights.gguf_write``; gguf-py cannot quantize K types) against gguf-py's own
dequantization: the bytes decode the same through gguf-py and through ``mgpu.weights.gguf``, every value lands within
half a quantization step, and a written file reads back through gguf-py's reader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from mgpu.weights.gguf import dequantize
from mgpu.weights.gguf_write import quantize_q4_k, write_gguf

Q4_K = gguf.GGMLQuantizationType.Q4_K


def _values(rng: np.random.Generator) -> np.ndarray:
    """Rows of DiT-like weights plus the awkward cases: a zero super-block, an all-positive one, an outlier, a
    sub-block of zeros beside large values, a constant sub-block."""
    x = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    x[0, :256] = 0
    x[1, :256] = np.abs(x[1, :256])
    x[2, 7] = -3.0
    x[3, :32] = 0
    x[3, 32:64] *= 40
    x[4, :32] = 0.001
    return x


@pytest.mark.parametrize("seed", [0, 1])
def test_q4_k_round_trip_through_gguf_py(seed):
    x = _values(np.random.default_rng(seed))
    blocks = quantize_q4_k(x)
    assert blocks.shape == (16, 2 * 144) and blocks.dtype == np.uint8
    theirs = gguf.quants.dequantize(blocks, Q4_K).reshape(x.shape)
    ours = dequantize(torch.from_numpy(blocks), "Q4_K").numpy()
    np.testing.assert_array_equal(ours, theirs)   # one format: two decoders agree bit for bit

    sub = x.reshape(-1, 8, 32)
    err = np.abs(theirs.reshape(sub.shape) - sub).max(axis=2)          # per 32-value sub-block
    header = blocks.reshape(-1, 144)[:, :4].copy().view(np.float16).astype(np.float32)   # d, dmin per super-block
    d, dmin = header[:, :1], header[:, 1:]
    spread = sub.max(axis=2) - np.minimum(sub.min(axis=2), 0)
    # half a step: the step covers the sub-block's spread (and the rounded-up min) in 15 levels, plus one 6-bit unit
    assert (err <= (spread + dmin) / 30 + d / 2 + 1e-7).all()
    assert np.all(theirs[0, :256] == 0)
    rms = np.sqrt(((theirs - x)[5:] ** 2).mean()) / x[5:].std()
    assert rms < 0.1, rms


def test_q4_k_refuses_rows_that_are_not_whole_super_blocks():
    with pytest.raises(ValueError, match="256"):
        quantize_q4_k(np.zeros((2, 128), dtype=np.float32))


def test_written_gguf_reads_back_as_the_values_it_returns(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"blocks.0.w": torch.randn(4, 256, generator=g) * 0.05, "blocks.0.q": torch.randn(8, 64, generator=g),
             "bias": torch.randn(4, generator=g), "conv": torch.randn(4, 2, 1, 2, 2, generator=g)}
    types = {"blocks.0.w": "Q4_K", "blocks.0.q": "Q8_0", "bias": "F32", "conv": "F32"}
    held = write_gguf(tmp_path / "m.gguf", state, types)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    for t in reader.tensors:
        assert t.tensor_type.name == types[t.name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(held[t.name].shape)
        np.testing.assert_array_equal(values, held[t.name].numpy())
    assert torch.equal(held["bias"], state["bias"]) and torch.equal(held["conv"], state["conv"])
    assert (held["blocks.0.w"] - state["blocks.0.w"]).abs().max() < 0.02
