"""A training run on real gloo ranks (mgpu.training), without a ComfyUI host: ComfyUI's own tiny WanModel sharded
over 2 cpu ranks trains the same adapters as the unsharded model in one process, only the adapters' gradients are
reduced, and a cancelled or failed run leaves the pool and the model as they were (the next run equals a fresh one;
a killed rank is named and the pool rebuilds)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

import tiny_models as tm
from comfyui_env import SKIP_REASON
from mgpu.errors import CallCancelled, RankFailure
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import ModelSpec, ShardedModule
from mgpu.training.run import TrainingRun

pytestmark = [pytest.mark.comfyui, pytest.mark.skipif(tm.comfyui_path() is None, reason=SKIP_REASON)]

TESTS = os.path.dirname(os.path.abspath(__file__))
FACTORY = "loaders.train_adapters:build"
MODE = "loaders.train_adapters:training_mode"
RANK = 4


def first_adapters(model: nn.Module, seed: int = 0) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """A LoRA on every 2-D layer (both factors random, so the first step already moves every weight) and a zero
    difference on every bias, in module order, as the host sends them."""
    g = torch.Generator().manual_seed(seed)
    specs, first = [], {}
    for name, module in model.named_modules():
        if not hasattr(module, "weight_function") or getattr(module, "weight", None) is None:
            continue
        if module.weight.ndim >= 2:
            out_dim, in_dim = module.weight.shape[0], module.weight[0].numel()
            specs.append({"key": f"{name}.weight", "kind": "adapter"})
            first[f"{name}.lora_up.weight"] = torch.randn(out_dim, RANK, generator=g) * 0.1
            first[f"{name}.lora_down.weight"] = torch.randn(RANK, in_dim, generator=g) * 0.1
            first[f"{name}.alpha"] = torch.tensor(2.0)
        if getattr(module, "bias", None) is not None:
            specs.append({"key": f"{name}.bias", "kind": "diff"})
            first[f"{name}.diff_b"] = torch.zeros(module.bias.shape)
    return specs, first


def start(run: TrainingRun, specs, first, lr: float = 1e-2) -> dict:
    return run.start(specs, first, factory=FACTORY, mode=MODE, optimizer="AdamW", learning_rate=lr,
                     training_dtype="fp32", lora_dtype="fp32", gradient_checkpointing=True)


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def reference_run(reference: nn.Module, specs, first, inputs, target, steps: int, lr: float = 1e-2):
    """The same training in one process: the adapters in the unsharded model's layers, one AdamW."""
    from loaders.train_adapters import build, training_mode
    from mgpu.training import adapters

    model = tm.tiny_comfy_wan()
    model.load_state_dict(reference.state_dict())
    found = build(specs, first, "fp32", torch.device("cpu"))
    adapters.attach(model, found)
    params = adapters.trainable(found)
    opt = torch.optim.AdamW(params.values(), lr=lr)
    training_mode(True)
    try:
        for _ in range(steps):
            loss_of(model(**inputs), target).backward()
            opt.step()
            opt.zero_grad()
    finally:
        training_mode(False)
    return adapters.state(found)


def sharded_wan(pool: RankPool, path, reference: nn.Module, **spec) -> ShardedModule:
    """The tiny ComfyUI Wan of ``path`` loaded over ``pool``'s ranks (``spec``: more ModelSpec fields)."""
    model = ShardedModule(pool, ModelSpec(factory="tiny_models:tiny_comfy_wan", checkpoint=str(path),
                                          key_prefix=tm.checkpoint_prefix(reference), cached_inputs=("context",),
                                          **spec))
    model.load()
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    reference = tm.reference("comfy_wan")
    path = tmp_path_factory.mktemp("train") / "wan.safetensors"
    tm.save_checkpoint(reference, path)
    pool = RankPool(PoolConfig(devices=["cpu", "cpu"], extra_sys_path=[TESTS], call_timeout_s=120))
    sharded = sharded_wan(pool, path, reference)
    yield reference, sharded, pool
    pool.close()


