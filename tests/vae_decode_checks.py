"""MGPU VAE Decode inside a ComfyUI interpreter on the CPU (tests/test_comfyui_vae_decode.py starts one per check).

Each ``check_*`` returns JSON-able facts. The VAE network's class gets a recording ``decode``, so what each call
saw is read from the networks themselves: which network object (the VAE's own or a copy), on which thread, when,
and where its weights live. Two "devices" here are two ``cpu`` entries: the split, copies and threads are the same
as for GPUs.
"""

from __future__ import annotations

import math
import threading
import time
import zlib

import torch

TILES = {"tile_size": 64, "overlap": 16, "temporal_size": 8, "temporal_overlap": 4}


class Calls:
    """Replaces ``cls.decode`` with a recording one; ``on_call(self, n)`` runs before the n-th call (from 1)."""

    def __init__(self, cls, on_call=None):
        self.cls, self.original, self.on_call = cls, cls.decode, on_call
        self.seen: list[dict] = []
        self.lock = threading.Lock()
        calls = self

        def decode(net, latent, *args, **kwargs):
            with calls.lock:
                n = len(calls.seen) + 1
                calls.seen.append({})
            if calls.on_call is not None:
                calls.on_call(net, n)
            began = time.perf_counter()
            out = calls.original(net, latent, *args, **kwargs)
            first = next(net.parameters())
            calls.seen[n - 1] = {"net": id(net), "thread": threading.current_thread().name, "began": began,
                                 "ended": time.perf_counter(), "shape": list(latent.shape),
                                 "weights": first.data_ptr(), "device": str(first.device)}
            return out

        cls.decode = decode

    def take(self) -> list[dict]:
        seen, self.seen = self.seen, []
        return seen


def random_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights with sane scales (norm scales 1, small biases, N(0, 1/fan_in) matrices) in the model's dtype."""
    out = {}
    for key, t in model.state_dict().items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        if t.ndim == 1 and ("norm" in key or key.endswith("gamma")) and key.endswith(("weight", "gamma")):
            w = torch.ones(t.shape)
        elif t.ndim <= 1:
            w = torch.randn(t.shape, generator=gen) * 0.02
        else:
            w = torch.randn(t.shape, generator=gen) / math.sqrt(math.prod(t.shape[1:]))
        out[key] = w.to(t.dtype)
    return out


def wan_vae():
    """ComfyUI's Wan 2.1 VAE (full size: ComfyUI builds no other) with seeded weights."""
    import comfy.sd
    from comfy_checkpoints import random_state_dict, wan21_vae_shapes

    return comfy.sd.VAE(sd=random_state_dict(wan21_vae_shapes(), seed=0, dtype=torch.bfloat16))


def image_vae():
    """A small SD-style image VAE (AutoencoderKL, 8x, 32 channels) through ComfyUI's own VAE object."""
    import comfy.sd

    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 64, "in_channels": 3, "out_ch": 3, "ch": 32,
                "ch_mult": [1, 1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}
    vae = comfy.sd.VAE(sd={}, config={"params": {"embed_dim": 4, "ddconfig": ddconfig}})
    vae.first_stage_model.load_state_dict(random_weights(vae.first_stage_model, seed=1))
    return vae


def latent(*shape: int, seed: int = 1) -> dict:
    return {"samples": torch.randn(*shape, generator=torch.Generator().manual_seed(seed))}


def stock(vae, samples: dict) -> torch.Tensor:
    import nodes

    return nodes.VAEDecodeTiled().decode(vae, samples, *TILES.values())[0]


def mgpu(vae, samples: dict, devices: str, plan=None) -> torch.Tensor:
    from loaders import parallel_decode

    return parallel_decode.decode(vae, samples, devices, parallel_decode.TileSettings(**TILES), plan=plan)


def split(vae, seen: list[dict]) -> dict:
    """Who decoded what, from the networks' side."""
    own = id(vae.first_stage_model)
    own_weights = next(vae.first_stage_model.parameters()).data_ptr()
    nets = sorted({c["net"] for c in seen}, key=lambda n: n != own)
    overlap = any(a["thread"] != b["thread"] and a["began"] < b["ended"] and b["began"] < a["ended"]
                  for a in seen for b in seen)
    return {"tiles_per_network": [sum(c["net"] == n for c in seen) for n in nets],
            "own_network_decoded": own in nets,
            "threads": sorted({c["thread"] for c in seen}),
            "copies_share_weights": any(c["weights"] == own_weights for c in seen if c["net"] != own),
            "weight_devices": sorted({c["device"] for c in seen}),
            "concurrent": overlap}


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------------------------------------ checks

