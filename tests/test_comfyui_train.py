"""MGPU Train LoRA against ComfyUI's own Train LoRA, inside real ComfyUI (no server; each check in a fresh ComfyUI
interpreter on the CPU, tests/training_checks.py): the same seed, data and settings give core's LoRA on 1, 2 and 3
fsdp cpu ranks, with gradient checkpointing and gradient accumulation too; the trained LoRA samples on the sharded
model as on one device, and the model samples as before the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from comfyui_env import run_checks

pytestmark = [pytest.mark.comfyui, pytest.mark.timeout(900)]   # core and ours, on a shared CI machine

BASE = {"batch_size": 2, "steps": 4, "learning_rate": 0.001, "rank": 4, "optimizer": "AdamW", "loss_function": "MSE",
        "seed": 3, "training_dtype": "fp32", "lora_dtype": "fp32", "algorithm": "LoRA",
        "gradient_checkpointing": False, "existing_lora": "[None]", "grad_accumulation_steps": 1}


def train_both(tmp_path: Path, ranks: int, rows: int = 2, file_dtype: str = "float32", heads: int = 1,
               plan: dict | None = None, **changes) -> dict:
    return run_checks("training_checks", "check_train_equals_core", str(tmp_path), ranks, {**BASE, **changes}, rows,
                      1, file_dtype, heads, plan, timeout=900)


def assert_core_lora(facts: dict, tolerance: float, loss_tolerance: float = 1e-5) -> None:
    """``tolerance``: the whole LoRA's relative L2 distance to core's; the losses step by step too."""
    assert facts["keys"] == facts["core_keys"], "the LoRA's keys (and their order) are core's"
    assert facts["dtypes"] == facts["core_dtypes"]
    assert facts["relative_l2"] <= tolerance, facts
    assert facts["down_max"] > 0, "the adapters trained (lora_down starts at zero)"
    assert len(facts["loss"]) == len(facts["core_loss"])
    for ours, core in zip(facts["loss"], facts["core_loss"]):
        assert abs(ours - core) <= loss_tolerance * abs(core), (facts["loss"], facts["core_loss"])


def test_two_ranks_train_cores_lora_in_fp32(tmp_path: Path) -> None:
    """fp32, batch 2 split over 2 ranks, 4 SGD steps: core's LoRA within 1e-4 (relative L2 over the whole LoRA;
    measured 6e-6: the rows' gradients are summed across ranks instead of inside one matmul). It samples on the
    sharded model as on one device through stock Load LoRA Model, and the run leaves the model as it was."""
    facts = train_both(tmp_path, 2, optimizer="SGD", learning_rate=0.01)
    assert_core_lora(facts, 1e-4)
    assert facts["unchanged_after_run"]
    refused = facts["misfit_refused"]   # an existing LoRA for another model: named before any rank works
    assert refused.startswith("MgpuError") and "blocks.0.ffn.0" in refused and "x.safetensors" in refused, refused
    assert facts["lora_moves_sample"] > 1e-3, "the comparison below has teeth"
    assert facts["lora_sample_diff"] <= 1e-5 * max(1.0, facts["lora_moves_sample"])


def test_three_ranks_with_checkpointing_and_accumulation_from_the_plan_train_cores_lora(tmp_path: Path) -> None:
    """3 ranks for 2 rows (one rank runs an empty share and still joins the collectives), Huber loss, AdamW, and an
    MGPU Plan connected, made for gradient checkpointing on and 2 micro steps per optimizer step: the node follows
    it over its own inputs (checkpointing off, no accumulation) and ends with core's LoRA for the plan's settings,
    which it cannot without following (the accumulation halves each micro step's share). AdamW divides each gradient
    by its own running magnitude, so gradients that differ from core's by float rounding (2e-7 relative at the first
    step, measured) move near-zero elements by up to the learning rate: the bound is 5e-4 (measured 1e-4), the
    losses still agree to 1e-5. The plan counts the trained parameters ComfyUI's Train LoRA makes, from the header."""
    facts = train_both(tmp_path, 3, plan={"checkpointing": "on", "grad_accumulation": 2}, steps=2,
                       loss_function="Huber", seed=7)
    assert facts["core_settings"]["gradient_checkpointing"] and facts["core_settings"]["grad_accumulation_steps"] == 2
    assert len(facts["followed"]) == 1 and "gradient_checkpointing True" in facts["followed"][0], facts["followed"]
    assert_core_lora(facts, 5e-4)
    assert facts["planned_adapter_params"] == facts["comfyui_adapter_params"] > 0
    assert facts["resume_keeps"] == [1, 4, True]   # a resumed run's own rows per forward, the plan's checkpointing