def data(batch: int = 3):
    inputs = tm.comfy_wan_inputs(batch, seed=1)
    target = torch.randn(batch, 4, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    return inputs, target


def train(sharded: ShardedModule, specs, first, inputs, target, steps: int, cancelled=None):
    run = TrainingRun(sharded, cancelled=cancelled)
    try:
        start(run, specs, first)
        for _ in range(steps):
            loss_of(run.network(**inputs), target).backward()
            run.step()
        return run.adapters(), run
    finally:
        run.stop()


def test_two_ranks_train_what_one_process_trains(setup):
    """3 rows over 2 ranks (2 + 1), gradient checkpointing on the ranks, 3 AdamW steps: the adapters equal the
    unsharded model's, trained in one process; per step the ranks reduce exactly the adapters' gradients."""
    reference, sharded, _ = setup
    specs, first = first_adapters(reference)
    inputs, target = data()
    trained, run = train(sharded, specs, first, inputs, target, steps=3)
    want = reference_run(reference, specs, first, inputs, target, steps=3)
    assert list(trained) == list(want)
    for key in want:
        torch.testing.assert_close(trained[key], want[key], rtol=2e-5, atol=2e-6, msg=key)
    assert any(not torch.equal(trained[k], first[k]) for k in first if k.endswith("lora_down.weight"))
    grad_bytes = sum(first[k].numel() * 4 for k in first if not k.endswith(".alpha"))
    assert run.bytes["adapter_reduce"] == 3 * grad_bytes, "one fp32 all-reduce of every adapter gradient per step"
    assert run.started["checkpointed_units"] == 3


@pytest.mark.parametrize("rows", [1, 3])
def test_a_sequence_parallel_model_trains_one_row_over_both_ranks(setup, tmp_path, rows):
    """The model loaded with sequence parallelism (degree 2): one row (one long video) splits its tokens over both
    ranks in forward and backward (the all-to-alls and the output gather carry gradients), and so do 3 rows
    (sampling's choice: even shares, where rows would split 2 + 1); with gradient checkpointing (the recompute
    exchanges tokens again) the adapters equal the unsharded model's trained in one process."""
    reference, _, pool = setup
    path = tmp_path / "wan.safetensors"
    tm.save_checkpoint(reference, path)
    sharded = sharded_wan(pool, path, reference, sp_degree=2)
    try:
        specs, first = first_adapters(reference, seed=3)
        inputs, target = data(rows)
        trained, _ = train(sharded, specs, first, inputs, target, steps=3)
        assert sharded.split == (1, 2)
    finally:
        sharded.free()
    want = reference_run(reference, specs, first, inputs, target, steps=3)
    for key in want:
        torch.testing.assert_close(trained[key], want[key], rtol=2e-5, atol=2e-6, msg=key)
    assert any(not torch.equal(trained[k], first[k]) for k in first if k.endswith("lora_down.weight"))


def test_a_cancelled_run_leaves_the_model_and_the_next_run_equals_a_fresh_one(setup):
    """Cancel during a run's forward: CallCancelled with the pool kept; the model's sampling output is what it was
    before the run (the adapters came off), and a new run trains exactly as the first run did."""
    reference, sharded, pool = setup
    specs, first = first_adapters(reference, seed=1)
    inputs, target = data()
    with torch.no_grad():
        before = sharded(**inputs)   # the context is now cached on the ranks, as when sampling
    fresh, _ = train(sharded, specs, first, inputs, target, steps=2)
    torch.testing.assert_close(sharded(**inputs), before, rtol=0, atol=0)
    with pytest.raises(CallCancelled) as info:
        train(sharded, specs, first, inputs, target, steps=2, cancelled=lambda: True)
    assert info.value.pool_kept and pool.alive
    torch.testing.assert_close(sharded(**inputs), before, rtol=0, atol=0)
    again, _ = train(sharded, specs, first, inputs, target, steps=2)
    for key in fresh:
        assert torch.equal(again[key], fresh[key]), key


def test_a_cancel_during_a_backward_lets_the_step_finish_and_stops_at_the_next_forward(setup):
    """Cancel pressed while the ranks run a backward (on a GPU: seconds; the pool gives ranks 3 s to agree): the
    backward and the optimizer step run to their end (the step's update is kept), and the next forward stops the run
    at a block boundary with the pool kept, so a checkpoint of the finished steps can still be written. (On cpu
    ranks a backward ends well inside the pool's grace, so this holds even if backward watched the Cancel; on a GPU
    it would not: TrainingRun passes the Cancel to forwards only.)"""
    reference, sharded, pool = setup
    specs, first = first_adapters(reference, seed=7)
    inputs, target = data()
    run = TrainingRun(sharded)
    try:
        start(run, specs, first)
        out = run.network(**inputs)
        run.cancelled = lambda: True   # Cancel, from here on
        loss_of(out, target).backward()
        run.step()
        stepped = run.adapters()
        assert any(not torch.equal(stepped[k], first[k]) for k in first if k.endswith("lora_down.weight"))
        with pytest.raises(CallCancelled) as info:
            run.network(**inputs)
        assert info.value.pool_kept and pool.alive
        run.cancelled = None
        assert all(torch.equal(run.adapters()[k], stepped[k]) for k in stepped)
    finally:
        run.stop()


def test_a_killed_rank_is_named_and_the_pool_rebuilds(setup):
    reference, sharded, pool = setup
    specs, first = first_adapters(reference, seed=2)
    inputs, target = data()
    run = TrainingRun(sharded)
    start(run, specs, first)
    pid = [r.payload["pid"] for r in pool.call("ping")][1]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RankFailure) as info:
        loss_of(run.network(**inputs), target).backward()
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    run.stop()   # nothing to end on ranks that are gone: no error
    sharded.load()   # the next use rebuilds the pool
    with torch.no_grad():
        assert torch.isfinite(sharded(**inputs)).all()
