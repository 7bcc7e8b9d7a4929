"""The plan of a LoRA training step (MGPU Train LoRA): what each rank holds, the ranks, checkpointing and rows per
forward it chooses, and the refusal with numbers and ways out. Full-size Wan checkpoints as sparse headers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

import ckpt_layouts as L
from mgpu.errors import PlanError, SizingError
from mgpu.planning.devices import parse_spec
from mgpu.planning.estimates import ACTIVATION_SAFETY, Workload, dit_tokens, fsdp_buffer_bytes
from mgpu.planning.partition import Component, Plan, make_plan, rank_need
from mgpu.planning.sizing import size_component
from mgpu.planning.training import (Training, adapter_params, adapter_state_bytes, dataset_bytes,
                                    train_activation_bytes)

GiB = 1 << 30


def workload(frames: int = 81, batch: int = 1, **train) -> Workload:
    return Workload(width=832, height=480, frames=frames, batch=batch, cfg=False,
                    train=Training(**{"lora_rank": 32, **train}))


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    d = tmp_path_factory.mktemp("train-plan")
    return {name: size_component(L.write_safetensors(d / f"{name}.safetensors", layout, sparse=True))
            for name, layout in (("wan14b", L.wan21_t2v_14b()), ("wan1.3b", L.wan21_t2v_1_3b()),
                                 ("ltxv", L.ltxv_2b()))}


def test_adapter_params_are_a_lora_on_every_matrix_and_every_vector_whole(sizes):
    """Counted from the header's shapes: rank x (out + in) per weight matrix, the 1-D weights and biases whole.
    For Wan 1.3B, by its dims: 30 blocks of 8 attention projections (1536 x 1536), two FFN matrices and 14 vectors
    (the biases, the q/k norms, norm3), plus the embeddings and the head; tests/test_comfyui_train.py checks the
    count against ComfyUI's own Train LoRA on the same file."""
    size = sizes["wan1.3b"]
    h, f = 1536, 8960
    per_block_sides = 8 * 2 * h + (h + f) + (f + h)
    per_block_vectors = 8 * h + f + h + 4 * h + 2 * h    # 8 projection biases, FFN biases, q/k norms, norm3
    assert size.adapter_sides >= 30 * per_block_sides
    assert size.adapter_vectors >= 30 * per_block_vectors
    assert adapter_params(size, 32) - adapter_params(size, 16) == 16 * size.adapter_sides
    assert adapter_params(size, 1) == size.adapter_sides + size.adapter_vectors


def test_a_rank_holds_its_shard_the_gathered_blocks_the_step_and_the_adapter_state(sizes):
    """rank_need for a training step: the shard as stored, and as working memory the calibrated activations of its
    rows and tokens (x the safety factor), FSDP2's gathered blocks and the adapter with its gradient and optimizer
    state; each term checked against the formulas it is made of."""
    size = sizes["wan14b"]
    wl = workload(frames=41, batch=2, checkpointing="on")
    group = parse_spec("2x80GiB")
    need = rank_need(Component("dit", size, "fp8_e4m3fn"), group, wl)
    rows, tokens = 1, dit_tokens(size, wl)   # 2 rows over 2 ranks: one each, every token
    activations = math.ceil(ACTIVATION_SAFETY * train_activation_bytes(size, tokens, rows, checkpointing=True))
    state = adapter_state_bytes(size, wl.train)
    assert state == adapter_params(size, 32) * 2 * 4 + 25 * 2**20   # values, gradient, AdamW's 2 moments; a bucket
    assert need.working == activations + state + fsdp_buffer_bytes(size, gather_itemsize=1)
    off = rank_need(Component("dit", size, "fp8_e4m3fn"), group, replace(wl, train=replace(wl.train,
                                                                                              checkpointing="off")))
    assert off.working > 10 * need.working   # every block's activations and patched weights wait for the backward
    sgd = rank_need(Component("dit", size, "fp8_e4m3fn"), group, replace(wl, train=replace(wl.train, optimizer="SGD")))
    assert need.working - sgd.working == adapter_params(size, 32) * 2 * 2


