"""Shared-memory tensor transport between the host and its ranks: tensor bytes never go through the pipe.

A segment is a file in a private 0700 directory under /dev/shm, mmapped by both sides. Not
``multiprocessing.shared_memory``: before Python 3.13 every process that attaches registers the segment with its own
resource tracker, which unlinks it (with a "leaked" warning) when that process exits, so a rank exiting would destroy
the host's segment. One private directory per pool also makes cleanup a single rmtree, and lets a later pool sweep
the directory of a host that was SIGKILLed (nothing runs in the host then).

Sampling sends a latent every step, so in steady state a tensor is copied once (into a segment already mapped by
both sides) and nothing is created, mapped or faulted in again. A sender packs tensors into a segment from its
``SegmentPool``; the receiver maps each segment once and keeps the mapping. The host *leases* what a
rank returns: its tensors are zero-copy views of the rank's segment, and the segment goes back to the rank (message
field ``released``) only once every one of those tensors is gone. The ranks only borrow the host's inputs for the
length of a call. Free segments are reused; past ``MAX_FREE`` or ``KEEP_BYTES`` they are unlinked and the peer is told
(field ``dropped``) so it unmaps them too, and one big transfer does not pin RAM for the life of the pool.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import MgpuError

try:
    import fcntl
except ImportError:           # Windows: the pack must still import there; the rank pool refuses to start
    fcntl = None

ALIGN = 64                    # every tensor starts on a cache line (and at any dtype's alignment)
MIN_SEGMENT = 1 << 20
KEEP_BYTES = 256 << 20        # a free segment larger than this is unlinked rather than kept for reuse
MAX_FREE = 4
_DIR_RE = re.compile(r"^mgpu-(\d+)-")


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in a segment. Plain data: it crosses the channel."""
    name: str
    dtype: str                 # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Packet:
    """A set of tensors written to one segment."""
    path: str
    size: int
    tensors: tuple[TensorMeta, ...]


def shm_parent() -> str:
    """/dev/shm where it exists (RAM, never written to disk), else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


LOCK_NAME = ".owner.lock"
_HELD_LOCKS: dict[str, int] = {}   # directory -> lock fd; the kernel drops the flock if this process dies


def private_dir(parent: str) -> str:
    """A 0700 directory of this process, with a lock file it holds an flock on while it lives: ``sweep_stale``
    can then tell a live owner from a dead one, also across PID namespaces sharing /dev/shm or /tmp."""
    path = tempfile.mkdtemp(prefix=f"mgpu-{os.getpid()}-", dir=parent)
    fd = os.open(os.path.join(path, LOCK_NAME), os.O_CREAT | os.O_RDWR, 0o600)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    _HELD_LOCKS[path] = fd
    return path


def remove_private_dir(path: str) -> None:
    """Delete a directory made by ``private_dir`` and let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _HELD_LOCKS.pop(path, None)
    if fd is not None:
        os.close(fd)


