"""MGPU Load Diffusion Model (fsdp) + MGPU FSDP Sampler inside a real ComfyUI, on CPU ranks.

Needs a ComfyUI checkout (COMFYUI_PATH, or this pack inside ComfyUI/custom_nodes/<name>); skips otherwise.
Run locally:  COMFYUI_PATH=/path/to/ComfyUI python -m pytest tests/test_comfyui_fsdp.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from comfy_checkpoints import (
    LTXVDiTConfig,
    WanDiTConfig,
    write_tiny_ltxv,
    write_tiny_wan21_t2v,
)
from comfyui_env import SKIP_REASON, ComfyServer, PromptRejected, find_comfyui, start_server
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.comfyui

WAN = "mgpu_fsdp_wan.safetensors"
LTXV = "mgpu_fsdp_ltxv.safetensors"
# Wan with 2 heads and 3 blocks (odd: the ranks' shards differ); LTXV with the "model.diffusion_model." prefix.
FAMILIES = {"wan": (WAN, "EmptyHunyuanLatentVideo", 5), "ltxv": (LTXV, "EmptyLTXVLatentVideo", 9)}
STEPS = 3
TOLERANCE = 1e-4   # fp32 on CPU: the ranks compute one row each, the stock model both rows at once
# logged when a sampling run ends (ComfyUI's cleanup): cpu ranks have no caching allocator, so nothing to release
RELEASED = "sampling ended: its ranks released 0 B of cached working memory on cpu, 0 B on cpu"


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    write_tiny_wan21_t2v(comfyui_server.diffusion_models / WAN, WanDiTConfig(dim=256, ffn_dim=512, num_layers=3))
    write_tiny_ltxv(comfyui_server.diffusion_models / LTXV, LTXVDiTConfig(num_layers=3))
    return comfyui_server


# ------------------------------------------------------------------------------------------------ prompt building

def _fsdp_loader(unet: str, device: str = "fsdp", ranks: int = 2) -> dict:
    return {"class_type": "MgpuLoadDiffusionModel",
            "inputs": {"unet_name": unet, "weight_dtype": "default", "device": device, "fsdp_ranks": ranks}}


def _conditioning(seed: int, tokens: int = 8) -> dict:
    return {"class_type": "MgpuTestConditioning",
            "inputs": {"width": 4096, "tokens": tokens, "seed": seed, "scale": 1.0}}


def _sampler(class_type: str, model: str, negative: str, seed: int, steps: int) -> dict:
    inputs = {"model": [model, 0], "positive": ["pos", 0], "negative": [negative, 0], "latent_image": ["latent", 0],
              "seed": seed, "steps": steps, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}
    if class_type == "MgpuFSDPSampler":
        inputs["timeout_s"] = 120.0
    return {"class_type": class_type, "inputs": inputs}


def _save(sampler: str) -> dict:
    return {"class_type": "SaveLatent", "inputs": {"samples": [sampler, 0], "filename_prefix": f"fsdp/{sampler}"}}


def _base(family: str, seed: int, size: int = 64) -> dict[str, Any]:
    unet, latent_node, frames = FAMILIES[family]
    return {
        "stock_unet": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "fsdp_unet": _fsdp_loader(unet),
        "pos": _conditioning(seed),
        "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
        "latent": {"class_type": latent_node,
                   "inputs": {"width": size, "height": size, "length": frames, "batch_size": 1}},
    }


def comparison_prompt(family: str, seed: int) -> dict[str, Any]:
    """Stock and sharded side by side. ``neg`` batches cond and uncond (batch 2: one row per rank); ``neg_long`` has
    41 tokens against 8, which ComfyUI will not pad into one batch, so each step calls the network twice with
    batch 1 (one rank computes, the other runs a dropped row to keep FSDP's all-gathers going)."""
    prompt = _base(family, seed)
    prompt.update({
        "cpu_unet": _fsdp_loader(FAMILIES[family][0], device="cpu"),
        "neg_long": _conditioning(seed + 1, tokens=41),
        "stock": _sampler("KSampler", "stock_unet", "neg", seed, STEPS),
        "fsdp": _sampler("MgpuFSDPSampler", "fsdp_unet", "neg", seed, STEPS),
        "fsdp_ksampler": _sampler("KSampler", "fsdp_unet", "neg", seed, STEPS),
        "single_cpu": _sampler("KSampler", "cpu_unet", "neg", seed, STEPS),
        "stock_split": _sampler("KSampler", "stock_unet", "neg_long", seed, STEPS),
        "fsdp_split": _sampler("MgpuFSDPSampler", "fsdp_unet", "neg_long", seed, STEPS),
    })
    for name in ("stock", "fsdp", "fsdp_ksampler", "single_cpu", "stock_split", "fsdp_split"):
        prompt[f"save_{name}"] = _save(name)
    return prompt


def sharded_prompt(steps: int, seed: int = 7, size: int = 64, with_stock: bool = False, **loader: Any) -> dict:
    """Sharded Wan + MGPU FSDP Sampler (+ the stock pair to compare with)."""
    prompt = _base("wan", seed, size)
    del prompt["stock_unet"]
    prompt["fsdp_unet"] = _fsdp_loader(WAN, **loader)
    prompt.update({"fsdp": _sampler("MgpuFSDPSampler", "fsdp_unet", "neg", seed, steps), "save_fsdp": _save("fsdp")})
    if with_stock:
        prompt["stock_unet"] = {"class_type": "UNETLoader", "inputs": {"unet_name": WAN, "weight_dtype": "default"}}
        prompt.update({"stock": _sampler("KSampler", "stock_unet", "neg", seed, steps), "save_stock": _save("stock")})
    return prompt


# ------------------------------------------------------------------------------------------------ helpers

def run(server: ComfyServer, prompt: dict, ok: bool = True, timeout: float = 300) -> dict:
    entry = server.wait(server.post_prompt(prompt), timeout=timeout)
    if ok:
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[-6000:]
    return entry


def latents(server: ComfyServer, entry: dict) -> dict[str, torch.Tensor]:
    out = {}
    for node, result in entry["outputs"].items():
        for item in result.get("latents", []):
            path = server.output_dir / item["subfolder"] / item["filename"]
            out[node.removeprefix("save_")] = load_file(str(path))["latent_tensor"]
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def ranks_of(server: ComfyServer) -> list[psutil.Process]:
    """The rank worker processes started by the server (``python -m mgpu.ranks.rank``)."""
    try:
        children = psutil.Process(server.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in children:
        try:
            if "mgpu.ranks.rank" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def rank_number(p: psutil.Process) -> int:
    argv = p.cmdline()
    return int(argv[argv.index("--rank") + 1])


def error_of(entry: dict) -> dict:
    assert entry["status"]["status_str"] == "error", entry["status"]
    errors = [data for kind, data in entry["status"]["messages"] if kind == "execution_error"]
    assert errors, entry["status"]["messages"]
    return errors[0]


def progress_of(server: ComfyServer, prompt_id: str, node: str) -> list[tuple[int, int]]:
    return [(m["data"]["value"], m["data"]["max"]) for m in server.ws_messages(prompt_id)
            if m["type"] == "progress" and m["data"]["node"] == node]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("family", ["wan", "ltxv"])
def test_sharded_model_matches_stock_in_every_sampler(server: ComfyServer, family: str) -> None:
    """(a) MGPU FSDP Sampler over 2 CPU ranks == stock UNETLoader + KSampler; (b) so does stock KSampler given the
    sharded MODEL; with cond/uncond batched and split. The single-device path (device cpu) is ComfyUI's own load."""
    prompt_id = server.post_prompt(comparison_prompt(family, seed=3))
    entry = server.wait(prompt_id, timeout=300)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[-6000:]
    lat = latents(server, entry)
    stock = lat["stock"]
    assert torch.isfinite(stock).all() and stock.abs().max() > 0.1
    assert max_diff(lat["fsdp"], stock) <= TOLERANCE
    assert max_diff(lat["fsdp_ksampler"], stock) <= TOLERANCE
    assert max_diff(lat["fsdp_split"], lat["stock_split"]) <= TOLERANCE
    assert max_diff(lat["stock_split"], stock) > 10 * TOLERANCE   # the two negatives really differ
    assert torch.equal(lat["single_cpu"], stock)
    assert len(ranks_of(server)) == 2
    assert f"{FAMILIES[family][0]} sharded over 2 ranks (cpu, cpu) loaded" in server.log()

    # (c) ComfyUI progress per step, for the node that samples: every step on 0.3.64; newer ComfyUI's ProgressBar
    # sends the first and the last and drops updates closer together than its interval
    server.wait_ws(prompt_id, "execution_success", timeout=30)
    for node in ("fsdp", "fsdp_split"):
        seen = progress_of(server, prompt_id, node)
        assert seen[0] == (1, STEPS) and seen[-1] == (STEPS, STEPS), seen
        assert seen == sorted(set(seen)) and set(seen) <= {(i, STEPS) for i in range(1, STEPS + 1)}, seen


def _pairs_prompt(models: dict[str, tuple[str, int]]) -> dict[str, Any]:
    """Wan plus one KSampler + SaveLatent per entry ``name: (model node, steps)``."""
    prompt = _base("wan", seed=5)
    for name, (model, steps) in models.items():
        prompt[name] = _sampler("KSampler", model, "neg", 5, steps)
        prompt[f"save_{name}"] = _save(name)
    return prompt


def test_fp8_weights_match_stock(server: ComfyServer) -> None:
    """fp8 storage on the ranks (all-gathered as fp8 bytes, gloo included) == UNETLoader fp8."""
    prompt = _pairs_prompt({"stock": ("stock_unet", STEPS), "stock_fp8": ("stock_fp8_unet", STEPS),
                            "fsdp_fp8": ("fsdp_fp8_unet", STEPS)})
    prompt["stock_fp8_unet"] = {"class_type": "UNETLoader", "inputs": {"unet_name": WAN, "weight_dtype": "fp8_e4m3fn"}}
    prompt["fsdp_fp8_unet"] = _fsdp_loader(WAN)
    prompt["fsdp_fp8_unet"]["inputs"]["weight_dtype"] = "fp8_e4m3fn"
    lat = latents(server, run(server, prompt))
    assert max_diff(lat["fsdp_fp8"], lat["stock_fp8"]) <= TOLERANCE
    assert max_diff(lat["stock_fp8"], lat["stock"]) > 10 * TOLERANCE   # fp8 really changed the weights
    assert "(float8_e4m3fn, compute float32;" in server.log()          # and the ranks really stored fp8


PATCHES = {  # node, inputs besides the model; one prompt each (stock ComfyUI lets one clone's patch leak into another)
    "model_sampling": ("ModelSamplingSD3", {"shift": 5.0}),
    "easycache": ("EasyCache", {"reuse_threshold": 1.0, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}),
}


@pytest.mark.parametrize("patch", list(PATCHES))
def test_other_nodes_patches_work_on_the_sharded_model(server: ComfyServer, patch: str) -> None:
    """A model-sampling object patch (it applies to the host's BaseModel) and EasyCache (a DIFFUSION_MODEL wrapper:
    it runs around the remote forward and skips steps) give stock's results."""
    node, inputs = PATCHES[patch]
    prompt = _pairs_prompt({"plain": ("stock_unet", 10), "stock": ("stock_patched", 10),
                            "fsdp": ("fsdp_patched", 10)})
    for unet in ("stock", "fsdp"):
        prompt[f"{unet}_patched"] = {"class_type": node, "inputs": {"model": [f"{unet}_unet", 0], **inputs}}
    log_start = len(server.log())
    lat = latents(server, run(server, prompt))
    assert max_diff(lat["fsdp"], lat["stock"]) <= TOLERANCE
    assert max_diff(lat["stock"], lat["plain"]) > 10 * TOLERANCE   # the patch did something
    if patch == "easycache":   # the same steps skipped, sharded or not
        skipped = re.findall(r"EasyCache - skipped (\d+)/10 steps", server.log()[log_start:])
        assert len(skipped) == 2 and skipped[0] == skipped[1] != "0", skipped


def test_options_the_network_reads_reach_the_ranks(server: ComfyServer) -> None:
    """ScaleROPE (newer ComfyUI) puts rope_options in transformer_options, which Wan's network reads: the ranks get
    them, so the sharded result equals stock's, and differs from the unpatched one. ComfyUI 0.3.64 has neither the
    node nor the option; there the test checks that, so a ComfyUI that adds them is not missed."""
    if "ScaleROPE" not in server.object_info():
        assert "rope_options" not in (server.comfyui / "comfy" / "ldm" / "wan" / "model.py").read_text()
        return
    rope = {"scale_x": 1.0, "shift_x": 3.0, "scale_y": 1.0, "shift_y": 0.0, "scale_t": 2.0, "shift_t": 0.0}
    prompt = _pairs_prompt({"plain": ("stock_unet", STEPS), "stock": ("stock_rope", STEPS),
                            "fsdp": ("fsdp_rope", STEPS)})
    for unet in ("stock", "fsdp"):
        prompt[f"{unet}_rope"] = {"class_type": "ScaleROPE", "inputs": {"model": [f"{unet}_unet", 0], **rope}}
    lat = latents(server, run(server, prompt))
    assert max_diff(lat["fsdp"], lat["stock"]) <= TOLERANCE
    assert max_diff(lat["stock"], lat["plain"]) > 10 * TOLERANCE


def test_interrupt_stops_within_a_step_and_keeps_the_pool(server: ComfyServer) -> None:
    """(d) POST /interrupt mid-run ends the prompt at the next step; the same ranks then serve the next prompt."""
    steps = 10_000
    start = len(server.log())
    prompt_id = server.post_prompt(sharded_prompt(steps, size=128))
    server.wait_ws(prompt_id, "progress", timeout=300)
    pids = sorted(p.pid for p in ranks_of(server))
    assert len(pids) == 2
    seen = len(progress_of(server, prompt_id, "fsdp"))
    server.interrupt()
    entry = server.wait(prompt_id, timeout=120)
    assert entry["status"]["status_str"] == "error"
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]]
    # a step in flight finishes; its progress update raises instead of reporting (plus one already on the wire)
    assert len(progress_of(server, prompt_id, "fsdp")) - seen <= 2

    assert RELEASED in server.log()[start:]   # ComfyUI's cleanup ran on the way out, and the ranks answered it

    lat = latents(server, run(server, sharded_prompt(2, size=128, with_stock=True)))
    assert max_diff(lat["fsdp"], lat["stock"]) <= TOLERANCE
    assert sorted(p.pid for p in ranks_of(server)) == pids


