"""One rank pool per device tuple for the whole ComfyUI process, and the life of the models on it.

Starting ranks costs seconds to minutes (imports, CUDA contexts, rendezvous), so every MGPU model on the same devices
shares one pool, and the ranks outlive the models: a model ComfyUI drops (its node cache moved on, or POST /free)
gives its shards back, and the next model on these devices starts at once; a loader run again first takes the model
it loaded before off the GPUs (``occupy``). Models that take turns on a pool (Wan 2.2's two experts when both do
not fit: ``take_turns``) are loaded one at a time: loading one frees the others first (``make_room``). A pool left
without models is stopped when one on other devices starts,
so idle ranks never pile up. Ranks never outlive ComfyUI: ``mgpu.ranks.pool`` closes every pool at exit, and a rank dies
with its host if that is killed (PR_SET_PDEATHSIG and a watchdog).

No ComfyUI import here: this is plain bookkeeping, unit-tested without ComfyUI.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Collection

from mgpu.errors import MgpuError, RankFailure
from mgpu.planning.devices import Device
from mgpu.ranks.pool import PoolConfig, RankPool

log = logging.getLogger("mgpu")

_lock = threading.Lock()
_pools: dict[tuple[str, ...], RankPool] = {}
_models: dict[tuple[str, ...], set[str]] = {}   # handles of the models loaded (or loading) on each pool
_collected: deque = deque()                       # ShardedModules whose MODEL is gone, not yet released
_slots: dict[tuple, object] = {}                  # loader slot -> the ShardedModule it has (or last had) loaded
_drain_lock = threading.Lock()                    # one drain at a time: a load waits for a release in progress
_live: weakref.WeakSet = weakref.WeakSet()        # every ShardedModule a MODEL was made of, while it exists
_turns: dict[tuple[str, ...], weakref.WeakSet] = {}   # per pool: models loaded one at a time (``take_turns``)
MEMORY_OP = "mgpu.sharding.model_ops:memory"


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
            _stop_idle_locked()
            pool = _pools[key] = RankPool(PoolConfig(devices=list(devices), extra_sys_path=list(extra_sys_path)))
        _models.setdefault(key, set()).add(handle)
        return pool


def release(sharded) -> None:
    """Free ``sharded``'s shards on its ranks for good; the ranks stay up for the next model on these devices."""
    with _lock:   # serialised with acquire(), which may stop this pool once it holds no model
        _models.get(tuple(sharded.pool.config.devices), set()).discard(sharded.handle)
        for slot in [k for k, v in _slots.items() if v is sharded]:
            del _slots[slot]
        _turns.get(tuple(sharded.pool.config.devices), set()).discard(sharded)
        _free(sharded, "is no longer used")


def _free(sharded, why: str) -> None:
    try:
        sharded.free()
    except MgpuError as exc:   # the pool tore itself down; whoever uses it next restarts it
        log.warning("MGPU: freeing %s on its FSDP ranks failed: %s", sharded.spec.checkpoint, exc)
    else:
        log.info("MGPU: %s %s; its shards on the FSDP ranks were freed", sharded.spec.checkpoint, why)


def occupy(slot: tuple | None, sharded) -> None:
    """``sharded`` is about to (re)load for ``slot``, one loader node of one workflow: the model that slot loaded
    before leaves the GPUs first, so two generations of one loader never sit there together.

    Needed besides ``release_garbage``: newer ComfyUI's default cache (RAM pressure) and ``--cache-lru`` still hold
    the replaced MODEL when its loader runs again, on a host with RAM to spare for as long as it likes. The evicted
    model stays a working MODEL (its loader may be set back and hit the cache): sampling it reloads it, and that
    reload evicts the newer one in turn. Models of other slots are never touched."""
    if slot is None:
        return
    with _lock:
        previous, _slots[slot] = _slots.get(slot), sharded
        if previous is not None and previous is not sharded and previous.loaded:
            _free(previous, f"was replaced by its loader ({slot[1]}) and may load again when used")


def vacate(slot: tuple | None) -> None:
    """The model ``slot``'s loader loaded before leaves the GPUs now (as ``occupy`` would at the load), so that what
    is free on the ranks is weighed without it. It stays a working MODEL that reloads when sampled."""
    if slot is None:
        return
    with _lock:
        previous = _slots.get(slot)
        if previous is not None and previous.loaded:
            _free(previous, f"was replaced by its loader ({slot[1]}) and may load again when used")


def rank_pids() -> list[int]:
    """The process ids of every pool's running ranks: what NVML reports for them on a GPU is ours to reuse."""
    with _lock:
        running = list(_pools.values())
    return [pid for pool in running for pid in pool.pids]


def staying_bytes(replacing: Collection[str] = ()) -> dict[str, int]:
    """Per device, what the loaded models stay holding on their ranks when the caller loads models of the checkpoints
    ``replacing`` (whose loaded copies their loaders free first): each other model's shard, and its gathered weights
    if it keeps them between steps (``load_replies``: the bytes each rank reported)."""
    replaced = {os.path.realpath(p) for p in replacing}
    held: dict[str, int] = {}
    for model in list(_live):
        if not model.loaded or os.path.realpath(model.spec.checkpoint) in replaced:
            continue
        for device, reply in zip(model.pool.config.devices, model.load_replies):
            kept = 0 if model.spec.reshard_after_forward else int(reply.get("gathered_bytes_per_forward", 0))
            held[device] = held.get(device, 0) + int(reply.get("local_param_bytes", 0)) + kept
    return held


