"""bench/gpu_check.py runs unattended and stops by itself (its dry run's sections: tests/test_gpu_check.py);
bench/calibrate_memory.py's ComfyUI figures are the ones mgpu.planning.estimates restates (and calibrates against), on
whichever ComfyUI COMFYUI_PATH names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import tiny_models as tm
from sp_ltxv_models import has_ltxav  # noqa: F401 - the xfail condition of the LTX-2 bench test

from comfyui_env import SKIP_REASON, find_comfyui
from mgpu.planning.estimates import (COMFYUI_EXTRA_RESERVED_BYTES, COMFYUI_MIN_INFERENCE_BYTES, CUDA_OVERHEAD_BYTES,
                            comfyui_reservation_bytes)

BENCH = Path(__file__).resolve().parents[1] / "bench"
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


def run_script(*args: str, timeout: float) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = {}
    return proc.returncode, report, proc.stderr


def test_every_bench_script_is_run_by_a_test():
    """A script under bench/ (one with a ``__main__`` block) that no test runs breaks unnoticed, as bench_fsdp.py did
    when make_checkpoint changed: each must be named by a test that runs it."""
    tests = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    scripts = [p.name for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text()]
    assert "bench_fsdp.py" in scripts
    assert [s for s in scripts if f'"{s}"' not in tests and f"/ {s!r}" not in tests] == []


@pytest.mark.timeout(300)
def test_fsdp_bench_runs_and_prints_its_ratios():
    """bench/bench_fsdp.py --quick: the FSDP engine's ratios, on a tiny model (the numbers are not kept)."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_fsdp.py"), "--quick"], capture_output=True, text=True,
                          timeout=280, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("ratio sharded/single", "CFG batch split", "all-gathered per step: ", "per-rank slices",
                 "10 MB latent round trip"):
        assert line in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_quant_gather_bench_reports_each_storage_against_bf16():
    """bench/bench_quant_gather.py at a small size: fp8, Q8_0 and Q4_K all-gather their stored bytes (1, 34/32 and
    144/256 bytes a weight against bf16's 2), in one run."""
    rc, report, err = run_script(str(BENCH / "bench_quant_gather.py"), "--dim", "256", "--layers", "2", "--steps", "1",
                                 timeout=280)
    assert rc == 0, err[-3000:]
    ratios = report["over_bf16"]
    assert 0.49 < ratios["fp8"] < 0.52 and 0.52 < ratios["Q8_0"] < 0.55 and 0.27 < ratios["Q4_K"] < 0.30, ratios


@pytest.mark.timeout(400)
def test_sp_bench_measures_the_exchanges_of_a_token_split_step(tmp_path):
    """bench/bench_sp.py --quick: 1 rank vs 2 splitting the 120 tokens of a cfg-1 step (dim 64, 2 blocks) 1 x 2,
    equal outputs; the bytes counted at the collectives are those of the exchange: per block 4 all-to-alls (q, k, v,
    attention output) of the other rank's 60 tokens x 32 of the 64 dims x 4 bytes, the output gather 60 tokens x
    64 values, and no FSDP all-gather in a step that keeps the gathered weights."""
    out = tmp_path / "sp.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_sp.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=380, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio 2/1" in proc.stdout and "all-to-alls" in proc.stdout
    report = json.loads(out.read_text())
    assert report["split"] == [1, 2] and report["max_relative_difference"] <= 1e-4
    moved = report["bytes_per_step_from_other_ranks"]
    assert report["all_to_all_calls_per_step"] == 2 * 4
    assert moved["all_to_all"] == moved["all_to_all_resharded"] == 2 * 4 * 60 * 32 * 4
    assert moved["output_gather"] == 60 * 64 * 4
    assert moved["fsdp_all_gather_kept"] == 0 < moved["fsdp_all_gather_resharded"]
    assert report["step_ratio"] > 0 and all(x > 0 for x in report["activation_bytes"]["live_peak_2"])


@pytest.mark.comfyui
@pytest.mark.skipif(tm.comfyui_path() is None, reason=SKIP_REASON)
@pytest.mark.xfail("tm.comfyui_path() is None or not has_ltxav()", run=False, strict=True,
                   reason="not applicable: this ComfyUI has no LTX-2 (LTXAVModel)")
