"""The pool's NCCL decisions, without GPUs: pool survival per backend, timeouts, the ranks' NCCL environment, the
start-up check's P2P fallback and /dev/shm warning, bounded teardown, and the flight-recorder verdict in errors."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import threading
import time
from collections import namedtuple

import pytest
import torch

from mgpu.errors import DeviceSpecError
from mgpu.planning.devices import parse_spec
from mgpu.ranks import p2p, pool as pool_mod, shm
from mgpu.ranks.pool import PoolConfig, ProbeFailure, RankPool, _Rank, collective_timeout, keeps_pool, reply_kind

FR_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE",
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*p2p.USER_VARS, *FR_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("mgpu.ranks.pool.live_gpus", lambda: parse_spec("2x24GiB:p2p"))


# --------------------------------------------------------------------------------------------- pool survival

def error(refusal: str | None = None, cancelled: bool = False) -> dict:
    return {"kind": "error", "error": "x", "refusal": refusal, "cancelled": cancelled}


def test_reply_kinds():
    assert [reply_kind(r) for r in ({"kind": "ok"}, error(), error("bad input"), error(cancelled=True))] == [
        "ok", "error", "refusal", "cancelled"]


@pytest.mark.parametrize("kinds", [["error", "error"], ["refusal", "refusal"], ["cancelled", "cancelled"],
                                   ["refusal", "error"], ["refusal", "cancelled"]])
def test_on_gloo_every_rank_raising_keeps_the_pool(kinds):
    assert keeps_pool("gloo", kinds) and keeps_pool("gloo", kinds, in_step=False)


@pytest.mark.parametrize("kinds, kept", [
    (["refusal", "refusal"], True),          # bad input caught before any collective
    (["cancelled", "cancelled"], True),      # the agreed Cancel
    (["error", "error"], False),             # e.g. a CUDA OOM after queueing an all-gather
    (["refusal", "error"], False),
    (["refusal", "cancelled"], False),       # stopped at different points
    (["cancelled", "error"], False),
])
def test_on_nccl_only_refusals_or_the_agreed_cancel_keep_the_pool(kinds, kept):
    assert keeps_pool("nccl", kinds) is kept


def test_on_nccl_refusals_after_different_numbers_of_collectives_tear_down():
    assert not keeps_pool("nccl", ["refusal", "refusal"], in_step=False)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_rank_that_succeeded_never_keeps_the_pool(backend):
    assert not keeps_pool(backend, ["ok", "error"]) and not keeps_pool(backend, ["ok", "refusal"])


# --------------------------------------------------------------------------------------------- timeouts

def test_the_collective_timeout_is_the_hosts_on_gloo_and_shorter_on_nccl():
    cfg = PoolConfig(["cuda:0", "cuda:1"], call_timeout_s=300.0, start_timeout_s=120.0)
    assert collective_timeout(cfg, "gloo") == 300.0
    assert collective_timeout(cfg, "nccl") == 300.0 - pool_mod.NCCL_DUMP_MARGIN_S
    assert collective_timeout(PoolConfig(["cuda:0"], call_timeout_s=20.0), "nccl") == 10.0
    assert collective_timeout(PoolConfig(["cuda:0"], collective_timeout_s=42.0), "nccl") == 42.0


# --------------------------------------------------------------------------------------------- devices

def test_two_ranks_on_one_gpu_only_with_gloo_asked_for(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pool_mod._validate(PoolConfig(["cuda:0", "cuda:0"], backend="gloo")) == ("gloo", "cuda")
    for backend in (None, "nccl"):
        with pytest.raises(DeviceSpecError, match="two ranks on one GPU.*NCCL needs one GPU per rank"):
            pool_mod._validate(PoolConfig(["cuda:0", "cuda:0"], backend=backend))


# --------------------------------------------------------------------------------------------- NCCL environment

def test_nccl_ranks_dump_the_flight_recorder_into_the_pools_directory(clean_env, tmp_path):
    env = RankPool(PoolConfig(["cuda:0", "cuda:1"]))._rank_env("nccl", str(tmp_path))
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env   # deprecated in 2.13: a warning on every rank
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(str(tmp_path), "nccl_trace_rank_")
    assert not any(var in RankPool(PoolConfig(["cpu", "cpu"]))._rank_env("gloo", str(tmp_path)) for var in FR_VARS)


@pytest.mark.parametrize("user", [{"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/data/fr_"}, {"TORCH_FR_DUMP_TEMP_FILE": "/x_"},
                                  {"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}])
def test_the_users_flight_recorder_settings_win(clean_env, tmp_path, monkeypatch, user):
    for var, value in user.items():
        monkeypatch.setenv(var, value)
    env = RankPool(PoolConfig(["cuda:0", "cuda:1"]))._rank_env("nccl", str(tmp_path))
    assert all(env[var] == value for var, value in user.items())
    if "TEMP_FILE" in next(iter(user)):
        assert "TORCH_FR_DUMP_TEMP_FILE" not in env or env["TORCH_FR_DUMP_TEMP_FILE"] == user.get(
            "TORCH_FR_DUMP_TEMP_FILE")
    if "BUFFER" in next(iter(user)):
        assert "TORCH_FR_BUFFER_SIZE" not in env or env.get("TORCH_FR_BUFFER_SIZE") == "0"


# --------------------------------------------------------------------------------------------- P2P fallback, /dev/shm

def test_a_failed_probe_turns_p2p_off_once_unless_the_user_chose():
    assert p2p.after_failed_probe({}, {}).env == {"NCCL_P2P_DISABLE": "1"}
    assert p2p.after_failed_probe({}, {"NCCL_P2P_LEVEL": "NVL"}).env == {"NCCL_P2P_DISABLE": "1"}
    already = p2p.after_failed_probe({}, {"NCCL_P2P_DISABLE": "1"})
    assert already.env == {} and "already off" in already.reason
    users = p2p.after_failed_probe({"NCCL_P2P_LEVEL": "SYS"}, {"NCCL_P2P_LEVEL": "SYS"})
    assert users.env == {} and "your NCCL_P2P_LEVEL=SYS" in users.reason and "try NCCL_P2P_DISABLE=1" in users.reason
    assert "try" not in p2p.after_failed_probe({"NCCL_P2P_DISABLE": "1"}, {"NCCL_P2P_DISABLE": "1"}).reason


Statvfs = namedtuple("Statvfs", "f_bavail f_frsize f_blocks")


def test_shm_warning_has_the_numbers_and_the_fix():
    text = p2p.shm_warning((60 * 2**20, 64 * 2**20), 2)
    assert "60 MiB free of 64 MiB" in text and "~74 MiB" in text and "--shm-size=1g" in text
    assert p2p.shm_warning((1 << 30, 1 << 30), 8) is None and p2p.shm_warning(None, 2) is None
    assert p2p.uses_shm({"NCCL_P2P_DISABLE": "1"}) and p2p.uses_shm({"NCCL_P2P_LEVEL": "nvl"})
    assert not p2p.uses_shm({}) and not p2p.uses_shm({"NCCL_P2P_DISABLE": "0"})


def test_nccl_ranks_without_p2p_check_dev_shm(clean_env, monkeypatch, caplog):
    """Docker's default /dev/shm (64 MB) with P2P off: logged, and kept for the failure messages."""
    monkeypatch.setattr(p2p.os, "statvfs", lambda path: Statvfs(16000, 4096, 16384))   # 62.5 of 64 MiB free
    pool = RankPool(PoolConfig(["cuda:0", "cuda:1"]))
    with caplog.at_level(logging.WARNING, logger="mgpu.ranks.pool"):
        pool._rank_env("nccl")
    assert pool._env_note is None and "shm" not in caplog.text          # P2P on: NCCL does not use /dev/shm
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    with caplog.at_level(logging.WARNING, logger="mgpu.ranks.pool"):
        pool._rank_env("nccl")
    assert "/dev/shm has 62 MiB free of 64 MiB" in caplog.text and "--shm-size" in caplog.text
    assert "--shm-size" in pool._note()
    gloo = RankPool(PoolConfig(["cpu", "cpu"]))
    gloo._rank_env("gloo")
    assert gloo._env_note is None