def check_wan_video(_folder: str) -> dict:
    """Wan 2.1 VAE, latent 3 frames x 10 x 10 (ComfyUI's tiles: 2 temporal chunks x 4 spatial tiles): stock
    VAEDecodeTiled, MGPU VAE Decode on cpu,cpu (with ComfyUI's progress hook) and on cpu alone."""
    import comfy.utils

    vae = wan_vae()
    calls = Calls(type(vae.first_stage_model))
    samples = latent(1, 16, 3, 10, 10)
    with torch.inference_mode():
        began = time.perf_counter()
        ref = stock(vae, samples)
        stock_s, stock_calls = time.perf_counter() - began, calls.take()
        progress = []
        comfy.utils.set_progress_bar_global_hook(lambda value, total, *_, **__: progress.append([value, total]))
        began = time.perf_counter()
        two = mgpu(vae, samples, "cpu,cpu")
        two_s, two_calls = time.perf_counter() - began, calls.take()
        comfy.utils.set_progress_bar_global_hook(None)
        one = mgpu(vae, samples, "cpu")
        one_calls = calls.take()
    return {"shape": list(ref.shape), "std": ref.std().item(), "tiles": len(stock_calls),
            "tile_shapes": [c["shape"] for c in stock_calls], "two_tile_shapes": sorted(c["shape"] for c in two_calls),
            "max_diff_two": _diff(two, ref), "max_diff_one": _diff(one, ref),
            "split_two": split(vae, two_calls), "split_one": split(vae, one_calls), "progress": progress,
            "seconds": {"stock": stock_s, "two_devices": two_s}}


def check_image(_folder: str) -> dict:
    """An image VAE (ComfyUI tiles it three times over, 2-D): a batch of 2 latents 4 x 16 x 24."""
    vae = image_vae()
    calls = Calls(type(vae.first_stage_model))
    samples = latent(2, 4, 16, 24)
    with torch.inference_mode():
        ref = stock(vae, samples)
        tiles = len(calls.take())
        two = mgpu(vae, samples, "cpu,cpu")
        two_calls = calls.take()
        three = mgpu(vae, samples, "cpu, cpu ,cpu")
        three_calls = calls.take()
    return {"shape": list(ref.shape), "std": ref.std().item(), "tiles": tiles,
            "max_diff_two": _diff(two, ref), "max_diff_three": _diff(three, ref),
            "split_two": split(vae, two_calls), "split_three": split(vae, three_calls)}


def check_cancel(_folder: str) -> dict:
    """Cancel (ComfyUI's interrupt flag) pressed while the first tile decodes: no further tile starts."""
    import comfy.model_management as mm

    vae = image_vae()
    calls = Calls(type(vae.first_stage_model))
    samples = latent(2, 4, 16, 24)
    with torch.inference_mode():
        stock(vae, samples)
        tiles = len(calls.take())
        calls.on_call = lambda net, n: n == 1 and mm.interrupt_current_processing(True)
        try:
            mgpu(vae, samples, "cpu,cpu")
            raised = None
        except BaseException as exc:   # ComfyUI's InterruptProcessingException is no Exception
            raised = type(exc).__name__
        decoded = len(calls.take())
        calls.on_call = None
        again = mgpu(vae, samples, "cpu,cpu")   # the node runs normally on the next prompt
    return {"tiles": tiles, "raised": raised, "decoded_after_cancel": decoded,
            "threads_left": [t.name for t in threading.enumerate() if t.name.startswith("mgpu-vae")],
            "flag_cleared": not mm.processing_interrupted(), "next_run_ok": list(again.shape)}


def check_failures(_folder: str) -> dict:
    """A device that fails names itself; a devices text naming a device this machine lacks fails before anything
    is decoded."""
    from mgpu.errors import MgpuError

    vae = image_vae()
    own = id(vae.first_stage_model)

    def fail_on_copy(net, n):
        if id(net) != own:
            raise RuntimeError("the copy's device broke")

    calls = Calls(type(vae.first_stage_model), fail_on_copy)
    samples = latent(1, 4, 16, 24)
    facts = {}
    with torch.inference_mode():
        for name, devices in (("failing", "cpu,cpu"), ("missing", "cpu,cuda:3"), ("garbled", "cpu;cpu")):
            try:
                mgpu(vae, samples, devices)
                facts[name] = None
            except MgpuError as exc:
                facts[name] = str(exc)
            facts[f"{name}_decoded"] = len(calls.take())
    facts["threads_left"] = [t.name for t in threading.enumerate() if t.name.startswith("mgpu-vae")]
    return facts


