"""Rank side of an FSDP diffusion model: ComfyUI's own network, found by ComfyUI's own detection.

The ranks import this module as top-level ``loaders.rank_factory`` (the pool puts the ComfyUI checkout and the pack
root on their path); the host imports it as part of the pack for ``detect`` and ``agree_dtype``. ComfyUI is only
imported inside functions: on a rank its command-line flags must be set first, because ``comfy.model_management``
reads them (and probes the device) at import.

Per (re)load the host calls ``prepare`` on every rank, then ``mgpu.sharding.model_ops:load`` with ``diffusion_model`` as the
factory. ``prepare`` does the ComfyUI imports outside the meta-device build, and reports the dtypes this rank's
device would compute in, so the host can pick one dtype for all ranks (FSDP shards one storage dtype, and the host
casts the inputs once).
"""

from __future__ import annotations

import torch
from torch import nn

from mgpu.errors import MgpuError, ShardingError
from mgpu.planning.sizing import read_header
from mgpu.sharding.slice_load import FORMAT_KEYS, SAFETENSORS_DTYPES

# Flags of the host's ComfyUI that change how the network computes (precision, attention, kernels); the ranks get
# the same values, so sharded and stock compute agree. Boolean flags, plus ENUM_SET_FLAGS.
NUMERIC_FLAGS = ("force_fp32", "force_fp16", "fp32_unet", "fp64_unet", "bf16_unet", "fp16_unet", "fp8_e4m3fn_unet",
                 "fp8_e5m2_unet", "fp8_e8m0fnu_unet", "supports_fp8_compute", "use_split_cross_attention",
                 "use_quad_cross_attention", "use_pytorch_cross_attention", "use_sage_attention", "use_flash_attention",
                 "use_ck_attention", "disable_xformers", "force_upcast_attention", "dont_upcast_attention",
                 "enable_triton_backend", "disable_triton_backend", "deterministic", "fast")
# Flags whose value is a set of enum members of comfy.cli_args (``--fast fp16_accumulation ...``): they travel as
# sorted lists of the members' values and become sets of members again on the rank.
ENUM_SET_FLAGS = {"fast": "PerformanceFeature"}
Flags = dict[str, bool | list[str]]


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """"bfloat16" for torch.bfloat16: dtypes travel to and from the ranks as plain strings."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def numeric_flags(args: object) -> Flags:
    """The NUMERIC_FLAGS of a ComfyUI ``comfy.cli_args.args`` that this ComfyUI version has, as plain data."""
    flags: Flags = {}
    for key in NUMERIC_FLAGS:
        value = getattr(args, key, None)
        if key in ENUM_SET_FLAGS and isinstance(value, (set, frozenset, list, tuple)):
            flags[key] = sorted(str(member.value) for member in value)
        elif isinstance(value, bool):
            flags[key] = value
    return flags


def restore_flags(flags: Flags, cli_args) -> dict[str, object]:
    """``numeric_flags`` back into the values ``cli_args`` (the module ``comfy.cli_args``) holds: enum sets again."""
    return {key: _members(getattr(cli_args, ENUM_SET_FLAGS[key]), value, key) if key in ENUM_SET_FLAGS else value
            for key, value in flags.items()}


def _members(enum: type, values: list[str], flag: str) -> set:
    known = {member.value: member for member in enum}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise MgpuError(f"the ComfyUI on the FSDP ranks has no --{flag} {' '.join(unknown)}: they import another "
                        "ComfyUI than the host's; check PoolConfig.extra_sys_path and PYTHONPATH")
    return {known[v] for v in values}


def _setup(device: str, flags: Flags) -> torch.device:
    """Give ComfyUI on this rank the host's numeric flags and this rank's device, then import it."""
    import comfy.cli_args

    for key, value in restore_flags(flags, comfy.cli_args).items():
        setattr(comfy.cli_args.args, key, value)
    comfy.cli_args.args.cpu = torch.device(device).type == "cpu"
    import comfy.model_management  # reads the flags above at import

    return torch.device(device)


def meta_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint as meta tensors of the right shapes and dtypes, from its header: all ComfyUI's detection reads."""
    header = read_header(path)
    unknown = sorted({info.dtype for info in header.tensors.values()} - set(SAFETENSORS_DTYPES))
    if unknown:
        raise MgpuError(f"{path}: tensors of dtype {', '.join(unknown)} cannot be loaded by this torch "
                        f"({torch.__version__}); convert the file, or upgrade torch")
    return {name: torch.empty(info.shape, dtype=SAFETENSORS_DTYPES[info.dtype], device="meta")
            for name, info in header.tensors.items()}


def detect(path: str):
    """(ComfyUI model config, prefix-stripped meta state dict, key prefix) of a diffusion checkpoint.

    The first half of ``comfy.sd.load_diffusion_model_state_dict``, on meta tensors: the host and every rank build
    exactly the model ComfyUI would, without reading weights.
    """
    import comfy.model_detection
    import comfy.utils

    sd = meta_state_dict(path)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
    stripped = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=True)
    if stripped:
        sd = stripped
    else:
        prefix = ""
    model_config = comfy.model_detection.model_config_from_unet(sd, "")   # pops a scaled_fp8 marker it supports
    if model_config is None:
        raise ShardingError(f"{path}: ComfyUI does not recognise this diffusion model from its keys, so it cannot be "
                            "sharded (diffusers-format files are converted only by ComfyUI's single-device loader); "
                            "load it on one device, or use a ComfyUI-format file")
    if "scaled_fp8" in sd:   # newer ComfyUI (0.33.0) leaves it for convert_old_quants: quantized tensors, no fp8 ops
        raise ShardingError(f"{path} is a scaled-fp8 checkpoint (a scaled_fp8 marker and per-layer scale_weight); "
                            f"this ComfyUI ({_comfy_version()}) loads it as quantized tensors, which MGPU Load "
                            "Diffusion Model cannot shard yet (ComfyUI 0.3.64's scaled-fp8 ops it can): load it on one "
                            "device (device cuda:N or cpu), or shard the bf16/fp16 file with weight_dtype fp8_e4m3fn")
    return model_config, sd, prefix


