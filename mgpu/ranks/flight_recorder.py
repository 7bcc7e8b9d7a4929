"""NCCL's flight recorder on the ranks, and the host's verdict from its dumps.

On NCCL a collective that waits for a rank that never joins does not block the waiting rank's CPU: the host's stack
dumps (``RankPool._diagnose``) then find every rank "busy" and cannot tell who hangs. ProcessGroupNCCL's watchdog
can: when a collective outlives the ranks' collective timeout it writes the flight recorder of every rank (a
coordinated dump through the store), then aborts the rank. Each dump holds, per process group, the sequence number
of the last collective the rank queued, started and completed; the rank whose number lags never joined.

Variables (the same in torch 2.11 and 2.13, read from their libtorch_cpu / libtorch_cuda and FlightRecorder.hpp):
``TORCH_FR_BUFFER_SIZE`` (entries kept; ``TORCH_NCCL_TRACE_BUFFER_SIZE``, its deprecated name, is read too and makes
2.13 warn on every rank), ``TORCH_NCCL_DUMP_ON_TIMEOUT``,
``TORCH_FR_DUMP_TEMP_FILE`` (file prefix, the global rank appended; ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` is its old
name, read second). Defaults there: 2000 entries, dump on, prefix ``~/.cache/torch/comm_lib_trace_rank_``. The pool
sets them explicitly (so the dumps land in its private 0700 directory); a value the user set wins.

The file is a pickle (``FlightRecorder::dump`` -> ``pickle_str``, torch's own C++ pickler of a dict of str / int /
float / bool / None / lists / tuples; no JSON writer for this file exists in 2.11 or 2.13, only in-process
``_dump_nccl_trace_json``). It is read with an Unpickler that refuses every global, so it can build only those plain
types and never runs code; acceptable because the file was written by our own ranks into our own 0700 directory (or
where the user pointed the prefix), and a file that needs anything else is reported as unreadable, never loaded.
"""

from __future__ import annotations

import glob
import io
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass

BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DUMP_VAR = "TORCH_NCCL_DUMP_ON_TIMEOUT"
BUFFER_SIZE = "2000"           # torch's own default; set so a build or site default of 0 does not switch it off
FILE_STEM = "nccl_trace_rank_"
MAX_DUMP_BYTES = 64 * 2**20    # 2000 entries with stacks are a few MB


def rank_env(work_dir: str, env: Mapping[str, str]) -> dict[str, str]:
    """What the NCCL ranks' environment gets: the recorder on, dumping on timeout into ``work_dir``."""
    out = {} if any(v in env for v in BUFFER_VARS) else {"TORCH_FR_BUFFER_SIZE": BUFFER_SIZE}   # the other: deprecated
    if DUMP_VAR not in env:
        out[DUMP_VAR] = "1"
    if not any(v in env for v in PREFIX_VARS):
        out["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(work_dir, FILE_STEM)
    return out


def dump_prefix(env: Mapping[str, str]) -> str | None:
    return next((env[v] for v in PREFIX_VARS if env.get(v)), None)


class _PlainUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings, numbers, booleans and None; refuses every global (class, function)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"the dump names {module}.{name}; only plain data is read")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("the dump holds a persistent reference; only plain data is read")


def loads_plain(data: bytes) -> object:
    return _PlainUnpickler(io.BytesIO(data)).load()


