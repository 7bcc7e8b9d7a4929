"""Host side of the rank pool: one persistent worker process per device, driven by plain-data calls.

Ranks are clean interpreters (``python -m mgpu.ranks.rank``) with the folder that contains ``mgpu`` on PYTHONPATH, not
``torch.multiprocessing`` spawn children: inside ComfyUI a spawn child re-runs ComfyUI's ``main.py`` as
``__mp_main__``, and ComfyUI imports a pack under its file path as module name, so nothing defined in the pack can be
unpickled in the child (both measured with ComfyUI 0.3.64). A clean interpreter works whatever folder name the pack
was cloned into, and needs only plain data from us.

Linux only (WSL2 included): the ranks rely on PR_SET_PDEATHSIG, flock, AF_UNIX and /dev/shm, so a pool refuses to
start elsewhere, before anything runs; the rest of the pack (planning, single-device loading) works everywhere.

Nothing listens on the network. The ranks meet through a ``torch.distributed.FileStore`` in the pool's private 0700
directory, and gloo / NCCL are pinned to the loopback interface. The host never joins a collective. It talks to each
rank over its own channel (an AF_UNIX socket in that directory; loopback TCP when the path is too long for AF_UNIX),
authenticated with a per-pool key that reaches the ranks on stdin; a connection that fails the challenge or stays
silent for ``HANDSHAKE_TIMEOUT_S`` is dropped. Tensors travel through ``mgpu.ranks.shm``. Every wait polls
the rank processes, so a dead rank is reported as soon as it dies rather than at the timeout.

Start-up ends with one all-reduce of a known tensor on every rank, checked and timed (``mgpu.ranks.rank``): a GPU
interconnect that NVML reports but that does not work fails there. On NCCL with P2P on, a failed or timed-out check
restarts the ranks once with ``NCCL_P2P_DISABLE=1`` (``p2p.after_failed_probe``; a P2P setting of the user's is
reported, never overridden). When NCCL may go through /dev/shm, its free room is checked and a shortage is logged and
added to failure messages.

Failures. Any failure that may leave ranks inconsistent (a death, a timeout, some ranks failing while others did not)
tears the whole pool down, since the survivors are likely stuck in a collective; the next call starts a fresh pool
and bumps ``generation`` so callers know to reload their models. When every rank raised, ``keeps_pool`` decides by
backend: on gloo a rank that raised is blocked nowhere, so the pool stays. On NCCL collectives are queued on the GPU
stream and a rank that raised after queueing one leaves it unmatched (the next call would hang or pair collectives
wrongly), so the pool stays only when every rank refused its input (one of our own errors) having queued the same
number of collectives, or every rank stopped at the agreed Cancel; anything else (a CUDA OOM first of all) tears
it down. Teardown waits a bounded time for killed ranks: one stuck in the kernel (D state, a GPU driver after an Xid)
is logged by rank, pid and device and given up, so no later call and not the host's exit waits on it.

Timeouts. On gloo the ranks' collective timeout is at least the host's call timeout: a hang blocks the CPU there,
and the host's stack dumps name the rank that hangs. On NCCL a GPU-side hang does not block the CPU, so the ranks'
collective timeout is shorter (``collective_timeout``): NCCL's watchdog fires first and writes its flight recorder
into the pool's directory (``mgpu.ranks.flight_recorder``), and the host's error carries the verdict of those dumps
(which rank's last collective lags: the one that never joined).

Protocol (pickled dicts, ``mgpu.ranks.rank.dumps``): rank -> host ``hello {rank, pid}`` on connecting, then ``ready`` or
``error`` once the process group is up; host -> rank ``call {op, payload, inputs: Packet | None, released: {rank:
[segment]}, dropped: [segment]}`` answered by ``ok {payload, outputs: Packet | None, dropped}`` or ``error {error,
traceback, dropped, cancelled, refusal}`` (``refusal``: the message of one of our own errors, else None); ``shutdown``
ends a rank. One call is in flight at a time.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from pathlib import Path
from queue import SimpleQueue

import psutil
import torch

from . import flight_recorder, p2p, shm
from ..errors import CallCancelled, DeviceSpecError, MgpuError, RankFailure
from ..planning.devices import live_gpus
from .rank import dumps, recv

log = logging.getLogger(__name__)
POLL_S = 0.1
SHUTDOWN_GRACE_S = 5.0     # a rank asked to stop gets this long before SIGTERM
KILL_GRACE_S = 2.0         # then this long before SIGKILL
CANCEL_GRACE_S = 3.0       # a cancelled call's ranks get this long to stop at a block boundary before teardown
STACK_DUMP_WAIT_S = 0.3    # after asking a timed-out rank for its stacks
LOG_TAIL_BYTES = 4000
HANDSHAKE_TIMEOUT_S = 5.0  # a channel connection that has not authenticated and said hello by then is dropped
REAP_TIMEOUT_S = 5.0       # after SIGKILL: a rank not gone by then is stuck in the kernel and given up
PROBE_TIMEOUT_S = 30.0     # the start-up all-reduce; NCCL's first one connects the ranks (a few seconds on 8 GPUs)
# On NCCL the ranks' collective timeout is the host's call timeout less this: after a collective times out NCCL's
# watchdog signals every rank to dump (polled each 1 s), waits TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default
# in 2.11 and 2.13) for the dumps, then aborts the rank; the host must still be waiting to read them.
NCCL_DUMP_MARGIN_S = 60.0
FR_DUMP_WAIT_S = 3.0       # once one flight-recorder dump exists, how long the others get to appear
# The ranks' allocator, whatever the host's: ComfyUI sets backend:cudaMallocAsync for itself, while FSDP's all-gather
# buffers of varying size fragment least with expandable segments. The variable MGPU_RANK_ALLOC_CONF (empty: torch's
# defaults) or PoolConfig.env overrides it.
RANK_ALLOC_CONF = "expandable_segments:True"
# torch >= 2.9 reads both (its CUDA allocator the second first, its generic settings the first first); older only
# the second. Both get the same value.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
PLATFORM_NAMES = {"win32": "Windows", "cygwin": "Windows (Cygwin)", "darwin": "macOS"}


@dataclass
class PoolConfig:
    """How to start the ranks. ``env`` is added to the ranks' environment; its allocator (PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF), GLOO/NCCL_SOCKET_IFNAME and OMP_NUM_THREADS win over the pool's choices."""
    devices: list[str]               # one rank per entry: ["cpu", "cpu"] or ["cuda:0", "cuda:1"]
    backend: str | None = None       # None: "nccl" when all ranks are cuda, else "gloo"
    call_timeout_s: float = 300.0
    start_timeout_s: float = 120.0
    extra_sys_path: list[str] = field(default_factory=list)   # prepended on the ranks (e.g. a ComfyUI checkout)
    env: dict[str, str] = field(default_factory=dict)
    imports: list[str] = field(default_factory=list)          # modules each rank imports at start (their register_op)
    error_grace_s: float = 5.0       # after one rank raises, how long the others get to finish before teardown
    collective_timeout_s: float | None = None   # None: see collective_timeout
    probe_timeout_s: float = PROBE_TIMEOUT_S


@dataclass
class RankReply:
    """One rank's answer. ``tensors`` are zero-copy views of shared memory, owned by the caller: the rank reuses the
    segment only after every one of them (and every view of them) is gone."""
    rank: int
    payload: dict
    tensors: dict[str, torch.Tensor]


@dataclass
class _Rank:
    rank: int
    device: str
    proc: subprocess.Popen
    log_path: str
    conn: Connection | None = None
    mapper: shm.Mapper = field(default_factory=shm.Mapper)     # its result segments, leased to our caller
    to_release: list[str] = field(default_factory=list)       # returned leases not yet announced to the rank


# PR_SET_PDEATHSIG fires when the *thread* that forked a rank exits, not the process. Forking from one long-lived
# daemon thread keeps ranks alive when the pool is started from a short-lived caller thread.
_spawn_queue: SimpleQueue = SimpleQueue()
_spawn_lock = threading.Lock()
_spawn_thread: threading.Thread | None = None


def _spawn_loop() -> None:
    while True:
        future, args, kwargs = _spawn_queue.get()
        try:
            future.set_result(subprocess.Popen(*args, **kwargs))
        except BaseException as exc:   # noqa: BLE001 - handed to the caller
            future.set_exception(exc)


def _popen(*args, **kwargs) -> subprocess.Popen:
    global _spawn_thread
    with _spawn_lock:
        if _spawn_thread is None:
            _spawn_thread = threading.Thread(target=_spawn_loop, name="mgpu-spawn", daemon=True)
            _spawn_thread.start()
    future: Future = Future()
    _spawn_queue.put((future, args, kwargs))
    return future.result()


class ProbeFailure(RankFailure):
    """The ranks' start-up all-reduce failed, timed out or returned wrong values."""


