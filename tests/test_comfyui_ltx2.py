"""LTX-2 (ComfyUI's LTXAV: a video and an audio stream in one DiT) sharded with FSDP in a real ComfyUI.

ComfyUI 0.33: MGPU Load Diffusion Model (fsdp, 2 cpu ranks) + the stock nodes of ComfyUI's LTX-2 workflow (video
and audio latents joined by LTXVConcatAVLatent, LTXVConditioning, CFGGuider + SamplerCustomAdvanced with
LTXVScheduler) == the same graph on UNETLoader, both streams; with a LoRA on the text connectors and an audio block
too. The connectors turn the text encoder's output into each stream's context outside the network's forward
(``preprocess_text_embeds``, called by ComfyUI's conds on the host): they run on the ranks. ComfyUI 0.3.64 has no
LTX-2 (it would take the file for LTX-Video): the loader says so, by name, on fsdp and on one device.
At cfg 1 (one batch row per step) the fsdp loader's sequence parallelism splits the video tokens over the 2 ranks,
the audio whole on both (mgpu.families.ltxav), and both streams still equal stock ComfyUI's.
MGPU Load VAE loads LTX-2's video VAE (from the all-in-one file) and audio VAE on a chosen device == ComfyUI's Load VAE.

The tiny LTX-2 comes with its dims in its metadata, as the real files do. The sampling test's audio latent is a zero
latent file of the shape LTXVEmptyLatentAudio makes, so that it needs no audio VAE.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from comfy_checkpoints import write_tiny_ltx2
from comfyui_env import ComfyServer, PromptRejected, find_comfyui
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from test_comfyui_fsdp import _conditioning, latents, max_diff, ranks_of, run
from test_example_workflows import write_tiny_ltx2_checkpoint

import ckpt_layouts as L

pytestmark = pytest.mark.comfyui

LTX2 = "mgpu_ltx2.safetensors"
AUDIO_LATENT = "mgpu_ltx2_audio.latent"
LORA = "mgpu_ltx2_lora.safetensors"
STEPS = 3
TOLERANCE = 1e-4   # fp32 on CPU: each rank computes one CFG row, stock both at once
# The text connectors pad the context to 1024 tokens with their registers; LTX-2's encoder gives no attention mask,
# the test conditioning an all-ones one, which must then cover those 1024 tokens.
TEXT_TOKENS = 1024
# LoRA targets: a layer of the video text connector (root FSDP unit, run outside forward) and one of an audio block.
LORA_TARGETS = ("video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q",
                "transformer_blocks.1.audio_attn1.to_v")


def _has_ltx2(server: ComfyServer) -> bool:
    return "LTXVConcatAVLatent" in server.object_info()


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    write_tiny_ltx2(comfyui_server.diffusion_models / LTX2)
    # LTXVEmptyLatentAudio's shape: [batch, 8 channels, audio latents, 16 frequency bins]
    save_file({"latent_tensor": torch.zeros(1, 8, 5, 16), "latent_format_version_0": torch.tensor([])},
              str(comfyui_server.base_dir / "input" / AUDIO_LATENT))
    _write_lora(comfyui_server.models_dir / "loras" / LORA)
    return comfyui_server


def _write_lora(path) -> None:
    layout = L.ltx2_tiny(prefix="")
    g = torch.Generator().manual_seed(9)
    tensors = {}
    for layer in LORA_TARGETS:
        out_dim, in_dim = layout[f"{layer}.weight"][0]
        tensors[f"diffusion_model.{layer}.lora_A.weight"] = torch.randn(4, in_dim, generator=g) * 0.3
        tensors[f"diffusion_model.{layer}.lora_B.weight"] = torch.randn(out_dim, 4, generator=g) * 0.3
    save_file(tensors, str(path))


def _loader(device: str) -> dict:
    if device == "stock":
        return {"class_type": "UNETLoader", "inputs": {"unet_name": LTX2, "weight_dtype": "default"}}
    return {"class_type": "MgpuLoadDiffusionModel",
            "inputs": {"unet_name": LTX2, "weight_dtype": "default", "device": device, "fsdp_ranks": 2}}


def _sample(prompt: dict, name: str, model: str, seed: int) -> None:
    """ComfyUI's LTX-2 sampling nodes on ``model``; the denoised streams saved as ``{name}_video`` / ``_audio``."""
    prompt.update({
        f"{name}_guider": {"class_type": "CFGGuider", "inputs": {"model": [model, 0], "positive": ["cond", 0],
                                                                "negative": ["cond", 1], "cfg": 3.0}},
        f"{name}_sample": {"class_type": "SamplerCustomAdvanced",
                           "inputs": {"noise": ["noise", 0], "guider": [f"{name}_guider", 0],
                                      "sampler": ["sampler", 0], "sigmas": ["sigmas", 0], "latent_image": ["av", 0]}},
        f"{name}_split": {"class_type": "LTXVSeparateAVLatent", "inputs": {"av_latent": [f"{name}_sample", 0]}},
    })
    for i, stream in enumerate(("video", "audio")):
        prompt[f"save_{name}_{stream}"] = {"class_type": "SaveLatent",
                                           "inputs": {"samples": [f"{name}_split", i],
                                                      "filename_prefix": f"ltx2/{name}_{stream}"}}