def take_turns(sharded, others: list = ()) -> None:
    """From now on ``sharded`` and ``others`` (models on the same ranks) are loaded one at a time: each (re)load
    frees the others first (``make_room``), so their shards are never resident together. The MGPU Plan asks for it
    when two experts do not fit both resident; without a plan, the loader does when the ranks' free memory does not
    hold a model beside the ones already there. Every model that joins a pool's group takes turns with all of it."""
    with _lock:
        group = _turns.setdefault(tuple(sharded.pool.config.devices), weakref.WeakSet())
        group.add(sharded)
        group.update(others)


def make_room(sharded) -> list[str]:
    """``sharded`` is about to (re)load: free the loaded models it takes turns with; returns their checkpoints."""
    with _lock:
        group = _turns.get(tuple(sharded.pool.config.devices))
        if group is None or sharded not in group:
            return []
        others = [m for m in list(group) if m is not sharded and m.loaded]
        for other in others:
            _free(other, f"takes turns with {sharded.spec.checkpoint} on the FSDP ranks and may load again when used")
    return [m.spec.checkpoint for m in others]


def loaded_beside(sharded) -> list:
    """The models loaded on ``sharded``'s ranks now, ``sharded`` left out."""
    return [m for m in list(_live) if m is not sharded and m.pool is sharded.pool and m.loaded]


def rank_memory(pool: RankPool) -> list[Device]:
    """One Device per rank with the free memory that rank reports now (``mgpu.sharding.model_ops.memory``)."""
    devices = []
    for reply in pool.call(MEMORY_OP):
        r, dev = reply.payload, reply.payload["device"]
        cuda = dev.startswith("cuda")
        devices.append(Device(id=dev, kind="cuda" if cuda else "cpu", index=int(dev.partition(":")[2] or 0) if cuda
                              else None, name=f"rank {reply.rank}", total_bytes=r["total_bytes"],
                              free_bytes=r["free_bytes"], simulated=r["simulated"], source="rank"))
    return devices


def release_with(model: object, sharded) -> None:
    """Free ``sharded``'s shards once ``model`` (the host's BaseModel, which every clone of the MODEL shares) is
    garbage: ownership follows the loaded model, not the node that loaded it, so a model any workflow, browser
    tab or cache entry still holds is never freed, whatever node ids collide."""
    _live.add(sharded)
    weakref.finalize(model, _on_collected, sharded).atexit = False   # at exit mgpu.ranks.pool closes every pool


def _stop_idle_locked() -> None:
    for idle in [k for k, handles in _models.items() if not handles]:
        _pools.pop(idle).close()
        del _models[idle]
        log.info("MGPU: stopped the idle FSDP ranks on %s", ", ".join(idle))


def unload_all(stop_idle_after_s: float = 5.0) -> None:
    """ComfyUI's "Unload models" (``POST /free``): free every sharded model's shards now (each MODEL stays usable
    and loads again when sampled), then, once ComfyUI has dropped what it drops (``free_memory`` empties its
    caches, which makes those MODELs garbage), stop the pools left without any model, so no idle rank keeps its
    CUDA context and imports."""
    for sharded in list(_live):
        if sharded.loaded:
            with _lock:
                _free(sharded, "was unloaded (ComfyUI's Unload models / POST /free)")

    def stop_idle() -> None:
        release_garbage()
        with _lock:
            _stop_idle_locked()

    timer = threading.Timer(stop_idle_after_s, stop_idle)
    timer.daemon = True
    timer.start()


def _on_collected(sharded) -> None:
    """Finalizer: queue the release. No pool call here: the collector can run in the middle of a pool call on
    this thread, and the pool lock would let a nested call through. A thread drains the queue in case no load
    comes to do it first."""
    _collected.append(sharded)
    threading.Thread(target=drain, name="mgpu-release", daemon=True).start()


def drain() -> None:
    """Release every queued model now. Also waits for a drain already running elsewhere."""
    with _drain_lock:
        while _collected:
            release(_collected.popleft())


def release_garbage() -> None:
    """Before a load: free, synchronously, the shards of every model ComfyUI has dropped. ComfyUI's classic cache
    (0.3.64's default) lets go of the outputs a new prompt no longer uses before any node runs, so there a loader
    run again with other inputs finds its previous model already garbage; with the caches that keep it, ``occupy``
    takes it off the GPUs."""
    gc.collect()
    drain()


def explain(exc: RankFailure, what: str) -> RankFailure:
    """A node error for a rank failure: what failed, the pool's diagnosis (rank, device, log tail) and what to do.
    A refusal (the ranks raised one of our own errors) leads with its message, which says what to change: queuing
    the same prompt again would fail the same way."""
    if exc.refusal is not None:
        diagnosis = str(exc).removeprefix(exc.refusal).lstrip("\n")
        text = f"{exc.refusal}\n{what} was refused on the ranks: {diagnosis}"
    else:
        advice = ("Queue the prompt again: a pool that was shut down restarts and reloads the model. If a rank raised "
                  "an error instead, its traceback below says why.")
        if exc.signal == "SIGKILL":
            advice += (" A rank killed by SIGKILL is most often out of memory (host RAM or GPU): use more ranks, fp8 "
                       "weights or a smaller video.")
        head, _, tail = str(exc).partition("\n")
        text = f"{what} failed: {head}\n{advice}" + (f"\n{tail}" if tail else "")
    return RankFailure(text, rank=exc.rank, device=exc.device, exitcode=exc.exitcode, signal=exc.signal,
                       traceback=exc.traceback, refusal=exc.refusal, pool_kept=exc.pool_kept)