def collective_timeout(config: PoolConfig, backend: str) -> float:
    """The ranks' collective timeout: ``config.collective_timeout_s`` if set; on gloo at least the host's timeouts
    (the host's stack dumps diagnose a hang there); on NCCL NCCL_DUMP_MARGIN_S less than the call timeout (at least
    half of it), so the watchdog's flight-recorder dumps exist when the host reports."""
    if config.collective_timeout_s is not None:
        return config.collective_timeout_s
    if backend == "nccl":
        return max(config.call_timeout_s / 2, config.call_timeout_s - NCCL_DUMP_MARGIN_S)
    return max(config.start_timeout_s, config.call_timeout_s)


def reply_kind(reply: dict) -> str:
    """"ok", "cancelled" (stopped at the agreed Cancel), "refusal" (one of our own errors) or "error"."""
    if reply["kind"] != "error":
        return "ok"
    if reply.get("cancelled"):
        return "cancelled"
    return "refusal" if reply.get("refusal") is not None else "error"


def keeps_pool(backend: str, kinds: list[str], in_step: bool = True) -> bool:
    """Whether the pool survives a call that every rank answered, with these reply kinds, without success.

    ``in_step``: every rank queued the same number of collectives (unknown counts as yes). On gloo a rank that
    raised is blocked in no collective, so any mix of errors keeps it. On NCCL collectives are queued on the GPU
    stream: a rank that raised after queueing one leaves it unmatched on the others, so only refusals on every rank
    in step, or the Cancel every rank agreed on, keep it. Mid-forward refusals (a sequence-parallel hook's shape check,
    a LoRA hook, a GGUF dequantization) are raised on every rank at the same hook, after the same collectives, because
    they test what all ranks share; ``in_step`` catches the exception."""
    if not kinds or "ok" in kinds:
        return False
    if backend != "nccl":
        return True
    return set(kinds) == {"cancelled"} or (set(kinds) == {"refusal"} and in_step)