def _advanced(model: str, latent: list, start: int, end: int, first: bool) -> dict:
    """KSamplerAdvanced over steps [start, end) of 4: the first pass adds the noise and returns what is left of it,
    the second goes on from there (Wan 2.2's two experts, here one model twice)."""
    return {"class_type": "KSamplerAdvanced",
            "inputs": {"model": [model, 0], "add_noise": "enable" if first else "disable", "noise_seed": 31,
                       "steps": 4, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple", "positive": ["pos", 0],
                       "negative": ["neg", 0], "latent_image": latent, "start_at_step": start, "end_at_step": end,
                       "return_with_leftover_noise": "enable" if first else "disable"}}


def test_every_sampling_run_has_the_ranks_release_their_cached_memory(server: ComfyServer) -> None:
    """ComfyUI's cleanup at the end of each sampling run (``outer_sample``'s finally) has the ranks empty their
    caching allocators, logged once per run for all ranks. Two KSamplerAdvanced in a row on the sharded model
    release after each; the second pass reserves again and the result equals stock's."""
    prompt = _base("wan", seed=31)
    for unet in ("stock", "fsdp"):
        prompt[f"{unet}_high"] = _advanced(f"{unet}_unet", ["latent", 0], 0, 2, first=True)
        prompt[f"{unet}_low"] = _advanced(f"{unet}_unet", [f"{unet}_high", 0], 2, 4, first=False)
        prompt[f"save_{unet}"] = _save(f"{unet}_low")
    start = len(server.log())
    lat = latents(server, run(server, prompt))
    assert max_diff(lat["fsdp"], lat["stock"]) <= TOLERANCE
    log = server.log()[start:]
    assert log.count(f"{WAN}: {RELEASED}") == 2, log[-3000:]