def test_a_bf16_base_trains_cores_lora_within_bf16s_rounding(tmp_path: Path) -> None:
    """A bf16 file, bf16 training and LoRA, 2 ranks, AdamW with checkpointing: core's LoRA within 2e-3 relative
    (measured 6.5e-4, where core against itself on another thread count already differs by 2e-4), losses within
    1e-3 (bf16 autocast rounds the first forward differently on the ranks: 1.4e-4)."""
    facts = train_both(tmp_path, 2, file_dtype="bfloat16", training_dtype="bf16", lora_dtype="bf16",
                       gradient_checkpointing=True)
    assert facts["dtypes"] == ["torch.bfloat16"]
    assert_core_lora(facts, 2e-3, loss_tolerance=1e-3)


def test_an_fp8_base_stays_fp8_on_the_ranks_and_trains_cores_lora(tmp_path: Path) -> None:
    """A plain fp8 file (matrices float8_e4m3fn): the ranks keep and gather the fp8 bytes, the adapters apply to the
    weight as ComfyUI casts it for the layer; core's LoRA within 1e-4 (measured 6.3e-6), losses within 2e-4 (the
    compute dtype of a plain fp8 layer is ComfyUI's per device: 6e-5 apart at the first step)."""
    facts = train_both(tmp_path, 2, file_dtype="fp8", optimizer="SGD", learning_rate=0.01,
                       gradient_checkpointing=True)
    assert_core_lora(facts, 1e-4, loss_tolerance=2e-4)


def test_one_latent_per_step_splits_its_tokens_over_the_ranks_and_trains_cores_lora(tmp_path: Path) -> None:
    """batch_size 1 on 2 ranks (one video per step): the loader's plan loaded the 2-head Wan with sequence
    parallelism, so each step's tokens split over both ranks in forward and backward (with checkpointing); core's
    LoRA within 1e-4 (SGD), losses within 1e-5."""
    facts = train_both(tmp_path, 2, rows=2, heads=2, batch_size=1, optimizer="SGD", learning_rate=0.01,
                       gradient_checkpointing=True)
    assert facts["split"] == [1, 2], facts["split"]   # (batch groups, sequence degree), through JSON
    assert_core_lora(facts, 1e-4)


def test_a_gguf_base_stays_quantized_on_the_ranks_and_trains_cores_lora_on_its_dequantized_copy(tmp_path: Path) -> None:
    """A GGUF file (the blocks' matrices Q8_0), which core's Train LoRA cannot read: the ranks keep and gather the
    Q8_0 blocks and dequantize them per block in forward and backward; core trains on a safetensors file of the
    same dequantized values. fp32, SGD, checkpointing: core's LoRA within 1e-4 (measured 2.2e-10 on 0.3.64, 6.1e-6
    on 0.33, as for an fp32 file), losses within 1e-5."""
    facts = train_both(tmp_path, 2, file_dtype="gguf-q8_0", optimizer="SGD", learning_rate=0.01,
                       gradient_checkpointing=True)
    assert_core_lora(facts, 1e-4)
    assert facts["unchanged_after_run"]


