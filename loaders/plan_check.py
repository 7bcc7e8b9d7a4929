"""Sampling a latent larger than the MGPU Plan was made for: say so, with the numbers, at the first step.

The plan sized every device's memory for one workload (frames x height x width, batch, CFG). A sampler fed a bigger
latent may run out of GPU memory minutes later, or on another machine, with nothing pointing at the cause. A
DIFFUSION_MODEL wrapper (ComfyUI's own interception point, so single-device and sharded MODELs alike) compares each
step's tokens x batch with the plan's and logs a warning once per shape. A video of another size than planned (the
latent node not wired to MGPU Plan's width, height, frames and batch outputs, or typed apart) warns too, smaller
ones included: the plan's devices, split and time estimate were decided for the other size. A smaller batch alone
does not warn: ComfyUI may run cond and uncond apart. A plan made for training (the LoRA training examples sample
with the trained LoRA on the same ranks) sized a training step: sampling the same video with CFG does not warn.
LTX-2 hands its network a list [video, audio]: the video stream is the one planned.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from mgpu.planning.estimates import Workload, dit_tokens
from mgpu.planning.sizing import ComponentSize

log = logging.getLogger("mgpu")

WRAPPER_KEY = "mgpu_plan_check"
# Rows per planned training row that a sampling step on the same ranks may take without a warning: CFG's two.
TRAINING_PLAN_SAMPLING_ROWS = 2
FIX = ("wire the plan's width, height, frames and batch outputs into the latent node, or set the plan's inputs to "
       "this video, and queue again.")


class PlanCheck:
    """``fn(executor, x, timestep, ...)`` for WrappersMP.DIFFUSION_MODEL: warns when a step differs from the plan."""

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
        if isinstance(x, (list, tuple)) and x:   # LTX-2: [video, audio]
            x = x[0]
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) in (4, 5) and shape not in self.warned:
            self.warned.add(shape)
            self.check(shape)
        return executor(*args, **kwargs)

    def check(self, shape: tuple[int, ...]) -> None:
        wl, tokens = self.workload, self.tokens(shape)
        per_video = self.planned // wl.dit_batch
        planned = f"{wl.width}x{wl.height}x{wl.frames}, batch {wl.batch}{' with CFG' if wl.cfg else ''}"
        # A training plan sized a training step, whose forward and backward hold several times what a sampling step
        # of the same video holds, with CFG's two rows too (mgpu.planning.training): only more rows than that warn.
        capacity = self.planned * (TRAINING_PLAN_SAMPLING_ROWS if wl.train is not None else 1)
        if wl.train is not None:
            planned = f"{wl.width}x{wl.height}x{wl.frames}, a training step of {wl.batch} row{'s' * (wl.batch > 1)}"
        if tokens * shape[0] > capacity:
            log.warning(
                "%s: this step's latent %s is %d tokens x batch %d = %d, but the MGPU Plan was made for %s = %d "
                "tokens x batch %d = %d (this is %.1fx that). Its memory estimate for each device no longer holds "
                "and a GPU may run out of memory: %s", self.label, "x".join(map(str, shape)), tokens, shape[0],
                tokens * shape[0], planned, per_video, wl.dit_batch, self.planned, tokens * shape[0] / self.planned,
                FIX)
        elif tokens != per_video:
            log.warning(
                "%s: this step's latent %s is %d tokens a video, but the MGPU Plan was made for %s = %d tokens a "
                "video: it placed the models and chose the split for that video, not this one (it reserved more "
                "memory than this needs, and may use more GPUs than pay): %s", self.label, "x".join(map(str, shape)),
                tokens, planned, per_video, FIX)


def add_plan_check(patcher, size: ComponentSize, plan, label: str):
    """Register the check on ``patcher`` (a fresh MODEL from a loader) for the plan it was loaded with."""
    from comfy.patcher_extension import WrappersMP

    workload = Workload.from_dict(plan.workload)
    placed = plan.expert(size.path) or plan.placement("dit")
    if workload.train is not None and placed is not None and placed.training:   # the rows per forward it chose
        workload = replace(workload, batch=placed.training["batch_size"])
    patcher.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, PlanCheck(size, workload, label))
    return patcher