def probe_failure(rank: int = 0) -> ProbeFailure:
    return ProbeFailure("the ranks' start-up check ... failed: it did not finish within 30s", rank=rank,
                        device=f"cuda:{rank}")


def fake_starts(monkeypatch, outcomes: list) -> list[dict]:
    """RankPool._start_ranks replaced: records the rank env each start would get, then raises or returns."""
    envs = []

    def start(self, backend, mesh_device_type):
        env = self._rank_env(backend)
        self._p2p_env = {v: env[v] for v in p2p.USER_VARS if v in env}
        envs.append(env)
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
    monkeypatch.setattr(RankPool, "_start_ranks", start)
    monkeypatch.setattr(pool_mod, "_validate", lambda cfg: ("nccl", "cuda"))
    return envs


def test_a_failed_probe_on_nccl_restarts_once_with_p2p_off_and_says_why(clean_env, monkeypatch, caplog):
    envs = fake_starts(monkeypatch, [probe_failure(), None])
    pool = RankPool(PoolConfig(["cuda:0", "cuda:1"]))
    with caplog.at_level(logging.WARNING, logger="mgpu.ranks.pool"):
        pool.start()
    assert "NCCL_P2P_DISABLE" not in envs[0] and envs[1]["NCCL_P2P_DISABLE"] == "1"
    assert "did not finish within 30s" in caplog.text and "restarting the ranks once with NCCL_P2P_DISABLE=1" in \
        caplog.text
    assert pool.generation == 1 and pool._rank_env("nccl")["NCCL_P2P_DISABLE"] == "1"   # later starts keep it off


