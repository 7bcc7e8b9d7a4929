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

import dataclasses
import json
from functools import partial

import torch
from torch import nn

from mgpu.errors import MgpuError, ShardingError
from mgpu.planning.sizing import TensorInfo, read_header
from mgpu.sharding.slice_load import FORMAT_KEYS, SAFETENSORS_DTYPES
from mgpu.weights.gguf import is_gguf
from mgpu.weights.quant import FP8_DTYPES, Fp8Compute, fp8_compute_line, fp8_compute_path, view_weight_as

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


# Checkpoint keys whose values ComfyUI reads while it converts a quantized checkpoint: each layer's format
# (``comfy_quant`` JSON) and the scaled-fp8 input scales it drops when they are 1. A few bytes each, read for real.
VALUE_KEYS = (".comfy_quant", ".scale_input")
# Per-layer formats (ComfyUI's comfy.quant_ops.QUANT_ALGOS) whose rows shard: fp8 bytes, one scale per layer.
SHARDABLE_FORMATS = ("float8_e4m3fn", "float8_e5m2")
# Keys of a quantized checkpoint that describe its format, and that hold no weight once ComfyUI has converted it.
_FORMAT_SUFFIXES = (".comfy_quant", ".scale_input", ".input_scale")


def meta_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint as meta tensors of the right shapes and dtypes, from its header: all ComfyUI's detection reads,
    but for the few bytes of ``VALUE_KEYS`` it converts quantized checkpoints by."""
    header = read_header(path)
    unknown = sorted({info.dtype for info in header.tensors.values()} - set(SAFETENSORS_DTYPES))
    if unknown:
        raise MgpuError(f"{path}: tensors of dtype {', '.join(unknown)} cannot be loaded by this torch "
                        f"({torch.__version__}); convert the file, or upgrade torch")
    return {name: _read_value(path, info) if name.endswith(VALUE_KEYS) else
            torch.empty(info.shape, dtype=SAFETENSORS_DTYPES[info.dtype], device="meta")
            for name, info in header.tensors.items()}


def _read_value(path: str, info: TensorInfo) -> torch.Tensor:
    with open(path, "rb") as f:
        f.seek(info.start)
        raw = bytearray(f.read(info.end - info.start))
    if not raw:
        return torch.empty(info.shape, dtype=SAFETENSORS_DTYPES[info.dtype])
    return torch.frombuffer(raw, dtype=SAFETENSORS_DTYPES[info.dtype]).reshape(info.shape)


def detect(path: str):
    """(ComfyUI model config, prefix-stripped meta state dict, key prefix) of a diffusion checkpoint.

    The first half of ``comfy.sd.load_diffusion_model_state_dict``, on meta tensors: the host and every rank build
    exactly the model ComfyUI would, without reading weights.

    Newer ComfyUI (0.33) first converts scaled-fp8 files and ``_quantization_metadata`` files to its quantized
    format (``comfy.utils.convert_old_quants``: per-layer ``comfy_quant`` entries); layers in a format the ranks
    cannot shard are refused here, before any rank starts. ComfyUI 0.3.x builds scaled-fp8 files with its scaled-fp8
    ops instead, and does not know the quantized format: such files are refused there. So are families this ComfyUI
    has no model for and would take for another (``NEWER_FAMILIES``: LTX-2 on 0.3.x).
    GGUF files are detected from their own header (``loaders.gguf_model``).
    """
    import comfy.model_detection
    import comfy.utils

    if is_gguf(path):
        from .gguf_model import detect as detect_gguf

        return detect_gguf(path)
    metadata = read_header(path).metadata
    sd = meta_state_dict(path)
    converts = hasattr(comfy.utils, "convert_old_quants")
    if converts:
        sd, metadata = comfy.utils.convert_old_quants(sd, "", metadata=metadata)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
    stripped = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=True)
    if stripped:
        sd = stripped
        if converts:
            sd, metadata = comfy.utils.convert_old_quants(sd, "", metadata=metadata)
    else:
        prefix = ""
    refuse_unknown_family(path, sd)
    detect_kwargs = {"metadata": metadata} if converts else {}
    model_config = comfy.model_detection.model_config_from_unet(sd, "", **detect_kwargs)   # 0.3.x: pops scaled_fp8
    if model_config is None:
        raise ShardingError(f"{path}: ComfyUI does not recognise this diffusion model from its keys, so it cannot be "
                            "sharded (diffusers-format files are converted only by ComfyUI's single-device loader); "
                            "load it on one device, or use a ComfyUI-format file")
    if converts:
        _refuse_unshardable_layers(path, sd)
    elif "_quantization_metadata" in metadata or any(k.endswith(".comfy_quant") for k in sd):
        raise ShardingError(f"{path} is a ComfyUI quantized checkpoint (per-layer quantization formats), which this "
                            f"ComfyUI ({_comfy_version()}) does not know: it would compute with its fp8 weights "
                            "unscaled. Update ComfyUI (0.33 and newer load it, and shard its float8 layers), or use "
                            "the file's bf16/fp16 original")
    return model_config, sd, prefix


# Diffusion models older ComfyUI would take for another family: a key only they have -> (name, what it is, ComfyUI's
# model config class for it in comfy.supported_models, what older ComfyUI takes it for). ComfyUI 0.3.64 detects
# LTX-2 as LTX-Video (the same adaln key) and would build it without its audio stream.
NEWER_FAMILIES = {"audio_adaln_single.linear.weight": ("LTX-2", "audio + video", "LTXAV", "LTX-Video")}


def refuse_unknown_family(path: str, keys) -> None:
    """Refuse a checkpoint of a family this ComfyUI has no model for, naming it, before anything is built.
    ``keys``: the checkpoint's tensor names (prefixed or not)."""
    import comfy.supported_models

    for key, (name, what, config, mistaken) in NEWER_FAMILIES.items():
        if not hasattr(comfy.supported_models, config) and any(k == key or k.endswith("." + key) for k in keys):
            raise ShardingError(f"{path} is an {name} diffusion model ({what}), and this ComfyUI "
                                f"({_comfy_version()}) has no {name} (its {config} model): it would load the file as "
                                f"{mistaken}. Update ComfyUI (0.33 runs {name}), or pick another model")


