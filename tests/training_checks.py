"""Training checks that run inside a ComfyUI interpreter on the CPU (tests/test_comfyui_train.py starts one per
check): ComfyUI's own Train LoRA on a one-device model against MGPU Train LoRA on the same file sharded over cpu
ranks, same seed and data."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch

WAN = "mgpu_train_wan.safetensors"
GGUF = "mgpu_train_wan-Q8_0.gguf"
TEXT_WIDTH = 4096


def _data(rows: int, seed: int = 5, captions: int = 1) -> tuple[dict, list]:
    """A tiny Wan dataset: ``rows`` latents (16 channels, 2 frames of 8 x 8) and ``captions`` conditionings."""
    g = torch.Generator().manual_seed(seed)
    latent = {"samples": torch.randn(rows, 16, 2, 8, 8, generator=g)}
    conds = [[torch.randn(1, 6, TEXT_WIDTH, generator=g), {}] for _ in range(captions)]
    return latent, conds


def _write_wan(folder: Path, file_dtype: str, heads: int = 1) -> tuple[str, Path]:
    """The tiny Wan in ``file_dtype``: the name MGPU loads and the file core loads. ``fp8``: as plain fp8 files
    store it (matrices float8_e4m3fn, the rest fp32); ``gguf-q8_0``: the blocks' matrices Q8_0 in a GGUF file (the
    rest F32) for MGPU, and for core (which reads no GGUF) a safetensors file of the values the GGUF holds
    (gguf-py's dequantization). ``heads``: ComfyUI's Wan has dim / 128 attention heads (2: a sequence split over 2
    ranks)."""
    from comfy_checkpoints import (WanDiTConfig, random_state_dict, save_checkpoint, wan21_dit_shapes,
                                   write_tiny_wan21_t2v)

    path = folder / WAN
    cfg = WanDiTConfig(dim=128 * heads)
    if file_dtype == "gguf-q8_0":
        from mgpu.weights.gguf_write import write_gguf

        sd = random_state_dict(wan21_dit_shapes(cfg), dtype=torch.float32)
        types = {k: "Q8_0" if v.ndim == 2 and k.startswith("blocks.") else "F32" for k, v in sd.items()}
        held = write_gguf(folder / GGUF, sd, types)
        return GGUF, save_checkpoint(path, held)
    if file_dtype != "fp8":
        return WAN, write_tiny_wan21_t2v(path, cfg, dtype=getattr(torch, file_dtype))
    sd = random_state_dict(wan21_dit_shapes(cfg), dtype=torch.float32)
    return WAN, save_checkpoint(path, {k: v.to(torch.float8_e4m3fn) if v.ndim >= 2 else v for k, v in sd.items()})


def _core_train(model, latent: dict, conds: list, settings: dict) -> tuple[dict, list]:
    """ComfyUI's own Train LoRA node, run right after ``torch.manual_seed(seed)`` (it draws from the global
    generator), whichever of its two forms this ComfyUI has."""
    from comfy_extras import nodes_train

    node = nodes_train.TrainLoraNode
    torch.manual_seed(settings["seed"])
    if hasattr(node, "define_schema"):   # ComfyUI 0.33: V3, every input a list
        params = inspect.signature(node.execute).parameters
        defaults = {"quantized_backward": False, "checkpoint_depth": 1, "offloading": False, "bucket_mode": False,
                    "bypass_mode": False}
        args = {"model": model, "latents": latent, "positive": conds, **settings, **defaults}
        listed = {k: [v] for k, v in args.items() if k in params}
        out = node.execute(**listed)
        lora, loss = out.result[0], out.result[1]
    else:   # 0.3.64: a V1 node with one LATENT
        _, lora, loss, _ = node().train(model=model, latents=latent, positive=conds, **settings)
    return lora, loss["loss"]


def _training_plan(path: Path, latent: dict, settings: dict, ranks: int, asked: dict):
    """An MGPU Plan of this training step (``asked``: its Training fields) over ``ranks`` cpu ranks, made from the
    file's header as MGPU Plan makes it, and the settings it has the node train with."""
    from mgpu.planning.devices import inventory
    from mgpu.planning.estimates import Workload
    from mgpu.planning.partition import Component, Policy, make_plan
    from mgpu.planning.sizing import size_component
    from mgpu.planning.training import Training

    t, h, w = latent["samples"].shape[2:]   # Wan's VAE: 4 frames and 8 pixels a latent step
    train = Training(lora_rank=settings["rank"], optimizer=settings["optimizer"],
                     training_dtype=settings["training_dtype"], lora_dtype=settings["lora_dtype"], **asked)
    wl = Workload(width=w * 8, height=h * 8, frames=(t - 1) * 4 + 1, batch=settings["batch_size"], cfg=False,
                  train=train)
    plan = make_plan([Component("dit", size_component(str(path)))], inventory("cpu=64GiB"), wl,
                     Policy(fsdp_devices=("cpu",) * ranks))
    chosen = plan.placement("dit").training
    return plan, {**settings, **{k: chosen[k] for k in ("gradient_checkpointing", "batch_size",
                                                         "grad_accumulation_steps")}}


