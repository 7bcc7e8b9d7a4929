"""Run a function on N forkserver rank processes for the single-file distributed tests (each sets up its own gloo
group from a file store in the test's folder), and fail, not hang, when they take too long."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.multiprocessing as mp


def run_ranks(fn: Callable, world: int, args: tuple, preload: list[str], timeout_s: float) -> None:
    """``fn(rank, *args)`` on ``world`` processes forked from a server that imported ``preload`` once (spawning
    each rank from scratch costs ~10 s of imports per rank on a small CPU)."""
    began = time.perf_counter()
    mp.get_context("forkserver").set_forkserver_preload(preload)
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="forkserver")
    try:
        while not ctx.join(timeout=1):
            if time.perf_counter() - began > timeout_s:
                raise TimeoutError(f"{world}-rank run did not finish in {timeout_s} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
