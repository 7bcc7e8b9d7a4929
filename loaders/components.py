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


def load_vae(name: str, device: str, plan=None):
    """A ComfyUI VAE on the chosen device, refused with ComfyUI's message if the file is no VAE it knows.

    Also takes the VAE out of an all-in-one checkpoint (LTX-Video ships DiT and VAE in one file, the VAE under
    ``vae.``), with the file's metadata, which carries the VAE config. Tensors are memory-mapped, so the DiT's
    bytes in that file are never read.
    """
    import comfy.sd
    import comfy.utils

    path = _path("vae", "vae", name)
    load = _single_device("vae", resolve(device, "vae", plan))
    sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    if not any(k.startswith("decoder.") for k in sd) and any(k.startswith(VAE_PREFIX_IN_CHECKPOINT) for k in sd):
        sd = comfy.utils.state_dict_prefix_replace(sd, {VAE_PREFIX_IN_CHECKPOINT: ""}, filter_keys=True)
    vae = comfy.sd.VAE(sd=sd, device=load, metadata=metadata)
    vae.throw_exception_if_invalid()
    return vae
