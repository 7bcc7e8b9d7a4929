"""GGUF diffusion models (city96's ComfyUI-GGUF quantizations of Wan, LTX-Video) for MGPU Load Diffusion Model.

Under ``fsdp`` a GGUF file shards like a safetensors one: the host and every rank detect the model with ComfyUI's
own detection on meta tensors of the logical shapes from the GGUF header (``detect``), build ComfyUI's network, and
the ranks keep the quantized weights as their stored blocks (``mgpu.weights.gguf``: sharded by rows, all-gathered as
bytes, dequantized per block to the network's dtype after the gather).

On one device the loader refuses a GGUF file and points to ComfyUI-GGUF's loader, which keeps it quantized there:
dequantizing a Q4 file to bf16 on one GPU would take 3.5 times the memory the file promises.
"""

from __future__ import annotations

import torch

from mgpu.errors import MgpuError, ShardingError
from mgpu.planning.sizing import read_gguf_header
from mgpu.weights.gguf import PLAIN, check_supported

# The dtype quantized tensors show ComfyUI's detection (it reads their shapes; comfy.utils.weight_dtype counts
# them as this, so a GPU computes them in bf16 where it can, as ComfyUI-GGUF does).
QUANTIZED_AS = torch.bfloat16
FP8_CHOICES = ("float8_e4m3fn", "float8_e5m2")
GGUF_LOADER = "ComfyUI-GGUF's Unet Loader (GGUF)"


def meta_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The GGUF file as meta tensors of its logical shapes; tensors of a type the ranks cannot dequantize are
    refused here, on the host, before any rank starts."""
    header = read_gguf_header(path)
    check_supported(header)
    return {name: torch.empty(info.shape, dtype=PLAIN.get(info.dtype, QUANTIZED_AS), device="meta")
            for name, info in header.tensors.items()}


def detect(path: str):
    """(ComfyUI model config, prefix-stripped meta state dict, key prefix) of a GGUF diffusion model: the first half
    of ComfyUI's ``load_diffusion_model_state_dict`` on the header's meta tensors, as for safetensors."""
    import comfy.model_detection
    import comfy.utils

    sd = meta_state_dict(path)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
    stripped = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=True)
    if stripped:
        sd = stripped
    else:
        prefix = ""
    model_config = comfy.model_detection.model_config_from_unet(sd, "")
    if model_config is None:
        arch = read_gguf_header(path).metadata.get("general.architecture", "not named")
        raise ShardingError(f"{path}: ComfyUI does not recognise this GGUF diffusion model from its keys "
                            f"(architecture {arch}), so it cannot be sharded; load it with {GGUF_LOADER}")
    return model_config, sd, prefix


def check_load(name: str, node: str, strategy: str, dtype: str | None) -> None:
    """Refuse what MGPU Load Diffusion Model does not do with a GGUF file, before anything loads: one device
    (ComfyUI-GGUF keeps it quantized there) and an fp8 weight dtype (its weights stay as their GGUF blocks)."""
    if strategy != "fsdp":
        raise MgpuError(f"{node}: {name} is a GGUF file, which this loader shards only (device fsdp): on one device "
                        f"load it with {GGUF_LOADER}, which keeps it quantized, or set device to fsdp")
    if dtype in FP8_CHOICES:
        raise MgpuError(f"{node}: weight_dtype {dtype} does not apply to the GGUF file {name}: its weights stay as "
                        "their GGUF blocks on the ranks, and weight_dtype picks the dtype they compute in. Pick "
                        "default, bf16, fp16 or fp32")
