"""Sampling a latent larger than the MGPU Plan was made for: say so, with the numbers, at the first step.

The plan sized every device's memory for one workload (frames x height x width, batch, CFG). A sampler fed a bigger
latent may run out of GPU memory minutes later, or on another machine, with nothing pointing at the cause. A
DIFFUSION_MODEL wrapper (ComfyUI's own interception point, so single-device and sharded MODELs alike) compares each
step's tokens x batch with the plan's and logs a warning once per shape.
"""

from __future__ import annotations

import logging
import math

from mgpu.planning.estimates import Workload, dit_tokens
from mgpu.planning.sizing import ComponentSize

log = logging.getLogger("mgpu")

WRAPPER_KEY = "mgpu_plan_check"


class PlanCheck:
    """``fn(executor, x, timestep, ...)`` for WrappersMP.DIFFUSION_MODEL: warns when a step exceeds the plan."""

    def __init__(self, size: ComponentSize, workload: Workload, label: str):
        self.size = size
        self.workload = workload
        self.label = label
        self.planned = dit_tokens(size, workload) * workload.dit_batch
        self.warned: set[tuple[int, ...]] = set()

    def tokens(self, shape: tuple[int, ...]) -> int:
        """Tokens of one batch item of a (B, C, T, H, W) or (B, C, H, W) latent, patched as the DiT patches it."""
        pt, ph, pw = (self.size.dims.get(k, 1) for k in ("patch_t", "patch_h", "patch_w"))
        t, h, w = (shape[2:] if len(shape) == 5 else (1, *shape[2:]))
        return math.ceil(t / pt) * math.ceil(h / ph) * math.ceil(w / pw)

    def __call__(self, executor, *args, **kwargs):
        x = args[0] if args else None
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) in (4, 5) and shape not in self.warned:
            self.warned.add(shape)
            tokens = self.tokens(shape)
            if tokens * shape[0] > self.planned:
                wl = self.workload
                log.warning(
                    "%s: this step's latent %s is %d tokens x batch %d = %d, but the MGPU Plan was made for %dx%dx%d, "
                    "batch %d%s = %d tokens x batch %d = %d (this is %.1fx that). Its memory estimate for each device no "
                    "longer holds and a GPU may run out of memory: set the plan's width, height, frames and batch to "
                    "this video and queue again.", self.label, "x".join(map(str, shape)), tokens, shape[0],
                    tokens * shape[0], wl.width, wl.height, wl.frames, wl.batch, " with CFG" if wl.cfg else "",
                    self.planned // wl.dit_batch, wl.dit_batch, self.planned, tokens * shape[0] / self.planned)
        return executor(*args, **kwargs)


def add_plan_check(patcher, size: ComponentSize, plan, label: str):
    """Register the check on ``patcher`` (a fresh MODEL from a loader) for the plan it was loaded with."""
    from comfy.patcher_extension import WrappersMP

    workload = Workload(**plan.workload)
    patcher.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, PlanCheck(size, workload, label))
    return patcher