def _validate(config: PoolConfig) -> tuple[str, str]:
    """Check the platform and devices before starting anything; returns (backend, mesh device type)."""
    if not sys.platform.startswith("linux"):
        host = PLATFORM_NAMES.get(sys.platform, sys.platform)
        raise MgpuError(f"sharding a model over ranks (FSDP on {', '.join(config.devices) or 'no devices'}) needs "
                        f"Linux, and this ComfyUI runs on {host}: run ComfyUI under Linux or WSL2 to shard it, or "
                        "load the model on one device")
    if not config.devices:
        raise DeviceSpecError("PoolConfig.devices is empty: give one entry per rank, e.g. ['cuda:0', 'cuda:1'] or "
                              "['cpu', 'cpu']")
    cuda = []
    for spec in config.devices:
        try:
            device = torch.device(spec)
        except RuntimeError as exc:
            raise DeviceSpecError(f"rank device {spec!r} is not a device: {exc}") from exc
        if device.type == "cuda" and device.index is None:
            raise DeviceSpecError(f"rank device {spec!r}: name the GPU, e.g. 'cuda:0'")
        if device.type not in ("cuda", "cpu"):
            raise DeviceSpecError(f"rank device {spec!r}: only 'cuda:N' and 'cpu' ranks are supported")
        if device.type == "cuda":
            cuda.append(device.index)
    if cuda:
        count = torch.cuda.device_count()
        missing = sorted({i for i in cuda if i >= count})
        if missing:
            raise DeviceSpecError(f"rank devices {', '.join(f'cuda:{i}' for i in missing)} do not exist: this machine "
                                  f"has {count} CUDA device(s); use fewer ranks or other devices")
        if len(set(cuda)) != len(cuda) and config.backend != "gloo":
            raise DeviceSpecError(f"two ranks on one GPU in {config.devices}: NCCL needs one GPU per rank (backend "
                                  "'gloo' allows it, for tests)")
    all_cuda = len(cuda) == len(config.devices)
    if cuda and not all_cuda:
        raise DeviceSpecError(f"ranks {config.devices} mix GPUs and cpu: FSDP needs every rank on the same kind of "
                              "device; use only GPUs or only cpu ranks")
    backend = config.backend or ("nccl" if all_cuda else "gloo")
    if backend == "nccl" and not all_cuda:
        raise DeviceSpecError(f"backend 'nccl' needs every rank on a GPU, got {config.devices}; use backend 'gloo'")
    return backend, "cuda" if all_cuda else "cpu"


def _loopback_interface() -> str | None:
    """The network interface of 127.0.0.1: gloo and NCCL open their own listening sockets on whatever interface the
    hostname resolves to unless told one."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _alloc_env(env: dict[str, str], explicit: dict[str, str]) -> dict[str, str]:
    """The allocator settings of the ranks, the same in both variables torch reads: ``explicit`` (PoolConfig.env)
    first, else MGPU_RANK_ALLOC_CONF, else RANK_ALLOC_CONF. Never the host's own: ComfyUI set that for itself. An
    empty value leaves torch's defaults."""
    conf = next((explicit[v] for v in ALLOC_CONF_VARS if v in explicit),
                env.get("MGPU_RANK_ALLOC_CONF", RANK_ALLOC_CONF))
    return dict.fromkeys(ALLOC_CONF_VARS, conf) if conf else {}


def _set_io_timeout(fd: int, seconds: float) -> None:
    """Kernel-side send/receive timeout on a blocking socket (0: none), so the blocking reads of
    ``multiprocessing.connection`` give up with an OSError instead of waiting forever."""
    timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    with socket.socket(fileno=os.dup(fd)) as sock:    # options belong to the socket, shared by every fd of it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    """What a log gained since ``offset`` (e.g. a stack dump just asked for)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(LOG_TAIL_BYTES * 4).decode("utf-8", "replace")
    except OSError:
        return ""


# A rank logs one "HH:MM:SS call N: op" line per call (what a dead rank was doing); a tail keeps the last few.
_CALL_LINE = re.compile(r"^\d\d:\d\d:\d\d call \d+: \S+$")
CALL_LINES_KEPT = 3