def test_a_probe_failing_again_with_p2p_off_is_reported_with_dev_shm(clean_env, monkeypatch):
    monkeypatch.setattr(p2p.os, "statvfs", lambda path: Statvfs(16000, 4096, 16384))
    fake_starts(monkeypatch, [probe_failure(), probe_failure(1)])
    with pytest.raises(ProbeFailure) as info:
        RankPool(PoolConfig(["cuda:0", "cuda:1"])).start()
    assert "P2P was already off" in str(info.value) and info.value.rank == 1


def test_a_probe_failing_with_the_users_p2p_setting_is_reported_not_overridden(clean_env, monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    envs = fake_starts(monkeypatch, [probe_failure()])
    with pytest.raises(ProbeFailure, match="your NCCL_P2P_DISABLE=0, which the pool does not override; try "
                                           "NCCL_P2P_DISABLE=1"):
        RankPool(PoolConfig(["cuda:0", "cuda:1"])).start()
    assert len(envs) == 1


# --------------------------------------------------------------------------------------------- teardown

class StuckProcess:
    """A Popen-like rank stuck in the kernel (state D): signals do nothing, ``wait()`` never returns by itself."""

    pid = 4242
    returncode = None

    def __init__(self):
        self.signals = []

    def poll(self):
        return None

    def terminate(self):
        self.signals.append("TERM")

    def kill(self):
        self.signals.append("KILL")

    def wait(self, timeout=None):
        if timeout is None:
            threading.Event().wait()            # forever, as Popen.wait() on a process that never exits
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("rank", timeout)


def test_teardown_gives_up_a_rank_that_sigkill_cannot_end_and_cleans_the_rest(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(pool_mod, "KILL_GRACE_S", 0.1)
    monkeypatch.setattr(pool_mod, "REAP_TIMEOUT_S", 0.5)
    pool = RankPool(PoolConfig(["cuda:3"]))
    stuck = StuckProcess()
    work_dir = shm.private_dir(str(tmp_path))
    pool._ranks = [_Rank(0, "cuda:3", stuck, os.path.join(work_dir, "rank0.log"))]
    pool._dirs = [work_dir]
    done = threading.Event()
    with caplog.at_level(logging.ERROR, logger="mgpu.ranks.pool"):
        threading.Thread(target=lambda: (pool.close(), done.set()), daemon=True).start()
        assert done.wait(10), "teardown waited forever on a rank that cannot exit"
    assert stuck.signals == ["TERM", "KILL"]
    assert "rank 0 (cuda:3, pid 4242) did not exit 0.5s after SIGKILL" in caplog.text and "given up" in caplog.text
    assert not os.path.exists(work_dir) and not pool.alive


# --------------------------------------------------------------------------------------------- verdict in errors

class ExitedProcess(StuckProcess):
    def __init__(self, returncode: int):
        super().__init__()
        self.returncode = returncode

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode


def dump(enqueued: int, completed: int) -> bytes:
    entries = [{"record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
                "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_gather_into_tensor_coalesced",
                "state": "completed" if seq <= completed else "scheduled", "is_p2p": False}
               for seq in range(1, enqueued + 1)]
    return pickle.dumps({"version": "2.10", "pg_config": {}, "pg_status": {"0": {
        "last_enqueued_collective": enqueued, "last_started_collective": completed,
        "last_completed_collective": completed}}, "entries": entries}, protocol=2)


def test_a_rank_the_nccl_watchdog_stopped_names_the_rank_that_never_joined(tmp_path, monkeypatch):
    """Rank 0 waited in collective #7 until the watchdog aborted it; rank 1 queued only #6."""
    pool = RankPool(PoolConfig(["cuda:0", "cuda:1"]))
    prefix = str(tmp_path / "nccl_trace_rank_")
    for rank, (enq, done) in enumerate([(7, 6), (6, 6)]):
        (tmp_path / f"nccl_trace_rank_{rank}").write_bytes(dump(enq, done))
    pool._backend, pool._dump_prefix, pool._launched_at, pool._collective_timeout = "nccl", prefix, 0.0, 240.0
    pool._ranks = [_Rank(r, f"cuda:{r}", ExitedProcess(-6), str(tmp_path / f"rank{r}.log")) for r in range(2)]
    err = pool._death_failure("model.forward", 0)
    text = str(err)
    assert "rank 0 (cuda:0, pid 4242) was stopped by NCCL's watchdog (SIGABRT)" in text and "240s" in text
    assert "rank 1 at #6: rank 1 never joined it" in text and "#7 nccl:all_gather_into_tensor_coalesced" in text
    pool._backend = "gloo"                                  # gloo: no flight recorder, no verdict
    assert "flight recorder" not in str(pool._death_failure("model.forward", 0))
