"""A sharded network with two streams, as ComfyUI 0.33's LTX-2 is: lists of latents in, a list out, each stream's
rows split over the ranks and joined again; and a method outside its forward (LTX-2's text connectors) that runs on
the ranks with the root's parameters gathered. Real rank processes, gloo."""

from __future__ import annotations

import os

import pytest
import torch

import stream_models as S
import tiny_models as T
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import ModelSpec, ShardedModule

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("streams") / "two_stream.safetensors"
    reference = S.reference()
    T.save_checkpoint(reference, path)
    pool = RankPool(PoolConfig(devices=["cpu"] * 2, extra_sys_path=[TESTS], call_timeout_s=120))
    model = ShardedModule(pool, ModelSpec(factory="stream_models:two_stream", checkpoint=str(path),
                                          cached_inputs=("context",)))
    model.load()
    yield model, reference
    pool.close()


def test_the_method_outside_forward_runs_on_the_ranks_before_any_forward(sharded):
    model, reference = sharded
    context = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1))
    got = model.call("preprocess", context, scale=2.0)
    torch.testing.assert_close(got, reference.preprocess(context, scale=2.0), atol=1e-6, rtol=0)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_each_stream_is_split_by_rows_and_joined(sharded, batch):
    model, reference = sharded
    inputs = S.inputs(batch, seed=batch)
    with torch.no_grad():
        want = reference(**inputs)
    got = model(**inputs)
    assert isinstance(got, list) and len(got) == 2
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    assert model.split == (2, 1)   # the rows went to both ranks (cfg 2 x sp 1)


def test_forward_and_method_interleave(sharded):
    """The method reshards the root after it; the next forward gathers it again, and vice versa."""
    model, reference = sharded
    context = torch.randn(1, 2, 5, generator=torch.Generator().manual_seed(2))
    for seed in (4, 5):
        inputs = S.inputs(2, seed=seed)
        with torch.no_grad():
            want = reference(**inputs)
        torch.testing.assert_close(model(**inputs)[1], want[1], atol=1e-5, rtol=0)
        torch.testing.assert_close(model.call("preprocess", context), reference.preprocess(context), atol=1e-6, rtol=0)
