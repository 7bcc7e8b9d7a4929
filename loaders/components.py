"""Text encoder and VAE on a chosen device, through ComfyUI's own loaders.

ComfyUI 0.3.64 loads both on its single main device; its loaders accept a device, though
(``load_clip(model_options={"load_device", "offload_device"})``, ``VAE(device=...)``), so a second GPU needs
no patching of ComfyUI. Its model management accounts memory per ``load_device``, so components on
different GPUs coexist. When ComfyUI frees them they park in host RAM, never on another GPU.

A text encoder too big for one GPU can have its layers split over several (``loaders.text_encoder_split``), and
every text encoder this loader returns caches its outputs by prompt (``loaders.conditioning_cache``).
"""

from __future__ import annotations

import logging

from mgpu.errors import MgpuError, ShardingError
from mgpu.planning.devices import gpus

from .model_files import VAE_PREFIX_IN_CHECKPOINT, folder_path
from .placement import AUTO, CPU, NODE_OF_ROLE, Choice, check_plan_file, live_devices, plan_to_follow, resolve

log = logging.getLogger("mgpu")

SPLIT = "split"   # a plan's text encoder strategy: its layers over several devices


def clip_types() -> list[str]:
    """The text encoder types this ComfyUI offers (``comfy.sd.CLIPType``), as CLIPLoader spells them."""
    import comfy.sd

    return [t.name.lower() for t in comfy.sd.CLIPType]


def _path(role: str, folder: str, name: str) -> str:
    """The file from ``folder``, else from checkpoints (where ComfyUI's own templates keep all-in-one files such as
    LTX-2's: ``model_files.folder_path``)."""
    path = folder_path(folder, name)
    if path is None:
        raise MgpuError(f"{NODE_OF_ROLE[role]}: {name!r} is not in ComfyUI's {folder} folder nor in checkpoints; put "
                        "the file there and refresh (press r in the ComfyUI page), or pick another")
    return path


def queue_check(role: str, folder: str, names: list[str], device: str) -> str | None:
    """What ComfyUI's ``validate_inputs`` of the text encoder and VAE loaders reports when the prompt is queued:
    files missing from ``folder`` and a device this machine lacks (auto depends on the plan: checked at run time).
    None when all is there."""
    try:
        for name in names:
            _path(role, folder, name)
        if device != AUTO:
            resolve(device, role)
    except MgpuError as exc:
        return str(exc)
    return None


def _single_device(role: str, choice: Choice):
    """The torch device of a one-device choice; a plan cannot shard or offload an encoder or VAE."""
    import torch

    if choice.strategy not in ("single", "cpu") or len(choice.devices) != 1:
        raise MgpuError(f"{NODE_OF_ROLE[role]}: the plan asks for {choice.strategy} on {', '.join(choice.devices)}, "
                        "which this loader cannot do; pick a device on this node")
    log.info("%s: %s", NODE_OF_ROLE[role], choice.reason)
    return torch.device(choice.devices[0])


def _planned_split(plan):
    """The plan's text encoder placement when it splits it, else None."""
    placed = plan.placement("text_encoder") if plan is not None else None
    return placed if placed is not None and placed.strategy == SPLIT else None


def split_devices(spec: str, plan=None, devices=None) -> list[str]:
    """The devices of the ``split_devices`` input, in order: "auto" = the plan's split, else every GPU; or a comma
    list. GPUs appear once each; "cpu" entries (a split only in name, to try a workflow without GPUs) are not mixed
    with GPUs: ComfyUI's own offloading serves a GPU too small better than layers computed on the CPU."""
    node = NODE_OF_ROLE["text_encoder"]
    devices = live_devices() if devices is None else devices
    if spec.strip() == AUTO:
        planned = _planned_split(plan)
        if planned is not None:
            return list(planned.devices)
        ids = [d.id for d in gpus(devices)]
        if len(ids) < 2:
            raise MgpuError(f"{node}: split_devices auto splits over every GPU, and this machine has "
                            f"{len(ids) or 'no'} GPU{'' if len(ids) == 1 else 's'}; pick one device instead, or list "
                            "the devices (e.g. cuda:0,cuda:1)")
        return ids
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    for w in wanted:
        if w == AUTO:
            raise MgpuError(f"{node}: split_devices lists devices (e.g. cuda:0,cuda:1) or is just auto; "
                            f"{w!r} cannot be one of them")
        resolve(w, "text_encoder", None, devices)   # exists here, else an error naming it and the choices
    gpu_ids = [w for w in wanted if w != CPU]
    if len(wanted) < 2:
        raise MgpuError(f"{node}: split_devices {spec!r} names one device; list two or more to split over, or pick "
                        "the device itself")
    if gpu_ids and len(gpu_ids) != len(wanted):
        raise MgpuError(f"{node}: split_devices {spec!r} mixes cpu with GPUs; list GPUs only (for a GPU too small, "
                        "pick it alone: ComfyUI then keeps what does not fit in host RAM)")
    if len(set(gpu_ids)) != len(gpu_ids):
        raise MgpuError(f"{node}: split_devices {spec!r} names a GPU twice; list each once")
    return wanted