def test_the_plan_trains_without_checkpointing_when_that_fits_and_with_it_when_not(sizes):
    size = sizes["wan1.3b"]
    roomy = make_plan([Component("dit", size)], parse_spec("2x141GiB,cpu=64GiB"), workload(frames=17))
    dit = roomy.placement("dit")
    assert dit.strategy == "fsdp" and dit.devices == ["cuda:0", "cuda:1"]   # every GPU trains
    assert dit.training["gradient_checkpointing"] is False and dit.training["batch_size"] == 1
    assert any("no gradient checkpointing" in r for r in dit.reasons)
    tight = make_plan([Component("dit", size)], parse_spec("2x24GiB,cpu=64GiB"), workload(frames=81))
    dit = tight.placement("dit")
    assert dit.training["gradient_checkpointing"] is True
    assert any(r.startswith("tried first: 1 row per forward (1 per rank), gradient checkpointing off")
               for r in dit.reasons)
    assert Plan.from_json(tight.to_json()).placement("dit").training == dit.training
    assert tight.workload["train"]["lora_rank"] == 32 and not tight.workload["cfg"]


def test_rows_that_do_not_fit_at_once_are_split_into_accumulated_forwards(sizes):
    """4 rows per step on 2 x 24 GiB: 2 rows per rank do not fit, 1 does: 2 rows per forward and twice the
    gradient accumulation, so each optimizer step still sums 4 rows (x the asked accumulation of 3)."""
    size = sizes["wan1.3b"]
    devices = parse_spec("2x24GiB,cpu=64GiB")
    wl = workload(frames=101, batch=4, checkpointing="on", grad_accumulation=3)
    one = rank_need(Component("dit", size), devices[:2], replace(wl, batch=2))
    two = rank_need(Component("dit", size), devices[:2], wl)
    budget = 24 * GiB - 512 * 2**20
    assert one.shard + one.process + one.working <= budget < two.shard + two.process + two.working
    dit = make_plan([Component("dit", size)], devices, wl).placement("dit")
    assert dit.training == {"gradient_checkpointing": True, "batch_size": 2, "grad_accumulation_steps": 6,
                            "adapter_params": adapter_params(size, 32),
                            "dataset_bytes": {"cpu": dataset_bytes(size, wl)}}
    assert dit.batch_per_rank == 1
    assert any("4 rows per forward" not in r and "(12 rows, as asked)" in r for r in dit.reasons)


def test_a_step_that_fits_nowhere_is_refused_with_each_need_and_the_frames_that_fit(sizes):
    """Wan 2.1 14B fp8, rank 32, 480p x 81 on 2 x 24 GiB (README's plan): refused, with each rank's need against
    its budget, the ways out, and the most frames that fit, which do fit while 4 more do not."""
    size = sizes["wan14b"]
    devices = parse_spec("2x24GiB,cpu=64GiB")
    with pytest.raises(PlanError) as e:
        make_plan([Component("dit", size, "fp8_e4m3fn")], devices, workload())
    text = str(e.value)
    assert "DiT sharded over 2 GPUs needs" in text and "gradient checkpointing on" in text, text
    assert "smallest budget is 23.5 GiB" in text
    assert "a smaller LoRA rank than 32" in text and "use more GPUs" in text
    assert "fp8 base" not in text   # it is one already
    assert "fewer rows per step" not in text   # 1 row per forward was tried already
    frames = int(text.split("up to ")[1].split(" at 832x480")[0])
    assert 1 < frames < 81 and (frames - 1) % 4 == 0
    assert make_plan([Component("dit", size, "fp8_e4m3fn")], devices, workload(frames=frames))
    with pytest.raises(PlanError):
        make_plan([Component("dit", size, "fp8_e4m3fn")], devices, workload(frames=frames + 4))
    with pytest.raises(PlanError) as e:   # checkpointing forced off: the first way out is to turn it on
        make_plan([Component("dit", size, "fp8_e4m3fn")], devices, workload(checkpointing="off"))
    assert "ways out: turn gradient checkpointing on" in str(e.value)
    with pytest.raises(PlanError) as e:   # not even one frame at 8K: no frame count to offer
        make_plan([Component("dit", size, "fp8_e4m3fn")], devices, replace(workload(), width=7680, height=4320))
    assert "train at a smaller size than 7680x4320 (not even one frame of it fits" in str(e.value)


