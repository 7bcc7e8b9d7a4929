"""`python -m mgpu devices | plan` as a user runs them: real processes, real exit codes, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_layouts as L
from mgpu.planning.partition import Plan

ROOT = Path(__file__).resolve().parents[1]


def mgpu(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "MGPU_DEVICES"}
    full_env.update({"PYTHONPATH": str(ROOT), **(env or {})})
    return subprocess.run([sys.executable, "-m", "mgpu", *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    return {
        "dit": L.write_safetensors(d / "wan2.1_t2v_14B_bf16.safetensors", L.wan21_t2v_14b(), sparse=True),
        "te": L.write_safetensors(d / "umt5_xxl_bf16.safetensors", L.umt5_xxl(), sparse=True),
        "vae": L.write_safetensors(d / "wan_2.1_vae.safetensors", L.wan_vae(), sparse=True),
        "notst": L.write_not_safetensors(d / "model.ckpt", "zip"),
        "dir": d,
    }


def test_devices_lists_simulated_gpus_and_the_host():
    r = mgpu("devices", "--devices", "2x24GiB:nvlink,cpu=64GiB", "--json")
    assert r.returncode == 0, r.stderr
    devices = json.loads(r.stdout)
    assert [d["id"] for d in devices] == ["cuda:0", "cuda:1", "cpu"]
    assert devices[0]["total_bytes"] == 24 << 30 and devices[0]["links"] == [[1, "nvlink"]]
    table = mgpu("devices", "--devices", "2x24GiB").stdout
    assert "cuda:1" in table and "24 GiB" in table and "simulated" in table


def test_devices_env_var_is_honoured():
    r = mgpu("devices", "--json", env={"MGPU_DEVICES": "cuda:0=80GiB,cpu=8GiB"})
    assert [d["id"] for d in json.loads(r.stdout)] == ["cuda:0", "cpu"]


def test_plan_table_and_json(files):
    common = ["--dit", str(files["dit"]), "--text-encoder", str(files["te"]), "--vae", str(files["vae"]),
              "--width", "832", "--height", "480", "--frames", "81", "--devices", "2x24GiB,cpu=64GiB"]
    r = mgpu("plan", *common)
    assert r.returncode == 0, r.stderr
    assert "fsdp on cuda:0, cuda:1" in r.stdout and "headroom" in r.stdout
    r = mgpu("plan", *common, "--json")
    p = Plan.from_json(r.stdout)
    assert p.placement("dit").strategy == "fsdp" and p.workload["width"] == 832


def test_plan_that_cannot_fit_exits_3_with_numbers(files):
    r = mgpu("plan", "--dit", str(files["dit"]), "--width", "1280", "--height", "720", "--devices", "1x24GiB,cpu=64GiB")
    assert r.returncode == 3
    assert "no plan fits" in r.stderr and "cuda:0: budget" in r.stderr and "fp8" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("case", ["missing", "not_safetensors", "bad_spec", "bad_size", "bad_dtype"])
def test_bad_input_exits_2_with_one_line(files, case):
    args = {
        "missing": ["--dit", str(files["dir"] / "nope.safetensors")],
        "not_safetensors": ["--dit", str(files["notst"])],
        "bad_spec": ["--dit", str(files["dit"]), "--devices", "3x"],
        "bad_size": ["--dit", str(files["dit"]), "--frames", "0"],
        "bad_dtype": ["--dit", str(files["dit"]), "--dit-weight-dtype", "fp7"],
    }[case]
    r = mgpu("plan", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    expected = {"missing": "nope.safetensors", "not_safetensors": "model.ckpt", "bad_spec": "3x",
                "bad_size": "frames", "bad_dtype": "fp7"}[case]
    assert expected in r.stderr


def test_demo_shards_and_matches_one_device():
    r = mgpu("demo", "--dim", "64", "--heads", "2", "--ffn", "128", "--layers", "2", "--steps", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: sharded matches one device" in r.stdout
    assert "ranks: 2 on cpu, cpu" in r.stdout and "all-gathered per step" in r.stdout
    # what it prints it does is what it does: no "dit: cpu on cpu" plan before sharding over cpu ranks
    assert "demo: the DiT sharded with FSDP over 2 cpu ranks" in r.stdout and "dit: cpu" not in r.stdout
    assert "split per step (CFG groups x sequence-parallel ranks, 2 rows per step): 2x1, 2x1" in r.stdout
    assert "sharded/single" in r.stdout


TINY_DEMO = ("--dim", "64", "--heads", "2", "--ffn", "128", "--layers", "2", "--steps", "2")


def test_demo_sequence_parallel_splits_the_tokens_of_each_cfg1_step_over_every_rank():
    """``--parallel sp``: no CFG, one row per step, its 320 tokens split over both ranks, == one device."""
    r = mgpu("demo", *TINY_DEMO, "--parallel", "sp", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: sharded matches one device" in r.stdout
    assert "with each step's tokens split over all 2 (Ulysses sequence parallelism), 2 steps without CFG" in r.stdout
    assert "split per step (CFG groups x sequence-parallel ranks, 1 row per step): 1x2, 1x2" in r.stdout
    assert "sharded/single" in r.stdout


@pytest.mark.timeout(600)
def test_demo_cfg_and_sequence_parallel_on_4_ranks_is_2_by_2():
    """``--parallel cfg+sp --ranks 4``: cond and uncond on 2 pairs of ranks, each pair splitting its tokens."""
    r = mgpu("demo", *TINY_DEMO, "--parallel", "cfg+sp", "--ranks", "4", timeout=500)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: sharded matches one device" in r.stdout
    assert "cond and uncond on 2 groups of 2 ranks" in r.stdout
    assert "split per step (CFG groups x sequence-parallel ranks, 2 rows per step): 2x2, 2x2" in r.stdout



def test_plan_with_a_low_noise_expert_prints_the_decision_and_the_switch_cost(files):
    """Wan 2.2 A14B: the two experts (here the 14B layout in bf16, recast to fp8) on 2x24GiB at 720p take turns."""
    r = mgpu("plan", "--dit", str(files["dit"]), "--dit-low-noise", str(files["dit"]), "--dit-weight-dtype",
             "fp8_e4m3fn", "--width", "1280", "--height", "720", "--devices", "2x24GiB,cpu=64GiB")
    assert r.returncode == 0, r.stderr
    assert "dit_low_noise: fsdp on cuda:0, cuda:1" in r.stdout and "DiT shard (1 expert at a time)" in r.stdout
    assert "one expert at a time" in r.stdout and "per prompt" in r.stdout
    r = mgpu("plan", "--dit", str(files["dit"]), "--dit-low-noise", str(files["dit"]), "--dit-weight-dtype",
             "fp8_e4m3fn", "--width", "1280", "--height", "720", "--devices", "2x16GiB,cpu=64GiB")
    assert r.returncode == 3 and "cannot place the DiT experts" in r.stderr and "one DiT expert at a time" in r.stderr


# dim and ffn multiples of 256: Q4_K stores rows of whole 256-value super-blocks
QUANT_DEMO = ("--dim", "256", "--heads", "2", "--ffn", "256", "--layers", "2", "--steps", "2")
# Bytes all-gathered by the blocks per step, counted at the process group, over the same blocks in bf16: the block
# Linear weights as stored (fp8 1 byte per value, Q8_0 34/32, Q4_K 144/256) beside their biases, norms and
# modulation, which gather in the compute dtype (fp32: about +0.02 here). bf16 storage computed in fp32 gathers fp32.
BLOCK_RATIO = {"bf16": (1.95, 2.05), "fp8": (0.50, 0.55), "gguf-q4_k": (0.28, 0.33)}


def _number(pattern: str, text: str) -> float:
    import re

    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return float(found.group(1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("weights,parallel", [("bf16", "cfg"), ("fp8", "cfg"), ("gguf-q4_k", "sp")])
def test_demo_weights_with_lora_match_one_device_and_gather_as_stored(weights, parallel):
    """``--weights W --lora``: the sharded model (fp32 compute) matches one device holding the same dequantized
    weights with the LoRA merged in fp32 (<= 1e-4 relative), the LoRA changes the output, plain weights take it in
    their rows and quantized ones in the forward, and the blocks all-gather their stored bytes. gguf-q4_k runs
    sequence-parallel: the forward-time LoRA term must add to ``to_v``'s output before the token exchange. One storage
    of each kind (rows, fp8 bytes, GGUF blocks): fp8-scaled and Q8_0 take the same demo path, and their sharded
    forward has its own tests (test_scaled_fp8_sharded, test_gguf_sharded)."""
    r = mgpu("demo", *QUANT_DEMO, "--weights", weights, "--lora", "--parallel", parallel, timeout=280)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "OK: sharded matches one device" in out and f"weights {weights}:" in out
    assert _number(r"max \|sharded - single\| = \S+ \(output scale \S+, relative (\S+)\)", out) <= 1e-4
    assert _number(r"changes the one-device output by \S+ \(relative (\S+)\)", out) > 0.05
    rows, forward = ("16", "0") if weights == "bf16" else ("0", "16")
    assert f"{rows} weights patched in their rows, {forward} in the forward" in out
    ratio = _number(r"the blocks \S+ \S+ = (\S+) x the blocks in bf16", out)
    low, high = BLOCK_RATIO[weights]
    assert low <= ratio <= high, (weights, ratio)


@pytest.mark.timeout(300)
def test_demo_train_matches_one_device_and_gathers_the_base_as_stored():
    """``demo --train``: a LoRA trained over 2 cpu ranks on a frozen FSDP base equals the one trained on one device
    (fp32, <= 1e-4 relative, and training moved it), with the same loss per step; per step only the adapters'
    gradients are all-reduced (their size exactly), and a Q4_K base's blocks gather about 0.15 of their fp32 bytes
    (forward and backward)."""
    gathered = {}
    for weights in ("fp32", "gguf-q4_k"):
        r = mgpu("demo", *QUANT_DEMO, "--train", "--weights", weights, timeout=280)
        out = r.stdout
        assert r.returncode == 0, out + r.stderr
        assert "OK: the ranks trained the one-device LoRA" in out and "split over 2 cpu ranks" in out
        assert _number(r"relative L2 (\S+) \(training moved", out) <= 1e-4
        assert _number(r"moved it (\S+) from its first values", out) > 1e-3
        ranks = _number(r"loss per step, ranks: +(\S+)", out)
        assert ranks == _number(r"loss per step, one device: +(\S+)", out) and ranks > 0
        # 2 blocks x 8 attention projections x rank 16 x (256 + 256) fp32 values
        assert "adapter gradients all-reduced 512 KiB (the adapters: 512 KiB)" in out
        gathered[weights] = _number(r"per rank \(the blocks (\S+) MiB", out)
    # Q4_K: 144 bytes per 256 values (0.14 of fp32) for the Linear weights, their biases and norms fp32
    assert 0.14 <= gathered["gguf-q4_k"] / gathered["fp32"] <= 0.17, gathered


def test_demo_train_splits_one_rows_tokens_over_the_ranks_in_forward_and_backward():
    """``demo --train --parallel sp``: one row per step, its tokens split over both ranks (diffusers' Wan, the LoRA
    on to_q/to_k/to_v added before their outputs are exchanged): the one-device LoRA."""
    r = mgpu("demo", *TINY_DEMO, "--train", "--parallel", "sp", timeout=280)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "steps of 1 row, each row's tokens split over 2 cpu ranks" in out and "sequence-parallel ranks): 1x2" in out
    assert _number(r"relative L2 (\S+) \(training moved", out) <= 1e-4
    assert _number(r"moved it (\S+) from its first values", out) > 1e-3


def test_demo_train_refuses_what_it_does_not_train():
    r = mgpu("demo", *TINY_DEMO, "--train", "--parallel", "cfg+sp")
    assert r.returncode == 2 and "--train with --parallel cfg+sp" in r.stderr and "Traceback" not in r.stderr


def test_demo_refuses_gguf_blocks_that_do_not_divide_the_rows():
    r = mgpu("demo", *TINY_DEMO, "--weights", "gguf-q4_k")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--weights gguf-q4_k" in r.stderr and "--dim 64" in r.stderr and "256" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("sig, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_demo_stopped_midway_exits_cleanly_and_leaves_nothing_behind(tmp_path, sig, status):
    """SIGTERM (a service manager, `kill`) and Ctrl+C while the ranks sample: one line, no traceback, the ranks
    gone, and neither the checkpoint's folder nor the pool's folders and shared memory left behind."""
    import glob
    import signal
    import time

    import psutil

    env = {k: v for k, v in os.environ.items() if k != "MGPU_DEVICES"}
    env.update({"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
    # Ctrl+C's default action in the demo, also when this suite runs in a background job, which starts with SIGINT
    # ignored (bash's rule for '&' without job control), a disposition a child would inherit
    proc = subprocess.Popen([sys.executable, "-m", "mgpu", "demo", *TINY_DEMO[:-1], "400"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ranks: list[psutil.Process] = []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
        ranks = [c for c in psutil.Process(proc.pid).children() if "mgpu.ranks.rank" in " ".join(c.cmdline())]
        time.sleep(0.2)
    assert len(ranks) == 2, proc.communicate(timeout=60)
    time.sleep(2)   # the pool is up and loading or sampling
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, (out, err)
    assert "Traceback" not in err, err
    if sig == "SIGINT":
        assert err.strip().endswith("interrupted")
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
    assert not list(tmp_path.glob("mgpu-*")), list(tmp_path.iterdir())
    assert not glob.glob(f"/dev/shm/mgpu-{proc.pid}-*")


@pytest.mark.parametrize("name, says", [
    ("wan2.1-14b", "dit: fsdp on cuda:0, cuda:1 (wan2.1-t2v-14b, fp8_e4m3fn, 13.3 GiB)"),
    ("wan2.2-a14b", "dit_low_noise: fsdp on cuda:0, cuda:1"),
    ("ltx2-19b", "dit: single on cuda:0 (ltx2-av, fp8_e4m3fn, 18.2 GiB)"),
])
def test_plan_example_plans_full_size_models_without_their_files(tmp_path, name, says):
    """README's way to try the planner without ~30 GB of downloads: the examples' headers, written to a
    temporary folder and removed, planned for two 24 GiB GPUs at their templates' size."""
    r = mgpu("plan", "--example", name, env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("example: ") and "devices 2x24GiB,cpu=64GiB" in r.stdout.splitlines()[0]
    assert says in r.stdout, r.stdout
    assert not list(tmp_path.iterdir())
    r = mgpu("plan", "--example", name, "--devices", "2x80GiB,cpu=64GiB", "--frames", "33", "--json")
    plan = Plan.from_json(r.stdout)   # JSON alone on stdout; the example's line goes to stderr
    assert plan.workload["frames"] == 33 and plan.workload["width"] == 1280


def test_plan_train_sizes_a_lora_step_and_says_what_fits(tmp_path):
    """README's training plans: Wan 2.1 14B fp8, LoRA rank 32, 480p x 81 on 2 x 24 GiB is refused (exit 3) with
    the frames that fit; at those frames the plan shards over both GPUs with checkpointing on and says why."""
    args = ("plan", "--example", "wan2.1-14b", "--train", "--lora-rank", "32", "--width", "832", "--height", "480")
    r = mgpu(*args, "--frames", "81", env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 3 and "a smaller LoRA rank than 32" in r.stderr, r.stderr
    frames = r.stderr.split("up to ")[1].split(" at 832x480")[0]
    r = mgpu(*args, "--frames", frames, "--json")
    assert r.returncode == 0, r.stderr
    plan = Plan.from_json(r.stdout)
    dit = plan.placement("dit")
    assert dit.devices == ["cuda:0", "cuda:1"] and dit.training["gradient_checkpointing"] is True
    assert plan.workload["train"]["lora_rank"] == 32 and plan.workload["frames"] == int(frames)


def test_plan_without_files_or_example_says_what_to_give():
    for args, says in ((("plan",), "give the DiT with --dit FILE, or plan an example with --example"),
                       (("plan", "--example", "sd15"), "--example 'sd15' is not an example; pick one of wan2.1-14b")):
        r = mgpu(*args)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and says in r.stderr, r.stderr