def ltx2_prompt(seed: int, runs: dict[str, str]) -> dict:
    """The stock LTX-2 text-to-video graph, minus text encoder and VAEs; ``runs``: saved name -> model node."""
    prompt = {
        "stock_unet": _loader("stock"), "fsdp_unet": _loader("fsdp"), "cpu_unet": _loader("cpu"),
        "pos": _conditioning(seed) | {"inputs": {"width": 48, "tokens": TEXT_TOKENS, "seed": seed, "scale": 1.0}},
        "neg": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}},
        "cond": {"class_type": "LTXVConditioning",
                 "inputs": {"positive": ["pos", 0], "negative": ["neg", 0], "frame_rate": 25.0}},
        "video": {"class_type": "EmptyLTXVLatentVideo", "inputs": {"width": 64, "height": 64, "length": 9,
                                                                   "batch_size": 1}},
        "audio": {"class_type": "LoadLatent", "inputs": {"latent": AUDIO_LATENT}},
        "av": {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": ["video", 0],
                                                             "audio_latent": ["audio", 0]}},
        "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
        "sampler": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "sigmas": {"class_type": "LTXVScheduler", "inputs": {"steps": STEPS, "max_shift": 2.05, "base_shift": 0.95,
                                                             "stretch": True, "terminal": 0.1, "latent": ["av", 0]}},
    }
    for unet in ("stock", "fsdp"):
        prompt[f"{unet}_lora"] = {"class_type": "LoraLoaderModelOnly",
                                  "inputs": {"model": [f"{unet}_unet", 0], "lora_name": LORA, "strength_model": 1.0}}
    for name, model in runs.items():
        _sample(prompt, name, model, seed)
    return prompt


