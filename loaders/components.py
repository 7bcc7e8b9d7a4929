"""Text encoder and VAE on a chosen device, through ComfyUI's own loaders.

ComfyUI 0.3.64 loads both on its single main device; its loaders accept a device, though
(``load_clip(model_options={"load_device", "offload_device"})``, ``VAE(device=...)``), so a second GPU needs
no patching of ComfyUI. Its model management accounts memory per ``load_device``, so components on
different GPUs coexist. When ComfyUI frees them they park in host RAM, never on another GPU.
"""

from __future__ import annotations

import logging

from mgpu.errors import MgpuError

from .model_files import VAE_PREFIX_IN_CHECKPOINT
from .placement import NODE_OF_ROLE, Choice, resolve

log = logging.getLogger("mgpu")


def clip_types() -> list[str]:
    """The text encoder types this ComfyUI offers (``comfy.sd.CLIPType``), as CLIPLoader spells them."""
    import comfy.sd

    return [t.name.lower() for t in comfy.sd.CLIPType]


def _path(role: str, folder: str, name: str) -> str:
    import folder_paths

    path = folder_paths.get_full_path(folder, name)
    if path is None:
        raise MgpuError(f"{NODE_OF_ROLE[role]}: {name!r} is not in ComfyUI's {folder} folder; put the file there "
                        "and refresh (press r in the ComfyUI page), or pick another")
    return path


def _single_device(role: str, choice: Choice):
    """The torch device of a one-device choice; a plan cannot shard or offload an encoder or VAE."""
    import torch

    if choice.strategy not in ("single", "cpu") or len(choice.devices) != 1:
        raise MgpuError(f"{NODE_OF_ROLE[role]}: the plan asks for {choice.strategy} on {', '.join(choice.devices)}, "
                        "which this loader cannot do; pick a device on this node")
    log.info("%s: %s", NODE_OF_ROLE[role], choice.reason)
    return torch.device(choice.devices[0])


def load_text_encoder(names: list[str], clip_type: str, device: str, plan=None):
    """A ComfyUI CLIP on the chosen device; ``names`` are files in text_encoders (two for dual encoders)."""
    import comfy.sd
    import folder_paths
    import torch

    types = clip_types()
    if clip_type not in types:
        raise MgpuError(f"{NODE_OF_ROLE['text_encoder']}: type {clip_type!r} is not offered by this ComfyUI; "
                        f"pick one of {', '.join(types)}")
    paths = [_path("text_encoder", "text_encoders", n) for n in names]  # before anything is loaded
    load = _single_device("text_encoder", resolve(device, "text_encoder", plan))
    options = {"load_device": load, "offload_device": torch.device("cpu")}
    return comfy.sd.load_clip(ckpt_paths=paths, embedding_directory=folder_paths.get_folder_paths("embeddings"),
                              clip_type=comfy.sd.CLIPType[clip_type.upper()], model_options=options)


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
    load = _single_device("vae", resolve(device, "vae", plan))
    sd, metadata = vae_state_dict(path)
    vae = comfy.sd.VAE(sd=sd, device=load, metadata=metadata)
    vae.throw_exception_if_invalid()
    return vae