def test_a_changed_loader_frees_its_old_shards_before_loading_new_ones(server: ComfyServer) -> None:
    """Re-running the loader node (another weight dtype) must not hold two models on the ranks at once: the old
    shards are freed before the new ones load (by the loader itself; ComfyUI's own cache drop may also get there
    first through the finalizer, so this checks the outcome, not which path freed them)."""
    run(server, sharded_prompt(1, seed=21))
    start = len(server.log())
    changed = sharded_prompt(1, seed=21)
    changed["fsdp_unet"]["inputs"]["weight_dtype"] = "fp32"
    lat = latents(server, run(server, changed))
    log = server.log()[start:]
    freed, loaded = log.find("its shards on the FSDP ranks were freed"), log.rfind("loaded in")
    assert 0 <= freed < loaded, log[-3000:]
    assert torch.isfinite(lat["fsdp"]).all()


@pytest.mark.parametrize(("loader", "expected"), [
    ({"unet_name": "no_such_model.safetensors"}, ["'no_such_model.safetensors' is not in ComfyUI's diffusion_models"]),
    ({"device": "cuda:7"}, ["cuda:7 does not exist", "pick one of auto, cpu, fsdp"]),
])
def test_bad_input_is_refused_when_queued(server: ComfyServer, loader: dict, expected: list[str]) -> None:
    """(e) a missing file or GPU refuses the prompt at POST /prompt, before any node runs (the text encoder's
    minute), with the loader's message naming it; no rank is started for it."""
    before = {p.pid for p in ranks_of(server)}
    prompt = sharded_prompt(2)
    prompt["fsdp_unet"]["inputs"].update(loader)
    node_type, message = rejection_of(server, prompt, "fsdp_unet")
    assert node_type == "MgpuLoadDiffusionModel"
    for text in expected:
        assert text in message, message
    assert {p.pid for p in ranks_of(server)} <= before


