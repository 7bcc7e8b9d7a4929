"""Peak working memory of one forward, on a GPU or on the CPU, for the memory calibration scripts in bench/.

On CUDA the allocator's own peak (``max_memory_allocated``) is the truth. The CPU allocator keeps no such count, so
``LiveBytes`` counts it at the operator level: every storage an op creates is added when it appears and taken off when
its last reference dies (storages keep their Python object alive as long as the C++ storage lives, so a weak
reference's finalizer fires exactly at the free). What it cannot see are buffers a kernel allocates and frees inside
one op (library workspaces): the estimates cover those with their allowance, and the GPU check measures them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode that are still alive, and the peak of that count."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self.live:     # views and in-place results reuse a storage already counted
            return
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._freed, key)


@dataclass
class Peak:
    """Peak bytes above what was allocated before the call (weights excluded); ``reserved`` is CUDA only."""
    bytes: int
    reserved: int | None = None


def forward_peak(run: Callable[[], object], device: torch.device | str) -> Peak:
    """Peak memory of ``run()`` (inputs it creates included, output dropped) under inference_mode."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base, base_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        with torch.inference_mode():
            run()
        torch.cuda.synchronize(device)
        return Peak(torch.cuda.max_memory_allocated(device) - base,
                    torch.cuda.max_memory_reserved(device) - base_reserved)
    probe = LiveBytes()
    with torch.inference_mode(), probe:
        run()
    return Peak(probe.peak)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept) of ys over xs: bytes per token and the fixed part."""
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs at least two points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx
