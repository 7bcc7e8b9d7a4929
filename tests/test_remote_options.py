"""ComfyUI's ``transformer_options`` on the way to the FSDP ranks: what travels, what is cut to each rank's rows, what
is refused with its name. No ComfyUI needed; tests/test_comfyui_host.py checks the key lists against real sampling."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import tiny_models as T
from loaders.transformer_options import HOST_ONLY, PER_CHUNK, REFUSED, WHOLE, for_ranks
from mgpu.errors import MgpuError
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import ModelSpec, PerChunk, ShardedModule

TESTS = os.path.dirname(os.path.abspath(__file__))
LABEL = "wan.safetensors sharded over 2 ranks (cuda:0, cuda:1)"


def sampling_options(batch: int = 2) -> dict:
    """transformer_options as ComfyUI's sampler passes them for one step of cond + uncond."""
    return {"wrappers": {"diffusion_model": {}}, "callbacks": {}, "sample_sigmas": torch.linspace(1, 0, 4),
            "cond_or_uncond": [1, 0], "uuids": [uuid.uuid4(), uuid.uuid4()], "sigmas": torch.full((batch,), 0.5),
            "mgpu_fsdp": {"timeout_s": 60.0}}


def test_the_classes_do_not_overlap() -> None:
    names = [*HOST_ONLY, *WHOLE, *PER_CHUNK, *REFUSED]
    assert len(names) == len(set(names))


def test_a_sampling_step_sends_the_network_data_and_keeps_the_host_machinery() -> None:
    options = sampling_options(batch=4)
    sent = for_ranks(options, 4, LABEL)
    assert set(sent) == {"sample_sigmas", "cond_or_uncond", "uuids", "sigmas"}
    assert sent["sample_sigmas"] is options["sample_sigmas"]                     # whole, never cut by rows
    assert sent["cond_or_uncond"] == PerChunk([1, 0]) and sent["uuids"] == PerChunk(options["uuids"])
    assert isinstance(sent["sigmas"], PerChunk) and sent["sigmas"].value is options["sigmas"]


def test_empty_patches_travel_as_they_are() -> None:
    sent = for_ranks({**sampling_options(), "patches": {}, "patches_replace": {}}, 2, LABEL)
    assert sent["patches"] == {} and sent["patches_replace"] == {}


def test_an_unknown_option_is_refused_by_name_not_dropped() -> None:
    with pytest.raises(MgpuError) as info:
        for_ranks({**sampling_options(), "my_node_strength": 0.7}, 2, LABEL)
    text = str(info.value)
    assert text.startswith(f"{LABEL}: the sampler passes transformer_options that cannot reach the FSDP ranks: "
                           "my_node_strength (not known to this pack")
    assert "remove the node that sets it, or load the model on one device" in text


def test_patches_are_refused_with_the_nodes_that_set_them() -> None:
    with pytest.raises(MgpuError, match=r"patches_replace \(set by nodes that replace attention or blocks.*; "
                                        r"optimized_attention_override \(set by nodes that choose the attention"):
        for_ranks({**sampling_options(), "patches_replace": {"attn1": {("output", 0): object()}},
                   "optimized_attention_override": print}, 2, LABEL)


def test_code_where_data_belongs_is_refused() -> None:
    with pytest.raises(MgpuError, match=r"rope_options \(holds dict, not plain data\)"):
        for_ranks({**sampling_options(), "rope_options": {"scale_t": print}}, 2, LABEL)


def test_per_chunk_values_that_do_not_divide_the_batch_are_refused() -> None:
    with pytest.raises(MgpuError, match=r"cond_or_uncond \(2 entries for a batch of 3 rows\)"):
        for_ranks(sampling_options(batch=3), 3, LABEL)


# ------------------------------------------------------------------------------------------------ on real ranks

@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "probe.safetensors"
    T.save_checkpoint(T.reference("mlp"), path)
    pool = RankPool(PoolConfig(devices=["cpu"] * 3, extra_sys_path=[TESTS], call_timeout_s=120))
    model = ShardedModule(pool, ModelSpec(factory="options_probe:options_probe", checkpoint=str(path)))
    model.load()
    yield model
    pool.close()


def test_each_rank_gets_the_options_of_its_own_rows(probe) -> None:
    """Batch 4 = 2 latents x (cond, uncond) over 3 ranks: rows [0, 2), [2, 3), [3, 4). Rank 1 and 2 each hold half
    of the uncond chunk; per-chunk lists still agree with their rows, the schedule (4 long, like the batch) is whole,
    and a nested dict arrives."""
    uuids = [uuid.UUID(int=101), uuid.UUID(int=202)]
    options = {"cond_or_uncond": PerChunk([0, 1]), "uuids": PerChunk(uuids),
               "sigmas": PerChunk(torch.tensor([0.9, 0.8, 0.7, 0.6])),
               "sample_sigmas": torch.tensor([1.0, 0.5, 0.25, 0.0]), "rope_options": {"scale_t": 2.0}}
    out = probe(x=torch.randn(4, 5, 8), transformer_options=options)
    expected = torch.tensor([[0, 101, 0.9, 1.75, 2.0], [0, 101, 0.8, 1.75, 2.0],
                             [1, 202, 0.7, 1.75, 2.0], [1, 202, 0.6, 1.75, 2.0]])
    torch.testing.assert_close(out, expected)


def test_a_rank_without_rows_gets_options_that_fit_its_spare_row(probe) -> None:
    """Batch 1 over 3 ranks: ranks 1 and 2 compute row 0 to keep FSDP going and drop it; their options must fit."""
    options = {"cond_or_uncond": PerChunk([1]), "uuids": PerChunk([uuid.UUID(int=7)]),
               "sigmas": PerChunk(torch.tensor([0.3])), "sample_sigmas": torch.tensor([1.0, 0.0]),
               "rope_options": {"scale_t": 1.0}}
    out = probe(x=torch.randn(1, 5, 8), transformer_options=options)
    torch.testing.assert_close(out, torch.tensor([[1, 7, 0.3, 1.0, 1.0]]))