def _load_split(paths: list[str], clip_type: str, devices: list[str], plan):
    """ComfyUI's CLIP built in host RAM, its encoder's layers then split over ``devices`` (as the plan split them
    when it did, else by the memory free now)."""
    import inspect

    import comfy.sd
    import folder_paths
    import torch

    from . import text_encoder_split

    node = NODE_OF_ROLE["text_encoder"]
    host = torch.device("cpu")
    options = {"load_device": torch.device(devices[0]), "offload_device": host, "initial_device": host}
    # ComfyUI >= 0.3.7x: a plain ModelPatcher, whose weights are real tensors the split can place
    extra = {"disable_dynamic": True} if "disable_dynamic" in inspect.signature(comfy.sd.load_clip).parameters else {}
    clip = comfy.sd.load_clip(ckpt_paths=paths, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                              clip_type=comfy.sd.CLIPType[clip_type.upper()], model_options=options, **extra)
    planned = _planned_split(plan)
    shares = [planned.resident_bytes.get(d, 0) for d in devices] if planned and planned.devices == devices else None
    try:
        return text_encoder_split.split_clip(clip, devices, shares, node)
    except ShardingError as e:
        raise MgpuError(f"{e}; list more devices in split_devices, free memory on them, or pick a smaller (fp8) "
                        "encoder file") from None


def load_text_encoder(names: list[str], clip_type: str, device: str, plan=None, split_spec: str = ""):
    """A ComfyUI CLIP on the chosen device, or with its layers split over the devices of ``split_spec`` (when not
    empty; it replaces ``device``) or of a plan that splits it (``device`` "auto"); ``names`` are files in
    text_encoders (two for dual encoders). Its encodes are cached by prompt (``loaders.conditioning_cache``); an
    encoder this process loaded before comes back deferred, its weights loaded at the first encode the cache lacks."""
    import comfy.sd
    import folder_paths
    import torch

    from . import conditioning_cache

    node = NODE_OF_ROLE["text_encoder"]
    types = clip_types()
    if clip_type not in types:
        raise MgpuError(f"{node}: type {clip_type!r} is not offered by this ComfyUI; pick one of {', '.join(types)}")
    paths = [_path("text_encoder", "text_encoders", n) for n in names]  # before anything is loaded
    check_plan_file(plan, "text_encoder", paths[0])
    if not split_spec.strip():   # the plan it follows: the connected one, or its own for this file
        plan = plan_to_follow("text_encoder", paths[0], device, plan)
    choice = None if split_spec.strip() else resolve(device, "text_encoder", plan)
    if choice is None or choice.strategy == SPLIT:
        devices = split_devices(split_spec, plan) if choice is None else list(choice.devices)
        log.info("%s: %s", node, choice.reason if choice else f"split over {', '.join(devices)}, as chosen")

        def load():
            return _load_split(paths, clip_type, devices, plan)
    else:
        load_device = _single_device("text_encoder", choice)
        devices = [str(load_device)]

        def load():
            options = {"load_device": load_device, "offload_device": torch.device("cpu")}
            return comfy.sd.load_clip(ckpt_paths=paths, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                                      clip_type=comfy.sd.CLIPType[clip_type.upper()], model_options=options)
    key = conditioning_cache.encoder_key(paths, clip_type, devices)
    # loaded before in this process: its weights load only if an encode misses the cache (or a node needs them)
    clip = conditioning_cache.deferred(key, load, node)
    return clip if clip is not None else conditioning_cache.cached(load(), key)


def vae_state_dict(path: str) -> tuple[dict, dict | None]:
    """The VAE's tensors and the file's metadata (which carries LTX-Video's VAE config).

    From an all-in-one checkpoint (LTX-Video ships DiT and VAE in one file, the VAE under ``vae.``) only the VAE's
    tensors are read, without the prefix: ComfyUI's ``load_torch_file`` would read every tensor of the file, the
    DiT's many GB included. Other files (.pt, .ckpt) go through ComfyUI's own reader.
    """
    import comfy.utils
    from safetensors import safe_open

    try:
        f = safe_open(path, framework="pt", device="cpu")
    except Exception:   # not safetensors, or a broken one: ComfyUI's reader loads it or says what is wrong
        return comfy.utils.load_torch_file(path, return_metadata=True)
    with f:
        keys = list(f.keys())
        prefix = "" if any(k.startswith("decoder.") for k in keys) else VAE_PREFIX_IN_CHECKPOINT
        if prefix and not any(k.startswith(prefix) for k in keys):
            prefix = ""   # no VAE inside: ComfyUI's VAE says what the file is not
        copy = comfy.utils.DISABLE_MMAP   # --disable-mmap: no tensor may stay backed by the file
        sd = {k[len(prefix):]: f.get_tensor(k) for k in keys if k.startswith(prefix)}
        return ({k: v.clone() for k, v in sd.items()} if copy else sd), f.metadata()


def load_vae(name: str, device: str, plan=None):
    """A ComfyUI VAE on the chosen device, refused with ComfyUI's message if the file is no VAE it knows; also the
    VAE inside an all-in-one checkpoint (``vae_state_dict``)."""
    import comfy.sd

    path = _path("vae", "vae", name)
    check_plan_file(plan, "vae", path)
    load = _single_device("vae", resolve(device, "vae", plan_to_follow("vae", path, device, plan)))
    sd, metadata = vae_state_dict(path)
    vae = comfy.sd.VAE(sd=sd, device=load, metadata=metadata)
    vae.throw_exception_if_invalid()
    return vae
