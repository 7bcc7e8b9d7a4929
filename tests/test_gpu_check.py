"""bench/gpu_check.py --dry-run (issue 15 §5): every section runs on CPU ranks over gloo at tiny sizes and reports
the numbers the GPU run reports; one dry run for the module (about 1.5 minutes on 2 busy cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SECTIONS = ["environment", "inventory", "memory", "formats", "two_ranks", "step", "device_mapping", "calibration",
            "fp8_matmul", "load_throughput"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=500, env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(600)
def test_every_section_runs_and_the_report_says_so(report):
    assert list(report["sections"]) == SECTIONS and list(report["summary"]) == SECTIONS
    assert report["summary"] == dict.fromkeys(SECTIONS, "ok"), report["summary"]
    assert report["dry_run"] and report["device"] == "cpu" and not report["watchdog"]["killed"]


@pytest.mark.timeout(600)
def test_memory_by_phase_against_the_plan(report):
    memory = report["sections"]["memory"]
    assert set(memory["phases"]) == {"init", "after_load", "first_step", "after_release", "vae_decode"}
    assert all(p[0]["rank"] == 0 for k, p in memory["phases"].items() if k != "vae_decode")
    assert memory["phases"]["vae_decode"]["host_decode"]["peak_above_weights_bytes"] > 0
    assert memory["load_report"]["bytes_read"] == memory["checkpoint_bytes"]   # one rank reads every slice
    assert memory["step_after_release"]["matches"]                             # released, reserved again, same step
    plan = memory["plan"]
    assert plan["rank_process_bytes"] > 0 and plan["shard_bytes"] > 0 and plan["activation_bytes"] > 0
    assert {"cuda_context", "libraries", "nccl_communicator_one_rank"} <= set(memory["measured"])
    assert memory["communicators"][0]["count"] == 2
    model = memory["time_model"]
    assert model["split"] == "1x1" and model["measured_s"] > 0 and model["estimated_s"] > 0


@pytest.mark.timeout(600)
def test_every_stored_format_equals_one_device_and_reports_its_dtypes(report):
    formats = report["sections"]["formats"]["formats"]
    stored = {"bf16": "Tensor[bfloat16]", "fp8": "Fp8Weight[float8_e4m3fn]",
              "fp8_scaled_mm": "Fp8Weight[float8_e4m3fn]", "comfy_fp8": "Fp8Weight[float8_e4m3fn]"}
    computed = {"bf16": "Parameter[bfloat16]", "fp8": "Parameter[bfloat16]",
                "fp8_scaled_mm": "Parameter[float8_e4m3fn]", "comfy_fp8": "QuantizedTensor[bfloat16]",
                "gguf_q4_k_m": "Parameter[bfloat16]"}
    for fmt in ("bf16", "fp8", "fp8_scaled_mm", "gguf_q4_k_m", "comfy_fp8"):
        result = formats[fmt]
        if fmt == "comfy_fp8" and "skipped" in result:
            assert "comfy_kitchen" in result["skipped"]
            continue
        assert result.get("matches"), (fmt, result.get("error"), result.get("max_abs_diff"))
        assert result["output_scale"] > 0
        assert set(result["computed_with"].values()) == {computed[fmt]}, fmt
        if fmt in stored:
            assert set(result["stored"].values()) == {stored[fmt]}, fmt
    gguf = formats["gguf_q4_k_m"]["stored"]
    assert gguf["ffn.2.weight"] == gguf["self_attn.v.weight"] == "GGUFWeight[Q6_K]"
    assert gguf["ffn.0.weight"] == gguf["self_attn.q.weight"] == "GGUFWeight[Q4_K]"
    # the step path of the weights makes nothing that would wait for a GPU (Q6_K made a tensor per chunk before)
    for fmt, result in formats.items():
        if "sync_prone_ops" in result:
            assert not [op for op in result["sync_prone_ops"] if "mgpu/weights" in op["at"]], fmt
    for qtype, check in report["sections"]["formats"]["gguf_on_device"].items():
        assert check["equal_to_cpu"] and check["sync_prone_ops"] == [], qtype


@pytest.mark.timeout(600)
def test_two_ranks_cancel_then_lora_equals_a_fresh_run_and_prefetch_follows_execution(report):
    two = report["sections"]["two_ranks"]
    assert two["devices"] == ["cpu", "cpu"] and two["execution_order"] == ["blocks.0", "blocks.2", "blocks.1"]
    assert two["cancel"]["cancelled"] and two["cancel"]["pool_kept"]
    assert two["lora_changed_output"]
    assert two["after_cancel_vs_fresh"]["matches"], two["after_cancel_vs_fresh"]
    assert two["cancel_path_ok"]
    assert two["prefetch_follows_execution"]
    assert all(p["prefetched"] == {"blocks.0": "blocks.2", "blocks.2": "blocks.1"} for p in two["prefetch"])


@pytest.mark.timeout(600)
def test_step_per_split_syncs_time_profile_and_the_cancel_vote(report):
    step = report["sections"]["step"]
    assert set(step["splits"]) == {"2x1", "1x2"}
    for name, split in step["splits"].items():
        assert split["step_seconds"] > 0 and split["time_model"]["split"] == name
        assert len(split["syncs"]) == 2 and all(isinstance(r["sync_prone_ops"], list) for r in split["syncs"])
        assert all(p["collective_us"] > 0 and p["prefetch_follows_execution"] for p in split["profile"])
        for vote in split["cancel_vote"]:   # one vote before each of the 3 blocks, timed against the block
            assert vote["votes"] == 3 and vote["vote_median_s"] > 0 and vote["block_median_s"] > 0
    assert any("all_to_all" in op for op in step["splits"]["1x2"]["profile"][0]["collective_ops"])
    assert all(v["seconds_per_vote"] > 0 for v in step["vote_alone"])


@pytest.mark.timeout(600)
def test_device_mapping_from_inside_a_rank_in_both_orders(report):
    mapping = report["sections"]["device_mapping"]
    assert mapping["default"][0]["env"]["CUDA_DEVICE_ORDER"] is None
    assert mapping["pci_bus_id"][0]["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert mapping["mgpu_agrees_with_torch"] and mapping["same_cuda_order"]
