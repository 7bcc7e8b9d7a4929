"""The host-side handle over a real rank pool: sharded forward == single device, batch split over ranks, text context
sent once, recovery after a killed rank. Real processes, gloo, diffusers' Wan model code."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

import tiny_models as T
from mgpu.errors import CallCancelled, RankFailure
from mgpu.sharding.model_ops import batch_rows
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import ModelSpec, ShardedModule

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "wan.safetensors"
    reference = T.reference("diffusers_wan")
    T.save_checkpoint(reference, path)
    return str(path), reference


def spec(path: str) -> ModelSpec:
    return ModelSpec(factory="tiny_models:tiny_diffusers_wan", checkpoint=path,
                     cached_inputs=("encoder_hidden_states",))


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["1rank", "2ranks", "3ranks"])
def sharded(request, checkpoint):
    pool = RankPool(PoolConfig(devices=["cpu"] * request.param, extra_sys_path=[TESTS], call_timeout_s=120))
    model = ShardedModule(pool, spec(checkpoint[0]))
    model.load()
    yield model
    pool.close()


def test_batch_rows_cover_the_batch_once():
    for batch in range(0, 7):
        for ranks in range(1, 5):
            rows = [batch_rows(batch, ranks, r) for r in range(ranks)]
            covered = [i for lo, hi in rows for i in range(lo, hi)]
            assert covered == list(range(batch))
            sizes = [hi - lo for lo, hi in rows]
            assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_sharded_forward_equals_single_device(sharded, checkpoint, batch):
    inputs = T.diffusers_wan_inputs(batch, seed=batch)
    expected = T.run_diffusers_wan(checkpoint[1], inputs)
    got = sharded(**inputs, return_dict=False)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_each_rank_computes_its_own_rows(sharded, checkpoint, monkeypatch):
    """Each rank answers with its own rows of the batch, and the host puts them back in batch order."""
    replies = []
    real_call = sharded.pool.call

    def spy(op, payload=None, tensors=None, **kwargs):
        out = real_call(op, payload, tensors, **kwargs)
        replies.extend(out)
        return out

    monkeypatch.setattr(sharded.pool, "call", spy)
    n = sharded.pool.world_size
    inputs = T.diffusers_wan_inputs(n, seed=7)
    out = sharded(**inputs, return_dict=False)
    assert [tuple(r.payload["rows"]) for r in replies] == [batch_rows(n, n, r) for r in range(n)]
    assert all(r.tensors["out"].shape[0] == 1 for r in replies)
    torch.testing.assert_close(out, T.run_diffusers_wan(checkpoint[1], inputs), atol=1e-5, rtol=0)


def test_no_rank_holds_the_whole_model(sharded, checkpoint):
    total = sum(t.numel() * t.element_size() for t in checkpoint[1].state_dict().values())
    n = sharded.pool.world_size
    for reply in sharded.load_replies:
        assert reply["report"]["bytes_read"] < total / n * 1.1 + 8192
        assert reply["local_param_bytes"] < total / n * 1.1 + 8192
    assert sum(r["report"]["bytes_read"] for r in sharded.load_replies) <= total * 1.01


def test_each_rank_reads_only_its_rows_from_disk(tmp_path):
    """Measured by the kernel, not by the loader: each rank's read_chars (/proc/PID/io rchar) grows by its share of
    the file during a load. A loader that read whole tensors and sliced them would read the file N times over."""
    ranks = 2
    path = tmp_path / "wide.safetensors"
    state = T.save_checkpoint(T.seeded_init(T.wide_mlp()), path)
    file_bytes = os.path.getsize(path)
    pool = RankPool(PoolConfig(devices=["cpu"] * ranks, extra_sys_path=[TESTS], call_timeout_s=120))
    try:
        ShardedModule(pool, ModelSpec(factory="tiny_models:wide_mlp", checkpoint=str(path))).load()  # imports, caches
        procs = [psutil.Process(r.payload["pid"]) for r in pool.call("ping")]
        before = [p.io_counters().read_chars for p in procs]
        model = ShardedModule(pool, ModelSpec(factory="tiny_models:wide_mlp", checkpoint=str(path)))
        model.load()
        read = [p.io_counters().read_chars - b for p, b in zip(procs, before)]
        x = T.mlp_inputs(2)["x"]
        reference = T.seeded_init(T.wide_mlp()).eval()
        reference.load_state_dict(state)
        torch.testing.assert_close(model(x=x), reference(x), atol=1e-5, rtol=1e-5)
    finally:
        pool.close()
    share = file_bytes / ranks
    for rank, got in enumerate(read):
        assert 0.9 * share <= got <= 1.05 * share + (256 << 10), (
            f"rank {rank} read {got:,} bytes of a {file_bytes:,}-byte file shared by {ranks} ranks")


def test_a_cancelled_step_stops_between_blocks_and_the_model_stays_loaded(tmp_path):
    """ComfyUI's Cancel during a long step: every rank stops before its next block (not after the step), the pool
    and the loaded shards stay, and the next step is exact."""
    path = tmp_path / "mlp.safetensors"
    reference = T.reference("mlp")
    T.save_checkpoint(reference, path)
    pool = RankPool(PoolConfig(devices=["cpu", "cpu"], extra_sys_path=[TESTS], call_timeout_s=120))
    try:
        model = ShardedModule(pool, ModelSpec(factory="tiny_models:slow_mlp", checkpoint=str(path),
                                              factory_kwargs={"seconds_per_block": 1.0}))
        model.load()
        generation = pool.generation
        x = T.mlp_inputs(2)["x"]
        t0 = time.monotonic()
        with pytest.raises(CallCancelled) as info:
            model(x=x, cancelled=lambda: time.monotonic() - t0 > 0.5)   # the step would take 4 s
        assert time.monotonic() - t0 < 2.5 and info.value.pool_kept
        assert pool.generation == generation and model.loaded
        torch.testing.assert_close(model(x=x), reference(x), atol=1e-5, rtol=1e-5)
    finally:
        pool.close()


def test_text_context_is_sent_once(sharded, monkeypatch):
    calls = []
    real_call = sharded.pool.call

    def spy(op, payload=None, tensors=None, **kwargs):
        calls.append((op, dict(payload or {}), sorted(tensors or {})))
        return real_call(op, payload, tensors, **kwargs)

    monkeypatch.setattr(sharded.pool, "call", spy)
    inputs = T.diffusers_wan_inputs(2, seed=11)
    sharded(**inputs, return_dict=False)
    inputs["hidden_states"] = inputs["hidden_states"] + 0.5   # a new latent, the same context
    sharded(**inputs, return_dict=False)
    forwards = [c for c in calls if c[0].endswith(":forward")]
    assert len(forwards) == 2
    assert any(name.startswith("cache:") for name in forwards[0][2])
    assert not any(name.startswith("cache:") for name in forwards[1][2])
    assert "hidden_states" in forwards[1][2]


def test_changed_context_is_sent_and_used(sharded, checkpoint):
    inputs = T.diffusers_wan_inputs(1, seed=3)
    sharded(**inputs, return_dict=False)
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"] * 2   # new content: must not hit the cache
    expected = T.run_diffusers_wan(checkpoint[1], inputs)
    got = sharded(**inputs, return_dict=False)
    assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killed_rank_fails_the_call_then_the_model_reloads(checkpoint, tmp_path):
    flag = tmp_path / "in-forward"
    pool = RankPool(PoolConfig(devices=["cpu", "cpu"], extra_sys_path=[TESTS], call_timeout_s=120))
    try:
        model = ShardedModule(pool, spec(checkpoint[0]))
        inputs = T.diffusers_wan_inputs(2, seed=5)
        expected = T.run_diffusers_wan(checkpoint[1], inputs)

        def close(got: torch.Tensor) -> bool:
            return (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())

        assert close(model(**inputs, return_dict=False))

        # Killed while idle (the OOM killer between prompts): the next call rebuilds the pool and reloads the model.
        generation = pool.generation
        os.kill(pool.call("ping")[1].payload["pid"], signal.SIGKILL)
        time.sleep(0.5)
        assert close(model(**inputs, return_dict=False)) and pool.generation == generation + 1

        # Killed in the middle of a forward: that call fails naming the rank, the next one works again.
        sleepy = ShardedModule(pool, ModelSpec(factory="tiny_models:sleepy_diffusers_wan", checkpoint=checkpoint[0],
                                               factory_kwargs={"flag": str(flag)}))
        sleepy.load()
        ranks = [r.payload["pid"] for r in pool.call("ping")]
        flag.touch()
        threading.Timer(1.0, os.kill, (ranks[1], signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(RankFailure) as info:
            sleepy(**inputs, return_dict=False)
        flag.unlink()
        assert time.monotonic() - t0 < 30
        assert info.value.rank == 1 and "SIGKILL" in str(info.value)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(gone(p) for p in ranks):
            time.sleep(0.1)
        assert all(gone(p) for p in ranks)
        assert close(model(**inputs, return_dict=False))
    finally:
        pool.close()


def test_a_forward_every_rank_rejects_leaves_the_model_usable(sharded, checkpoint):
    """Bad input raises on every rank: the pool stays, the gathered blocks are resharded, the next call is exact."""
    generation = sharded.pool.generation
    bad = T.diffusers_wan_inputs(2, seed=8)
    bad["hidden_states"] = bad["hidden_states"][:, :3]     # 3 channels where the model has 4
    with pytest.raises(RankFailure) as info:
        sharded(**bad, return_dict=False)
    assert "Traceback" in str(info.value) or info.value.traceback
    assert sharded.pool.generation == generation
    inputs = T.diffusers_wan_inputs(2, seed=9)
    expected = T.run_diffusers_wan(checkpoint[1], inputs)
    torch.testing.assert_close(sharded(**inputs, return_dict=False), expected, atol=1e-5, rtol=0)


def test_releasing_cached_memory_keeps_every_rank_working(tmp_path):
    """What ComfyUI's cleanup runs after sampling (``release_cached_memory``) answers from every rank (a cpu rank has
    no caching allocator: 0 bytes), reshards units a model that reshards left gathered, keeps a model's kept-gathered
    weights, and changes no result, called twice in a row too. A model whose pool is gone starts no rank for it."""
    path = tmp_path / "mlp.safetensors"
    T.save_checkpoint(T.reference("mlp"), path)
    pool = RankPool(PoolConfig(devices=["cpu", "cpu"], extra_sys_path=[TESTS], call_timeout_s=120))
    try:
        resharding = ShardedModule(pool, ModelSpec(factory="tiny_models:tiny_mlp", checkpoint=str(path)))
        keeping = ShardedModule(pool, ModelSpec(factory="tiny_models:tiny_mlp", checkpoint=str(path),
                                                reshard_after_forward=False))
        models = (resharding, keeping)
        x = T.mlp_inputs(2, seed=4)["x"]
        before = [m(x=x) for m in models]

        def held(model: ShardedModule) -> list[int]:   # parameter bytes on each rank: its shard, or gathered
            return [d["local_param_bytes"] for d in model.describe()]

        shard, gathered = held(resharding), held(keeping)
        assert all(g > s for g, s in zip(gathered, shard))
        pool.call("fsdp_probes:unshard", {"handle": resharding.handle})
        assert held(resharding) == gathered
        for _ in range(2):
            for model in models:
                released = model.release_cached_memory()
                assert released == [{"device": "cpu", "released_bytes": 0, "reserved_bytes": 0}] * 2
            assert held(resharding) == shard and held(keeping) == gathered
            for model, expected in zip(models, before):
                torch.testing.assert_close(model(x=x), expected, rtol=0, atol=0)
    finally:
        pool.close()
    assert resharding.release_cached_memory() == [] and not pool.alive