def _comfy_version() -> str:
    try:
        from comfyui_version import __version__
    except ImportError:
        return "version unknown"
    return __version__


def scaled_fp8(model_config) -> bool:
    """Whether ComfyUI builds this network with its scaled-fp8 ops (``detect`` refuses the file otherwise)."""
    return getattr(model_config, "scaled_fp8", None) is not None


def prepare(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: set ComfyUI up for this rank's device and report the dtypes it would use here.

    ``preferred``: what ComfyUI's UNETLoader would pick on this device for this rank's share of the weights;
    ``manual_cast``: the compute dtype for each candidate storage dtype (None: computes in the storage dtype).
    """
    device = _setup(ctx.device, payload["flags"])
    import comfy.model_management as mm
    import comfy.utils

    model_config, sd, _ = detect(payload["checkpoint"])
    supported = list(model_config.supported_inference_dtypes)
    forced = payload.get("unet_dtype")
    if forced is not None:
        preferred = getattr(torch, forced)
    else:   # as comfy.sd.load_diffusion_model_state_dict: a scaled-fp8 file's fp8 says nothing of the compute dtype
        weight_dtype = None if scaled_fp8(model_config) else comfy.utils.weight_dtype(sd)
        preferred = mm.unet_dtype(device=device, model_params=comfy.utils.calculate_parameters(sd) // ctx.world_size,
                                  supported_dtypes=supported, weight_dtype=weight_dtype)
    candidates = [preferred] if forced is not None else list(dict.fromkeys([preferred, *supported]))
    return {"preferred": dtype_name(preferred),
            "manual_cast": {dtype_name(d): dtype_name(mm.unet_manual_cast(d, device, supported)) for d in candidates}}


def agree_dtype(replies: list[dict], devices: list[str]) -> tuple[str, str | None]:
    """One (storage dtype, compute dtype or None) for all ranks, from their ``prepare`` replies.

    The ranks' common preference if they share one, else the first storage dtype (ComfyUI's order for the model)
    that every rank computes the same way: e.g. a bf16 GPU and an fp16-only GPU agree on fp16.
    """
    preferred = {r["preferred"] for r in replies}
    order = ([*preferred] if len(preferred) == 1 else []) + list(replies[0]["manual_cast"])
    for dtype in dict.fromkeys(order):
        casts = {r["manual_cast"].get(dtype, "?") for r in replies}
        if len(casts) == 1 and "?" not in casts:
            return dtype, casts.pop()
    seen = "; ".join(f"{dev}: {r['preferred']} (computes {r['manual_cast'].get(r['preferred']) or 'as stored'})"
                     for dev, r in zip(devices, replies))
    raise MgpuError(f"the FSDP ranks cannot compute the model in one dtype ({seen}); pick weight_dtype fp16 or fp32 "
                    "on MGPU Load Diffusion Model, or shard over GPUs of the same kind")


def diffusion_model(checkpoint: str, unet_dtype: str, devices: list[str], flags: Flags) -> nn.Module:
    """FSDP factory (``ModelSpec.factory``, run under ``mgpu.sharding.fsdp.build_meta``): ComfyUI's network for the
    checkpoint, stored in ``unet_dtype``, with the operations ComfyUI picks for this rank's device."""
    import torch.distributed as dist

    device = _setup(devices[dist.get_rank()], flags)
    import comfy.model_management as mm

    model_config, sd, _ = detect(checkpoint)
    dtype = getattr(torch, unet_dtype)
    model_config.set_inference_dtype(dtype, mm.unet_manual_cast(dtype, device, model_config.supported_inference_dtypes))
    network = model_config.get_model(sd, "").diffusion_model
    if scaled_fp8(model_config):
        default_absent_scales(network, sd)
        setattr(network, FORMAT_KEYS, ("scaled_fp8",))   # detection read the marker; it holds no weights
    return network


SCALES = ("scale_weight", "scale_input")


def default_absent_scales(network: nn.Module, sd: dict[str, torch.Tensor]) -> list[str]:
    """Scales of ComfyUI's scaled-fp8 layers that the file lacks become fixed buffers of the ops' own start value.

    ComfyUI's loader leaves such a scale as the op built it (1: a layer stored unscaled); a meta parameter would be
    allocated uninitialised instead, and the slice loader refuses keys the file lacks. Returns their names.
    """
    kept = []
    for module_name, sub in network.named_modules():
        for name in SCALES:
            param = sub._parameters.get(name)
            key = f"{module_name}.{name}"
            if param is not None and key not in sd:
                del sub._parameters[name]
                sub.register_buffer(name, torch.ones(param.shape, dtype=param.dtype), persistent=False)
                kept.append(key)
    return kept