def test_four_16_gib_gpus_are_tried_first_with_the_tokens_split_four_ways(sizes):
    """README's second plan: on 4 x 16 GiB the 14B fp8 step at 480p x 81 is tried on every GPU first, each with 1/4
    of the tokens, the least per rank of all the groups; it does not fit either, and the refusal says what does."""
    with pytest.raises(PlanError) as e:
        make_plan([Component("dit", sizes["wan14b"], "fp8_e4m3fn")], parse_spec("4x16GiB,cpu=64GiB"), workload())
    attempts = [line for line in str(e.value).splitlines() if "DiT sharded over" in line]
    assert [a.split("sharded over ")[1].split(" GPU")[0] for a in attempts] == ["4", "3", "2", "1"]
    assert "1/4 of the tokens" in attempts[0]
    needs = [float(a.split("needs ")[1].split(" GiB")[0]) for a in attempts]
    assert needs[0] == min(needs) and needs[0] > 15.5
    assert "smallest budget is 15.5 GiB" in attempts[0] and "up to " in str(e.value)


def test_the_dataset_is_held_in_host_ram_and_counted_there(sizes):
    size = sizes["wan1.3b"]
    wl = workload(frames=17, dataset=200)
    plan = make_plan([Component("dit", size)], parse_spec("2x141GiB,cpu=64GiB"), wl)
    host = next(u for u in plan.usage if u.device == "cpu")
    assert host.by_phase["sample"] == dataset_bytes(size, wl) == 200 * (16 * 5 * 60 * 104 * 4 + 512 * 4096 * 4)
    with pytest.raises(PlanError) as e:   # refused before any model is placed, with its own ways out
        make_plan([Component("dit", size)], parse_spec("2x141GiB,cpu=64GiB"), replace(wl, train=replace(
            wl.train, dataset=200_000)))
    assert "the training dataset's 200000 latent(s) of 17 x 832x480" in str(e.value)
    assert "Ways out: fewer latents in the dataset, a smaller size, or more free host RAM" in str(e.value)
    assert e.value.needs == [{"device": "cpu", "budget_bytes": 60 * GiB, "committed_bytes": 0}]


def test_training_plans_refuse_what_the_trainer_cannot_train(sizes):
    with pytest.raises(SizingError, match="MGPU Train LoRA trains Wan DiTs"):
        make_plan([Component("dit", sizes["ltxv"])], parse_spec("2x80GiB,cpu=64GiB"), workload())
    with pytest.raises(SizingError, match="optimizer 'Lion'"):
        Training(optimizer="Lion")


def test_a_training_steps_time_counts_its_backward_and_recompute():
    """The step-time model for training: 3 forwards' compute without checkpointing, 4 with it (the recompute);
    the all-gathers twice (forward and backward) when resharding, the sequence exchanges 2 or 3 times; the same
    split on one GPU computes the same passes, so the ratio is what communication costs."""
    from mgpu.planning import parallel

    group = parse_spec("2x24GiB:pcie")[:2]
    args = dict(params=14_000_000_000, weight_bytes=14 << 30, tokens=32760, rows=1, hidden=5120, layers=40)

    def run(training):
        return parallel.estimate(parallel.Degrees(ranks=2, cfg=1, sp=2), group, **args, training=training)

    sampling, off, on = run(None), run("off"), run("on")
    assert off.single_seconds == pytest.approx(3 * sampling.single_seconds)
    assert on.single_seconds == pytest.approx(4 * sampling.single_seconds)
    moved = {name: d.step_seconds - d.single_seconds / 2 for name, d in (("sampling", sampling), ("off", off),
                                                                         ("on", on))}
    gather = (14 << 30) / 2 / parallel.LINK_BYTES_PER_S["pcie"]
    exchange = moved["sampling"] - gather
    assert moved["off"] == pytest.approx(2 * gather + 2 * exchange)
    assert moved["on"] == pytest.approx(2 * gather + 3 * exchange)
