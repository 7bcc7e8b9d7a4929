"""The oldest torch the FSDP runtime supports, checked when a sharded model loads (planning and the single-device
loaders work with whatever torch ComfyUI runs).

Why 2.11: it is the oldest release the runtime is run on. CI runs 2.13 (CPU); the runtime's rank, FSDP and
sharded-model tests also pass on 2.11 (its CUDA wheel on a CPU-only machine, 2026-11-30), the torch of the GPU
machine ``bench/gpu_check.py`` is written for. FSDP2's public ``fully_shard`` exists from 2.6, but FSDP2's unshard
crashes under ``torch.inference_mode`` at world size 1 ("Inference tensors do not track version counter"; still so
in 2.13), which is why the ranks compute under ``no_grad``; nothing older than 2.11 has been run, so nothing older
is claimed.
"""

from __future__ import annotations

import re

import torch

from mgpu.errors import MgpuError

MIN_TORCH = (2, 11)


def torch_version(text: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.13.0+cpu" or "2.12.0.dev20260101"."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise MgpuError(f"cannot read the torch version {text!r}")
    return int(match[1]), int(match[2])


def require_fsdp_torch(version: str | None = None) -> None:
    """Raise a clear error, before any rank starts, when this torch is older than MIN_TORCH."""
    version = torch.__version__ if version is None else version
    if torch_version(version) < MIN_TORCH:
        floor = ".".join(map(str, MIN_TORCH))
        raise MgpuError(f"FSDP sharding needs torch >= {floor}; this ComfyUI runs torch {version}. Update torch in "
                        f"ComfyUI's Python environment (pip install -U 'torch>={floor}' with the CUDA build ComfyUI "
                        "uses), or load the model on one device")