def test_sharded_ltx2_matches_stock_on_both_streams(server: ComfyServer) -> None:
    if not _has_ltx2(server):   # ComfyUI 0.3.64: the loader refuses the file by name, on fsdp and on one device
        for device in ("fsdp", "cpu"):
            prompt = {"unet": _loader(device), "video": {"class_type": "EmptyLTXVLatentVideo", "inputs": {
                "width": 64, "height": 64, "length": 9, "batch_size": 1}}, "pos": _conditioning(1)}
            prompt["sample"] = {"class_type": "KSampler", "inputs": {
                "model": ["unet", 0], "positive": ["pos", 0], "negative": ["pos", 0], "latent_image": ["video", 0],
                "seed": 1, "steps": 1, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}
            prompt["save"] = {"class_type": "SaveLatent", "inputs": {"samples": ["sample", 0],
                                                                      "filename_prefix": "ltx2/refused"}}
            with pytest.raises(PromptRejected) as info:   # read from the header when the prompt is queued
                server.post_prompt(prompt)
            errors = info.value.body["node_errors"]["unet"]
            assert errors["class_type"] == "MgpuLoadDiffusionModel", errors
            message = "\n".join(e.get("details", "") for e in errors["errors"])
            assert LTX2 in message and "is an LTX-2 diffusion model (audio + video)" in message, message
            assert "has no LTX-2" in message and "as LTX-Video" in message and "Update ComfyUI" in message, message
        return
    runs = {"stock": "stock_unet", "fsdp": "fsdp_unet", "cpu": "cpu_unet", "stock_lora": "stock_lora",
            "fsdp_lora": "fsdp_lora"}
    log_start = len(server.log())
    out = latents(server, run(server, ltx2_prompt(seed=5, runs=runs), timeout=600))
    log = server.log()[log_start:]
    for stream in ("video", "audio"):
        stock = out[f"stock_{stream}"]
        assert torch.isfinite(stock).all() and stock.abs().max() > 0.1, stream
        assert max_diff(out[f"fsdp_{stream}"], stock) <= TOLERANCE, stream
        assert torch.equal(out[f"cpu_{stream}"], stock), stream   # device cpu: ComfyUI's own loader
        assert max_diff(out[f"fsdp_lora_{stream}"], out[f"stock_lora_{stream}"]) <= TOLERANCE, stream
        assert max_diff(out[f"stock_lora_{stream}"], stock) > 10 * TOLERANCE, stream   # the LoRA matters
    assert out["stock_video"].shape == (1, 128, 2, 2, 2) and out["stock_audio"].shape == (1, 8, 5, 16)
    assert len(ranks_of(server)) == 2
    assert f"{LTX2} sharded over 2 ranks (cpu, cpu) loaded" in log
    assert "weight patches for 2 weights sent to the ranks" in log


# ------------------------------------------------------------------------------------- sequence parallelism

def _comfyui_has_ltx2() -> bool:
    """Without starting it: the ComfyUI under test has LTX-2's network (0.33; 0.3.64 has none)."""
    path = find_comfyui()
    return path is not None and (path / "comfy" / "ldm" / "lightricks" / "av_model.py").is_file()


def _splits(log: str) -> set[tuple[int, int]]:
    """The (cfg groups, sequence ranks) splits the sharded LTX-2's forwards took, as ComfyUI's log says them."""
    return {(int(c), int(s)) for c, s in re.findall(re.escape(LTX2) + r": \d+ batch rows? per step split (\d+) "
                                                    r"\(CFG/batch\) x (\d+) \(sequence\)", log)}


@pytest.mark.xfail("not _comfyui_has_ltx2()", run=False, strict=True,
                   reason="not applicable: this ComfyUI has no LTX-2 (the loader's refusal is tested above)")
def test_cfg_1_splits_the_video_tokens_and_matches_stock_on_both_streams(server: ComfyServer) -> None:
    """The LTX-2 workflow at cfg 1 (one batch row per step) on MGPU Load Diffusion Model (fsdp, 2 ranks,
    sequence_parallel auto): the 27 video tokens (3 latent frames of 3 x 3) split 14 / 13 over the ranks, the audio
    whole on both; both streams equal stock ComfyUI's."""
    prompt = ltx2_prompt(seed=6, runs={"stock": "stock_unet", "sp": "sp_unet"})
    prompt["sp_unet"] = {"class_type": "MgpuLoadDiffusionModel",
                         "inputs": {"unet_name": LTX2, "weight_dtype": "default", "device": "fsdp", "fsdp_ranks": 2,
                                    "sequence_parallel": "auto"}}
    prompt["video"]["inputs"].update(width=96, height=96, length=17)
    for name in ("stock", "sp"):
        prompt[f"{name}_guider"]["inputs"]["cfg"] = 1.0
    log_start = len(server.log())
    out = latents(server, run(server, prompt, timeout=600))
    assert out["stock_video"].shape == (1, 128, 3, 3, 3) and out["stock_audio"].shape == (1, 8, 5, 16)
    for stream in ("video", "audio"):
        stock = out[f"stock_{stream}"]
        assert torch.isfinite(stock).all() and stock.abs().max() > 0.1, stream
        diff = max_diff(out[f"sp_{stream}"], stock)
        print(f"LTX-2 cfg 1, sequence parallel over 2 ranks, {stream}: max diff {diff:.3g}")
        assert diff <= TOLERANCE, stream
    assert _splits(server.log()[log_start:]) == {(1, 2)}


# ------------------------------------------------------------------------------------------------ VAEs

ALL_IN_ONE = "mgpu_ltx2_all_in_one.safetensors"


def _split_vae_files(server: ComfyServer) -> None:
    """The tiny all-in-one LTX-2 file in the vae folder, and its two VAEs split out of it beside it (keys as ComfyUI's
    VAE loader takes them: the video VAE's without ``vae.``, the audio VAE's ``audio_vae.`` + ``vocoder.``)."""
    path = server.vae / ALL_IN_ONE
    write_tiny_ltx2_checkpoint(path)
    with safe_open(str(path), framework="pt") as f:
        metadata, keys = f.metadata(), list(f.keys())
        video = {k.removeprefix("vae."): f.get_tensor(k) for k in keys if k.startswith("vae.")}
        audio = {k: f.get_tensor(k) for k in keys if k.startswith(("audio_vae.", "vocoder."))}
    save_file(video, str(server.vae / "mgpu_ltx2_video_vae.safetensors"), metadata=metadata)
    save_file(audio, str(server.vae / "mgpu_ltx2_audio_vae.safetensors"), metadata=metadata)
    g = torch.Generator().manual_seed(3)
    for name, shape in (("mgpu_ltx2_video.latent", (1, 128, 2, 2, 2)), ("mgpu_ltx2_sound.latent", (1, 8, 5, 16))):
        save_file({"latent_tensor": torch.randn(shape, generator=g), "latent_format_version_0": torch.tensor([])},
                  str(server.base_dir / "input" / name))


def _decoded(server: ComfyServer, entry: dict) -> dict[str, np.ndarray]:
    """The saved images (pixels) and audio (samples) by node, without the files' metadata (the prompt)."""
    import av

    out = {}
    for node, result in entry["outputs"].items():
        for kind in ("images", "audio"):
            for item in result.get(kind, []):
                path = server.output_dir / item["subfolder"] / item["filename"]
                if kind == "images":
                    out[node] = np.asarray(Image.open(path))
                else:
                    with av.open(str(path)) as container:
                        out[node] = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=-1)
    return out


