"""The plan check (loaders/plan_check.py) without ComfyUI: which latents a sampler hands the DiT warn, and with what.

The real-ComfyUI run of the same warning is tests/test_comfyui_nodes.py; the example workflows, whose latent
sizes are wired from MGPU Plan, run without it (tests/test_example_workflows.py).
"""

from __future__ import annotations

import logging

import pytest
import torch

import ckpt_layouts as L
from loaders.plan_check import PlanCheck
from mgpu.planning.estimates import Workload
from mgpu.planning.sizing import size_component


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """Wan 2.1 14B's header (no weights): 8x spatial, 4x temporal VAE, 1x2x2 patches."""
    return size_component(L.write_safetensors(tmp_path_factory.mktemp("plan_check") / "wan.safetensors",
                                              L.wan21_t2v_14b(), sparse=True))


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory):
    return size_component(L.write_safetensors(tmp_path_factory.mktemp("plan_check") / "ltx2.safetensors",
                                              L.ltx2_19b(), sparse=True))


def warnings_for(check: PlanCheck, x, caplog) -> list[str]:
    """What one step with latent ``x`` logs; the step itself still runs (the executor's result comes back)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mgpu"):
        assert check(lambda *a, **k: "ran", x, torch.zeros(1)) == "ran"
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def wan_latent(batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    """The (B, 16, T, H, W) latent EmptyHunyuanLatentVideo makes for that video (on meta: only its shape matters)."""
    return torch.empty(batch, 16, (frames - 1) // 4 + 1, height // 8, width // 8, device="meta")


def test_the_planned_size_says_nothing_and_cond_uncond_apart_neither(wan, caplog):
    check = PlanCheck(wan, Workload(width=1280, height=720, frames=81, batch=1, cfg=True), "DiT")
    assert warnings_for(check, wan_latent(2, 81, 720, 1280), caplog) == []
    assert warnings_for(check, wan_latent(1, 81, 720, 1280), caplog) == []   # ComfyUI ran cond and uncond apart


def test_a_larger_latent_warns_with_both_sizes_once(wan, caplog):
    check = PlanCheck(wan, Workload(width=832, height=480, frames=81, batch=1, cfg=True), "DiT")
    (message,) = warnings_for(check, wan_latent(2, 81, 720, 1280), caplog)
    assert ("DiT: this step's latent 2x16x21x90x160 is 75600 tokens x batch 2 = 151200, but the MGPU Plan was made "
            "for 832x480x81, batch 1 with CFG = 32760 tokens x batch 2 = 65520 (this is 2.3x that)") in message
    assert "wire the plan's width, height, frames and batch outputs into the latent node" in message
    assert warnings_for(check, wan_latent(2, 81, 720, 1280), caplog) == []   # once per shape


def test_a_smaller_video_warns_too_with_both_sizes(wan, caplog):
    """A latent typed apart from the plan, smaller: no memory risk, but the plan is for another video."""
    check = PlanCheck(wan, Workload(width=1280, height=720, frames=81, batch=1, cfg=True), "DiT")
    (message,) = warnings_for(check, wan_latent(2, 33, 480, 832), caplog)
    assert ("DiT: this step's latent 2x16x9x60x104 is 14040 tokens a video, but the MGPU Plan was made for "
            "1280x720x81, batch 1 with CFG = 75600 tokens a video") in message
    assert "wire the plan's width, height, frames and batch outputs into the latent node" in message


def test_a_larger_batch_warns(wan, caplog):
    check = PlanCheck(wan, Workload(width=832, height=480, frames=81, batch=1, cfg=False), "DiT")
    (message,) = warnings_for(check, wan_latent(2, 81, 480, 832), caplog)
    assert "is 32760 tokens x batch 2 = 65520, but the MGPU Plan was made for 832x480x81, batch 1 = " in message


def test_ltx2s_video_stream_is_checked(ltx2, caplog):
    """LTX-2's network gets [video, audio] (ComfyUI 0.33 unpacks the AV latent before the DiT): the video is the
    stream the plan sized. Before, a list had no shape and nothing was checked."""
    check = PlanCheck(ltx2, Workload(width=768, height=512, frames=97, batch=1, cfg=True), "DiT")
    audio = torch.empty(2, 8, 101, 16, device="meta")
    planned = torch.empty(2, 128, 13, 16, 24, device="meta")
    assert warnings_for(check, [planned, audio], caplog) == []
    (message,) = warnings_for(check, [torch.empty(2, 128, 13, 32, 48, device="meta"), audio], caplog)
    assert "latent 2x128x13x32x48 is 19968 tokens x batch 2" in message and "768x512x97, batch 1 with CFG" in message


def test_a_training_plan_lets_the_same_video_sample_with_cfg_and_warns_beyond(wan, caplog):
    """A plan made for a training step (the LoRA examples sample with the new LoRA on the same ranks): its one row's
    forward and backward hold far more than CFG's two sampling rows of the same video, so those pass; a third row,
    or a larger video, warns, naming the training step."""
    from mgpu.planning.training import Training

    check = PlanCheck(wan, Workload(width=832, height=480, frames=33, batch=1, cfg=False, train=Training()), "DiT")
    assert warnings_for(check, wan_latent(1, 33, 480, 832), caplog) == []   # the training step itself
    assert warnings_for(check, wan_latent(2, 33, 480, 832), caplog) == []   # sampling with CFG
    (message,) = warnings_for(check, wan_latent(3, 33, 480, 832), caplog)
    assert "the MGPU Plan was made for 832x480x33, a training step of 1 row = 14040 tokens x batch 1" in message
    (message,) = warnings_for(check, wan_latent(1, 81, 480, 832), caplog)
    assert "is 32760 tokens x batch 1 = 32760, but the MGPU Plan was made for 832x480x33, a training step" in message