def quantized_layers(sd: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Each quantized layer's ComfyUI config (the ``comfy_quant`` JSON of a converted state dict), by layer name."""
    return {key.removesuffix(".comfy_quant"): json.loads(bytes(value.tolist()))
            for key, value in sd.items() if key.endswith(".comfy_quant")}


def _refuse_unshardable_layers(path: str, sd: dict[str, torch.Tensor]) -> None:
    """Refuse a quantized checkpoint with any layer the ranks cannot shard, naming the layers and their formats.

    Shardable: fp8 weights (their rows split over the ranks, all-gathered as bytes) with one scale per layer (held
    whole by every rank). Block-scaled (mxfp8, nvfp4) and int8 formats pack scales that do not follow the rows.
    """
    problems: dict[str, list[str]] = {}
    for layer, conf in quantized_layers(sd).items():
        fmt = conf.get("format")
        weight, scale = sd.get(f"{layer}.weight"), sd.get(f"{layer}.weight_scale")
        if weight is None:   # a layer name no weight has (ComfyUI re-adds a prefixed file's names): ignored, as there
            continue
        if fmt not in SHARDABLE_FORMATS:
            problems.setdefault(str(fmt), []).append(layer)
        elif weight.dtype not in FP8_DTYPES:
            problems.setdefault(f"{fmt} stored as {dtype_name(weight.dtype)}", []).append(layer)
        elif scale is None or scale.numel() != 1:
            values = "no weight_scale" if scale is None else f"{scale.numel()} weight_scale values"
            problems.setdefault(f"{fmt} with {values}", []).append(layer)
    if problems:
        listed = "; ".join(f"{kind}: {len(layers)} layer{'s' * (len(layers) > 1)} ({', '.join(layers[:3])}"
                           f"{', ...' if len(layers) > 3 else ''})" for kind, layers in problems.items())
        raise ShardingError(f"{path}: MGPU Load Diffusion Model cannot shard these quantized layers: {listed}. It "
                            f"shards {' and '.join(SHARDABLE_FORMATS)} layers with one weight_scale each (the fp8 "
                            "rows split over the ranks, the scale held whole); load this file on one device "
                            "(device cuda:N or cpu) instead")


def _comfy_version() -> str:
    try:
        from comfyui_version import __version__
    except ImportError:
        return "version unknown"
    return __version__


def _config_value(model_config, name: str):
    """An attribute of a ComfyUI model config, None where this ComfyUI lacks it (its __getattr__ logs a warning)."""
    return vars(model_config).get(name, getattr(type(model_config), name, None))


def scaled_fp8(model_config) -> bool:
    """Whether ComfyUI (0.3.x) builds this network with its scaled-fp8 ops."""
    return _config_value(model_config, "scaled_fp8") is not None


def quantized(model_config) -> bool:
    """Whether ComfyUI (0.33+) builds this network with its mixed-precision ops (quantized layers)."""
    return _config_value(model_config, "quant_config") is not None


def fp8_full_precision(model_config, sd: dict[str, torch.Tensor]) -> bool | None:
    """Whether the checkpoint asks ComfyUI to compute its fp8 layers in full precision rather than by fp8 matmul;
    None when it has no scaled or quantized fp8 layers (their compute follows ComfyUI's plain casting)."""
    if quantized(model_config):
        confs = [c for c in quantized_layers(sd).values() if c.get("format") in SHARDABLE_FORMATS]
        return all(c.get("full_precision_matrix_mult", False) for c in confs) if confs else None
    if scaled_fp8(model_config):   # a 2-element scaled_fp8 marker turns ComfyUI 0.3.x's fp8 optimizations off
        return not model_config.optimizations.get("fp8", False)
    return None


def plain_fp8_cast(model_config) -> bool:
    """Whether ComfyUI casts plain fp8 weights per layer even where the device has fp8 matmul: unless the model asks
    for fp8 optimizations or ComfyUI runs with --fast fp8_matrix_mult (``comfy.ops.pick_operations``)."""
    import comfy.cli_args

    fast = comfy.cli_args.PerformanceFeature.Fp8MatrixMultiplication in comfy.cli_args.args.fast
    return not (fast or model_config.optimizations.get("fp8", False))


def rank_fp8_compute(device: torch.device, full_precision: bool, plain_cast: bool = False) -> Fp8Compute:
    """How this rank's fp8 layers compute (``mgpu.weights.quant.fp8_compute_path`` on its device); ComfyUI's own
    verdict for the device wins where the two disagree, since ComfyUI's ops are what run."""
    import comfy.cli_args
    import comfy.model_management as mm

    nvidia = device.type == "cuda" and torch.version.cuda is not None
    capability = torch.cuda.get_device_capability(device) if nvidia else None
    path = fp8_compute_path(str(device), capability, full_precision=full_precision, plain_cast=plain_cast,
                            forced=bool(getattr(comfy.cli_args.args, "supports_fp8_compute", False)))
    comfy_matmul = bool(mm.supports_fp8_compute(device)) and not full_precision and not plain_cast
    if comfy_matmul != path.matmul:
        return Fp8Compute(str(device), comfy_matmul, f"ComfyUI {_comfy_version()}'s choice on this device")
    return path


def fp8_compute_summary(replies: list[dict]) -> str | None:
    """The line the host logs once per load from the ranks' ``prepare`` replies; None without fp8 layers."""
    paths = [r["fp8_compute"]["summary"] for r in replies if r.get("fp8_compute")]
    return fp8_compute_line(paths) if paths else None


# ComfyUI's command-line storage dtypes for the diffusion model (--bf16-unet, ...), which
# ``comfy.model_management.unet_dtype`` honours before anything else.
UNET_DTYPE_FLAGS = ("fp32_unet", "fp64_unet", "bf16_unet", "fp16_unet", "fp8_e4m3fn_unet", "fp8_e5m2_unet",
                    "fp8_e8m0fnu_unet")


def sharded_storage_dtype(device: torch.device, weight_dtype: torch.dtype | None, rank_params: int,
                          supported: list[torch.dtype]) -> torch.dtype:
    """The dtype a rank stores the network in when no weight_dtype is forced: ComfyUI's UNETLoader choice for this
    device and the rank's ``rank_params`` (``comfy.model_management.unet_dtype``), except that a plain fp8 file
    stays fp8 unless a ``UNET_DTYPE_FLAGS`` flag says otherwise.

    Without fp8 compute (3090, A100, CPU) ComfyUI upcasts an fp8 model that fits the device whole, to spare the
    per-layer cast; a rank's 1/N share nearly always fits, so every rank would hold, and every all-gather move, twice
    the bytes the plan sized (Wan 14B fp8 on 2x3090: 14 GB per rank instead of 7 GB, out of memory at the first
    step). Kept fp8, the shard is gathered as fp8 and ComfyUI's manual-cast ops cast one layer at a time, as they do
    on one GPU that the upcast model does not fit.
    """
    import comfy.cli_args
    import comfy.model_management as mm

    if weight_dtype in FP8_DTYPES and not any(getattr(comfy.cli_args.args, f, False) for f in UNET_DTYPE_FLAGS):
        return weight_dtype
    return mm.unet_dtype(device=device, model_params=rank_params, supported_dtypes=supported,
                         weight_dtype=weight_dtype)


def prepare(ctx, payload: dict, tensors: dict) -> dict:
    """Rank op: set ComfyUI up for this rank's device and report the dtypes it would use here.

    ``preferred``: what ComfyUI's UNETLoader would pick on this device for this rank's share of the weights;
    ``manual_cast``: the compute dtype for each candidate storage dtype (None: computes in the storage dtype);
    ``fp8_compute``: how this rank's device computes the file's scaled or quantized fp8 layers, or the network's
    plain fp8 weights (None: it has neither).
    """
    device = _setup(ctx.device, payload["flags"])
    import comfy.model_management as mm
    import comfy.utils

    model_config, sd, _ = detect(payload["checkpoint"])
    supported = list(model_config.supported_inference_dtypes)
    quant = quantized(model_config)
    forced = payload.get("unet_dtype")
    if forced is not None:
        preferred = getattr(torch, forced)
    else:   # as comfy.sd.load_diffusion_model_state_dict: a scaled/quantized file's fp8 says nothing of the compute
        weight_dtype = None if scaled_fp8(model_config) or quant else comfy.utils.weight_dtype(sd)
        preferred = sharded_storage_dtype(device, weight_dtype, comfy.utils.calculate_parameters(sd) // ctx.world_size,
                                          supported)
    candidates = [preferred] if forced is not None else list(dict.fromkeys([preferred, *supported]))
    full_precision = fp8_full_precision(model_config, sd)
    if full_precision is not None:
        fp8_compute = rank_fp8_compute(device, full_precision).to_dict()
    elif preferred in FP8_DTYPES:   # a plain fp8 file kept fp8, or weight_dtype fp8
        fp8_compute = rank_fp8_compute(device, False, plain_fp8_cast(model_config)).to_dict()
    else:
        fp8_compute = None
    return {"preferred": dtype_name(preferred),   # quantized: ComfyUI computes in its cast of "no weight dtype"
            "manual_cast": {dtype_name(d): dtype_name(mm.unet_manual_cast(None if quant else d, device, supported))
                            for d in candidates},
            "fp8_compute": fp8_compute}


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

    model_config, sd, prefix = detect(checkpoint)
    dtype = getattr(torch, unet_dtype)
    quant = quantized(model_config)
    model_config.set_inference_dtype(dtype, mm.unet_manual_cast(None if quant else dtype, device,
                                                                model_config.supported_inference_dtypes))
    network = model_config.get_model(sd, "").diffusion_model
    if quant:
        file_keys = {k[len(prefix):] for k in read_header(checkpoint).tensors if k.startswith(prefix)}
        shard_quantized_layers(network, sd, file_keys)
    elif scaled_fp8(model_config):
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


def shard_quantized_layers(network: nn.Module, sd: dict[str, torch.Tensor], file_keys: set[str]) -> list[str]:
    """Make ComfyUI's quantized network (its mixed-precision ops) shardable; returns the quantized layers' names.

    Those ops create a layer's weight only when loaded, so each such layer first gets its parameters from ComfyUI's
    own loader, on the header's meta tensors: its format, layout and compute path are ComfyUI's. Then each fp8 layer
    becomes: a plain fp8 ``weight`` (FSDP shards it and all-gathers its bytes), its ``weight_scale`` a buffer every
    rank holds whole, and, for each forward, ComfyUI's ``QuantizedTensor`` of the gathered bytes and that scale, so
    ComfyUI's ops (and comfy_kitchen's fp8 kernels on a GPU) compute as on one device. The layers' state dicts name
    the checkpoint's own keys (a scaled-fp8 file's ``scale_weight``), for the slice loader; format keys that hold no
    weight become the network's ``FORMAT_KEYS``.
    """
    modules = dict(network.named_modules())
    names = load_layers_on_meta(network, sd)
    for name in names:
        _shardable_fp8(modules[name], name, sd, file_keys)
    consumed = set(network.state_dict())
    setattr(network, FORMAT_KEYS, tuple(sorted(k for k in file_keys - consumed
                                               if k == "scaled_fp8" or k.endswith(_FORMAT_SUFFIXES))))
    return names


def load_layers_on_meta(network: nn.Module, sd: dict[str, torch.Tensor]) -> list[str]:
    """Run ComfyUI's own loader, on the header's meta tensors, for the layers of its mixed-precision ops (which
    create their weight only when loaded) and every layer with a ``comfy_quant`` entry; returns the names of those
    whose weight it made a (meta) ``QuantizedTensor``.

    The ranks build on it (``shard_quantized_layers``); on the host's meta model it gives each layer the weight,
    and so the state-dict keys, stock ComfyUI's model has (weight patches are matched against those).
    """
    from comfy.quant_ops import QuantizedTensor

    names = []
    for name, module in network.named_modules():
        prefix = f"{name}."
        builds_weight = getattr(module, "weight", None) is None and f"{prefix}weight" in sd
        if not name or not (builds_weight or f"{prefix}comfy_quant" in sd):
            continue
        _comfy_load_on_meta(module, prefix, sd)
        if isinstance(module.weight, QuantizedTensor):
            names.append(name)
    return names


def _comfy_load_on_meta(module: nn.Module, prefix: str, sd: dict[str, torch.Tensor]) -> None:
    """ComfyUI's ``_load_from_state_dict`` of one layer, on its meta entries.

    Its parameters are registered as they are: accelerate's ``init_empty_weights`` (the meta build) re-creates each
    registered parameter from its ``__dict__``, which a ``QuantizedTensor`` cannot take.
    """
    entries = {k: v for k, v in sd.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    module.register_parameter = partial(_register_as_is, module)
    try:
        module._load_from_state_dict(entries, prefix, {}, True, missing, unexpected, errors)
    finally:
        del module.register_parameter
    if errors:
        raise ShardingError(f"ComfyUI cannot build layer {prefix.rstrip('.')} of this checkpoint: {'; '.join(errors)}")


def _register_as_is(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    module._parameters[name] = param


def _shardable_fp8(module: nn.Module, name: str, sd: dict[str, torch.Tensor], file_keys: set[str]) -> None:
    """One fp8 layer ComfyUI built with a (meta) QuantizedTensor weight, made shardable (``shard_quantized_layers``)."""
    template = module.weight
    qdata, scale = template._qdata, sd[f"{name}.weight_scale"]
    module._parameters["weight"] = nn.Parameter(torch.empty(qdata.shape, dtype=qdata.dtype, device="meta"),
                                                requires_grad=False)
    module.register_buffer("weight_scale", torch.ones(scale.shape, dtype=scale.dtype))
    view_weight_as(module, partial(_as_quantized_tensor, layout=module.layout_type, params=template.params))
    keys = {"weight": "weight", "weight_scale": _file_key(name, ("scale_weight", "weight_scale"), file_keys)}
    if module.bias is not None:
        keys["bias"] = "bias"
    if getattr(module, "input_scale", None) is not None:
        keys["input_scale"] = _file_key(name, ("scale_input", "input_scale"), file_keys)
    module.state_dict = _checkpoint_state_dict(module, keys)


def _as_quantized_tensor(module: nn.Module, gathered: torch.Tensor, *, layout: str, params) -> torch.Tensor:
    """The gathered fp8 rows as ComfyUI's QuantizedTensor, with the layer's replicated scale (no copy)."""
    from comfy.quant_ops import QuantizedTensor

    if gathered.dtype not in FP8_DTYPES:
        raise ShardingError(f"a quantized layer received its weight as {gathered.dtype}, not its fp8 bytes: shard "
                            "ComfyUI's quantized models without a param_dtype")
    return QuantizedTensor(gathered.detach(), layout, dataclasses.replace(params, scale=module.weight_scale))


def _file_key(layer: str, names: tuple[str, ...], file_keys: set[str]) -> str:
    """The name the checkpoint stores a layer's tensor under (scaled-fp8 files: ``scale_weight``), else the last."""
    return next((n for n in names if f"{layer}.{n}" in file_keys), names[-1])


def _checkpoint_state_dict(module: nn.Module, keys: dict[str, str]):
    """A ``state_dict`` for ``module`` that lists its tensors under the checkpoint's key names (attribute -> key)."""
    def state_dict(*args, destination=None, prefix: str = "", keep_vars: bool = False, **kwargs) -> dict:
        out = {} if destination is None else destination
        for attr, key in keys.items():
            value = getattr(module, attr)
            out[prefix + key] = value if keep_vars else value.detach()
        return out

    return state_dict