def test_an_html_page_saved_as_safetensors_is_refused_when_queued(server: ComfyServer) -> None:
    """A download that saved the site's HTML page under the model's name: its header is read at POST /prompt."""
    page = server.models_dir / "diffusion_models" / "mgpu_saved_page.safetensors"
    page.write_text("<!DOCTYPE html><html><body>Sign in to download</body></html>\n" * 20)
    prompt = sharded_prompt(2)
    prompt["fsdp_unet"]["inputs"]["unet_name"] = page.name
    _, message = rejection_of(server, prompt, "fsdp_unet")
    assert "mgpu_saved_page.safetensors" in message and "safetensors" in message, message


def rejection_of(server: ComfyServer, prompt: dict, node: str) -> tuple[str, str]:
    """(class type, messages) of ``node``'s errors when POST /prompt refuses ``prompt`` (validate_inputs)."""
    with pytest.raises(PromptRejected) as info:
        server.post_prompt(prompt)
    errors = info.value.body["node_errors"][node]
    return errors["class_type"], "\n".join(e.get("details", "") for e in errors["errors"])


def test_killed_rank_is_a_node_error_and_the_next_prompt_rebuilds(server: ComfyServer) -> None:
    """(e) SIGKILL of a rank mid-run: a node error naming rank, device and cause; no rank left; the next prompt
    restarts the pool and reloads the model, and the result is right."""
    start = len(server.log())
    prompt_id = server.post_prompt(sharded_prompt(10_000, size=128))
    server.wait_ws(prompt_id, "progress", timeout=300)
    ranks = ranks_of(server)
    victim = next(p for p in ranks if rank_number(p) == 1)
    victim.send_signal(signal.SIGKILL)
    error = error_of(server.wait(prompt_id, timeout=120))
    message = error["exception_message"]
    assert error["node_id"] == "fsdp" and error["node_type"] == "MgpuFSDPSampler"
    assert f"rank 1 (cpu, pid {victim.pid}) was killed by SIGKILL" in message, message
    assert "Queue the prompt again" in message
    # ComfyUI's cleanup after the failed run found the ranks gone: a warning, not an error in place of the node's
    assert "its ranks are gone, so no cached working memory was released after sampling" in server.log()[start:]
    wait_until(lambda: not ranks_of(server), 15, "the surviving rank to be stopped")

    lat = latents(server, run(server, sharded_prompt(2, size=128, with_stock=True)))
    assert max_diff(lat["fsdp"], lat["stock"]) <= TOLERANCE
    assert not {p.pid for p in ranks_of(server)} & {p.pid for p in ranks}


