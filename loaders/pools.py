"""One rank pool per device tuple for the whole ComfyUI process, and the life of the models on it.

Starting ranks costs seconds to minutes (imports, CUDA contexts, rendezvous), so every MGPU model on the same devices
shares one pool, and the ranks outlive the models: a model ComfyUI drops (its node cache moved on, or POST /free)
gives its shards back, and the next model on these devices starts at once. A pool left without models is stopped
when one on other devices starts, so idle ranks never pile up. Ranks never outlive ComfyUI: ``mgpu.pool`` closes
every pool at exit, and a rank dies with its host if that is killed (PR_SET_PDEATHSIG and a watchdog).

No ComfyUI import here: this is plain bookkeeping, unit-tested without ComfyUI.
"""

from __future__ import annotations

import logging
import threading

from mgpu.errors import MgpuError, RankFailure
from mgpu.pool import PoolConfig, RankPool

log = logging.getLogger("mgpu")

_lock = threading.Lock()
_pools: dict[tuple[str, ...], RankPool] = {}
_models: dict[tuple[str, ...], set[str]] = {}   # handles of the models loaded (or loading) on each pool
_owned: dict[str, object] = {}                    # node id -> the ShardedModule that node loaded last


def fsdp_devices(devices: list[str], ranks: int) -> list[str]:
    """The rank devices for ``fsdp_ranks``: 0 keeps the resolved group; N takes its first N GPUs, or N cpu ranks
    when the group is on the cpu (a machine without GPU)."""
    if ranks <= 0:
        return list(devices)
    if all(d == "cpu" for d in devices):
        return ["cpu"] * ranks
    if ranks > len(devices):
        raise MgpuError(f"MGPU Load Diffusion Model: fsdp_ranks is {ranks} but the FSDP group has only "
                        f"{len(devices)} GPU(s) ({', '.join(devices)}); set fsdp_ranks to at most {len(devices)}, "
                        "or 0 for all of them")
    return list(devices[:ranks])


def acquire(devices: list[str], handle: str, extra_sys_path: list[str]) -> RankPool:
    """The shared pool for ``devices`` with ``handle`` registered on it; the ranks start on the pool's first call.
    A new pool first stops the pools that hold no model (their GPUs are likely the ones wanted now)."""
    key = tuple(devices)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            for idle in [k for k, handles in _models.items() if not handles]:
                _pools.pop(idle).close()
                del _models[idle]
                log.info("MGPU: stopped the idle FSDP ranks on %s", ", ".join(idle))
            pool = _pools[key] = RankPool(PoolConfig(devices=list(devices), extra_sys_path=list(extra_sys_path)))
        _models.setdefault(key, set()).add(handle)
        return pool


def release(sharded) -> None:
    """Free ``sharded``'s shards on its ranks; the ranks stay up for the next model on these devices."""
    with _lock:   # serialised with acquire(), which may stop this pool once it holds no model
        _models.get(tuple(sharded.pool.config.devices), set()).discard(sharded.handle)
        try:
            sharded.free()
        except MgpuError as exc:   # the pool tore itself down; whoever uses it next restarts it
            log.warning("MGPU: freeing %s on its FSDP ranks failed: %s", sharded.spec.checkpoint, exc)
        else:
            log.info("MGPU: %s is no longer used; its shards on the FSDP ranks were freed", sharded.spec.checkpoint)


def own(owner: str | None, sharded) -> None:
    """Remember that node ``owner`` loaded ``sharded``, so its next run can free it first (``release_owned``)."""
    if owner is not None:
        _owned[owner] = sharded


def release_owned(owner: str | None) -> None:
    """Free, now, the model node ``owner`` loaded before: its replacement must not load beside it."""
    previous = _owned.pop(owner, None) if owner is not None else None
    if previous is not None:
        release(previous)


def release_later(sharded) -> None:
    """``release`` from a garbage-collection finalizer: on its own thread, because the collector can run in the
    middle of a pool call on this thread, and the pool lock would let a nested call through."""
    threading.Thread(target=release, args=(sharded,), name="mgpu-release", daemon=True).start()


def explain(exc: RankFailure, what: str) -> RankFailure:
    """A node error for a rank failure: what failed, the pool's diagnosis (rank, device, log tail) and what to do."""
    advice = ("Queue the prompt again: a pool that was shut down restarts and reloads the model. If a rank raised an "
              "error instead, its traceback below says why.")
    if exc.signal == "SIGKILL":
        advice += (" A rank killed by SIGKILL is most often out of memory (host RAM or GPU): use more ranks, fp8 "
                   "weights or a smaller video.")
    head, _, tail = str(exc).partition("\n")
    text = f"{what} failed: {head}\n{advice}" + (f"\n{tail}" if tail else "")
    return RankFailure(text, rank=exc.rank, device=exc.device, exitcode=exc.exitcode, signal=exc.signal,
                       traceback=exc.traceback)
