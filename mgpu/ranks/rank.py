"""Rank worker: one process per device, started by ``mgpu.ranks.pool`` as ``python -m mgpu.ranks.rank``.

It joins the process group, checks it with one timed all-reduce of a known tensor (a broken GPU interconnect shows
there, at start-up, not as a hang in the first denoising step), then serves calls from the host over an authenticated
channel until told to stop or the host goes away. Ops are plain functions ``fn(ctx, payload, tensors) -> (payload,
tensors)``, either registered here with ``@register_op(name)`` (the defining module must be imported on the rank:
list it in ``PoolConfig.imports``) or named as ``"package.module:function"`` and imported on first use. An op that
raises is reported with its traceback (and, for one of our own ``MgpuError``s, as a refusal of its input with the
error's message) and the rank keeps serving; whether the pool survives is the host's decision.

The wire format (``dumps``/``recv``) lives here because both sides speak it: pickled plain-data messages, which is
safe only because the channel is authenticated with a per-pool random key; tensors are refused in messages and go
through ``mgpu.ranks.shm`` instead.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # `-m mgpu.ranks.rank` runs this file as __main__; alias it so `from mgpu.ranks.rank import register_op` in op modules
    # registers into the registry this process actually dispatches from, not a second copy of the module.
    sys.modules.setdefault("mgpu.ranks.rank", sys.modules[__name__])

import argparse
import ctypes
import faulthandler
import gc
import importlib
import io
import mmap
import os
import pickle
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Any

import psutil
import torch

from ..errors import MgpuError
from .shm import Mapper, SegmentPool

Tensors = dict[str, torch.Tensor]
OpResult = tuple[dict, Tensors] | dict | None
OpFn = Callable[["RankContext", dict, Tensors], OpResult]

_OPS: dict[str, OpFn] = {}
PARENT_POLL_S = 0.25
# The start-up check: each rank fills its own row with rank + 1; the sum is known. 1 MiB per row, past NCCL's
# small-message protocols, so the bulk transfer path (the one a broken P2P link breaks) runs too.
PROBE_ELEMENTS = 1 << 18


class Cancelled(Exception):
    """The host cancelled the call in flight (ComfyUI's Cancel); every rank raises it at the same point."""


class ProbeFailed(Exception):
    """The start-up all-reduce failed. ``outcome``: "wrong" (``bad``: the ranks whose rows arrived wrong), "error"
    (it raised) or "timeout" (sent by the probe's timer)."""

    def __init__(self, message: str, outcome: str, bad: list[int] | None = None):
        super().__init__(message)
        self.outcome = outcome
        self.bad = bad or []


@dataclass
class RankContext:
    """What an op sees of its rank. ``objects`` holds models and cached tensors by handle across calls."""
    rank: int
    world_size: int
    device: str                   # as configured: "cuda:1", "cpu"
    torch_device: torch.device
    backend: str                  # "gloo" | "nccl"
    group: Any                    # the default torch.distributed ProcessGroup
    mesh: Any                     # 1-D DeviceMesh over all ranks
    objects: dict[str, Any] = field(default_factory=dict)
    control: Any = None           # a gloo group over all ranks: agreeing on a cancel costs no GPU synchronisation
    cancel_flag: Any = None       # the host writes the number of the call it cancels here (mmap, 8 bytes)
    call: int = 0                 # the number of the call being served
    collective_timeout: timedelta | None = None   # the pool's, for process groups ops make (sequence groups)

    def raise_if_cancelled(self) -> None:
        """Raise Cancelled on every rank, or on none: call it at the same point on all ranks (e.g. before each
        block). The host's flag is read locally, then the ranks agree with one tiny CPU all-reduce, so no rank stops
        while another goes on into a collective and hangs there."""
        wanted = self.cancel_flag is not None and int.from_bytes(self.cancel_flag[:8], "little") == self.call
        if self.world_size > 1:
            import torch.distributed as dist

            vote = torch.tensor([int(wanted)])
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.control)
            wanted = bool(vote.item())
        if wanted:
            raise Cancelled(f"call {self.call} cancelled by the host")


def register_op(name: str) -> Callable[[OpFn], OpFn]:
    """Register ``fn(ctx, payload, tensors)`` under ``name``. Input tensors are views of shared memory that the
    host overwrites on its next call: clone (or move to the device) anything kept in ``ctx.objects``."""
    def deco(fn: OpFn) -> OpFn:
        _OPS[name] = fn
        return fn
    return deco


