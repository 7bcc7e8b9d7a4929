"""Ulysses sequence parallelism inside ComfyUI's own WanModel, sharded with FSDP over 4 real gloo ranks: the
tokens of one sample split over 4 ranks, or over 2 ranks per CFG branch (a 2 x 2 mesh), equal the single-device
forward; 45 tokens divide by neither degree. Heads that the degree does not divide get the largest degree that does."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import tiny_models as tm
from comfyui_env import SKIP_REASON
from sp_wan_models import TOKENS, tiny_wan, wan_inputs

from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.model_ops import batch_rows
from mgpu.sharding.sharded import ModelSpec, ShardedModule

pytestmark = [pytest.mark.comfyui, pytest.mark.skipif(tm.comfyui_path() is None, reason=SKIP_REASON),
              pytest.mark.timeout(900)]

TESTS = os.path.dirname(os.path.abspath(__file__))
RANKS = 4
REL = 1e-4   # fp32: the split changes only the order of float sums


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(PoolConfig(devices=["cpu"] * RANKS, extra_sys_path=[TESTS], call_timeout_s=300))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> dict[int, tuple[str, torch.nn.Module]]:
    """Checkpoints (ComfyUI key layout) and single-device references of a 4-head and a 6-head model."""
    folder = tmp_path_factory.mktemp("sp_wan")
    models = {}
    for heads in (4, 6):
        reference = tm.seeded_init(tiny_wan(heads, 16 * heads)).eval()
        path = str(folder / f"wan{heads}.safetensors")
        tm.save_checkpoint(reference, path)
        models[heads] = (path, reference)
    return models


def _load(pool: RankPool, wan: dict, heads: int, sp_degree: int) -> ShardedModule:
    path, _ = wan[heads]
    model = ShardedModule(pool, ModelSpec(factory="sp_wan_models:tiny_wan", checkpoint=path,
                                          factory_kwargs={"heads": heads, "dim": 16 * heads},
                                          cached_inputs=("context",), sp_degree=sp_degree))
    model.load()
    return model


@pytest.fixture(scope="module", params=[4, 2], ids=["sp4", "cfg2xsp2"])
def sharded(request, pool, wan):
    model = _load(pool, wan, 4, request.param)
    yield model
    model.free()


def _relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("per_token", [False, True], ids=["timestep", "per_token_timestep"])
@pytest.mark.parametrize("batch", [1, 2])
def test_sequence_parallel_forward_equals_single_device(sharded, wan, batch, per_token):
    """Batch 1 (cfg 1), batch 2 (cond + uncond); a timestep per sample, or per token as Wan 2.2 TI2V feeds it."""
    inputs = wan_inputs(batch, seed=batch, per_token=per_token)
    with torch.no_grad():
        want = wan[4][1](**inputs)
    diff = _relative_diff(sharded(**inputs), want)
    print(f"sp {sharded.load_replies[0]['layout']} batch {batch} per_token {per_token}: relative diff {diff:.3g}")
    assert diff <= REL


def test_parameters_are_sharded_over_every_rank(sharded, wan):
    """FSDP still shards over all 4 ranks, across the CFG groups: each holds about a quarter of the weights."""
    total = sum(t.numel() * t.element_size() for t in wan[4][1].state_dict().values())
    for reply in sharded.load_replies:
        assert reply["local_param_bytes"] < total / RANKS * 1.1 + 8192


def test_each_rank_of_a_group_attends_its_own_tokens(sharded, pool):
    """The self-attention of each rank gets its contiguous chunk of the 45 tokens (the rest come by all-to-all)."""
    sp = sharded.load_replies[0]["layout"]["sp"]
    replies = pool.call("sp_wan_models:self_attention_tokens", {"handle": sharded.handle}, wan_inputs(1))
    chunks = [TOKENS // sp + (1 if r % sp < TOKENS % sp else 0) for r in range(RANKS)]
    assert [r.payload["tokens"] for r in replies] == [[n] for n in chunks]


def test_the_first_rank_of_each_cfg_group_answers_with_its_rows(sharded, monkeypatch):
    replies = []
    real_call = sharded.pool.call

    def spy(op, payload=None, tensors=None, **kwargs):
        out = real_call(op, payload, tensors, **kwargs)
        replies.extend(out)
        return out

    monkeypatch.setattr(sharded.pool, "call", spy)
    sharded(**wan_inputs(2, seed=5))
    cfg, sp = replies[0].payload["layout"]
    assert (cfg, sp) == (2, 2)   # CFG's 2 rows: one per pair of ranks, whatever the widest degree
    answering = {r.rank: tuple(r.payload["rows"]) for r in replies if "out" in r.tensors}
    assert answering == {g * sp: batch_rows(2, cfg, g) for g in range(cfg)}


def test_heads_the_degree_does_not_divide_get_the_largest_degree_that_does(pool, wan, caplog):
    """6 heads, degree 4 asked on 4 ranks: degree 2 (2 CFG groups of 2), said on the host, and still exact."""
    with caplog.at_level(logging.WARNING, logger="mgpu.sharding.sharded"):
        model = _load(pool, wan, 6, 4)
    try:
        layout = model.load_replies[0]["layout"]
        assert (layout["cfg"], layout["sp"], layout["degrees"]) == (2, 2, [1, 2])
        assert "6 attention heads" in layout["note"] and "using degree 2" in layout["note"]
        assert layout["note"] in caplog.text
        inputs = wan_inputs(2, seed=3)
        with torch.no_grad():
            want = wan[6][1](**inputs)
        assert _relative_diff(model(**inputs), want) <= REL
    finally:
        model.free()