def _owner_alive(path: str) -> bool:
    """Whether the directory's owner still holds its lock (a directory without a lock file is left alone)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def sweep_stale(parent: str) -> list[str]:
    """Remove our private directories whose owning process is gone (a host killed before it could clean up).
    Without flock a live owner cannot be told from a dead one, so nothing is removed."""
    removed = []
    if fcntl is None:
        return removed
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = _DIR_RE.match(entry.name)
        if not match or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            mine = entry.stat(follow_symlinks=False).st_uid == os.getuid()
        except OSError:
            continue
        if mine and not _owner_alive(entry.path):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown tensor dtype {name!r}")
    return dtype


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _create(dirs: Sequence[str], size: int) -> str:
    """A new segment file in the first directory with room. Allocating up front turns a full /dev/shm into ENOSPC
    here instead of a SIGBUS when a page is first written."""
    for directory in dirs:
        path = os.path.join(directory, f"seg-{secrets.token_hex(8)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            _allocate(fd, size)
        except OSError as exc:
            os.unlink(path)
            if exc.errno == errno.ENOSPC:
                continue
            raise
        finally:
            os.close(fd)
        return path
    raise MgpuError(f"no room for a {size / 2**20:.0f} MiB shared-memory segment in {', '.join(dirs)}; free memory "
                    "or disk space there (in Docker, raise --shm-size)")


def _allocate(fd: int, size: int) -> None:
    if hasattr(os, "posix_fallocate"):        # not on macOS / Windows
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:                 # a filesystem without fallocate: fall back to a sparse file
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    os.ftruncate(fd, size)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _views(buf: mmap.mmap, packet: Packet) -> dict[str, torch.Tensor]:
    """Tensors over ``buf``; they share one fresh storage, so a weak reference to it tells when all are gone."""
    data = torch.frombuffer(buf, dtype=torch.uint8, count=packet.size)
    return {m.name: data[m.offset:m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape) for m in packet.tensors}


def layout(tensors: dict[str, torch.Tensor]) -> tuple[tuple[TensorMeta, ...], int]:
    """Offsets of each tensor in a packed segment, and the total size."""
    metas, offset = [], 0
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"tensor {name!r}: expected a dense torch.Tensor, got {type(tensor).__name__}")
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += _round_up(nbytes, ALIGN)
    return tuple(metas), max(offset, ALIGN)


class SegmentPool:
    """The sending side: segments this process created, each either lent to the peer or free for reuse."""

    def __init__(self, dirs: Sequence[str]):
        self.dirs = list(dirs)
        self._data: dict[str, torch.Tensor] = {}    # path -> uint8 view of the whole mapping
        self._free: list[str] = []                  # oldest first

    def pack(self, tensors: dict[str, torch.Tensor] | None) -> Packet | None:
        """Copy ``tensors`` (any device, any strides) into a segment, lent until ``release``; None if empty."""
        if not tensors:
            return None
        metas, size = layout(tensors)
        fitting = [p for p in self._free if self._data[p].numel() >= size]
        if fitting:
            path = min(fitting, key=lambda p: self._data[p].numel())
            self._free.remove(path)
        else:
            capacity = _round_up(size, MIN_SEGMENT)
            path = _create(self.dirs, capacity)
            self._data[path] = torch.frombuffer(_map(path, capacity), dtype=torch.uint8)
        packet = Packet(path, self._data[path].numel(), metas)
        data = self._data[path]
        with torch.no_grad():
            for meta, tensor in zip(metas, tensors.values()):
                data[meta.offset:meta.offset + meta.nbytes].view(_dtype(meta.dtype)).view(meta.shape).copy_(tensor)
        return packet

    def release(self, paths: Sequence[str]) -> list[str]:
        """The peer is done with these; returns the paths unlinked instead of kept (tell the peer to unmap)."""
        for path in paths:
            if path in self._data and path not in self._free:
                self._free.append(path)
        big = [p for p in self._free if self._data[p].numel() > KEEP_BYTES]
        rest = [p for p in self._free if p not in big]
        dropped = big + rest[:max(0, len(rest) - MAX_FREE)]
        for path in dropped:
            self._free.remove(path)
            del self._data[path]
            _unlink(path)
        return dropped

    def close(self) -> None:
        for path in self._data:
            _unlink(path)
        self._data.clear()
        self._free.clear()


class Mapper:
    """The receiving side: maps the peer's segments once and keeps them mapped until the peer drops them."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._leases: dict[str, StorageWeakRef] = {}

    def _buffer(self, packet: Packet) -> mmap.mmap:
        if packet.path not in self._maps:
            self._maps[packet.path] = _map(packet.path, packet.size)
        return self._maps[packet.path]

    def borrow(self, packet: Packet) -> dict[str, torch.Tensor]:
        """Views valid until the peer reuses the segment, i.e. for the current call (a rank reading inputs)."""
        return _views(self._buffer(packet), packet)

    def lease(self, packet: Packet) -> dict[str, torch.Tensor]:
        """Zero-copy tensors the caller keeps (the host): the segment is not reused while any of them lives."""
        views = _views(self._buffer(packet), packet)
        self._leases[packet.path] = StorageWeakRef(next(iter(views.values())).untyped_storage())
        return views

    def returned(self) -> list[str]:
        """Leased segments whose tensors are all gone: the peer may reuse them."""
        done = [path for path, ref in self._leases.items() if ref.expired()]
        for path in done:
            del self._leases[path]
        return done

    def forget(self, paths: Sequence[str]) -> None:
        """The peer unlinked these: unmap (live tensors keep their own reference to the mapping)."""
        for path in paths:
            self._maps.pop(path, None)
            self._leases.pop(path, None)
