"""Training checkpoints on real gloo ranks (``mgpu.training.ops.save_state`` / ``load_state``, host side
``mgpu.training.checkpoints``): a run saved after 2 of 4 AdamW steps and resumed in a fresh run ends with the
uninterrupted run's adapters bit for bit; the same checkpoint resumes on 3 ranks (DCP reshards it); only folders this
pack signed are read, and a checkpoint exports as one safetensors LoRA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tiny_models as tm
from comfyui_env import SKIP_REASON
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.training import checkpoints as ck
from mgpu.training.run import TrainingRun
from test_training_ranks import TESTS, data, first_adapters, loss_of, sharded_wan, start

ROOT = os.path.dirname(TESTS)
pytestmark = [pytest.mark.comfyui, pytest.mark.skipif(tm.comfyui_path() is None, reason=SKIP_REASON)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    reference = tm.reference("comfy_wan")
    path = tmp_path_factory.mktemp("ckpt") / "wan.safetensors"
    tm.save_checkpoint(reference, path)
    pool = RankPool(PoolConfig(devices=["cpu", "cpu"], extra_sys_path=[TESTS], call_timeout_s=120))
    yield reference, path, sharded_wan(pool, path, reference)
    pool.close()


def _steps(run: TrainingRun, inputs, target, n: int) -> None:
    for _ in range(n):
        loss_of(run.network(**inputs), target).backward()
        run.step()


def _train(sharded, specs, first, inputs, target, steps: int, save_to=None, resume_from=None):
    """A run of ``steps`` optimizer steps, from ``first`` or from a checkpoint folder; optionally saved at its end."""
    run = TrainingRun(sharded)
    try:
        start(run, specs, first)
        if resume_from is not None:
            run.load(str(resume_from))
        _steps(run, inputs, target, steps)
        if save_to is not None:
            run.save(str(save_to))
        return run.adapters()
    finally:
        run.stop()


def _state(world: int) -> ck.HostState:
    return ck.HostState(run="r", optimizer_steps=2, micro_steps=2, rng=ck.HostState.encode_rng(torch.get_rng_state()),
                        losses=[1.0, 0.5], fingerprint={"lr": 0.01}, keys=[], prefix="", world_size=world)


def test_resume_equals_the_uninterrupted_run_bit_for_bit_and_on_three_ranks(setup, tmp_path):
    reference, path, sharded = setup
    specs, first = first_adapters(reference, seed=5)
    inputs, target = data()
    key = ck.signing_key(tmp_path / "user")
    uninterrupted = _train(sharded, specs, first, inputs, target, 4)

    folder = ck.step_folder(tmp_path / "out", "r", 2)
    halfway = _train(sharded, specs, first, inputs, target, 2, save_to=folder)
    ck.write_host_state(folder, _state(2))
    ck.sign(folder, key)
    files = sorted(p.name for p in folder.iterdir())
    assert "__0_0.distcp" in files and "__1_0.distcp" in files, files   # each rank wrote its own shard
    assert ck.verify(folder, key).optimizer_steps == 2

    resumed = _train(sharded, specs, first, inputs, target, 2, resume_from=folder)
    assert list(resumed) == list(uninterrupted)
    for k in uninterrupted:
        assert torch.equal(resumed[k], uninterrupted[k]), k
    assert any(not torch.equal(uninterrupted[k], halfway[k]) for k in halfway)

    pool3 = RankPool(PoolConfig(devices=["cpu"] * 3, extra_sys_path=[TESTS], call_timeout_s=120))
    try:
        three = sharded_wan(pool3, path, reference)
        loaded = _train(three, specs, first, inputs, target, 0, resume_from=folder)
        for k in halfway:   # the state DCP resharded for 3 ranks is what 2 ranks saved, bit for bit
            assert torch.equal(loaded[k], halfway[k]), k
        on_three = _train(three, specs, first, inputs, target, 2, resume_from=folder)
        # 3 ranks save it again: rows that 3 ranks cannot all share (4 LoRA rows: chunks 2, 2, 0) stay whole
        again = tmp_path / "three"
        _train(three, specs, first, inputs, target, 0, save_to=again, resume_from=folder)
    finally:
        pool3.close()
    ck.write_host_state(again, _state(3))
    ck.sign(again, key)
    back = _train(sharded, specs, first, inputs, target, 0, resume_from=again)   # and 2 ranks read that
    for k in halfway:
        assert torch.equal(back[k], halfway[k]), k
    for k in uninterrupted:   # 3 ranks sum the rows' gradients in another order: float rounding only
        torch.testing.assert_close(on_three[k], uninterrupted[k], rtol=1e-5, atol=1e-6, msg=k)

    out = tmp_path / "lora.safetensors"
    host = ck.read_host_state(folder)
    host.keys, host.prefix = [f"diffusion_model.{k}" for k in halfway], "diffusion_model."
    ck.write_host_state(folder, host)
    ck.sign(folder, key)
    from safetensors.torch import load_file

    assert ck.export_lora(folder, key, out) == host.keys
    exported = load_file(str(out))
    for k in halfway:
        assert torch.equal(exported[f"diffusion_model.{k}"], halfway[k]), k

    # the same from a shell; a changed checkpoint is refused there too, with one line and exit code 2
    cli = [sys.executable, "-m", "mgpu", "export-lora", str(folder), str(tmp_path / "cli.safetensors"),
           "--key-dir", str(tmp_path / "user")]
    env = {**os.environ, "PYTHONPATH": ROOT}
    r = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert load_file(str(tmp_path / "cli.safetensors")).keys() == exported.keys()
    (folder / ck.HOST_FILE).write_text((folder / ck.HOST_FILE).read_text().replace('"run": "r"', '"run": "x"'))
    r = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "do not match the signature" in r.stderr and "Traceback" not in r.stderr


def test_only_folders_this_pack_signed_are_read(setup, tmp_path):
    reference, _, sharded = setup
    specs, first = first_adapters(reference, seed=6)
    inputs, target = data()
    key = ck.signing_key(tmp_path / "user")
    assert ck.signing_key(tmp_path / "user") == key   # made once, then read
    assert oct(os.stat(tmp_path / "user" / ck.KEY_FILE).st_mode)[-3:] == "600"
    folder = ck.step_folder(tmp_path / "out", "r", 1)
    _train(sharded, specs, first, inputs, target, 1, save_to=folder)
    ck.write_host_state(folder, _state(2))
    with pytest.raises(ck.CheckpointRefused, match="no signature from this pack"):
        ck.verify(folder, key)
    ck.sign(folder, key)
    with pytest.raises(ck.CheckpointRefused, match="do not match the signature"):
        ck.verify(folder, os.urandom(32))   # another machine's key
    meta = folder / ".metadata"
    meta.write_bytes(meta.read_bytes() + b"\0")   # a changed pickle
    with pytest.raises(ck.CheckpointRefused, match="do not match the signature"):
        ck.verify(folder, key)


def test_pruning_keeps_the_newest_signed_checkpoints(tmp_path):
    key = ck.signing_key(tmp_path / "user")
    for step in (2, 4, 6, 8):
        folder = ck.step_folder(tmp_path, "run 1", step)
        folder.mkdir(parents=True)
        ck.write_host_state(folder, _state(2))
        ck.sign(folder, key)
    unsigned = ck.step_folder(tmp_path, "run 1", 10)   # a save that died half-way, the newest: kept for a look
    unsigned.mkdir()
    removed = ck.prune(tmp_path, "run 1", 2)
    assert sorted(p.name for p in removed) == ["step_000002", "step_000004"]
    assert [p.name for p in ck.saved_steps(tmp_path, "run 1")] == ["step_000006", "step_000008", "step_000010"]
    with pytest.raises(Exception, match="names a folder"):
        ck.run_folder(tmp_path, "../elsewhere")