def vae_plan(strategy: str, devices: list[str], tiled: bool | None = None):
    """An MGPU Plan whose VAE decodes ``strategy`` on ``devices`` (the planner splits over GPUs only; cpu entries
    stand in for them here), in tiles or not (a split always is)."""
    from mgpu.planning.partition import Placement, Plan

    placed = Placement(role="vae", file="vae.safetensors", family="wan-vae", strategy=strategy, devices=devices,
                       weight_dtype="bf16", weight_bytes=1, resident_bytes=dict.fromkeys(devices, 1),
                       working_bytes=dict.fromkeys(devices, 1), tiled=strategy == "split" if tiled is None else tiled)
    return Plan(placements=[placed], usage=[], devices=[], workload={}, policy={}, reasons=[])


def check_plan(_folder: str) -> dict:
    """devices auto with an MGPU Plan connected: a plan that splits the decode over two devices decodes on two
    networks, one that decodes in tiles on one device on the VAE's own network, one that decodes the whole video on
    one device as VAE Decode does; a plan for GPUs this machine lacks fails before anything is decoded."""
    import nodes

    from mgpu.errors import MgpuError

    vae = image_vae()
    calls = Calls(type(vae.first_stage_model))
    samples = latent(1, 4, 16, 24)
    with torch.inference_mode():
        ref = stock(vae, samples)
        ref_whole = nodes.VAEDecode().decode(vae, samples)[0]
        calls.take()
        two = mgpu(vae, samples, "auto", vae_plan("split", ["cpu", "cpu"]))
        two_calls = calls.take()
        one = mgpu(vae, samples, "auto", vae_plan("cpu", ["cpu"], tiled=True))
        one_calls = calls.take()
        whole = mgpu(vae, samples, "auto", vae_plan("cpu", ["cpu"], tiled=False))
        whole_calls = calls.take()
        try:
            mgpu(vae, samples, "auto", vae_plan("split", ["cuda:0", "cuda:1"]))
            missing = None
        except MgpuError as exc:
            missing = str(exc)
        missing_decoded = len(calls.take())
    return {"max_diff_split": _diff(two, ref), "max_diff_one": _diff(one, ref),
            "max_diff_whole": _diff(whole, ref_whole), "tiled_vs_whole": _diff(ref, ref_whole),
            "split": split(vae, two_calls), "one": split(vae, one_calls), "whole": split(vae, whole_calls),
            "missing": missing,
            "missing_decoded": missing_decoded}


class _DeviceHandle:
    """Stands in for comfy-aimdo's per-device handles (vbar, pinned host buffers): C pointers that cannot be copied."""

    def __deepcopy__(self, memo):
        raise TypeError("a comfy-aimdo device handle cannot be copied")


def check_dynamic_vram(_folder: str) -> dict:
    """ComfyUI 0.33's dynamic VRAM (comfy-aimdo) on an NVIDIA GPU: ComfyUI's layers are built as under it
    (``aimdo_enabled`` on while the VAE is made: Linear/Embedding lazily) and the VAE's patcher is a
    ModelPatcherDynamic that ties a vbar signature and pinned host buffers to each ComfyUI layer and to the model.
    comfy-aimdo does not start without a GPU, so that state is attached as handles that refuse to be copied, where
    ModelPatcherDynamic puts it. The copies for the other devices must leave it behind, decode with their own
    weights and give VAE Decode (Tiled)'s result."""
    try:
        import comfy.memory_management
    except ImportError:   # ComfyUI 0.3.x
        return {"applies": False}
    if not hasattr(comfy.memory_management, "aimdo_enabled"):
        return {"applies": False}
    comfy.memory_management.aimdo_enabled = True
    try:
        vae = wan_vae()
    finally:
        comfy.memory_management.aimdo_enabled = False
    net = vae.first_stage_model
    lazy = [m for m in net.modules() if hasattr(m, "comfy_cast_weights")]   # ComfyUI's own layers
    for m in lazy:
        m._v_signature, m._pin_state = _DeviceHandle(), _DeviceHandle()
    net.dynamic_vbars, net.dynamic_pins, net.dynamic_patchers = {"cuda:0": _DeviceHandle()}, {"cuda:0": _DeviceHandle()}, {1}
    calls = Calls(type(net))
    samples = latent(1, 16, 3, 10, 10)
    with torch.inference_mode():
        ref = stock(vae, samples)
        calls.take()
        two = mgpu(vae, samples, "cpu,cpu")
        seen = calls.take()
    return {"applies": True, "comfy_layers": len(lazy), "max_diff_two": _diff(two, ref), "split": split(vae, seen),
            "state_kept_on_original": all(hasattr(m, "_pin_state") for m in lazy) and hasattr(net, "dynamic_pins")}
