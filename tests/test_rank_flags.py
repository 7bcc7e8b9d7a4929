"""The host ComfyUI's numeric flags reach the FSDP ranks, enum-valued ones included (``--fast ...``), so sharded and
stock compute agree. Needs a ComfyUI checkout (COMFYUI_PATH); the plain-data half is in test_loaders_diffusion.py.

The op below runs on a real rank, a fresh interpreter that imports this file as module ``test_rank_flags``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiny_models import comfyui_path

from mgpu.ranks.pool import PoolConfig, RankPool

pytestmark = pytest.mark.comfyui
TESTS = str(Path(__file__).resolve().parent)


def op_comfy_args(ctx, payload, tensors):
    """Set ComfyUI up on this rank as the FSDP loader does, then report what its flags hold."""
    from loaders.rank_factory import _setup

    _setup(ctx.device, payload["flags"])
    import comfy.cli_args
    import comfy.model_management  # noqa: F401 - imported by _setup, after the flags were set

    args, feature = comfy.cli_args.args, comfy.cli_args.PerformanceFeature
    return {"fast": sorted(f.value for f in args.fast), "members": all(isinstance(f, feature) for f in args.fast),
            "autotune": feature.AutoTune in args.fast, "cublas": feature.CublasOps in args.fast,
            "force_fp32": args.force_fp32}


def test_fast_reaches_a_fresh_rank_as_comfyuis_enum_set() -> None:
    root = comfyui_path()
    if root is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH")
    if root not in sys.path:
        sys.path.insert(0, root)
    import comfy.cli_args

    from loaders.rank_factory import numeric_flags

    args = comfy.cli_args.parser.parse_args(["--fast", "fp16_accumulation", "autotune", "--force-fp32"])
    args.fast = set(args.fast)      # as comfy/cli_args.py leaves it
    pool = RankPool(PoolConfig(["cpu"], extra_sys_path=[root, TESTS]))
    try:
        reply = pool.call("test_rank_flags:op_comfy_args", {"flags": numeric_flags(args)})[0].payload
    finally:
        pool.close()
    assert reply == {"fast": ["autotune", "fp16_accumulation"], "members": True, "autotune": True, "cublas": False,
                     "force_fp32": True}
