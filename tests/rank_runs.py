"""Run a function on N forkserver rank processes for the single-file distributed tests (each sets up its own gloo
group from a file store in the test's folder), and fail, not hang, when they take too long."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

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


@contextlib.contextmanager
def gloo_mesh(rank: int, world: int, workdir: str) -> Iterator:
    """Inside a rank process: one thread, a gloo group over a file store in ``workdir``, a 1-D cpu mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()