def test_mgpu_load_vae_loads_ltx2s_video_and_audio_vaes_on_the_chosen_device(server: ComfyServer) -> None:
    """MGPU Load VAE on cpu: LTX-2's video VAE out of the all-in-one file (its vae. part) and its audio VAE from its
    own file decode exactly as ComfyUI's Load VAE does from the split files. (The audio VAE inside the all-in-one
    file is ComfyUI's Load LTXV Audio VAE's: MGPU Load VAE takes the vae. part there.)"""
    if not _has_ltx2(server):   # ComfyUI 0.3.64: no LTX-2 VAE nodes to decode with
        assert "LTXVAudioVAEDecode" not in server.object_info()
        return
    _split_vae_files(server)

    def vae(kind: str, name: str) -> dict:
        if kind == "stock":
            return {"class_type": "VAELoader", "inputs": {"vae_name": name}}
        return {"class_type": "MgpuLoadVAE", "inputs": {"vae_name": name, "device": "cpu"}}

    prompt = {
        "video": {"class_type": "LoadLatent", "inputs": {"latent": "mgpu_ltx2_video.latent"}},
        "sound": {"class_type": "LoadLatent", "inputs": {"latent": "mgpu_ltx2_sound.latent"}},
        "stock_video_vae": vae("stock", "mgpu_ltx2_video_vae.safetensors"),
        "mgpu_video_vae": vae("mgpu", ALL_IN_ONE),
        "stock_audio_vae": vae("stock", "mgpu_ltx2_audio_vae.safetensors"),
        "mgpu_audio_vae": vae("mgpu", "mgpu_ltx2_audio_vae.safetensors"),
    }
    for kind in ("stock", "mgpu"):
        prompt[f"{kind}_frames"] = {"class_type": "VAEDecode",
                                    "inputs": {"samples": ["video", 0], "vae": [f"{kind}_video_vae", 0]}}
        prompt[f"save_{kind}_frames"] = {"class_type": "SaveImage", "inputs": {
            "images": [f"{kind}_frames", 0], "filename_prefix": f"ltx2/{kind}_frames"}}
        prompt[f"{kind}_audio"] = {"class_type": "LTXVAudioVAEDecode",
                                   "inputs": {"samples": ["sound", 0], "audio_vae": [f"{kind}_audio_vae", 0]}}
        prompt[f"save_{kind}_audio"] = {"class_type": "SaveAudio", "inputs": {
            "audio": [f"{kind}_audio", 0], "filename_prefix": f"ltx2/{kind}_audio"}}
    log_start = len(server.log())
    out = _decoded(server, run(server, prompt))
    assert out["save_mgpu_frames"].shape == out["save_stock_frames"].shape == (64, 64, 3)
    assert np.array_equal(out["save_mgpu_frames"], out["save_stock_frames"])
    assert out["save_mgpu_frames"].std() > 1   # a picture, not a constant
    assert out["save_mgpu_audio"].shape == out["save_stock_audio"].shape and out["save_mgpu_audio"].shape[-1] > 1000
    assert np.array_equal(out["save_mgpu_audio"], out["save_stock_audio"])
    assert server.log()[log_start:].count("MGPU Load VAE: cpu, as chosen") == 2


# ------------------------------------------------------------------ the one file where ComfyUI's template puts it

IN_CHECKPOINTS = "mgpu_ltx2_in_checkpoints.safetensors"
# Every input of the pack's nodes that names a model file (MGPU Plan's, the loaders').
FILE_INPUTS = {"MgpuPlan": ("dit", "text_encoder", "vae", "dit_low_noise"), "MgpuLoadDiffusionModel": ("unet_name",),
               "MgpuLoadTextEncoder": ("clip_name", "clip_name2"), "MgpuLoadVAE": ("vae_name",)}


