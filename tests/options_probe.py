"""A rank-side model that reports, row by row, the ``transformer_options`` it received (tests/test_remote_options.py).

Its parameters are TinyMLP's, so FSDP shards it like a real model; its output ignores them except to stay in the
all-gathers, and says what each row saw: [cond_or_uncond label, uuid number, sigma, sum of sample_sigmas, rope scale].
"""

from __future__ import annotations

import torch

from tiny_models import TinyMLP


class OptionsProbe(TinyMLP):
    def forward(self, x: torch.Tensor, transformer_options: dict | None = None) -> torch.Tensor:
        opts = transformer_options or {}
        rows = x.shape[0]
        labels = _per_row(opts["cond_or_uncond"], rows)
        uuids = _per_row(opts["uuids"], rows)
        sigmas = _per_row(opts["sigmas"], rows)
        whole = opts["sample_sigmas"].sum().item()
        scale = opts["rope_options"]["scale_t"]
        reported = [[float(labels[i]), float(uuids[i].int % 1000), float(sigmas[i]), whole, scale] for i in range(rows)]
        zero = super().forward(x).sum() * 0   # every rank runs the sharded blocks (FSDP's all-gathers)
        return torch.tensor(reported) + zero


def _per_row(chunks, rows: int) -> list:
    """A network's reading of a per-chunk value: ``rows`` split in len(chunks) equal parts."""
    per = rows // len(chunks)
    assert per * len(chunks) == rows, (rows, len(chunks))
    return [chunks[i // per] for i in range(rows)]


def options_probe() -> OptionsProbe:
    return OptionsProbe()