def import_path(path: str) -> Callable:
    """The function named ``"package.module:function"``, imported from the rank's sys.path (with extra_sys_path)."""
    module, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise LookupError(f"{path!r}: module {module!r} has no function {attr!r}")
    return fn


def resolve_op(name: str) -> OpFn:
    """A registered op, else ``"module:function"`` imported."""
    if name in _OPS:
        return _OPS[name]
    if ":" in name:
        return import_path(name)
    raise LookupError(f"unknown op {name!r}; registered: {sorted(_OPS)}. Ops registered in another module need that "
                      "module in PoolConfig.imports, or call them as 'package.module:function'")


@register_op("ping")
def _ping(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    return {"rank": ctx.rank, "pid": os.getpid(), "device": ctx.device}


@register_op("stats")
def _stats(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    stats = {"rank": ctx.rank, "pid": os.getpid(), "device": ctx.device,
             "rss": psutil.Process().memory_info().rss, "handles": sorted(ctx.objects),
             "allocated": None, "reserved": None, "max_allocated": None}
    if ctx.torch_device.type == "cuda":
        stats.update(allocated=torch.cuda.memory_allocated(ctx.torch_device),
                     reserved=torch.cuda.memory_reserved(ctx.torch_device),
                     max_allocated=torch.cuda.max_memory_allocated(ctx.torch_device))
    return stats


@register_op("free")
def _free(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Drop handles (``{"handles": [...]}`` or ``{"handle": h}``) and give their memory back to the device."""
    handles = payload.get("handles") or [payload["handle"]]
    freed = [h for h in handles if ctx.objects.pop(h, None) is not None]
    gc.collect()
    if ctx.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    _trim_heap()
    return {"freed": freed}


def _trim_heap() -> None:
    """Give freed host memory back to the system: glibc keeps it in its arenas otherwise, and an idle rank that
    held a model's CPU shards would look as big as when it held them."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):   # not glibc (musl): nothing to trim
            pass


class _NoTensorPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            raise TypeError("a tensor inside a payload: pass tensors in the tensors dict, they travel through shared "
                            "memory")
        return NotImplemented


def dumps(msg: dict) -> bytes:
    buf = io.BytesIO()
    _NoTensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(msg)
    return buf.getvalue()


def recv(conn: Connection) -> dict:
    return pickle.loads(conn.recv_bytes())


def _die_with_parent(host_pid: int) -> None:
    """Exit when the host does. PR_SET_PDEATHSIG kills us even while stuck in a collective; the watchdog thread
    covers platforms without it (and a parent that died before the prctl)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # 1 = PR_SET_PDEATHSIG
    if os.getppid() != host_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == host_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="mgpu-parent-watchdog", daemon=True).start()


def _channel_address(text: str) -> str | tuple[str, int]:
    kind, _, rest = text.partition(":")
    if kind == "unix":
        return rest
    host, _, port = rest.rpartition(":")
    return host, int(port)


class _StartReport:
    """The one start-up message (ready or error) of a rank: the probe's timer may send it from its own thread."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()
        self._sent = False

    def send(self, msg: dict) -> bool:
        """Send ``msg`` unless a start-up message went already; returns whether this one went."""
        with self._lock:
            if self._sent:
                return False
            self._sent = True
            self._conn.send_bytes(dumps(msg))
            return True


def start_error(exc: BaseException) -> dict:
    """The start-up error message for ``exc``; a failed probe says how, for the host's P2P decision."""
    probe = {"outcome": exc.outcome, "bad": exc.bad} if isinstance(exc, ProbeFailed) else None
    return {"kind": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
            "probe": probe}


def probe_tensor(rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    t = torch.zeros(world_size, PROBE_ELEMENTS, device=device)
    t[rank] = rank + 1
    return t


def pair_probe_tensor(rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """What ``rank`` sends every rank in the start-up all-to-all: row j (for rank j) filled with
    rank * world_size + j + 1, so each pair's values are its own and a row lost on the way shows."""
    rows = torch.arange(world_size, dtype=torch.float32, device=device) + rank * world_size + 1
    return rows.unsqueeze(1).expand(world_size, PROBE_ELEMENTS // world_size or 1).contiguous()


def probe_wrong_rows(result: torch.Tensor) -> list[int]:
    """The rows of a summed ``probe_tensor`` that are not rank + 1 throughout: whose contribution arrived wrong."""
    want = torch.arange(1, result.shape[0] + 1, dtype=result.dtype).unsqueeze(1)
    return [int(i) for i in torch.nonzero((result != want).any(dim=1)).flatten()]


def _probe(rank: int, world_size: int, device: torch.device, report: _StartReport, timeout_s: float) -> float:
    """One all-reduce and one all-to-all of known tensors on the default group, checked; returns their seconds. Past
    ``timeout_s`` a timer reports the timeout (waiting in them, or not even there) and ends the process: a hung NCCL
    kernel never returns control to this thread."""
    import torch.distributed as dist

    # Whether this rank reached the collectives: on NCCL the calls return at once and the wait is in the copy back,
    # so the flag tells; on gloo the wait is inside the call, and the main thread's frame tells (a rank stuck before
    # it, in Python, shows there too).
    in_collective = threading.Event()
    main = threading.get_ident()

    def expire() -> None:
        waiting = in_collective.is_set() and (dist.get_backend() == "nccl" or _in_collective(main))
        where = "waiting for the other ranks in it" if waiting else "not even in the collective: busy elsewhere"
        message = (f"ProbeFailed: the start-up all-reduce over {world_size} ranks did not finish within "
                   f"{timeout_s:g}s on rank {rank} ({device}), {where}")
        if report.send({"kind": "error", "error": message, "traceback": "",
                        "probe": {"outcome": "timeout", "bad": [], "waiting": waiting}}):
            print(message, flush=True)
            os._exit(1)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    t0 = time.perf_counter()
    try:
        t = probe_tensor(rank, world_size, device)
        # every pair too: one all-reduce uses only ring neighbours (or NVLS), the sequence-parallel all-to-alls all
        sent = pair_probe_tensor(rank, world_size, device)
        exchanged = torch.empty_like(sent)
        in_collective.set()
        dist.all_reduce(t)
        dist.all_to_all_single(exchanged, sent)
        result, received = t.cpu(), exchanged.cpu()
        in_collective.clear()
    except Exception as exc:  # noqa: BLE001 - the backend's own error, reported as the probe's
        raise ProbeFailed(f"the start-up all-reduce over {world_size} ranks raised on rank {rank} ({device}): "
                          f"{type(exc).__name__}: {exc}", "error") from exc
    finally:
        timer.cancel()
    expected = torch.tensor([[j * world_size + rank + 1] for j in range(world_size)], dtype=received.dtype)
    if bad := [j for j in range(world_size) if not bool((received[j] == expected[j]).all())]:
        raise ProbeFailed(f"the start-up all-to-all over {world_size} ranks returned wrong values on rank {rank} "
                          f"({device}) from rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}", "wrong", bad)
    seconds = time.perf_counter() - t0
    bad = probe_wrong_rows(result)
    if bad:
        got = ", ".join(f"rank {i}: {result[i].min().item():g}..{result[i].max().item():g} instead of {i + 1}"
                        for i in bad)
        raise ProbeFailed(f"the start-up all-reduce over {world_size} ranks returned wrong values on rank {rank} "
                          f"({device}) for the contribution of {got}", "wrong", bad)
    print(f"{time.strftime('%H:%M:%S')} start-up all-reduce over {world_size} ranks correct in "
          f"{seconds * 1e3:.1f} ms", flush=True)
    return seconds


def _in_collective(thread_id: int) -> bool:
    """Whether that thread's innermost Python frame is in torch.distributed (waiting for the others), as the host's
    stack-dump diagnosis reads it."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and "torch/distributed" in frame.f_code.co_filename.replace(os.sep, "/")


def _init_context(args: argparse.Namespace, report: _StartReport) -> tuple[RankContext, float]:
    """The rank's context and the probe's seconds. The collective timeout is the pool's choice (on NCCL shorter
    than the host's call timeout, so NCCL's watchdog dumps its flight recorder before the host gives up); the
    store's covers the rendezvous."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.collective_timeout)
    # A file in the pool's private 0700 directory: no port to bind, and nobody but this user can join the group.
    store = dist.FileStore(args.store_file, args.world_size)
    store.set_timeout(timedelta(seconds=args.store_timeout))
    extra = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world_size, timeout=timeout,
                            **extra)
    probe_s = _probe(args.rank, args.world_size, device, report, args.probe_timeout)
    mesh = init_device_mesh(args.mesh_device_type, (args.world_size,))
    control = dist.group.WORLD if args.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    with open(args.cancel_file, "rb") as f:
        cancel_flag = mmap.mmap(f.fileno(), 8, access=mmap.ACCESS_READ)
    for module in args.imports:
        importlib.import_module(module)
    return RankContext(args.rank, args.world_size, args.device, device, args.backend, dist.group.WORLD, mesh,
                       control=control, cancel_flag=cancel_flag, collective_timeout=timeout), probe_s


def _normalize(result: OpResult) -> tuple[dict, Tensors]:
    if result is None:
        return {}, {}
    if isinstance(result, dict):
        return result, {}
    payload, tensors = result
    return payload or {}, tensors or {}


def _serve_call(ctx: RankContext, msg: dict, inputs: Mapper, outputs: SegmentPool) -> bytes:
    inputs.forget(msg["dropped"])
    dropped = outputs.release(msg["released"].get(ctx.rank, ()))
    ctx.call = msg["call"]
    print(f"{time.strftime('%H:%M:%S')} call {ctx.call}: {msg['op']}", flush=True)   # what a dead rank was doing
    packet = None
    try:
        fn = resolve_op(msg["op"])
        tensors = inputs.borrow(msg["inputs"]) if msg["inputs"] else {}
        payload, results = _normalize(fn(ctx, msg["payload"], tensors))
        packet = outputs.pack(results)
        return dumps({"kind": "ok", "payload": payload, "outputs": packet, "dropped": dropped})
    except Exception as exc:  # noqa: BLE001 - reported to the host, which decides the pool's fate
        if packet is not None:           # packed, then the payload would not pickle: nobody will lease it
            dropped += outputs.release([packet.path])
        return dumps({"kind": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                      "dropped": dropped, "cancelled": isinstance(exc, Cancelled),
                      "refusal": str(exc) if isinstance(exc, MgpuError) else None,
                      "collectives": _collectives_queued(ctx)})


def _collectives_queued(ctx: RankContext) -> int | None:
    """How many collectives this rank queued on the default group (a host-side counter, no GPU sync); on NCCL the
    host keeps a pool after refusals only when every rank queued the same number. None where torch does not say."""
    if ctx.backend != "nccl":
        return None
    try:
        return int(ctx.group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mgpu.ranks.rank", description="comfy-mgpu rank worker (started by the pool)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--backend", required=True, choices=["gloo", "nccl"])
    p.add_argument("--mesh-device-type", required=True)
    p.add_argument("--store-file", required=True, help="rendezvous FileStore, in the pool's private directory")
    p.add_argument("--channel", required=True, help="unix:/path or tcp:host:port of the host's command channel")
    p.add_argument("--host-pid", type=int, required=True)
    p.add_argument("--segment-dirs", nargs="+", required=True)
    p.add_argument("--store-timeout", type=float, required=True, help="rendezvous (FileStore) timeout, seconds")
    p.add_argument("--collective-timeout", type=float, required=True, help="collective timeout, seconds")
    p.add_argument("--probe-timeout", type=float, required=True, help="limit of the start-up all-reduce, seconds")
    p.add_argument("--cancel-file", required=True, help="8 bytes the host writes a cancelled call's number to")
    p.add_argument("--imports", nargs="*", default=[])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run one rank. The channel key arrives on stdin, not argv, so other users cannot read it from ps."""
    args = _parse(argv)
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    faulthandler.enable()                                   # a crash leaves its stack in the log the host reads
    if hasattr(faulthandler, "register"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)   # the host asks where a timed-out rank is stuck
    _die_with_parent(args.host_pid)
    conn = Client(_channel_address(args.channel), authkey=authkey)
    conn.send_bytes(dumps({"kind": "hello", "rank": args.rank, "pid": os.getpid()}))
    report = _StartReport(conn)
    try:
        ctx, probe_s = _init_context(args, report)
    except Exception as exc:  # noqa: BLE001 - reported to the host
        report.send(start_error(exc))
        sys.exit(1)
    if not report.send({"kind": "ready", "probe_s": probe_s}):
        os._exit(1)                 # the probe's timer reported a timeout meanwhile and is ending the process
    inputs, outputs = Mapper(), SegmentPool(args.segment_dirs)
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            os._exit(1)             # the host closed the channel without saying goodbye: it is gone
        if msg["kind"] == "shutdown":
            break
        conn.send_bytes(_serve_call(ctx, msg, inputs, outputs))
    outputs.close()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # skip interpreter teardown (seconds with torch loaded): the host waits on it to close


if __name__ == "__main__":
    main()