def _options(info: dict, node: str, name: str) -> list[str]:
    spec = info[node]["input"]
    typ, *rest = spec.get("required", {}).get(name) or spec["optional"][name]
    return typ if isinstance(typ, list) else (rest[0] if rest else {}).get("options", [])


def _queued_errors(server: ComfyServer, prompt: dict) -> dict:
    with pytest.raises(PromptRejected) as info:
        server.post_prompt(prompt)
    return info.value.body["node_errors"]


def test_the_ltx2_file_in_checkpoints_alone_serves_every_node(server: ComfyServer) -> None:
    """ComfyUI's own LTX-2 template keeps the one LTX-2 file (DiT, video and audio VAE, Gemma's text projection) in
    models/checkpoints, where CheckpointLoaderSimple, LTXAVTextEncoderLoader and LTXVAudioVAELoader read it. Put
    there alone, with no copy or link in diffusion_models, text_encoders or vae, every MGPU node offers it, the
    loaders take it when the prompt is queued, and the LTX-2 example runs from it (its file names changed to this
    one). ComfyUI 0.3.64 has no LTX-2: MGPU Load Diffusion Model refuses the file by name from there too."""
    from test_example_workflows import _audio_streams, _for_the_run, _run_twin, _video, load, model_files

    checkpoints = server.base_dir / "models" / "checkpoints"   # ComfyUI's own folder under --base-directory
    checkpoints.mkdir(parents=True, exist_ok=True)
    path = checkpoints / IN_CHECKPOINTS
    if not _has_ltx2(server):
        write_tiny_ltx2(path)
        prompt = {"unet": {"class_type": "MgpuLoadDiffusionModel", "inputs": {
            "unet_name": IN_CHECKPOINTS, "weight_dtype": "default", "device": "cpu", "fsdp_ranks": 2}},
            "show": {"class_type": "PreviewAny", "inputs": {"source": ["unet", 0]}}}
        message = "\n".join(e.get("details", "") for e in _queued_errors(server, prompt)["unet"]["errors"])
        assert f"checkpoints/{IN_CHECKPOINTS} is an LTX-2 diffusion model (audio + video)" in message, message
        assert "has no LTX-2" in message, message
        return
    write_tiny_ltx2_checkpoint(path)
    assert not [f for f in (server.diffusion_models, server.text_encoders, server.vae) if (f / IN_CHECKPOINTS).exists()]
    info = server.object_info()
    for node, names in FILE_INPUTS.items():
        for name in names:
            assert IN_CHECKPOINTS in _options(info, node, name), (node, name)

    # the text encoder loader (ComfyUI's LTX-2 encoder: Gemma from text_encoders, the projection from this file)
    (server.text_encoders / "mgpu_gemma_stand_in.safetensors").write_bytes(b"")   # the queue check looks, no more
    for clip_name2, refused in ((IN_CHECKPOINTS, False), ("mgpu_nowhere.safetensors", True)):
        prompt = {"te": {"class_type": "MgpuLoadTextEncoder", "inputs": {
            "clip_name": "mgpu_gemma_stand_in.safetensors", "type": "ltxv", "device": "cpu", "clip_name2": clip_name2}},
            "enc": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["te", 0]}},   # no text: refused, never run
            "show": {"class_type": "PreviewAny", "inputs": {"source": ["enc", 0]}}}
        errors = _queued_errors(server, prompt)
        assert "enc" in errors and ("te" in errors) == refused, (clip_name2, errors)
        if refused:
            assert "'mgpu_nowhere.safetensors' is not in ComfyUI's text_encoders folder nor in checkpoints" in \
                errors["te"]["errors"][0]["details"], errors

    _, api = load("ltx2_t2v_multi_gpu")
    (shipped,) = model_files(api)
    for node in api.values():
        node["inputs"].update({k: IN_CHECKPOINTS for k, v in node["inputs"].items() if v == shipped})
    entry = _run_twin(server, _for_the_run(api, 64, 64, 9, text=(48, 1024)))
    assert _video(server, entry) == (9, 64, 64) and _audio_streams(server, entry) == 1
    plan = next(out for out in entry["outputs"].values() if "mgpu_plan" in out)["mgpu_plan"][0]
    assert {p["role"]: (p["family"], os.path.basename(p["file"])) for p in plan["placements"]} == {
        "dit": ("ltx2-av", IN_CHECKPOINTS), "vae": ("ltxv-vae", IN_CHECKPOINTS)}