def read_dumps(prefix: str, since: float) -> tuple[dict[int, dict], list[str]]:
    """The dumps ``<prefix><rank>`` written at or after ``since`` (time.time()), by rank, and the files that could
    not be read (with why)."""
    dumps, unreadable = {}, []
    for path in glob.glob(glob.escape(prefix) + "[0-9]*"):
        suffix = path[len(prefix):]
        try:
            if not suffix.isdigit() or os.path.getmtime(path) < since:
                continue
            if os.path.getsize(path) > MAX_DUMP_BYTES:
                raise ValueError(f"over {MAX_DUMP_BYTES >> 20} MiB")
            with open(path, "rb") as f:
                dump = loads_plain(f.read())
            if not isinstance(dump, dict):
                raise ValueError(f"a {type(dump).__name__}, not a dict")
        except (OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:
            unreadable.append(f"{path}: {exc}")
            continue
        dumps[int(suffix)] = dump
    return dumps, unreadable


@dataclass(frozen=True)
class Verdict:
    """``culprits``: the ranks that hang (empty when the dumps single out none); ``text``: one paragraph."""
    culprits: list[int]
    text: str


def _status(dump: dict) -> dict[str, tuple[int, int, int]]:
    """pg id -> (last enqueued, started, completed collective sequence number)."""
    out = {}
    for pg, s in (dump.get("pg_status") or {}).items():
        if isinstance(s, dict):
            out[str(pg)] = tuple(int(s.get(k, -1)) for k in ("last_enqueued_collective", "last_started_collective",
                                                              "last_completed_collective"))
    return out


def _collective(dumps: dict[int, dict], pg: str, seq: int) -> str:
    """What collective ``seq`` of group ``pg`` was (its profiling name and group description), from any dump."""
    for dump in dumps.values():
        for e in dump.get("entries") or ():
            if str(e.get("pg_id")) == pg and e.get("collective_seq_id") == seq and not e.get("is_p2p"):
                group = e.get("process_group")
                desc = group[1] if isinstance(group, (list, tuple)) and len(group) > 1 else ""
                return f"#{seq} {e.get('profiling_name', '?')}" + (f" of group {pg} ({desc})" if desc else
                                                                 f" of group {pg}")
    return f"#{seq} of group {pg}"


def _names(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def verdict(dumps: dict[int, dict], world_size: int) -> Verdict | None:
    """Which rank hangs, from the ranks' dumps: in the first process group where they disagree, the ranks whose last
    queued collective lags the others' never joined; if all queued the same one, those that did not complete it are
    stuck on their GPU; if none completed it, the collective itself hangs (the interconnect, not a rank). None when
    there are no dumps (the watchdog did not fire)."""
    if not dumps:
        return None
    status = {rank: _status(d) for rank, d in sorted(dumps.items())}
    silent = [r for r in range(world_size) if r not in dumps]
    note = f" ({_names(silent)} wrote no dump)" if silent else ""
    for pg in sorted({pg for s in status.values() for pg in s}, key=lambda p: (len(p), p)):
        seen = {rank: s[pg] for rank, s in status.items() if pg in s}
        last = max(enq for enq, _, _ in seen.values())
        lagging = [rank for rank, (enq, _, _) in seen.items() if enq < last]
        if lagging:
            ahead = [rank for rank in seen if rank not in lagging]
            behind = ", ".join(f"rank {rank} at #{seen[rank][0]}" for rank in lagging)
            return Verdict(lagging, f"NCCL's flight recorder: {_names(ahead)} queued collective "
                                    f"{_collective(dumps, pg, last)}, {behind}: {_names(lagging)} never joined it, "
                                    f"so the hang is there{note}")
        stuck = [rank for rank, (_, _, done) in seen.items() if done < last]
        if stuck and len(stuck) < len(seen):
            return Verdict(stuck, f"NCCL's flight recorder: every rank queued collective {_collective(dumps, pg, last)}"
                                  f"; {_names(stuck)} did not complete it while the others did: stuck on "
                                  f"{'their GPUs' if len(stuck) > 1 else 'its GPU'}{note}")
        if stuck:
            return Verdict([], f"NCCL's flight recorder: every rank queued collective {_collective(dumps, pg, last)} "
                               "and none completed it: the transfer itself hangs between the GPUs (a peer-to-peer "
                               "path that NVML reports but that does not work, PCIe ACS/IOMMU): try NCCL_P2P_DISABLE=1"
                               f"{note}")
    if silent:
        return Verdict(silent, f"NCCL's flight recorder: the ranks that dumped agree on every collective; "
                               f"{_names(silent)} wrote no dump")
    return Verdict([], "NCCL's flight recorder: every rank queued and completed the same collectives")