def pool_dirs(owner: int) -> list[str]:
    """The private directories (shared-memory segments, logs) of pools run by process ``owner``."""
    from mgpu.ranks import shm

    return [os.path.join(parent, n) for parent in {shm.shm_parent(), tempfile.gettempdir()}
            for n in os.listdir(parent) if n.startswith(f"mgpu-{owner}-")]


def test_ranks_and_shared_memory_go_with_comfyui(tmp_path: Path) -> None:
    """(f) ComfyUI stopped on its own (SIGTERM to the main process only): its ranks go with it and so do their shared
    memory and directories; what a killed ComfyUI left (a directory whose owner is gone) is swept when the pack loads."""
    from mgpu.ranks import shm

    comfyui = find_comfyui()
    if comfyui is None:
        pytest.skip(SKIP_REASON)
    dead = 2**22 + 12345   # above pid_max by default: no live process owns it
    stale = Path(shm.shm_parent()) / f"mgpu-{dead}-stale"
    stale.mkdir(exist_ok=True)
    (stale / shm.LOCK_NAME).touch()   # a lock file nobody holds: its owner died
    own = start_server(comfyui, tmp_path)
    try:
        assert not stale.exists(), "the pack did not sweep a dead ComfyUI's directory when it loaded"
        write_tiny_wan21_t2v(own.diffusion_models / WAN, WanDiTConfig(dim=256, ffn_dim=512, num_layers=3))
        run(own, sharded_prompt(2))
        ranks = ranks_of(own)
        assert len(ranks) == 2 and pool_dirs(own.process.pid)
        os.kill(own.process.pid, signal.SIGTERM)
        own.process.wait(timeout=60)
        _, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, [p.pid for p in alive]
        assert pool_dirs(own.process.pid) == []
    finally:
        leftovers = own.stop()
        shutil.rmtree(stale, ignore_errors=True)
    assert not leftovers, leftovers


