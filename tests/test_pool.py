"""Rank pool with real processes: 2 cpu ranks on gloo, driven from this process as the host.

The ops below run on the ranks: they import this file as module ``test_pool`` (its folder is in extra_sys_path).
Destructive tests come last and in order; each one's first call also proves the pool rebuilt after the previous one.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge

from mgpu.ranks import shm
from loaders import pools
from mgpu.errors import CallCancelled, DeviceSpecError, MgpuError, RankFailure, ShardingError
from mgpu.ranks.pool import CANCEL_GRACE_S, HANDSHAKE_TIMEOUT_S, PoolConfig, RankPool
from mgpu.ranks.rank import register_op

TESTS = str(Path(__file__).resolve().parent)
REPO = str(Path(__file__).resolve().parent.parent)
GRACE_S = 1.0

# --------------------------------------------------------------------------------------------- ops (rank side)


def op_echo(ctx, payload, tensors):
    """Send the inputs back from the ranks in payload["ranks"] (all by default)."""
    send = ctx.rank in payload.get("ranks", range(ctx.world_size))
    return {"rank": ctx.rank}, (dict(tensors) if send else {})


def op_all_reduce(ctx, payload, tensors):
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t, group=ctx.group)
    return {"sum": t.item(), "mesh": ctx.mesh.size()}


def op_raise(ctx, payload, tensors):
    """Raise on payload["ranks"]; the others wait in a barrier the failing ranks never join."""
    if ctx.rank in payload["ranks"]:
        raise ValueError(f"boom on rank {ctx.rank}")
    dist.barrier(group=ctx.group)


REFUSAL = "blocks.0.weight: the checkpoint was made for another model; load it with the loader it was made for"


def op_refuse(ctx, payload, tensors):
    """Refuse (one of our own errors) on payload["ranks"]; the others wait in a barrier the refusing ranks skip."""
    if ctx.rank in payload["ranks"]:
        raise ShardingError(REFUSAL)
    dist.barrier(group=ctx.group)


def op_sleep(ctx, payload, tensors):
    """payload["ranks"] sleep (saying so on stderr); then, with "collective", everyone all-reduces."""
    if ctx.rank in payload.get("ranks", range(ctx.world_size)):
        print(f"rank {ctx.rank} going to sleep", file=sys.stderr, flush=True)
        time.sleep(payload["seconds"])
    if payload.get("collective"):
        dist.all_reduce(torch.ones(1), group=ctx.group)


def op_env(ctx, payload, tensors):
    return {name: os.environ.get(name) for name in payload["names"]}


@register_op("test_pool.store")
def op_store(ctx, payload, tensors):
    ctx.objects[payload["handle"]] = tensors["x"].clone()   # inputs are views of memory the host reuses


@register_op("test_pool.fetch")
def op_fetch(ctx, payload, tensors):
    return {}, {"x": ctx.objects[payload["handle"]]}


# --------------------------------------------------------------------------------------------- helpers (host)


def make_pool(**kwargs) -> RankPool:
    return RankPool(PoolConfig(["cpu", "cpu"], extra_sys_path=[TESTS], error_grace_s=GRACE_S, **kwargs))


def pids(pool: RankPool) -> list[int]:
    return [r.payload["pid"] for r in pool.call("ping")]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid_list: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(gone(p) for p in pid_list):
            return True
        time.sleep(0.05)
    return False


def pool_dirs(owner: int) -> list[str]:
    """The private directories (segments, logs, socket) of pools run by process ``owner``."""
    found = []
    for parent in {shm.shm_parent(), tempfile.gettempdir()}:
        found += [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(f"mgpu-{owner}-")]
    return found


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


@pytest.fixture(scope="module")
def pool():
    p = make_pool(imports=["test_pool"])
    # Started from a thread that then exits: the ranks' PDEATHSIG must not be tied to it.
    starter = threading.Thread(target=p.start)
    starter.start()
    starter.join()
    assert p.generation == 1
    yield p
    p.close()


# --------------------------------------------------------------------------------------------- tests


def test_ranks_are_clean_interpreters_that_outlive_the_starting_thread(pool):
    replies = pool.call("ping")
    assert [r.rank for r in replies] == [0, 1]
    assert [r.payload["device"] for r in replies] == ["cpu", "cpu"]
    for r in replies:
        proc = psutil.Process(r.payload["pid"])
        assert proc.ppid() == os.getpid()
        assert proc.cmdline()[1:3] == ["-m", "mgpu.ranks.rank"]
    assert pool.alive and pool.world_size == 2


def test_gloo_all_reduce_across_ranks(pool):
    assert [r.payload for r in pool.call("test_pool:op_all_reduce")] == [{"sum": 3.0, "mesh": 2}] * 2


def test_tensors_round_trip_bit_exact(pool):
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45, -3.5])
    sent = {
        "f32": torch.cat([special, torch.randn(1000)]),
        "bf16": torch.randn(3, 7, 5).to(torch.bfloat16),
        "i64": torch.randint(-2**62, 2**62, (17,), dtype=torch.int64),
        "strided": torch.arange(24, dtype=torch.float32).reshape(4, 6).t()[::2],
        "scalar": torch.tensor(7, dtype=torch.int16),
        "empty": torch.empty(0, 3),
        "mask": torch.rand(9) > 0.5,
    }
    assert not sent["strided"].is_contiguous()
    first = pool.call("test_pool:op_echo", tensors=sent)
    for reply in first:
        assert set(reply.tensors) == set(sent)
        for name, t in sent.items():
            assert same_bits(reply.tensors[name], t), name
    assert first[0].tensors["f32"].data_ptr() != first[1].tensors["f32"].data_ptr()
    # Segments are reused between calls: what an earlier call returned must not change under the caller.
    pool.call("test_pool:op_echo", tensors={k: torch.zeros_like(v) for k, v in sent.items()})
    assert same_bits(first[0].tensors["bf16"], sent["bf16"]) and same_bits(first[1].tensors["i64"], sent["i64"])


def test_steady_state_reuses_segments(pool):
    def segments() -> int:
        return sum(len([n for n in os.listdir(d) if n.startswith("seg-")]) for d in pool_dirs(os.getpid()))
    for _ in range(3):
        pool.call("test_pool:op_echo", tensors={"x": torch.randn(1000)})
    count = segments()
    for _ in range(10):
        assert pool.call("test_pool:op_echo", tensors={"x": torch.randn(1000)})[1].tensors["x"].shape == (1000,)
    assert segments() == count


def test_only_the_ranks_that_return_tensors_send_them(pool):
    replies = pool.call("test_pool:op_echo", {"ranks": [0]}, {"x": torch.ones(4)})
    assert torch.equal(replies[0].tensors["x"], torch.ones(4)) and replies[1].tensors == {}


def test_registered_ops_objects_by_handle_stats_and_free(pool):
    x = torch.randn(64, 64)
    pool.call("test_pool.store", {"handle": "latent"}, {"x": x})
    pool.call("test_pool:op_echo", tensors={"x": torch.zeros(64, 64)})    # overwrites the host's input segment
    assert all(torch.equal(r.tensors["x"], x) for r in pool.call("test_pool.fetch", {"handle": "latent"}))
    stats = pool.call("stats")
    assert [s.payload["handles"] for s in stats] == [["latent"], ["latent"]]
    assert all(s.payload["rss"] > 50e6 and s.payload["allocated"] is None for s in stats)
    assert [r.payload["freed"] for r in pool.call("free", {"handle": "latent"})] == [["latent"]] * 2
    assert [s.payload["handles"] for s in pool.call("stats")] == [[], []]


def test_tensor_in_payload_is_refused_before_sending(pool):
    generation = pool.generation
    with pytest.raises(TypeError, match="tensors dict"):
        pool.call("ping", {"oops": torch.ones(2)})
    assert pool.generation == generation and pool.alive


def test_every_rank_raising_reports_traceback_and_keeps_the_pool(pool):
    generation, before = pool.generation, pids(pool)
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_raise", {"ranks": [0, 1]})
    err = info.value
    assert err.rank in (0, 1) and err.device == "cpu"
    assert f"ValueError: boom on rank {err.rank}" in str(err)
    assert "op_raise" in err.traceback and 'raise ValueError(f"boom' in err.traceback
    assert pool.alive and pool.generation == generation and pids(pool) == before
    with pytest.raises(RankFailure, match="unknown op 'no_such_op'"):
        pool.call("no_such_op")


def test_a_refusal_on_every_rank_leads_the_node_error_without_queue_again_and_keeps_the_pool(pool):
    generation, before = pool.generation, pids(pool)
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_refuse", {"ranks": [0, 1]})
    err = info.value
    assert err.refusal == REFUSAL and err.pool_kept
    assert pool.alive and pool.generation == generation and pids(pool) == before
    text = str(pools.explain(err, "wan.safetensors sharded over 2 ranks: a denoising step"))
    assert text.startswith(f"{REFUSAL}\nwan.safetensors sharded over 2 ranks: a denoising step was refused on the "
                           f"ranks: rank {err.rank} (cpu) refused 'test_pool:op_refuse'; rank {1 - err.rank} the same. "
                           "Every rank raised, so none is stuck: the pool stays up"), text
    diagnosis, _, traceback = text.partition(f"--- rank {err.rank} traceback ---")
    assert "Queue the prompt again" not in text and diagnosis.count(REFUSAL) == 1
    assert "raise ShardingError(REFUSAL)" in traceback


def test_a_refusal_on_one_rank_says_the_pool_was_shut_down_without_queue_again(pool):
    before = pids(pool)
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_refuse", {"ranks": [1]})
    err = info.value
    assert err.refusal == REFUSAL and not err.pool_kept and wait_gone(before, 5)
    text = str(pools.explain(err, "load"))
    assert text.startswith(f"{REFUSAL}\nload was refused on the ranks: rank 1 (cpu) refused 'test_pool:op_refuse'. "
                           "Ranks [0] were still busy"), text
    assert "shut down and restarts on next use" in text and "Queue the prompt again" not in text


def test_every_socket_the_ranks_own_stays_on_loopback(pool):
    listening = []
    for pid in pids(pool):
        proc = psutil.Process(pid)
        conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
        listening += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
        assert all(loopback(c.laddr.ip) for c in conns), conns
    assert listening, "gloo's listening sockets should be there to check"


def test_the_rendezvous_is_a_file_in_the_pools_private_directory(pool):
    stores = set()
    for pid in pids(pool):
        argv = psutil.Process(pid).cmdline()
        assert not any(a.startswith("--master") for a in argv)
        stores.add(argv[argv.index("--store-file") + 1])
    (store,) = stores                                    # one store for all ranks
    directory = os.path.dirname(store)
    assert directory in pool_dirs(os.getpid()) and os.path.isfile(store)
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()


def test_report_10mb_round_trip_overhead(pool, capsys):
    """Not a timed assertion (a shared 2-core box); prints the numbers the lead tracks in bench/."""
    latent = torch.randn(10 * 2**20 // 4)

    def timing(fn, n=40) -> str:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return f"{statistics.median(times) * 1e3:.2f} ms (min {min(times) * 1e3:.2f})"

    ping = timing(lambda: pool.call("ping"))
    one = timing(lambda: pool.call("test_pool:op_echo", {"ranks": [0]}, {"x": latent}))
    both = timing(lambda: pool.call("test_pool:op_echo", tensors={"x": latent}))
    with capsys.disabled():
        print(f"\n[pool round trip, 2 cpu ranks, median] ping {ping}; 10 MB to both ranks and back from rank 0 {one}; "
              f"back from both {both}")
    assert torch.equal(pool.call("test_pool:op_echo", {"ranks": [0]}, {"x": latent})[0].tensors["x"], latent)


def test_close_is_idempotent_and_leaves_no_processes_or_segments(pool):
    before = pids(pool)
    kept = pool.call("test_pool:op_echo", {"ranks": [1]}, {"x": torch.arange(5.0)})[1].tensors["x"]
    assert pool_dirs(os.getpid())
    pool.close()
    pool.close()
    assert all(gone(p) for p in before) and not pool.alive
    assert pool_dirs(os.getpid()) == []
    assert torch.equal(kept, torch.arange(5.0))                # a result outlives the pool that made it


def test_one_rank_raising_while_others_wait_restarts_the_pool(pool):
    before = pids(pool)               # a call after close() starts a fresh pool
    generation = pool.generation
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_raise", {"ranks": [1]})
    assert time.monotonic() - t0 < GRACE_S + 5
    err = info.value
    assert err.rank == 1 and "boom on rank 1" in str(err) and "op_raise" in err.traceback
    assert "Ranks [0] were still busy" in str(err)
    assert wait_gone(before, 5) and not pool.alive
    assert pids(pool) != before and pool.generation == generation + 1


def test_on_nccl_only_refusals_keep_the_pool_and_any_other_error_on_every_rank_tears_it_down(pool, monkeypatch):
    """The host's policy for NCCL, on gloo ranks (the backend the host believes it has faked): refusals on every
    rank keep the ranks; a plain error on every rank (as a CUDA OOM after queueing an all-gather) tears them down,
    and the error says why."""
    before, generation = pids(pool), pool.generation
    monkeypatch.setattr(pool, "_backend", "nccl", raising=False)
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_refuse", {"ranks": [0, 1]})
    assert info.value.pool_kept and "the pool stays up" in str(info.value)
    assert pids(pool) == before and pool.generation == generation
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_raise", {"ranks": [0, 1]})
    err = info.value
    assert not err.pool_kept and "boom on rank" in str(err)
    assert "On NCCL a rank that raised may have left a collective queued on its GPU" in str(err)
    assert "the pool was shut down and restarts on next use" in str(err)
    assert wait_gone(before, 5) and not pool.alive
    monkeypatch.undo()
    assert pids(pool) != before and pool.generation == generation + 1


def test_rank_sigkilled_in_a_collective_is_named_fast_and_the_pool_rebuilds(pool):
    before = pids(pool)
    generation = pool.generation
    threading.Timer(1.0, os.kill, (before[1], signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_sleep", {"ranks": [1], "seconds": 60, "collective": True}, timeout=60)
    elapsed = time.monotonic() - t0
    err = info.value
    assert elapsed < 8, elapsed
    assert err.rank == 1 and err.signal == "SIGKILL" and err.device == "cpu"
    assert "rank 1 (cpu" in str(err) and "SIGKILL" in str(err)
    assert "rank 1 going to sleep" in str(err)             # the tail of its stderr log
    assert err.refusal is None and not err.pool_kept
    assert "Queue the prompt again" in str(pools.explain(err, "a denoising step"))
    assert wait_gone(before, 5)
    assert pids(pool) != before and pool.generation == generation + 1


def test_rank_dying_while_idle_is_logged_and_the_pool_rebuilt_on_next_use(pool, caplog):
    before, generation = pids(pool), pool.generation
    os.kill(before[0], signal.SIGKILL)
    assert wait_gone(before[:1], 5) and not pool.alive
    with caplog.at_level("WARNING", logger="mgpu.ranks.pool"):
        after = pids(pool)
    assert "rank 0 (cpu" in caplog.text and "SIGKILL" in caplog.text and "while idle" in caplog.text
    assert wait_gone(before, 5) and after != before and pool.generation == generation + 1


def test_a_call_for_models_of_a_lost_generation_names_the_death_instead_of_running_on_fresh_ranks(pool):
    """A rank that dies between two steps: the next step (which carries the generation its model was loaded in)
    fails naming that rank, and starts no ranks that would not hold the model; the call after that rebuilds."""
    before, generation = pids(pool), pool.generation
    os.kill(before[1], signal.SIGKILL)
    assert wait_gone(before[1:], 5)
    with pytest.raises(RankFailure) as info:
        pool.call("ping", generation=generation)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value) and "during 'ping'" in str(info.value)
    assert not pool.alive and pool.generation == generation      # torn down, nothing started for the stale call
    assert wait_gone(before, 5)
    after = pids(pool)                                            # a call without a generation rebuilds the pool
    assert after != before and pool.generation == generation + 1
    with pytest.raises(RankFailure, match="since been restarted or closed"):
        pool.call("ping", generation=generation)                  # the old generation's models are gone for good
    assert pids(pool) == after                                    # and the live pool is left as it was


def test_call_timeout_names_silent_ranks_and_where_they_hang(pool):
    before = pids(pool)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_sleep", {"seconds": 60}, timeout=1.0)
    assert time.monotonic() - t0 < 6
    text = str(info.value)
    assert "ranks 0 (cpu), 1 (cpu) did not answer" in text and "within 1s" in text
    assert "op_sleep" in text                               # faulthandler's stack dump from the rank's log
    assert wait_gone(before, 5) and not pool.alive
    assert pool_dirs(os.getpid()) == []


def test_rank_failing_to_start_reports_its_traceback_and_leaves_nothing_running():
    pool = RankPool(PoolConfig(["cpu"], imports=["no_such_module_for_mgpu"]))
    children = set(psutil.Process().children())
    with pytest.raises(RankFailure, match="rank 0 \\(cpu\\) raised ModuleNotFoundError") as info:
        pool.start()
    assert "No module named 'no_such_module_for_mgpu'" in info.value.traceback
    assert not pool.alive and pool.generation == 0
    assert set(psutil.Process().children()) <= children


PROBE_SITECUSTOMIZE = """
import os, time
if os.environ.get("MGPU_TEST_PROBE"):
    import torch.distributed as dist
    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if dist.get_rank() == 1 and not getattr(all_reduce, "done", False):   # the start-up check only
            all_reduce.done = True
            if os.environ["MGPU_TEST_PROBE"] == "wrong":
                tensor[1] += 0.5          # rank 1's contribution arrives wrong
            else:
                time.sleep(60)            # rank 1 never joins
        return real(tensor, *args, **kwargs)
    dist.all_reduce = all_reduce
