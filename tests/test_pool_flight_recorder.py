"""The verdict from NCCL flight-recorder dumps, and reading them without running code.

The dumps are built in the format of torch's ``FlightRecorder::dump`` (torch/csrc/distributed/c10d/
FlightRecorderDetail.hpp, 2.11 and 2.13): a protocol-2 pickle of {version, pg_config, comm_lib_version, pg_status
{pg id: last_enqueued/started/completed_collective}, entries [{record_id, pg_id, process_group (name, desc),
collective_seq_id, p2p_seq_id, op_id, profiling_name, ..., state, retired, timeout_ms, is_p2p}]}.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch

from mgpu.ranks import flight_recorder as fr


def entry(seq: int, state: str, pg: int = 0, name: str = "nccl:all_to_all", desc: str = "default_pg") -> dict:
    return {"record_id": seq, "pg_id": pg, "process_group": (str(pg), desc), "thread_name": "pt_main_thread",
            "thread_id": "1", "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": name,
            "time_created_ns": 1, "input_sizes": [[4, 8]], "input_dtypes": ["BFloat16"], "output_sizes": [[4, 8]],
            "output_dtypes": ["BFloat16"], "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 240000,
            "is_p2p": False}


def dump(status: dict[int, tuple[int, int, int]], entries: list[dict]) -> dict:
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}},
            "comm_lib_version": "2.27.5", "entries": entries,
            "pg_status": {str(pg): {"last_enqueued_collective": e, "last_started_collective": s,
                                    "last_completed_collective": c} for pg, (e, s, c) in status.items()}}


def write(tmp_path, dumps: dict[int, dict]) -> str:
    prefix = str(tmp_path / "nccl_trace_rank_")
    for rank, d in dumps.items():
        with open(f"{prefix}{rank}", "wb") as f:
            pickle.dump(d, f, protocol=2)
    return prefix


def test_the_rank_whose_last_collective_lags_never_joined(tmp_path):
    waiting = dump({0: (12, 12, 11)}, [entry(11, "completed"), entry(12, "started")])
    prefix = write(tmp_path, {0: waiting, 1: dump({0: (11, 11, 11)}, [entry(11, "completed")]), 2: waiting})
    dumps, unreadable = fr.read_dumps(prefix, since=0)
    assert sorted(dumps) == [0, 1, 2] and unreadable == []
    v = fr.verdict(dumps, 3)
    assert v.culprits == [1]
    assert "ranks 0, 2 queued collective #12 nccl:all_to_all of group 0 (default_pg), rank 1 at #11" in v.text


def test_a_collective_every_rank_queued_and_none_completed_blames_the_interconnect():
    d = dump({0: (5, 5, 4)}, [entry(5, "started")])
    v = fr.verdict({0: d, 1: d}, 2)
    assert v.culprits == [] and "none completed it" in v.text and "NCCL_P2P_DISABLE=1" in v.text


def test_the_rank_that_did_not_complete_what_all_queued_is_stuck_on_its_gpu():
    v = fr.verdict({0: dump({0: (5, 5, 5)}, []), 1: dump({0: (5, 5, 4)}, [])}, 2)
    assert v.culprits == [1] and "rank 1 did not complete it" in v.text and "its GPU" in v.text


def test_a_sub_group_counts_only_among_its_members_and_a_silent_rank_is_named():
    """Group 1 (a sequence group of ranks 0 and 1) is behind on rank 1; rank 2 never dumped."""
    dumps = {0: dump({0: (3, 3, 3), 1: (9, 9, 8)}, [entry(9, "started", pg=1, desc="sequence")]),
             1: dump({0: (3, 3, 3), 1: (8, 8, 8)}, [])}
    v = fr.verdict(dumps, 3)
    assert v.culprits == [1] and "of group 1 (sequence)" in v.text and "(rank 2 wrote no dump)" in v.text
    agreed = fr.verdict({0: dump({0: (3, 3, 3)}, [])}, 2)
    assert agreed.culprits == [1] and "rank 1 wrote no dump" in agreed.text
    assert fr.verdict({}, 2) is None


class Evil:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def test_dumps_that_need_any_global_are_reported_never_loaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prefix = str(tmp_path / "nccl_trace_rank_")
    with open(f"{prefix}0", "wb") as f:
        pickle.dump({"entries": [Evil()]}, f, protocol=2)
    with open(f"{prefix}1", "wb") as f:
        pickle.dump(dump({0: (1, 1, 1)}, []), f, protocol=2)
    (tmp_path / "nccl_trace_rank_1.tmp").write_bytes(b"not a rank")    # not <prefix><rank>: ignored
    dumps, unreadable = fr.read_dumps(prefix, since=0)
    assert list(dumps) == [1] and len(unreadable) == 1 and "names posix.system" in unreadable[0]
    assert not (tmp_path / "pwned").exists()


def test_dumps_older_than_the_pool_are_skipped(tmp_path):
    prefix = write(tmp_path, {0: dump({0: (1, 1, 1)}, [])})
    os.utime(f"{prefix}0", (time.time() - 3600,) * 2)
    assert fr.read_dumps(prefix, since=time.time() - 60) == ({}, [])


@pytest.mark.skipif(not hasattr(torch._C._distributed_c10d, "_dump_nccl_trace"), reason="torch built without NCCL")
def test_torchs_own_dump_writer_reads_as_plain_data():
    """The C++ writer's bytes (an empty recorder without a GPU): the restricted reader loads them."""
    d = fr.loads_plain(torch._C._distributed_c10d._dump_nccl_trace())
    assert {"version", "pg_config", "pg_status", "entries"} <= set(d) and fr.verdict({0: d}, 1).culprits == []