@pytest.mark.parametrize("ranks", [1, 3])
def test_every_rank_count_the_menu_offers_matches_stock(server: ComfyServer, ranks: int) -> None:
    """fsdp_ranks 1 (a one-GPU machine choosing fsdp: FSDP2's world-size-1 path) and 3 (uneven shards, a rank with
    no batch row) sample what stock sampling does."""
    entry = run(server, sharded_prompt(steps=2, seed=5, with_stock=True, ranks=ranks))
    lat = latents(server, entry)
    assert max_diff(lat["fsdp"], lat["stock"]) <= TOLERANCE
    assert f"{WAN} sharded over {ranks} ranks ({', '.join(['cpu'] * ranks)}) loaded" in server.log()
    # no MGPU Plan connected: the loader decides as a plan would, and a tiny model's gathered weights fit
    assert "no MGPU Plan: the gathered weights stay between steps" in server.log()


def test_cancel_ends_a_step_a_rank_hangs_in_within_seconds(server: ComfyServer) -> None:
    """A rank that hangs (here stopped with SIGSTOP, as a stuck GPU would) cannot answer: POST /interrupt still ends
    the prompt within a few seconds (the pool is torn down, not waited out), and the next prompt runs on new ranks."""
    prompt_id = server.post_prompt(sharded_prompt(10_000, size=128))
    server.wait_ws(prompt_id, "progress", timeout=300)
    ranks = sorted(ranks_of(server), key=rank_number)
    assert len(ranks) == 2
    ranks[1].suspend()
    time.sleep(0.5)   # the step in flight now waits on rank 1
    t0 = time.monotonic()
    server.interrupt()
    entry = server.wait(prompt_id, timeout=60)
    assert time.monotonic() - t0 < 10, "Cancel waited for the hung rank"
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]]
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), 10,
               "the old ranks to be gone")
    lat = latents(server, run(server, sharded_prompt(2, size=128, with_stock=True)))
    assert max_diff(lat["fsdp"], lat["stock"]) <= TOLERANCE
    assert {p.pid for p in ranks_of(server)}.isdisjoint(p.pid for p in ranks)