"""


def probe_pool(tmp_path: Path, mode: str | None, **kwargs) -> RankPool:
    """Two cpu ranks whose start-up all-reduce rank 1 spoils (a sitecustomize on their sys.path) as ``mode`` says."""
    (tmp_path / "sitecustomize.py").write_text(PROBE_SITECUSTOMIZE)
    return RankPool(PoolConfig(["cpu", "cpu"], extra_sys_path=[str(tmp_path), TESTS], error_grace_s=GRACE_S,
                               env={"MGPU_TEST_PROBE": mode} if mode else {}, **kwargs))


def test_start_up_checks_one_all_reduce_and_logs_it(tmp_path, caplog):
    pool = probe_pool(tmp_path, None)
    try:
        with caplog.at_level("INFO", logger="mgpu.ranks.pool"):
            pool.start()
        assert "2 gloo ranks up; the start-up all-reduce was correct on every rank" in caplog.text
        assert pool.call("test_pool:op_all_reduce")[0].payload["sum"] == 3.0
    finally:
        pool.close()


def test_a_wrong_start_up_all_reduce_fails_naming_the_rank(tmp_path):
    pool = probe_pool(tmp_path, "wrong")
    children = set(psutil.Process().children())
    with pytest.raises(RankFailure) as info:
        pool.start()
    text = str(info.value)
    assert info.value.rank == 1 and "start-up check" in text and "the contribution of rank 1 arrived wrong" in text
    assert "rank 1: 2.5..2.5 instead of 2" in text
    assert not pool.alive and pool.generation == 0 and set(psutil.Process().children()) <= children


def test_a_start_up_all_reduce_that_does_not_finish_fails_within_its_limit(tmp_path):
    pool = probe_pool(tmp_path, "hang", probe_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.start()
    text = str(info.value)
    assert time.monotonic() - t0 < 60
    assert "did not finish within 2s" in text and info.value.rank == 1
    assert "on rank 0 (cpu), waiting for the other ranks in it" in text and "on rank 1 (cpu), not even in" in text
    assert not pool.alive


def _wrong_key_client(sock: socket.socket, outcome: list) -> None:
    try:
        answer_challenge(Connection(sock.detach()), b"not the pool's key")
    except (AuthenticationError, OSError, EOFError) as exc:
        outcome.append(exc)


def _read_until_closed(sock: socket.socket, seconds: float) -> bool:
    """Whether the other end closed ``sock`` within ``seconds`` (whatever it sent before)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:       # closed with our bytes unread
        return True
    except TimeoutError:
        return False