def test_cancel_keeps_the_lora_of_the_finished_steps_and_the_next_run_is_fresh(tmp_path: Path) -> None:
    """Cancel during the third of 4 steps: the node ends as ComfyUI's interrupt, the LoRA after the 2 finished steps
    is saved in ComfyUI's output folder (loras/) and equals a 2-step run's bit for bit; the next run on the same
    ranks equals a fresh one."""
    facts = run_checks("training_checks", "check_cancel_keeps_the_finished_steps", str(tmp_path), BASE, timeout=900)
    assert facts["interrupted"] == "InterruptProcessingException" and not facts["flag_left"]
    assert len(facts["files"]) == 1 and facts["same_keys"]
    assert facts["kept_equals_two_steps"]
    assert facts["again_equals_fresh"]


def test_ltx_video_is_refused_by_name_where_core_fails_in_its_backward(tmp_path: Path) -> None:
    """ComfyUI's LTX-Video blocks change their input in place after layers kept it for the backward: core's Train
    LoRA on one device fails in autograd; MGPU Train LoRA says why up front, naming the network, before a run
    starts on the ranks."""
    facts = run_checks("training_checks", "check_ltx_video_is_refused_by_name", str(tmp_path), BASE, timeout=900)
    assert "modified by an inplace operation" in facts["core"], facts["core"]
    assert facts["ours"].startswith("MgpuError") and "LTXVModel" in facts["ours"] and "in place" in facts["ours"]


def test_a_cancelled_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_lora(tmp_path: Path) -> None:
    """Cancel after 2 of 4 optimizer steps with checkpoints every step (keep 1): the checkpoint of step 2 stays; the
    same prompt with resume on ends with the uninterrupted run's LoRA and losses bit for bit (fp32, 2 ranks), its
    final checkpoint replacing step 2's; a resume with another learning rate is refused by name; the checkpoint
    exports as a LoRA that stock LoraLoaderModelOnly loads on a one-device model; a 2-step checkpoint resumes on 3
    ranks within float rounding; after a killed rank the error names the checkpoint, and resuming from it still
    ends with the uninterrupted LoRA."""
    facts = run_checks("training_checks", "check_resume_equals_uninterrupted", str(tmp_path), BASE, timeout=900)
    assert facts["cancelled"] == "InterruptProcessingException"
    assert facts["saved_after_cancel"] == ["step_000002"]
    assert facts["bit_equal"] and facts["loss_equal"] and facts["steps"] == BASE["steps"]
    assert facts["refused"].startswith("MgpuError") and "learning_rate" in facts["refused"], facts["refused"]
    assert not facts["step2_left"] and facts["newest"] == ["step_000004"]
    assert facts["exported_equal"] and facts["sample_finite"]
    assert facts["three_worst"] is not None and facts["three_worst"] <= 1e-4, facts["three_worst"]
    # a rank killed after step 2 of a run checkpointing every 2 steps: the error names the rank and the checkpoint,
    # and resuming from it (the pool rebuilt) still ends with the uninterrupted LoRA
    assert "rank 1" in facts["killed"] and "killed/step_000002" in facts["killed"], facts["killed"]
    assert facts["after_kill_equal"]


def test_wan22_experts_train_their_shares_of_the_schedule_in_turn_on_the_same_ranks(tmp_path: Path) -> None:
    """timestep_start / timestep_end: the high-noise expert trains on the noisiest half (every timestep its network
    sees is above the boundary), the low-noise expert on the rest, both on the same 2 ranks in one process; the
    range changes the LoRA, and the experts taking turns changes nothing (the high one again: bit for bit)."""
    facts = run_checks("training_checks", "check_wan22_experts_train_in_turn", str(tmp_path), BASE, timeout=900)
    boundary = facts["boundary"]
    # every row of every step (ComfyUI 0.33 gives Wan a timestep per latent frame: more entries, the same values)
    assert len(facts["high_t"]) >= BASE["steps"] * BASE["batch_size"] <= len(facts["low_t"])
    assert min(facts["high_t"]) >= boundary - 1e-3 and max(facts["low_t"]) <= boundary + 1e-3, facts
    assert facts["again_equal"] and facts["range_changes_lora"] and facts["experts_differ"]