def post_free_until(server: ComfyServer, body: dict, done, timeout: float, what: str) -> None:
    """POST /free, again every few seconds until ``done()``: ComfyUI's queue wakes its worker for the flags with a
    notify that is lost if the worker is busy just then (finishing the last prompt), until its next prompt."""
    deadline = time.monotonic() + timeout
    while True:
        status, _ = server._request("POST", "/free", body)
        assert status == 200
        try:
            wait_until(done, 5, what)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise


def test_unload_models_frees_the_shards_and_free_memory_stops_the_ranks(server: ComfyServer) -> None:
    """ComfyUI's "Unload models" (POST /free unload_models) cannot see the ranks' memory: the pack frees the shards
    there too (the ranks shrink by at least their share of the model; the next prompt loads it again), and
    free_memory, which also drops ComfyUI's caches, stops the ranks left without a model."""
    big = "mgpu_fsdp_wan_unload.safetensors"
    write_tiny_wan21_t2v(server.diffusion_models / big, WanDiTConfig(dim=1024, ffn_dim=4096, num_layers=2))
    fp32_bytes = 2 * (server.diffusion_models / big).stat().st_size    # bf16 file, fp32 on cpu ranks

    def prompt(seed: int) -> dict:
        p = sharded_prompt(1, seed=seed)
        p["fsdp_unet"]["inputs"]["unet_name"] = big
        return p

    run(server, prompt(31))
    ranks = sorted(ranks_of(server), key=rank_number)
    assert len(ranks) == 2
    before = [p.memory_info().rss for p in ranks]
    post_free_until(server, {"unload_models": True},
                    lambda: all(b - p.memory_info().rss >= 0.4 * fp32_bytes for p, b in zip(ranks, before)), 40,
                    f"each rank to give back its share of {fp32_bytes:,} bytes (RSS was {before})")
    assert sorted(p.pid for p in ranks_of(server)) == sorted(p.pid for p in ranks)   # ranks kept, small
    start = len(server.log())
    assert torch.isfinite(latents(server, run(server, prompt(32)))["fsdp"]).all()
    assert f"{big} sharded over 2 ranks" not in server.log()[start:]   # the same MODEL: its shards reload ...
    assert sum(p.memory_info().rss for p in ranks) - sum(before) > -0.4 * fp32_bytes   # ... on the same ranks

    post_free_until(server, {"unload_models": True, "free_memory": True}, lambda: not ranks_of(server), 40,
                    "the idle ranks to stop")


# ------------------------------------------------------------------------------------------------ LoRA

LORA = "mgpu_fsdp_lora.safetensors"
LORA_TARGETS = {"self_attn.q": (256, 256), "self_attn.o": (256, 256), "ffn.0": (512, 256)}   # (out, in)


def write_lora(path: Path, rank: int = 4, alpha: float = 2.0) -> int:
    """A LoRA for the tiny Wan in ComfyUI's key layout (lora_up/lora_down/alpha for every block's q, o and first
    FFN layer, plus a bias diff), as trainers write them; returns the file's size."""
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for block in range(3):
        for target, (out_dim, in_dim) in LORA_TARGETS.items():
            name = f"diffusion_model.blocks.{block}.{target}"
            tensors[f"{name}.lora_up.weight"] = (torch.randn(out_dim, rank, generator=g) * 0.1).to(torch.bfloat16)
            tensors[f"{name}.lora_down.weight"] = (torch.randn(rank, in_dim, generator=g) * 0.1).to(torch.bfloat16)
            tensors[f"{name}.alpha"] = torch.tensor(alpha)
    tensors["diffusion_model.blocks.0.self_attn.q.diff_b"] = torch.randn(256, generator=g) * 0.1
    save_file(tensors, str(path))
    return path.stat().st_size


