"""Imported on cpu ranks at start (``PoolConfig.imports``): ComfyUI's device queries answer as for a 24 GiB Ampere
GPU (an RTX 3090: fp16 and bf16, no fp8 compute), so ComfyUI's dtype choices on the rank are that GPU's while the
tensors stay on the CPU (tests/test_fp8_storage.py). Only the queries ``comfy.model_management.unet_dtype`` and
``unet_manual_cast`` make are answered; ComfyUI is set up as ``loaders.rank_factory`` sets it up for a cpu rank.
"""

from __future__ import annotations

import comfy.cli_args

comfy.cli_args.args.cpu = True   # comfy.model_management probes the device at import
import comfy.model_management as mm  # noqa: E402

TOTAL_BYTES = 24 << 30


def _total_memory(dev=None, torch_total_too: bool = False):
    return (TOTAL_BYTES, TOTAL_BYTES) if torch_total_too else TOTAL_BYTES


def _ampere(device=None, model_params: int = 0, prioritize_performance: bool = True, manual_cast: bool = False):
    return True   # sm_86 computes fp16 and bf16 natively


mm.supports_fp8_compute = lambda device=None: False   # sm_86: fp8 matmul needs sm_89
mm.get_total_memory = _total_memory
mm.should_use_fp16 = _ampere
mm.should_use_bf16 = _ampere