def _tail(path: str) -> str:
    """The end of a rank's log for a failure message: its last LOG_TAIL_BYTES, with all but the last
    CALL_LINES_KEPT per-call lines folded into one count, so the error, warnings and traceback are what shows."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - LOG_TAIL_BYTES * 4))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
    except OSError:
        return ""
    calls = [i for i, line in enumerate(lines) if _CALL_LINE.match(line)]
    folded = set(calls[:-CALL_LINES_KEPT])
    kept = [line for i, line in enumerate(lines) if i not in folded]
    if folded:
        kept.insert(0, f"({len(folded)} earlier 'call N: op' lines left out)")
    text = "\n".join(kept)
    return text[-LOG_TAIL_BYTES:]


class RankPool:
    """N rank processes, started lazily and rebuilt after failures. Thread-safe; one call at a time."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self._generation = 0
        self._ranks: list[_Rank] = []
        self._lock = threading.RLock()
        self._dirs: list[str] = []
        self._listener: socket.socket | None = None
        self._inputs: shm.SegmentPool | None = None
        self._dropped_inputs: list[str] = []      # input segments unlinked since the last call: ranks must unmap
        self._calls = 0                            # calls sent, numbered so a cancel names the one in flight
        self._cancel_flag: mmap.mmap | None = None   # 8 bytes the ranks read: the number of the cancelled call
        self._backend = ""
        self._p2p_off = False                      # the start-up check failed with P2P on: later starts keep it off
        self._p2p_env: dict[str, str] = {}         # the NCCL_P2P_* settings the ranks started with
        self._env_note: str | None = None          # a warning about the ranks' environment (/dev/shm), for errors
        self._dump_prefix: str | None = None       # where NCCL's flight recorder dumps
        self._launched_at = 0.0
        self._collective_timeout = 0.0
        _live_pools.add(self)

    @property
    def generation(self) -> int:
        """Bumped on every (re)start: what a caller loaded on the ranks in an older generation is gone. Call
        ``start()`` and compare before a call that relies on loaded models."""
        return self._generation

    @property
    def world_size(self) -> int:
        return len(self.config.devices)

    @property
    def alive(self) -> bool:
        return bool(self._ranks) and not any(_exited(r) for r in self._ranks)

    @property
    def pids(self) -> list[int]:
        """The running ranks' process ids (none before start): NVML counts GPU memory per process, and a plan
        counts what our ranks hold as ours to reuse (``loaders.placement.available_devices``)."""
        return [r.proc.pid for r in list(self._ranks) if r.proc.poll() is None]

    def start(self) -> None:
        """Start the ranks if they are not running (idempotent); raises RankFailure if they do not come up.
        A pool that lost a rank while idle (e.g. to the OOM killer) is logged and rebuilt."""
        with self._lock:
            if self._ranks and not self.alive:
                dead = next(r.rank for r in self._ranks if _exited(r))
                log.warning("%s", self._death_failure(None, dead))
                self._teardown(graceful=False)
            if self._ranks:
                return
            backend, mesh_device_type = _validate(self.config)
            for attempt in range(2):
                try:
                    self._start_ranks(backend, mesh_device_type)
                    break
                except ProbeFailure as exc:
                    decision = (p2p.after_failed_probe({**os.environ, **self.config.env}, self._p2p_env)
                                if backend == "nccl" else p2p.P2pDecision())
                    if attempt or not decision.env:
                        raise ProbeFailure("\n".join(filter(None, [str(exc), decision.reason])), rank=exc.rank,
                                           device=exc.device) from None
                    log.warning("mgpu: %s\n%s", exc, decision.reason)
                    self._p2p_off = True
            self._generation += 1

    def _start_ranks(self, backend: str, mesh_device_type: str) -> None:
        try:
            self._launch(backend, mesh_device_type)
            replies = self._gather("start-up", self.config.start_timeout_s)
        except BaseException:
            self._teardown(graceful=False)
            raise
        slowest = max(reply.get("probe_s", 0.0) for reply in replies.values())
        log.info("mgpu: %d %s ranks up; the start-up all-reduce was correct on every rank (%.1f ms on the slowest)",
                 self.world_size, backend, slowest * 1e3)

    def call(self, op: str, payload: dict | None = None, tensors: dict[str, torch.Tensor] | None = None,
             timeout: float | None = None, cancelled: Callable[[], bool] | None = None,
             generation: int | None = None) -> list[RankReply]:
        """Run ``op`` on every rank; one reply per rank in rank order. Raises RankFailure naming the rank(s).

        ``cancelled`` is polled while the ranks work (ComfyUI's interrupt flag): once it is true the ranks are asked
        to stop (ops that call ``RankContext.raise_if_cancelled`` stop at their next check, together) and the call
        raises CallCancelled within CANCEL_GRACE_S, tearing the pool down if they did not stop in time.
        ``generation``: the one the caller's models were loaded in. If the pool died or was rebuilt since, the call
        raises the RankFailure of that loss instead of running on fresh ranks that do not hold them (a rank that dies
        between two steps would otherwise turn into a missing-model error from the rebuilt pool)."""
        with self._lock:
            if generation is not None and (generation != self._generation or not self.alive):
                raise self._lost(op)
            self.start()
            packet = self._inputs.pack(tensors)
            self._calls += 1
            try:
                for r in self._ranks:
                    r.to_release += r.mapper.returned()
                message = dumps({"kind": "call", "op": op, "payload": payload or {}, "inputs": packet,
                                 "released": {r.rank: r.to_release for r in self._ranks},
                                 "dropped": self._dropped_inputs, "call": self._calls})
                for r in self._ranks:
                    r.to_release = []
                self._dropped_inputs = []
                replies = self._send_and_gather(op, message, self.config.call_timeout_s if timeout is None else timeout,
                                                cancelled)
            finally:
                if packet is not None and self._inputs is not None:   # the ranks only borrowed it
                    self._dropped_inputs += self._inputs.release([packet.path])
            return [RankReply(r.rank, replies[r.rank]["payload"],
                              r.mapper.lease(replies[r.rank]["outputs"]) if replies[r.rank]["outputs"] else {})
                    for r in self._ranks]

    def close(self) -> None:
        """Stop the ranks and remove every file of the pool. Idempotent; a later call() starts a new pool."""
        with self._lock:
            self._teardown(graceful=True)

    def kill_now(self) -> None:
        """Kill the ranks and delete the pool's files at once, without the lock: for a signal handler, when the
        process is about to end and a pool call may be in flight on another thread."""
        for r in list(self._ranks):
            if r.proc.poll() is None:
                r.proc.kill()
        for directory in list(self._dirs):
            shm.remove_private_dir(directory)

    # --- internals -------------------------------------------------------------------------------------------

    def _launch(self, backend: str, mesh_device_type: str) -> None:
        cfg = self.config
        for parent in (shm.shm_parent(), tempfile.gettempdir()):
            shm.sweep_stale(parent)
        work_dir = shm.private_dir(tempfile.gettempdir())            # logs, socket, store, spill segments
        self._dirs = [work_dir]
        segment_dirs = [work_dir]
        if shm.shm_parent() != tempfile.gettempdir():
            segment_dirs.insert(0, shm.private_dir(shm.shm_parent()))
            self._dirs.append(segment_dirs[0])
        self._inputs = shm.SegmentPool(segment_dirs)
        cancel_file = os.path.join(work_dir, "cancel")
        with open(cancel_file, "w+b") as f:
            f.write(bytes(8))
            f.flush()
            self._cancel_flag = mmap.mmap(f.fileno(), 8)
        channel = self._listen(work_dir)
        authkey = secrets.token_bytes(32)
        self._backend = backend
        self._collective_timeout = collective_timeout(cfg, backend)
        env = self._rank_env(backend, work_dir)
        self._p2p_env = {var: env[var] for var in p2p.USER_VARS if var in env}
        self._dump_prefix = flight_recorder.dump_prefix(env) if backend == "nccl" else None
        self._launched_at = time.time()
        for rank, device in enumerate(cfg.devices):
            log_path = os.path.join(work_dir, f"rank{rank}.log")
            argv = [sys.executable, "-m", "mgpu.ranks.rank", "--rank", str(rank), "--world-size", str(self.world_size),
                    "--device", device, "--backend", backend, "--mesh-device-type", mesh_device_type,
                    "--store-file", os.path.join(work_dir, "store"), "--cancel-file", cancel_file,
                    "--channel", channel, "--host-pid", str(os.getpid()),
                    "--store-timeout", str(max(cfg.start_timeout_s, cfg.call_timeout_s)),
                    "--collective-timeout", str(self._collective_timeout),
                    "--probe-timeout", str(cfg.probe_timeout_s),
                    "--segment-dirs", *segment_dirs, "--imports", *cfg.imports]
            with open(log_path, "wb") as log:
                proc = _popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                              cwd=work_dir)    # cwd lands on sys.path[0]: keep the caller's folder from shadowing
            self._ranks.append(_Rank(rank, device, proc, log_path))
            proc.stdin.write(authkey.hex().encode() + b"\n")
            proc.stdin.close()
        self._accept(authkey, time.monotonic() + cfg.start_timeout_s)

    def _listen(self, work_dir: str) -> str:
        path = os.path.join(work_dir, "channel")
        if hasattr(socket, "AF_UNIX") and len(path) < 100:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            address = f"unix:{path}"
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            address = f"tcp:127.0.0.1:{sock.getsockname()[1]}"
        sock.listen(self.world_size + 16)   # room for the ranks behind strangers being turned away
        self._listener = sock
        return address

    def _rank_env(self, backend: str, work_dir: str | None = None) -> dict[str, str]:
        """The ranks' environment. On NCCL: the P2P decision (and the fallback after a failed start-up check), the
        /dev/shm check, and, given the pool's ``work_dir``, the flight recorder dumping there."""
        cfg = self.config
        package_parent = str(Path(__file__).resolve().parents[2])   # the folder that contains mgpu/
        env = {**os.environ, **cfg.env}
        # extra paths first: the pack root beside mgpu/ holds a `nodes` package that would shadow ComfyUI's nodes.py
        paths = [*cfg.extra_sys_path, package_parent, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["PYTHONUNBUFFERED"] = "1"          # the log tail we report must be current when a rank dies
        cpu_ranks = sum(d == "cpu" for d in cfg.devices)
        if cpu_ranks:  # cpu ranks share the host's cores: N ranks x all-cores threads thrash
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cpu_ranks)))
        for var in ALLOC_CONF_VARS:
            env.pop(var, None)
        env.update(_alloc_env(env, cfg.env))
        interface = _loopback_interface()
        if interface:   # over the host's own setting too (meant for other jobs): ranks never talk off this machine
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                env[var] = cfg.env.get(var, interface)
        self._env_note = None
        if backend == "nccl":
            decision = p2p.decide(live_gpus(), cfg.devices, env)
            if decision.reason:
                log.warning(decision.reason)
            env.update(decision.env)
            if self._p2p_off:
                env.pop("NCCL_P2P_LEVEL", None)
                env.update(p2p.OFF)
            if p2p.uses_shm(env):
                self._env_note = p2p.shm_warning(p2p.shm_space(), self.world_size)
                if self._env_note:
                    log.warning("mgpu: %s", self._env_note)
            if work_dir is not None:
                env.update(flight_recorder.rank_env(work_dir, env))
        return env

    def _accept(self, authkey: bytes, deadline: float) -> None:
        """Take one authenticated connection per rank, noticing ranks that die before connecting. Anyone else who
        connects (the TCP fallback is open to every local user) is dropped within HANDSHAKE_TIMEOUT_S."""
        pending = {r.rank for r in self._ranks}
        while pending:
            self._raise_if_dead("start-up", pending)
            if time.monotonic() > deadline:
                raise self._timeout_failure("start-up", sorted(pending), self.config.start_timeout_s)
            self._listener.settimeout(POLL_S)
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            limit = max(POLL_S, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic()))
            accepted = _handshake(sock, authkey, pending, limit)
            if accepted is not None:
                rank, conn = accepted
                self._ranks[rank].conn = conn
                pending.discard(rank)

    def _raise_if_dead(self, op: str, ranks: set[int]) -> None:
        for rank in sorted(ranks):
            if _exited(self._ranks[rank]):
                raise self._death_failure(op, rank)

    def _send_and_gather(self, op: str, message: bytes, timeout_s: float,
                         cancelled: Callable[[], bool] | None = None) -> dict[int, dict]:
        """Anything unexpected here (an interrupt, a garbled message) leaves the ranks out of step with us: their
        next reply would answer the wrong call. So it tears the pool down like a failure does."""
        try:
            for r in self._ranks:
                try:
                    r.conn.send_bytes(message)
                except OSError:
                    pass              # a dead rank: _gather reports it with its exit status
            return self._gather(op, timeout_s, cancelled)
        except (RankFailure, CallCancelled):
            raise
        except BaseException:
            self._teardown(graceful=False)
            raise

    def _gather(self, op: str, timeout_s: float, cancelled: Callable[[], bool] | None = None) -> dict[int, dict]:
        """One message per rank. Stops early on a death, ``error_grace_s`` after the first error, or
        CANCEL_GRACE_S after ``cancelled()`` turned true."""
        by_conn = {r.conn: r.rank for r in self._ranks}
        replies: dict[int, dict] = {}
        errors: list[int] = []           # in arrival order: the first is most likely the cause
        dead: list[int] = []
        stop = time.monotonic() + timeout_s
        cancel_sent = False
        while len(replies) < self.world_size and not dead and time.monotonic() < stop:
            if cancelled is not None and not cancel_sent and cancelled():
                self._cancel_flag[:8] = self._calls.to_bytes(8, "little")
                cancel_sent = True
                stop = min(stop, time.monotonic() + CANCEL_GRACE_S)
            waiting = [r for r in self._ranks if r.rank not in replies]
            for conn in wait([r.conn for r in waiting], timeout=max(0.0, min(POLL_S, stop - time.monotonic()))):
                rank = by_conn[conn]
                try:
                    replies[rank] = recv(conn)
                except (EOFError, OSError):
                    dead.append(rank)
                    continue
                self._ranks[rank].mapper.forget(replies[rank].get("dropped", ()))
                if replies[rank]["kind"] == "error":
                    errors.append(rank)
                    stop = min(stop, time.monotonic() + self.config.error_grace_s)
            dead += [r.rank for r in waiting if r.rank not in replies and r.rank not in dead
                     and _exited(r)]
        missing = [r.rank for r in self._ranks if r.rank not in replies and r.rank not in dead]
        if not (errors or dead or missing):
            return replies
        if cancel_sent:
            raise self._cancel_failure(op, errors, replies, missing + dead)
        if op == "start-up" and any(replies[rank].get("probe") for rank in errors):
            raise self._probe_failure(errors, replies, missing + dead)
        # Every rank answered: keeps_pool decides by backend (a failed start-up is torn down by start)
        in_step = len({replies[rank].get("collectives") for rank in errors} - {None}) <= 1
        kept = (not (dead or missing) and op != "start-up"
                and keeps_pool(self._backend, [reply_kind(reply) for reply in replies.values()], in_step))
        if dead:
            failure = self._death_failure(op, dead[0])
        elif errors:
            failure = self._error_failure(op, errors, replies, missing, kept)
        else:
            failure = self._timeout_failure(op, missing, timeout_s)
        if not kept:
            self._teardown(graceful=False)
        raise failure

    def _lost(self, op: str) -> RankFailure:
        """What a call for models of an older generation gets: the death of the rank that ended it (the pool is torn
        down, so the next use rebuilds it), or word that the pool was rebuilt or closed since they were loaded."""
        dead = [r.rank for r in self._ranks if _exited(r)]
        if dead:
            failure = self._death_failure(op, dead[0])
            self._teardown(graceful=False)
            return failure
        return RankFailure(f"{op!r} was for models loaded on ranks that have since been restarted or closed (after a "
                           "rank failure or a cancelled call); they are loaded again on next use")

    def _death_failure(self, op: str | None, rank: int) -> RankFailure:
        """``op`` None: it died between calls."""
        r = self._ranks[rank]
        try:
            returncode = r.proc.wait(timeout=KILL_GRACE_S)   # it closed its channel: it is exiting
        except subprocess.TimeoutExpired:
            returncode = None
        sig = _signal_name(returncode)
        found = self._flight_verdict()
        if sig == "SIGKILL":
            how = "was killed by SIGKILL (the kernel's OOM killer, or another process)"
        elif sig == "SIGABRT" and found is not None:
            how = (f"was stopped by NCCL's watchdog (SIGABRT) when a collective outlived the ranks' collective timeout "
                   f"of {self._collective_timeout:g}s")
        elif sig:
            how = f"was killed by {sig}"
        elif returncode is None:
            how = "closed its channel"
        else:
            how = f"exited with code {returncode}"
        tail = _tail(r.log_path) or "(the rank logged nothing)"
        when = f"during {op!r}" if op else "while idle"
        verdict = f"\n{found.text}" if found is not None else ""
        return RankFailure(f"rank {rank} ({r.device}, pid {r.proc.pid}) {how} {when}; the pool was shut down and "
                           f"restarts on next use (reload what it held).{verdict}{self._note()}\n"
                           f"--- end of rank {rank} log ---\n{tail}",
                           rank=rank, device=r.device, exitcode=returncode, signal=sig, traceback=tail)

    def _flight_verdict(self) -> flight_recorder.Verdict | None:
        """On NCCL, the verdict of the flight-recorder dumps the ranks wrote since they started (None: none, e.g.
        the watchdog did not fire). Once one dump exists the others get FR_DUMP_WAIT_S to appear."""
        if self._backend != "nccl" or not self._dump_prefix:
            return None
        deadline = time.monotonic() + FR_DUMP_WAIT_S
        dumps, unreadable = flight_recorder.read_dumps(self._dump_prefix, self._launched_at)
        while dumps and len(dumps) + len(unreadable) < self.world_size and time.monotonic() < deadline:
            time.sleep(POLL_S)
            dumps, unreadable = flight_recorder.read_dumps(self._dump_prefix, self._launched_at)
        found = flight_recorder.verdict(dumps, self.world_size)
        if unreadable:
            text = (found.text + "; " if found else "") + "unreadable dumps: " + "; ".join(unreadable)
            found = flight_recorder.Verdict(found.culprits if found else [], text)
        return found

    def _flight_text(self) -> str:
        found = self._flight_verdict()
        return f".\n{found.text}" if found is not None else ""

    def _note(self) -> str:
        return f"\n{self._env_note}" if self._env_note else ""

    def _probe_failure(self, errors: list[int], replies: dict[int, dict], unanswered: list[int]) -> ProbeFailure:
        """The start-up check failed: the ranks whose contribution arrived wrong, else those that never answered,
        else the first that raised, and each rank's own account."""
        probes = {rank: replies[rank].get("probe") or {} for rank in errors}
        bad = sorted({b for p in probes.values() for b in p.get("bad", ())})
        timed_out = [rank for rank, p in probes.items() if p.get("outcome") == "timeout"]
        if bad:
            lead = f"the contribution of rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))} arrived wrong"
        elif timed_out:
            lead = f"it did not finish within {self.config.probe_timeout_s:g}s"
        else:
            lead = "it raised"
        busy = [rank for rank in timed_out if not probes[rank].get("waiting")]   # not waiting for the others
        culprit = (bad or unanswered or busy or errors)[0]
        lines = [f"rank {rank} ({self._ranks[rank].device}): {replies[rank]['error']}" for rank in errors]
        lines += [f"rank {rank} ({self._ranks[rank].device}) did not answer" for rank in unanswered]
        return ProbeFailure(f"the ranks' start-up check (one all-reduce of a known tensor over {self.world_size} "
                            f"ranks on {self._backend}) failed: {lead}; the ranks were shut down.\n"
                            + "\n".join(lines) + self._note(),
                            rank=culprit, device=self._ranks[culprit].device)

    def _error_failure(self, op: str, errors: list[int], replies: dict[int, dict], missing: list[int],
                       kept: bool) -> RankFailure:
        """The first rank's error, the others', and the pool's fate. When every rank that raised refused its input
        (one of our own errors), the message leads with the first refusal, which says what to do."""
        first = self._ranks[errors[0]]
        reply = replies[first.rank]
        refusals = [replies[rank].get("refusal") for rank in errors]
        refusal = refusals[0] if None not in refusals else None
        how = "refused" if refusal is not None else f"raised {reply['error']} in"
        text = f"rank {first.rank} ({first.device}) {how} {op!r}" + self._other_errors(errors, replies)
        if missing:
            text += (f". Ranks {missing} were still busy {self.config.error_grace_s:g}s later (likely stuck in a "
                     "collective): the pool was shut down and restarts on next use")
        elif len(errors) < self.world_size:
            text += ". Other ranks succeeded, so the ranks may disagree: the pool was shut down and restarts on next use"
        elif kept:
            text += ". Every rank raised, so none is stuck: the pool stays up with the models it holds"
        elif self._backend == "nccl" and op != "start-up":
            text += (". On NCCL a rank that raised may have left a collective queued on its GPU that the others never "
                     "match (only refusals of the input on every rank, or a Cancel, leave the ranks in step): the "
                     "pool was shut down and restarts on next use")
        else:
            text += ". The pool was shut down and restarts on next use"
        if missing:
            text += self._flight_text()
        if refusal is not None:
            text = f"{refusal}\n{text}"
        return RankFailure(f"{text}\n--- rank {first.rank} traceback ---\n{reply['traceback']}",
                           rank=first.rank, device=first.device, traceback=reply["traceback"], refusal=refusal,
                           pool_kept=kept)

    def _other_errors(self, errors: list[int], replies: dict[int, dict]) -> str:
        """The errors of the ranks after the first: those that raised the first's error by rank only."""
        first = replies[errors[0]]["error"]
        same = [str(rank) for rank in errors[1:] if replies[rank]["error"] == first]
        other = [f"rank {rank} ({self._ranks[rank].device}): {replies[rank]['error']}" for rank in errors[1:]
                 if replies[rank]["error"] != first]
        return ((f"; rank{'s' if len(same) > 1 else ''} {', '.join(same)} the same" if same else "")
                + ("; also " + "; ".join(other) if other else ""))

    def _cancel_failure(self, op: str, errors: list[int], replies: dict[int, dict], unanswered: list[int]) -> MgpuError:
        """A cancelled call: every rank stopped together (the pool stays), or some did not and the pool goes. An
        error that is not the cancellation is still reported as the failure it is."""
        real = [rank for rank in errors if not replies[rank].get("cancelled")]
        if real:
            self._teardown(graceful=False)
            return self._error_failure(op, real, replies, unanswered, kept=False)
        if not unanswered:
            return CallCancelled(f"{op!r} cancelled: every rank stopped at its next check; the models stay loaded",
                                 pool_kept=True)
        culprits, report = self._diagnose(unanswered)
        self._teardown(graceful=False)
        names = ", ".join(f"{rank} ({self.config.devices[rank]})" for rank in culprits)
        return CallCancelled(f"{op!r} cancelled: rank{'s' if len(culprits) > 1 else ''} {names} did not stop within "
                             f"{CANCEL_GRACE_S:g}s, so the pool was shut down; it restarts and reloads its models on "
                             f"next use.\n{report}", pool_kept=False)

    def _timeout_failure(self, op: str, missing: list[int], seconds: float) -> RankFailure:
        """Name the rank(s) that hang, not the ones waiting for them in a collective, with where each one is."""
        culprits, report = self._diagnose(missing)
        found = self._flight_verdict()
        if found is not None:
            culprits = found.culprits or culprits
            report = f"{found.text}\n{report}"
        names = ", ".join(f"{rank} ({self._ranks[rank].device})" for rank in culprits)
        return RankFailure(f"rank{'s' if len(culprits) > 1 else ''} {names} did not answer {op!r} within "
                           f"{seconds:g}s; the pool was shut down and restarts on next use.{self._note()}\n{report}",
                           rank=culprits[0], device=self._ranks[culprits[0]].device)

    def _diagnose(self, silent: list[int]) -> tuple[list[int], str]:
        """Which of the ``silent`` ranks hang, and a report of each with its log tail.

        Each is asked for its stacks (faulthandler on SIGUSR1). One that is waiting in a torch.distributed
        collective is waiting for another rank; one that is stopped, or cannot even dump its stacks (stuck outside
        Python, e.g. in a GPU call), or is busy elsewhere, is the one that hangs."""
        sizes = {rank: _size(self._ranks[rank].log_path) for rank in silent}
        if hasattr(signal, "SIGUSR1"):
            for rank in silent:
                if self._ranks[rank].proc.poll() is None:
                    self._ranks[rank].proc.send_signal(signal.SIGUSR1)
            time.sleep(STACK_DUMP_WAIT_S)
        culprits, lines, logs = [], [], []
        for rank in silent:
            r = self._ranks[rank]
            dump = _read_from(r.log_path, sizes[rank])
            try:
                stopped = psutil.Process(r.proc.pid).status() == psutil.STATUS_STOPPED
            except psutil.NoSuchProcess:
                stopped = False
            if stopped:
                state = "is stopped (SIGSTOP, or a debugger holds it)"
            elif not dump.strip():
                state = "did not even dump its stacks: stuck outside Python (e.g. in a GPU call or a driver)"
            elif "torch/distributed" in dump:
                state = "was waiting for the other ranks in a collective"
            else:
                state = "was busy in its op"
            if state != "was waiting for the other ranks in a collective":
                culprits.append(rank)
            lines.append(f"rank {rank} ({r.device}, pid {r.proc.pid}) {state}")
            logs.append(f"--- end of rank {rank} log ---\n{_tail(r.log_path) or '(the rank logged nothing)'}")
        return culprits or list(silent), "\n".join(lines + logs)

    def _teardown(self, graceful: bool) -> None:
        """Stop every rank (ask, then SIGTERM, then SIGKILL) and delete the pool's files. Safe to repeat."""
        ranks, self._ranks = self._ranks, []
        if graceful:
            for r in ranks:
                if r.conn is not None and r.proc.poll() is None:
                    try:
                        r.conn.send_bytes(dumps({"kind": "shutdown"}))
                    except OSError:
                        pass
            _wait_exit(ranks, SHUTDOWN_GRACE_S)
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.terminate()
        _wait_exit(ranks, KILL_GRACE_S)
        for r in ranks:
            if r.proc.poll() is None:
                r.proc.kill()
        _reap(ranks, REAP_TIMEOUT_S)
        for r in ranks:
            if r.conn is not None:
                r.conn.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._inputs is not None:
            self._inputs.close()
            self._inputs = None
        if self._cancel_flag is not None:
            self._cancel_flag.close()
            self._cancel_flag = None
        self._dropped_inputs = []
        for directory in self._dirs:
            shm.remove_private_dir(directory)
        self._dirs = []


