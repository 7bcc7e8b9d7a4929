"""Rank ops for tests only (pools in tests import them by path, ``"fsdp_probes:unshard"``): put a sharded model in a
state no call of its own leaves it in."""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule


def unshard(ctx, payload: dict, tensors: dict) -> dict:
    """Gather every FSDP unit of the model, as a step cut short between a prefetch and its block would leave it."""
    for module in ctx.objects[payload["handle"]]["model"].modules():
        if isinstance(module, FSDPModule):
            module.unshard()
    return {}