def _lora_node(model: str, strength: float, name: str = LORA) -> dict:
    return {"class_type": "LoraLoaderModelOnly",
            "inputs": {"model": [model, 0], "lora_name": name, "strength_model": strength}}


def test_a_lora_on_the_sharded_model_matches_stock(server: ComfyServer) -> None:
    """Stock LoraLoaderModelOnly on the FSDP MODEL == on UNETLoader's: each rank patches its own rows with the
    adapter tensors alone (bytes sent = about the LoRA file); a changed strength and the LoRA removed need no reload
    of the base weights, and removing it gives plain stock again."""
    lora_bytes = write_lora(server.models_dir / "loras" / LORA)
    prompt = _pairs_prompt({"plain": ("stock_unet", STEPS), "stock_full": ("stock_lora_full", STEPS),
                            "stock_half": ("stock_lora_half", STEPS), "fsdp_full": ("fsdp_lora_full", STEPS),
                            "fsdp_half": ("fsdp_lora_half", STEPS), "fsdp_plain": ("fsdp_unet", STEPS)})
    for unet in ("stock", "fsdp"):
        prompt[f"{unet}_lora_full"] = _lora_node(f"{unet}_unet", 1.0)
        prompt[f"{unet}_lora_half"] = _lora_node(f"{unet}_unet", 0.5)
    prompt["fsdp_unet"]["inputs"]["unet_name"] = "mgpu_fsdp_wan_lora.safetensors"   # a model only this test loads
    shutil.copy(server.diffusion_models / WAN, server.diffusion_models / "mgpu_fsdp_wan_lora.safetensors")
    log_start = len(server.log())
    lat = latents(server, run(server, prompt))
    log = server.log()[log_start:]
    assert max_diff(lat["fsdp_full"], lat["stock_full"]) <= TOLERANCE
    assert max_diff(lat["fsdp_half"], lat["stock_half"]) <= TOLERANCE
    assert max_diff(lat["fsdp_plain"], lat["plain"]) <= TOLERANCE
    assert max_diff(lat["stock_full"], lat["plain"]) > 10 * TOLERANCE      # the LoRA changes the result ...
    assert max_diff(lat["stock_half"], lat["stock_full"]) > 10 * TOLERANCE   # ... and so does its strength
    assert log.count("mgpu_fsdp_wan_lora.safetensors sharded over 2 ranks") == 1   # loaded once, never reloaded
    sent = [int(b) for n, b in re.findall(r"weight patches for (\d+) weights sent to the ranks: (\d+) bytes", log)
            if int(n)]
    assert len(sent) == 2 and all(0 < n <= lora_bytes for n in sent), (sent, lora_bytes)


def test_a_lora_type_the_ranks_cannot_apply_is_refused_by_name(server: ComfyServer) -> None:
    """A LoHa (or LoKr, DoRA, ...) is refused before the first step with the type and what to do, never applied
    wrong."""
    g = torch.Generator().manual_seed(3)
    name = "diffusion_model.blocks.0.self_attn.q"
    loha = {f"{name}.hada_w{i}_{ab}": torch.randn(*((256, 4) if ab == "a" else (4, 256)), generator=g) * 0.1
            for i in (1, 2) for ab in "ab"}
    save_file(loha, str(server.models_dir / "loras" / "mgpu_fsdp_loha.safetensors"))
    prompt = sharded_prompt(2)
    prompt["loha"] = _lora_node("fsdp_unet", 1.0, "mgpu_fsdp_loha.safetensors")
    prompt["fsdp"]["inputs"]["model"] = ["loha", 0]
    error = error_of(run(server, prompt, ok=False))
    assert error["node_id"] == "fsdp"
    assert "blocks.0.self_attn.q.weight carries a loha adapter" in error["exception_message"]
    assert "only plain LoRA is supported" in error["exception_message"]