def test_strangers_on_the_tcp_channel_are_dropped_and_start_up_goes_on(tmp_path, monkeypatch):
    """A temp dir too long for an AF_UNIX path puts the channel on loopback TCP, where any local user can connect.
    Three strangers connect before the ranks: one stays silent, one has the wrong key, one sends garbage."""
    long_tmp = tmp_path / ("t" * 100)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    strangers: list[socket.socket] = []
    wrong_key: list[Exception] = []
    listen = RankPool._listen

    def listen_then_knock(self, work_dir):
        address = listen(self, work_dir)
        assert address.startswith("tcp:127.0.0.1:"), address
        target = ("127.0.0.1", int(address.rpartition(":")[2]))
        strangers.append(socket.create_connection(target))                 # says nothing
        threading.Thread(target=_wrong_key_client, args=(socket.create_connection(target), wrong_key),
                         daemon=True).start()
        strangers.append(socket.create_connection(target))
        strangers[-1].sendall(b"\xff" * 64)                               # not a message at all
        return address

    monkeypatch.setattr(RankPool, "_listen", listen_then_knock)
    pool = make_pool()
    outcome: list = []
    starter = threading.Thread(target=lambda: outcome.append(_try(pool.start)), daemon=True)
    t0 = time.monotonic()
    starter.start()
    starter.join(timeout=120 + 3 * HANDSHAKE_TIMEOUT_S)
    try:
        assert not starter.is_alive(), "start-up hung on a stranger's connection"
        assert outcome == [None], outcome
        assert pool.generation == 1 and [r.rank for r in pool.call("ping")] == [0, 1]
        assert len(wrong_key) == 1                      # refused, and told so
        assert all(_read_until_closed(s, 1.0) for s in strangers)
        print(f"\n[start-up past 3 strangers] {time.monotonic() - t0:.1f} s")
    finally:
        pool.close()
        for s in strangers:
            s.close()