def check_train_equals_core(folder: str, ranks: int, settings: dict, rows: int = 2, captions: int = 1,
                            file_dtype: str = "float32", heads: int = 1, plan: dict | None = None) -> dict:
    """The same LoRA from core Train LoRA (one device) and MGPU Train LoRA (``ranks`` fsdp cpu ranks). ``plan``:
    MGPU Train LoRA follows an MGPU Plan made with these Training fields (core trains with what the plan chose)."""
    import comfy.sd
    import folder_paths

    from loaders import diffusion, training
    from mgpu.planning.sizing import size_component
    from mgpu.planning.training import adapter_params

    name, path = _write_wan(Path(folder), file_dtype, heads)
    folder_paths.add_model_folder_path("diffusion_models", folder)
    latent, conds = _data(rows, captions=captions)
    the_plan, core_settings = _training_plan(path, latent, settings, ranks, plan) if plan else (None, settings)
    core_lora, core_loss = _core_train(comfy.sd.load_diffusion_model(str(path)), latent, conds, core_settings)

    sharded = diffusion.load(name, "default", "fsdp", ranks)
    before = _sample_once(sharded)
    with _logged("mgpu") as logged:
        ours, loss_map, steps = training.train(sharded, [latent], [conds], training.TrainSettings(**settings),
                                               plan=the_plan)
    _, first, _ = training.first_adapters(sharded.model, training.TrainSettings(**settings), {})
    split = sharded.sharded.split   # (batch groups, sequence degree) of the last network call
    after = _sample_once(sharded)   # the model samples as before the run: the adapters came off the ranks
    misfit = {"diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.zeros(7, 4),
              "diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.zeros(4, 9)}
    try:
        training.first_adapters(sharded.model, training.TrainSettings(**{**settings, "existing_lora": "x.safetensors"}),
                                misfit)
        refused = ""
    except Exception as exc:   # noqa: BLE001 - the test asserts what was raised
        refused = f"{type(exc).__name__}: {exc}"
    # the loop closed: the trained LoRA through stock Load LoRA Model, on the same sharded MODEL and on one device
    one_device = comfy.sd.load_diffusion_model(str(path))
    with_lora = [_sample_once(_with_lora(m, ours)) for m in (sharded, one_device)]
    before_keys = list(core_lora)
    common = [k for k in before_keys if k in ours]
    worst = max(((ours[k].float() - core_lora[k].float()).abs().max() /
                 core_lora[k].float().abs().max().clamp_min(1e-12)).item() for k in common)
    norm = sum((core_lora[k].float() ** 2).sum().item() for k in common)

    def relative_l2(lora: dict) -> float:
        return (sum(((lora[k].float() - core_lora[k].float()) ** 2).sum().item() for k in common) / norm) ** 0.5
    moved = max(ours[k].float().abs().max().item() for k in before_keys if k.endswith("lora_down.weight"))
    return {"core_keys": before_keys, "keys": list(ours), "worst_relative": worst, "relative_l2": relative_l2(ours),
            "dtypes": sorted({str(v.dtype) for v in ours.values()}), "core_dtypes": sorted({str(v.dtype) for v in
                                                                                           core_lora.values()}),
            "core_loss": core_loss, "loss": loss_map["loss"], "steps": steps, "down_max": moved, "split": split,
            "unchanged_after_run": torch.equal(before, after), "misfit_refused": refused,
            "lora_sample_diff": (with_lora[0] - with_lora[1]).abs().max().item(),
            "lora_moves_sample": (with_lora[1] - _sample_once(one_device)).abs().max().item(),
            "comfyui_adapter_params": sum(v.numel() for k, v in first.items() if not k.endswith(".alpha")),
            "planned_adapter_params": adapter_params(size_component(str(path)), settings["rank"]),
            "followed": [line for line in logged if "following the MGPU Plan" in line],
            "core_settings": core_settings,
            # resuming a run trained with 1 row x 4 micro steps: its rows per forward stay, the plan's checkpointing
            "resume_keeps": (lambda kept: [kept.batch_size, kept.grad_accumulation_steps, kept.gradient_checkpointing])(
                training.follow_plan(the_plan, sharded, training.TrainSettings(**settings),
                                     {"batch_size": 1, "grad_accumulation_steps": 4})) if the_plan else None}


@contextlib.contextmanager
def _logged(name: str):
    """The messages of logger ``name`` (INFO and up) while the block runs."""
    import logging

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _with_lora(model, lora: dict):
    """Stock Load LoRA Model (ComfyUI's own node, either form) on ``model``."""
    from comfy_extras import nodes_train

    node = nodes_train.LoraModelLoader
    if hasattr(node, "define_schema"):
        return node.execute(model, lora, 1.0).result[0]
    return node().load_lora_model(model, lora, 1.0)[0]


def _sample_once(model) -> torch.Tensor:
    """One cfg-1 Euler step, as KSampler runs it."""
    import comfy.sample

    latent = torch.zeros(1, 16, 1, 8, 8)
    pos = [[torch.randn(1, 6, TEXT_WIDTH, generator=torch.Generator().manual_seed(1)), {}]]
    noise = comfy.sample.prepare_noise(latent, 1)
    out = comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", pos, pos, latent, seed=1, disable_pbar=True)
    assert torch.isfinite(out).all()
    return out


@contextlib.contextmanager
def _after_step(n: int, action):
    """``action()`` right after MGPU Train LoRA's optimizer step ``n`` (its checkpoint, if due, written)."""
    from loaders import training

    real_step = training.RemoteOptimizer.step

    def step(self):
        real_step(self)
        if self.done == n:
            action()

    training.RemoteOptimizer.step = step
    try:
        yield
    finally:
        training.RemoteOptimizer.step = real_step


def _press_cancel() -> None:
    """What ComfyUI's Cancel button does: the next progress update raises its interrupt."""
    import comfy.model_management as mm

    mm.interrupt_current_processing(True)


def check_cancel_keeps_the_finished_steps(folder: str, settings: dict) -> dict:
    """ComfyUI's Cancel during step 3 of 4 (the interrupt flag raised after 2 optimizer steps): the node ends as an
    interrupt, the LoRA of the 2 finished steps is in ComfyUI's output folder, equal to a 2-step run's; the model
    still samples, and a run after it equals a fresh one."""
    import comfy.model_management as mm
    import folder_paths
    from safetensors.torch import load_file

    from loaders import diffusion, training

    _write_wan(Path(folder), "float32")
    folder_paths.add_model_folder_path("diffusion_models", folder)
    folder_paths.set_output_directory(str(Path(folder) / "output"))
    latent, conds = _data(2)
    sharded = diffusion.load(WAN, "default", "fsdp", 2)
    two, _, _ = training.train(sharded, [latent], [conds], training.TrainSettings(**{**settings, "steps": 2}))

    interrupted = ""
    try:
        with _after_step(2, _press_cancel):
            training.train(sharded, [latent], [conds], training.TrainSettings(**{**settings, "steps": 4}))
    except mm.InterruptProcessingException as exc:
        interrupted = type(exc).__name__
    kept = sorted((Path(folder) / "output" / "loras").glob("mgpu_cancelled_lora_2_steps_*.safetensors"))
    saved = load_file(str(kept[0])) if kept else {}
    again, _, _ = training.train(sharded, [latent], [conds], training.TrainSettings(**{**settings, "steps": 2}))
    return {"interrupted": interrupted, "files": [p.name for p in kept], "flag_left": mm.processing_interrupted(),
            "same_keys": sorted(saved) == sorted(two),
            "kept_equals_two_steps": bool(saved) and all(torch.equal(saved[k], two[k]) for k in two),
            "again_equals_fresh": all(torch.equal(again[k], two[k]) for k in two)}


def check_ltx_video_is_refused_by_name(folder: str, settings: dict) -> dict:
    """MGPU Train LoRA on a sharded LTX-Video refuses by name before a run starts; core's Train LoRA on the same
    file, one device, fails in its backward (the reason the refusal gives)."""
    import comfy.sd
    import folder_paths

    from comfy_checkpoints import write_tiny_ltxv
    from loaders import diffusion, training

    path = write_tiny_ltxv(Path(folder) / "mgpu_train_ltxv.safetensors", dtype=torch.float32)
    folder_paths.add_model_folder_path("diffusion_models", folder)
    g = torch.Generator().manual_seed(0)
    latent = {"samples": torch.randn(1, 128, 2, 4, 4, generator=g)}
    conds = [[torch.randn(1, 6, TEXT_WIDTH, generator=g), {"attention_mask": torch.ones(1, 6, dtype=torch.long)}]]
    facts = {}
    try:
        _core_train(comfy.sd.load_diffusion_model(str(path)), latent, conds, settings)
        facts["core"] = ""
    except Exception as exc:   # noqa: BLE001 - the test asserts what was raised
        facts["core"] = f"{type(exc).__name__}: {exc}"
    sharded = diffusion.load(path.name, "default", "fsdp", 2)
    try:
        training.train(sharded, [latent], [conds], training.TrainSettings(**settings))
        facts["ours"] = ""
    except Exception as exc:   # noqa: BLE001
        facts["ours"] = f"{type(exc).__name__}: {exc}"
    return facts


def check_resume_equals_uninterrupted(folder: str, settings: dict) -> dict:
    """A run cancelled after 2 of 4 optimizer steps (checkpoints every step), queued again with resume on, ends
    with the uninterrupted run's LoRA and losses; the same checkpoint resumes on 3 ranks; other settings are refused
    by name; the checkpoint exports as a LoRA file stock LoraLoaderModelOnly loads on a one-device model."""
    import comfy.model_management as mm
    import comfy.sd
    import folder_paths
    from safetensors.torch import load_file

    from loaders import diffusion, training, training_checkpoints
    from mgpu.training import checkpoints as ck

    name, path = _write_wan(Path(folder), "float32")
    folder_paths.add_model_folder_path("diffusion_models", folder)
    folder_paths.set_output_directory(str(Path(folder) / "output"))
    folder_paths.set_user_directory(str(Path(folder) / "user"))
    latent, conds = _data(2)
    sharded = diffusion.load(name, "default", "fsdp", 2)

    def train(model, **changes):
        return training.train(model, [latent], [conds], training.TrainSettings(**{**settings, **changes}))

    full, full_loss, _ = train(sharded, run_name="full")
    cancelled = ""
    try:
        with _after_step(2, _press_cancel):
            train(sharded, run_name="part", checkpoint_every=1, keep_checkpoints=1)
    except mm.InterruptProcessingException as exc:
        cancelled = type(exc).__name__
    saved = [p.name for p in ck.saved_steps(training_checkpoints.root(), "part")]
    resumed, resumed_loss, steps = train(sharded, run_name="part", resume=True, keep_checkpoints=1)
    try:
        train(sharded, run_name="part", resume=True, learning_rate=settings["learning_rate"] * 2)
        refused = ""
    except Exception as exc:   # noqa: BLE001 - the test asserts what was raised
        refused = f"{type(exc).__name__}: {exc}"
    step2 = ck.step_folder(training_checkpoints.root(), "part", 2)   # keep 1: the final checkpoint replaced it
    newest = ck.saved_steps(training_checkpoints.root(), "part")
    out = Path(folder) / "exported.safetensors"
    exported_keys = ck.export_lora(newest[-1], training_checkpoints.key(), out)
    exported = load_file(str(out))
    one_device = comfy.sd.load_diffusion_model(str(path))
    sample = _sample_once(_with_lora(one_device, exported))

    import os
    import signal

    def kill_rank_1():   # a rank dies (OOM killer, a driver fault)
        os.kill([r.payload["pid"] for r in sharded.sharded.pool.call("ping")][1], signal.SIGKILL)

    killed = ""
    try:
        with _after_step(2, kill_rank_1):
            train(sharded, run_name="killed", checkpoint_every=2)
    except Exception as exc:   # noqa: BLE001 - the test asserts what was raised
        killed = f"{type(exc).__name__}: {exc}"
    after_kill, _, _ = train(sharded, run_name="killed", resume=True)   # the pool rebuilds, the model reloads
    train(sharded, run_name="two", steps=2)   # 2 of the 4 steps on 2 ranks, the rest on 3
    on_three, _, _ = train(diffusion.load(name, "default", "fsdp", 3), run_name="two", resume=True)
    return {"cancelled": cancelled, "saved_after_cancel": saved, "steps": steps,
            "bit_equal": list(resumed) == list(full) and all(torch.equal(resumed[k], full[k]) for k in full),
            "loss_equal": resumed_loss["loss"] == full_loss["loss"], "refused": refused,
            "step2_left": step2.exists(), "newest": [p.name for p in newest],
            "exported_equal": exported_keys == list(full) and all(torch.equal(exported[k], full[k]) for k in full),
            "sample_finite": bool(torch.isfinite(sample).all()), "killed": killed,
            "after_kill_equal": all(torch.equal(after_kill[k], full[k]) for k in full),
            "three_worst": max(((on_three[k] - full[k]).abs().max() / full[k].abs().max().clamp_min(1e-12)).item()
                               for k in full)}


def check_wan22_experts_train_in_turn(folder: str, settings: dict) -> dict:
    """Wan 2.2 A14B's shape: two experts loaded by two MGPU loaders on the same 2 ranks, the high-noise LoRA trained
    on the first half of the noise schedule, then the low-noise LoRA on the rest, in one process. The timesteps that
    reach each expert's network stay in its share; training the high-noise expert again after the low one (the
    experts took turns on the ranks) gives its LoRA bit for bit."""
    import folder_paths

    from comfy_checkpoints import WanDiTConfig, write_tiny_wan21_t2v
    from loaders import diffusion, training

    cfg = WanDiTConfig()
    for name, seed in (("mgpu_wan22_high.safetensors", 1), ("mgpu_wan22_low.safetensors", 2)):
        write_tiny_wan21_t2v(Path(folder) / name, cfg, seed=seed, dtype=torch.float32)
    folder_paths.add_model_folder_path("diffusion_models", folder)
    folder_paths.set_output_directory(str(Path(folder) / "output"))
    folder_paths.set_user_directory(str(Path(folder) / "user"))
    high = diffusion.load("mgpu_wan22_high.safetensors", "default", "fsdp", 2, slot=("high", 0))
    low = diffusion.load("mgpu_wan22_low.safetensors", "default", "fsdp", 2, slot=("low", 0))
    latent, conds = _data(2)
    seen: list[float] = []
    real_call = training.TrainingForward.__call__

    def call(self, *args, **kwargs):
        named, _, _ = self.bind(args, kwargs)
        seen.extend(named["timestep"].detach().flatten().tolist())
        return real_call(self, *args, **kwargs)

    def train(model, start, end, run):
        seen.clear()
        lora, _, _ = training.train(model, [latent], [conds], training.TrainSettings(
            **{**settings, "timestep_start": start, "timestep_end": end, "run_name": run}))
        return lora, list(seen)

    training.TrainingForward.__call__ = call
    try:
        high_lora, high_t = train(high, 0.0, 0.5, "high")
        low_lora, low_t = train(low, 0.5, 1.0, "low")
        again, _ = train(high, 0.0, 0.5, "high again")
        whole, _ = train(high, 0.0, 1.0, "whole")
    finally:
        training.TrainingForward.__call__ = real_call
    ms = high.get_model_object("model_sampling")
    boundary = float(ms.timestep(ms.percent_to_sigma(0.5)))
    return {"boundary": boundary, "high_t": high_t, "low_t": low_t,
            "again_equal": all(torch.equal(again[k], high_lora[k]) for k in high_lora),
            "range_changes_lora": any(not torch.equal(whole[k], high_lora[k]) for k in high_lora),
            "experts_differ": any(not torch.equal(low_lora[k], high_lora[k]) for k in high_lora)}