@pytest.mark.timeout(600)
def test_sp_bench_measures_ltx2s_video_split_and_its_audio_key_value_gathers(tmp_path):
    """bench/bench_sp.py --model ltx2 --quick: ComfyUI's LTXAVModel (video 2 heads x 16, audio 2 x 8, 2 blocks), its
    120 video tokens split 1 x 2 (the 16 audio tokens whole on each rank), outputs equal to 1 rank's on both streams.
    Per block: one all-to-all of the stacked q/k/v and one of the attention output (the other rank's 60 tokens x 16
    of the 32 dims x 4 bytes, 3 + 1 times), and one all-gather of the audio queries' video keys and values, counted
    apart from the output gather: 2 x 60 tokens x the audio's 16 dims x 4 bytes; the output gather 60 x 32 x 4."""
    out = tmp_path / "sp_ltx2.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_sp.py"), "--model", "ltx2", "--quick", "--json",
                           str(out)], capture_output=True, text=True, timeout=580,
                          env={**ENV, "COMFYUI_PATH": tm.comfyui_path()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LTXAVModel" in proc.stdout and "ratio 2/1" in proc.stdout
    report = json.loads(out.read_text())
    assert report["split"] == [1, 2]
    assert set(report["relative_difference_per_stream"]) == {"video", "audio"}
    assert report["max_relative_difference"] <= 1e-4
    moved = report["bytes_per_step_from_other_ranks"]
    assert report["all_to_all_calls_per_step"] == 2 * 2 and moved["all_to_all"] == 2 * (3 + 1) * 60 * 16 * 4
    assert report["kv_all_gather_calls_per_step"] == 2 and moved["kv_all_gather"] == 2 * 2 * 60 * 16 * 4
    assert moved["output_gather"] == 60 * 32 * 4
    assert moved["fsdp_all_gather_kept"] == 0 < moved["fsdp_all_gather_resharded"]


def test_sp_bench_ltx2_without_comfyui_033_says_what_to_do(tmp_path):
    """--model ltx2 where COMFYUI_PATH names no ComfyUI with LTX-2 (as 0.3.64, or any other folder): it stops before
    starting ranks, naming the missing network and how to run it."""
    proc = subprocess.run([sys.executable, str(BENCH / "bench_sp.py"), "--model", "ltx2", "--quick"],
                          capture_output=True, text=True, timeout=120, env={**ENV, "COMFYUI_PATH": str(tmp_path)})
    assert proc.returncode != 0 and proc.stdout == ""
    assert "needs ComfyUI 0.33" in proc.stderr and f"COMFYUI_PATH={tmp_path} has no" in proc.stderr
    assert "av_model.py" in proc.stderr and "--model ltx2" in proc.stderr


def _work_dirs() -> set[str]:
    return {str(p) for p in Path(tempfile.gettempdir()).glob("mgpu-gpu-check-*")}


def test_gpu_check_watchdog_ends_a_hung_run_and_its_ranks():
    before = _work_dirs()
    began = time.monotonic()
    rc, report, err = run_script(str(BENCH / "gpu_check.py"), "--dry-run", "--deadline", "5", "--simulate-hang",
                                 timeout=200)
    took = time.monotonic() - began
    assert rc == 3, err[-3000:]
    watchdog = report["watchdog"]
    assert watchdog["killed"] and watchdog["while_running"] == "hang"
    assert report["sections"]["environment"]["ok"]   # what finished before the hang is kept
    assert took < 5 + 20 + 90   # deadline + grace + the kill and a start-up slowed by CI's two suites side by side
    for pid in [report["pid"], *report["rank_pids"]]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert _work_dirs() == before, "the killed run left its temporary files"


def _calibrate(tmp_path_factory, *args: str, script: str = "calibrate_memory.py") -> tuple[dict, str]:
    """A calibration script's report (its --json) and printed table, under this ComfyUI."""
    comfyui = find_comfyui()
    if comfyui is None:
        pytest.skip(SKIP_REASON)
    out = tmp_path_factory.mktemp("calibrate") / "report.json"
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env={**ENV, "COMFYUI_PATH": str(comfyui)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """Every family's restated ComfyUI rules (header-only models on meta: no forward), and the measured peaks of
    the smallest Wan and LTX-Video blocks at real dimensions (the 14B and 13B blocks measure the same per-token rule
    at 4-10x the CPU time: bench/RESULTS.md has their rows)."""
    rules, stdout = _calibrate(tmp_path_factory, "--tokens", "--families", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b",
                               "wan2.2-ti2v-5b", "ltxv-2b", "ltxv-13b")
    assert "| wan2.1-t2v-14b | 1280x720x81 | 75,600 |" in stdout
    measured, _ = _calibrate(tmp_path_factory, "--tokens", "256", "512", "--families", "wan2.1-t2v-1.3b", "ltxv-2b")
    return {**rules, "measured_dits": measured["dits"]}


def test_training_calibration_measures_comfyuis_wan_blocks_and_the_estimate_covers_them(tmp_path_factory):
    """bench/calibrate_training.py on Wan 2.1 1.3B's real block at 64 and 128 tokens (rank 32 adapters, bf16,
    forward + backward): a checkpointed block keeps its input (1 U per token), one without checkpointing keeps far more
    and about its own patched weights, and mgpu.planning.training's estimate at the model's 30 blocks is at or above
    each measured peak and within 1.25 of it (bench/RESULTS.md: 1.01-1.18 at 256 and 512 tokens)."""
    report, stdout = _calibrate(tmp_path_factory, "--tokens", "64", "128", script="calibrate_training.py")
    assert "| wan2.1-t2v-1.3b |" in stdout
    (row,) = report["rows"]
    unit, weights = 2 * row["hidden"], 2 * row["block_params"]
    assert abs(row["checkpointed_per_block"][0] / unit - 1.0) < 0.05, row["checkpointed_per_block"]
    assert row["saved_per_block"][0] / unit > 20 and 0.9 < row["saved_per_block"][1] / weights < 1.3, row
    for tokens, at in row["at_layers"].items():
        for mode in ("off", "on"):
            assert 1.0 <= at[f"estimate_{mode}"] / at[f"measured_{mode}"] <= 1.25, (tokens, mode, at)


def test_restated_comfyui_rules_equal_comfyuis_own(calibration):
    """mgpu restates ComfyUI's reservations (it cannot import ComfyUI): they must be what this ComfyUI computes."""
    assert calibration["extra_reserved_memory"] == COMFYUI_EXTRA_RESERVED_BYTES
    assert calibration["minimum_inference_memory"] == COMFYUI_MIN_INFERENCE_BYTES
    for row in calibration["dits"]:
        assert abs(row["restated_memory_required"] - row["comfyui_memory_required"]) <= 1, row["family"]
    for row in calibration["vaes"]:
        used = row["comfyui_memory_used_decode"]
        assert row["restated_memory_used_decode"] >= used, row["vae"]   # the larger of the versions' rules
        assert row["need_untiled"] >= comfyui_reservation_bytes(used) + CUDA_OVERHEAD_BYTES, row["vae"]
    for row in calibration["text_encoders"]:
        assert row["ours_working"] >= row["comfyui_reservation"] + CUDA_OVERHEAD_BYTES


@pytest.mark.timeout(900)
def test_calibrated_formula_covers_comfyuis_measured_peaks(calibration):
    """The live-tensor peak of ComfyUI's own one-block network grows per token no faster than our formula, and the
    budget rule gives a single GPU at least ComfyUI's own reservation."""
    assert len(calibration["measured_dits"]) == 2
    for row in calibration["measured_dits"]:
        assert 0 < row["measured_bytes_per_token"] <= row["ours_bytes_per_token"], row["family"]
    for row in calibration["dits"]:
        assert row["ours_working_single"] >= row["comfyui_reservation"] + CUDA_OVERHEAD_BYTES, row["family"]


@pytest.mark.skipif(tm.comfyui_path() is None, reason=SKIP_REASON)
@pytest.mark.timeout(400)
def test_train_bench_measures_a_training_step_over_two_ranks(tmp_path):
    """bench/bench_train.py --quick: 1 rank vs 2 at the same global batch; at the collectives, a kept-gathered model
    all-gathers its weights once per step (forward: FSDP reshards after the backward), a resharding one twice
    (forward and backward), and the adapters' fp32 gradients are all-reduced once per step, nothing else;
    checkpointing lowers a rank's peak, an fp8 file's blocks gather fp8 bytes."""
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_train.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=380, env={**ENV, "COMFYUI_PATH": tm.comfyui_path()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio 2/1" in proc.stdout and "DDP of the whole model" in proc.stdout
    r = json.loads(out.read_text())
    kept, resharded = r["two_ranks_kept"], r["two_ranks_resharded"]
    assert r["one_rank"]["fsdp_all_gather_per_step"] == 0
    assert resharded["fsdp_all_gather_per_step"] == 2 * kept["fsdp_all_gather_per_step"] > 0
    assert kept["adapter_all_reduce_per_step"] == kept["adapter_bytes"] > 0
    assert r["ddp_whole_model_all_reduce_per_step"] == 4 * r["model_params"]
    # checkpointing keeps each block's input instead of its activations: a smaller peak per rank
    off = r["two_ranks_resharded_no_checkpointing"]
    assert resharded["gradient_checkpointing"] and not off["gradient_checkpointing"]
    assert 0 < resharded["peak_step_bytes"] < off["peak_step_bytes"]
    # an fp8 file's blocks gather their fp8 bytes (the rest fp32): about half of fp32's; at --quick's dim no row of
    # a matrix is whole Q4_K blocks, so that file gathers what fp32 does
    stored = r["all_gather_per_step_by_storage"]
    assert 0.4 <= stored["fp8"] / stored["fp32"] <= 0.6, stored
    assert stored["gguf-q4_k"] == stored["fp32"] == resharded["fsdp_all_gather_per_step"], stored
    # a checkpoint holds the adapters and AdamW's two moments: at least 3 x the adapters, on disk, per LoRA rank
    assert [c["lora_rank"] for c in r["checkpoints"]] == [4, 16]
    for c in r["checkpoints"]:
        assert c["checkpoint_bytes"] >= 3 * c["adapter_bytes"] > 0 and c["load_seconds"] > 0, c
    small, large = (c["adapter_bytes"] for c in r["checkpoints"])
    assert 3 * small < large < 4 * small   # the factors grow with the rank, the bias differences do not
    # the plan's working memory per rank covers each measured step, and not by more than the calibration's margin
    # (the safety factor and the rounded-up coefficients: 1.14-1.35x at this size, 1.27-1.41x at the default one)
    assert set(r["plan_over_measured"]) == {"one_rank", "two_ranks_resharded", "two_ranks_resharded_no_checkpointing"}
    for run, ratio in r["plan_over_measured"].items():
        assert 1.0 <= ratio <= 1.8, (run, ratio, r["planned_working"][run])