def _try(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:   # noqa: BLE001 - reported by the test
        return exc
    return None


def test_ranks_get_their_own_allocator_and_loopback_whatever_the_host_env(monkeypatch):
    """ComfyUI's cuda_malloc.py sets backend:cudaMallocAsync for itself; a GLOO_SOCKET_IFNAME set for other jobs
    would move gloo off loopback (here: to an interface that does not exist, so the ranks would not start)."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    names = ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "GLOO_SOCKET_IFNAME"]
    pool = RankPool(PoolConfig(["cpu"], extra_sys_path=[TESTS]))
    try:
        env = pool.call("test_pool:op_env", {"names": names})[0].payload
    finally:
        pool.close()
    loopback_names = [n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs)]
    assert env == {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "GLOO_SOCKET_IFNAME": loopback_names[0]}


def test_the_rank_allocator_follows_pool_config_env_then_mgpu_rank_alloc_conf(monkeypatch):
    monkeypatch.setenv("MGPU_RANK_ALLOC_CONF", "garbage_collection_threshold:0.6")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    names = ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"]
    explicit = RankPool(PoolConfig(["cpu"], extra_sys_path=[TESTS],
                                   env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}))
    documented = RankPool(PoolConfig(["cpu"], extra_sys_path=[TESTS]))
    try:
        assert explicit.call("test_pool:op_env", {"names": names})[0].payload == dict.fromkeys(
            names, "expandable_segments:False")
        explicit.close()
        assert documented.call("test_pool:op_env", {"names": names})[0].payload == dict.fromkeys(
            names, "garbage_collection_threshold:0.6")
    finally:
        explicit.close()
        documented.close()


@pytest.mark.parametrize("platform", ["win32", "darwin"])
def test_a_pool_on_a_host_other_than_linux_says_so_before_starting_anything(monkeypatch, platform):
    children, dirs = set(psutil.Process().children()), pool_dirs(os.getpid())
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(MgpuError, match=r"FSDP on cuda:0, cuda:1\) needs Linux.*Linux or WSL2"):
        RankPool(PoolConfig(["cuda:0", "cuda:1"])).start()
    monkeypatch.undo()
    assert set(psutil.Process().children()) <= children and pool_dirs(os.getpid()) == dirs


def test_more_ranks_than_gpus_fails_before_starting():
    missing = f"cuda:{torch.cuda.device_count() + 1}"
    with pytest.raises(DeviceSpecError, match=f"{missing} do not exist"):
        RankPool(PoolConfig(["cuda:0", missing])).start()
    with pytest.raises(DeviceSpecError, match="empty"):
        RankPool(PoolConfig([])).start()


HOST_SCRIPT = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
{setup}
from mgpu.ranks.pool import PoolConfig, RankPool
pool = RankPool(PoolConfig(["cpu"]))
print(json.dumps([r.payload["pid"] for r in pool.call("ping")]), flush=True)
time.sleep(120)
"""


def isolated_parents(tmp_path: Path) -> tuple[list[str], str]:
    """Parents for a host's private directories that only this test sees, and the host code that puts them there.

    A SIGKILLed host's directories are stale at once, and any pool starting on this machine (another test run of
    the same user, a ComfyUI loading the pack) sweeps /dev/shm and the temp dir: in the shared parents they could
    vanish before the test looks at them or sweeps them itself."""
    parents = [str(tmp_path / "shm"), str(tmp_path / "tmp")]
    for parent in parents:
        os.mkdir(parent)
    setup = (f"import tempfile\nfrom mgpu.ranks import shm\n"
             f"shm.shm_parent = lambda: {parents[0]!r}\ntempfile.tempdir = {parents[1]!r}")
    return parents, setup


def dirs_in(parents: list[str]) -> list[str]:
    return sorted(os.path.join(parent, name) for parent in parents for name in os.listdir(parent))


def test_ranks_exit_when_their_host_is_sigkilled(tmp_path):
    parents, setup = isolated_parents(tmp_path)
    host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT.format(repo=REPO, setup=setup)],
                            stdout=subprocess.PIPE, text=True)
    try:
        rank_pids = json.loads(host.stdout.readline())
        assert all(not gone(p) for p in rank_pids)
        os.kill(host.pid, signal.SIGKILL)
        host.wait()
        assert wait_gone(rank_pids, 5), "ranks outlived their host"
    finally:
        host.kill()
        host.wait()
    leftovers = dirs_in(parents)
    assert len(leftovers) == 2, "a SIGKILLed host cannot clean up; the next pool's sweep must"
    for parent in parents:
        shm.sweep_stale(parent)
    assert dirs_in(parents) == []