def _handshake(sock: socket.socket, authkey: bytes, pending: set[int],
               seconds: float) -> tuple[int, Connection] | None:
    """(rank, channel) of a connection that proves it holds ``authkey`` and says hello as a pending rank within
    ``seconds``; anything else is closed, logged, and None."""
    sock.setblocking(True)
    _set_io_timeout(sock.fileno(), seconds)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        hello = recv(conn)
        rank = hello["rank"] if isinstance(hello, dict) and hello.get("kind") == "hello" else None
        if rank not in pending:
            raise ValueError(f"unexpected first message {hello!r}")
    except (AuthenticationError, OSError, EOFError, ValueError) as exc:
        why = "silent" if isinstance(exc, BlockingIOError) else f"{type(exc).__name__}: {exc}"   # SO_RCVTIMEO
        log.warning("mgpu: dropped a connection to the rank channel that did not authenticate as a rank within "
                    "%gs (%s); start-up goes on", seconds, why)
        conn.close()
        return None
    _set_io_timeout(conn.fileno(), 0)
    return rank, conn


def _exited(r: _Rank) -> bool:
    """Whether a rank process has ended. ``Popen.poll()`` answers "running" while another thread is inside
    ``wait()`` on the same process, so a zombie (dead, not yet reaped) also counts as ended."""
    if r.proc.poll() is not None:
        return True
    try:
        return psutil.Process(r.proc.pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _reap(ranks: list[_Rank], seconds: float) -> None:
    """Wait for killed ranks, ``seconds`` for all together. One still there is stuck in the kernel (state D: a GPU
    driver after an Xid, a hung NFS read), where SIGKILL waits for the call to return: it is logged and given up,
    because waiting would hang every later call on the pool's lock, and the host's exit."""
    deadline = time.monotonic() + seconds
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("mgpu: rank %d (%s, pid %d) did not exit %gs after SIGKILL: it is stuck in the kernel (e.g. the "
                      "GPU driver after an Xid error; see dmesg) and was given up. Its GPU memory may stay taken "
                      "until the process ends or the driver is reset (nvidia-smi lists the pid).", r.rank, r.device,
                      r.proc.pid, seconds)


def _wait_exit(ranks: list[_Rank], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(r.proc.poll() is None for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.02)


_live_pools: weakref.WeakSet[RankPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Ranks must not outlive the host; PDEATHSIG and the rank watchdog cover a host that dies without atexit."""
    for pool in list(_live_pools):
        pool.close()


def sweep_stale_dirs() -> list[str]:
    """Remove the private directories (shared-memory segments, logs) of hosts that died without cleaning up, e.g.
    a ComfyUI killed with SIGKILL. Cheap; ComfyUI calls it when the pack loads."""
    return [d for parent in dict.fromkeys((shm.shm_parent(), tempfile.gettempdir())) for d in shm.sweep_stale(parent)]


def clean_up_on_sigterm() -> bool:
    """On SIGTERM (how service managers and Ctrl+C in some shells stop ComfyUI), kill the ranks and delete the pools'
    shared memory and directories before the process ends, then let the signal do what it did before. Python's
    default SIGTERM ends the process without running atexit, which left /dev/shm segments behind.

    The handler takes no lock (a pool call may hold one in another thread): it only kills processes and removes
    files. Installs from the main thread only; returns whether it did."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "mgpu_cleanup", False):
        return True

    def on_sigterm(signum, frame) -> None:
        for pool in list(_live_pools):
            pool.kill_now()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    on_sigterm.mgpu_cleanup = True
    signal.signal(signal.SIGTERM, on_sigterm)
    return True