def test_segments_are_lent_until_every_tensor_is_gone_then_reused_or_dropped(tmp_path, monkeypatch):
    monkeypatch.setattr(shm, "KEEP_BYTES", 2 * shm.MIN_SEGMENT)
    sender, receiver = shm.SegmentPool([str(tmp_path)]), shm.Mapper()
    first = sender.pack({"a": torch.arange(10)})
    held = receiver.lease(first)["a"][2:]                  # a view of a leased tensor keeps the lease too
    assert receiver.returned() == []
    second = sender.pack({"a": torch.zeros(10)})
    assert second.path != first.path                        # the first segment is still lent out
    assert torch.equal(held, torch.arange(2, 10))
    del held
    assert receiver.returned() == [first.path]
    assert sender.release([first.path]) == []
    third = sender.pack({"b": torch.ones(3, dtype=torch.bfloat16)})
    assert third.path == first.path and torch.equal(receiver.lease(third)["b"], torch.ones(3, dtype=torch.bfloat16))
    big = sender.pack({"big": torch.zeros(3 * shm.MIN_SEGMENT // 4)})
    assert sender.release([big.path]) == [big.path] and not os.path.exists(big.path)
    receiver.forget([big.path])
    sender.close()
    assert os.listdir(tmp_path) == []


def test_sweep_spares_a_live_owner_whose_pid_is_not_ours_to_see(tmp_path):
    """Another PID namespace sharing /dev/shm: the owner's pid means nothing here, its lock does."""
    import fcntl

    foreign = tmp_path / "mgpu-999999-abc"
    foreign.mkdir()
    fd = os.open(foreign / shm.LOCK_NAME, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)          # held by a live process (this one, standing in for the owner)
    try:
        assert shm.sweep_stale(str(tmp_path)) == [] and foreign.exists()
    finally:
        os.close(fd)                        # the owner dies: its lock goes with it
    assert shm.sweep_stale(str(tmp_path)) == [str(foreign)] and not foreign.exists()


# ------------------------------------------------------------------------------------- cancel (ComfyUI's Cancel)


def op_spin(ctx, payload, tensors):
    """Work in small pieces with a cancel check between them, as a forward checks between blocks: the same number
    of checks on every rank (each check is a collective vote; a rank that stopped on its own clock one check before
    another left it waiting in the vote, which hung the test under load)."""
    for _ in range(round(payload["seconds"] / 0.01)):
        ctx.raise_if_cancelled()
        time.sleep(0.01)
    return {"rank": ctx.rank}


def _cancel_after(seconds: float):
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0 > seconds


def test_cancel_stops_every_rank_at_its_next_check_and_keeps_the_pool(pool):
    before, generation = pids(pool), pool.generation
    t0 = time.monotonic()
    with pytest.raises(CallCancelled) as info:
        pool.call("test_pool:op_spin", {"seconds": 60}, cancelled=_cancel_after(0.5))
    assert time.monotonic() - t0 < 3
    assert info.value.pool_kept and "every rank stopped" in str(info.value)
    assert pids(pool) == before and pool.generation == generation          # same ranks, models still loaded
    assert [r.payload["rank"] for r in pool.call("test_pool:op_spin", {"seconds": 0.1})] == [0, 1]


def test_cancel_while_one_rank_hangs_tears_down_within_the_grace_and_names_it(pool):
    """Rank 1 sleeps without checking (a hung GPU); rank 0 waits for it in a collective. Cancel returns within
    CANCEL_GRACE_S, names rank 1 only, and the next call gets fresh ranks."""
    before = pids(pool)
    t0 = time.monotonic()
    with pytest.raises(CallCancelled) as info:
        pool.call("test_pool:op_sleep", {"ranks": [1], "seconds": 60, "collective": True},
                  cancelled=_cancel_after(0.5))
    assert time.monotonic() - t0 < CANCEL_GRACE_S + 4
    text = str(info.value)
    assert not info.value.pool_kept and "rank 1 (cpu) did not stop" in text, text
    assert "rank 0 (cpu" in text and "waiting for the other ranks in a collective" in text
    assert "rank 1 going to sleep" in text                                 # rank 1's own log lines
    assert wait_gone(before, 5)
    assert len(pids(pool)) == 2


def test_a_hang_names_the_rank_that_hangs_not_the_one_waiting_for_it(pool):
    with pytest.raises(RankFailure) as info:
        pool.call("test_pool:op_sleep", {"ranks": [1], "seconds": 60, "collective": True}, timeout=1.0)
    text = str(info.value)
    assert info.value.rank == 1 and text.startswith("rank 1 (cpu) did not answer"), text
    assert "rank 0 (cpu" in text and "waiting for the other ranks in a collective" in text


def test_a_stopped_rank_is_named_as_stopped(pool):
    victim = pids(pool)[1]
    threading.Timer(0.5, os.kill, (victim, signal.SIGSTOP)).start()
    try:
        with pytest.raises(RankFailure) as info:
            pool.call("test_pool:op_spin", {"seconds": 3}, timeout=2.0)
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
    text = str(info.value)
    assert info.value.rank == 1 and "is stopped" in text, text


# ------------------------------------------------------------------------------------- what a stopped host leaves

SIGTERM_HOST_SCRIPT = """
import os, sys, time
sys.path[:0] = [{repo!r}, {tests!r}]
{setup}
from mgpu.ranks.pool import PoolConfig, RankPool, clean_up_on_sigterm
pool = RankPool(PoolConfig(["cpu", "cpu"], extra_sys_path=[{tests!r}]))
pids = [r.payload["pid"] for r in pool.call("ping")]
assert clean_up_on_sigterm()
print(" ".join(map(str, pids)), flush=True)
time.sleep(120)
"""


def test_a_host_stopped_with_sigterm_leaves_no_rank_and_no_shared_memory():
    host = subprocess.Popen([sys.executable, "-c", SIGTERM_HOST_SCRIPT.format(repo=REPO, tests=TESTS, setup="")],
                            stdout=subprocess.PIPE, text=True)
    try:
        rank_pids = [int(p) for p in host.stdout.readline().split()]
        assert len(rank_pids) == 2 and pool_dirs(host.pid), "the host's pool has no private directories"
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=20) == -signal.SIGTERM   # the signal still ends the process as before
    finally:
        host.kill()
    assert wait_gone(rank_pids, 5)
    assert pool_dirs(host.pid) == []


def test_stale_directories_of_a_killed_host_are_swept(tmp_path, monkeypatch):
    parents, setup = isolated_parents(tmp_path)
    host = subprocess.Popen([sys.executable, "-c", SIGTERM_HOST_SCRIPT.format(repo=REPO, tests=TESTS, setup=setup)],
                            stdout=subprocess.PIPE, text=True)
    try:
        rank_pids = [int(p) for p in host.stdout.readline().split()]
        left = dirs_in(parents)
        host.kill()
        host.wait(timeout=20)
        assert wait_gone(rank_pids, 10) and len(left) == 2 and dirs_in(parents) == left   # SIGKILL: nothing ran
    finally:
        host.kill()
    from mgpu.ranks.pool import sweep_stale_dirs

    monkeypatch.setattr(shm, "shm_parent", lambda: parents[0])
    monkeypatch.setattr(tempfile, "tempdir", parents[1])
    assert set(left) <= set(sweep_stale_dirs()) and dirs_in(parents) == []


def test_a_failure_shows_the_ranks_last_meaningful_log_lines(tmp_path):
    """A rank logs a line per call; after 50 calls its error must still be what the failure message shows, with a
    few call lines for context, not a screen of 'call N: op' names."""
    from mgpu.ranks.pool import _tail

    log = tmp_path / "rank0.log"
    calls = [f"12:00:{i % 60:02d} call {i}: model.forward" for i in range(1, 51)]
    error = ["Traceback (most recent call last):", '  File "x.py", line 1, in forward',
             "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    log.write_text("\n".join(["warning: something the rank said once", *calls, *error]) + "\n")
    tail = _tail(str(log)).splitlines()
    assert tail[0] == "(47 earlier 'call N: op' lines left out)"
    assert "warning: something the rank said once" in tail
    assert [line for line in tail if line.endswith(": model.forward")] == calls[-3:]
    assert tail[-3:] == error


PAIR_SITECUSTOMIZE = """
import torch.distributed as dist
real = dist.all_to_all_single

def all_to_all_single(output, input, *args, **kwargs):
    work = real(output, input, *args, **kwargs)
    if dist.get_rank() == 0 and not getattr(all_to_all_single, "done", False):   # the start-up check only
        all_to_all_single.done = True
        output[1].zero_()                  # what rank 1 sent rank 0 never arrived (a broken pair)
    return work
dist.all_to_all_single = all_to_all_single
"""


def test_a_broken_pair_in_the_start_up_all_to_all_fails_naming_the_sender(tmp_path):
    """One all-reduce passes over ring neighbours only; the sequence-parallel all-to-alls use every pair, so the
    start-up check sends a distinct row to every rank too, and a row lost on one pair names its sender."""
    (tmp_path / "sitecustomize.py").write_text(PAIR_SITECUSTOMIZE)
    pool = RankPool(PoolConfig(["cpu", "cpu"], extra_sys_path=[str(tmp_path), TESTS], error_grace_s=GRACE_S))
    with pytest.raises(RankFailure) as info:
        pool.start()
    text = str(info.value)
    assert "the start-up all-to-all over 2 ranks returned wrong values on rank 0 (cpu) from rank 1" in text, text
    assert info.value.rank == 1 and not pool.alive
