"""Model files by NAME from ComfyUI's model folders, and the plan request the MGPU Plan node and
POST /mgpu/plan share.

Why names only: the route is reachable by anything that can reach ComfyUI, so it must never open a path a
client chose. A name is accepted only if ComfyUI itself lists it in that folder (subfolders included, as
ComfyUI's own loaders show them); absolute paths, ``..`` and unknown names are refused before any file is
touched. Planning reads safetensors headers only, so a request never loads weights nor writes anything.

ComfyUI is imported lazily (``comfy_folders``): the validation runs, and is unit-tested, without it.
"""

from __future__ import annotations

import ntpath
import posixpath
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mgpu.planning.devices import Device, inventory, parse_spec
from mgpu.errors import MgpuError, SizingError
from mgpu.planning.estimates import Workload
# phases_resident / PHASE_OF are the partitioner's own rules: the chart's bars then add up to its numbers.
from mgpu.planning.partition import (
    EXPERT_ROLES,
    ONE_AT_A_TIME,
    PHASE_OF,
    PHASES,
    Component,
    Plan,
    Policy,
    make_plan,
    phases_resident,
)
from mgpu.planning.sizing import ComponentSize, size_component
from mgpu.planning.training import CHECKPOINTING, OPTIMIZER_STATES, Training

from .placement import available_devices, host_context_gpus, live_devices

# dit_low_noise: the second expert of a two-expert DiT (Wan 2.2 A14B), planned on the same devices as dit
FOLDERS = {"dit": "diffusion_models", "dit_low_noise": "diffusion_models", "text_encoder": "text_encoders",
           "vae": "vae"}
NONE = "none"
AUTO_DEVICES = "auto"
# The weight dtypes MGPU Load Diffusion Model offers (its module imports ComfyUI, so they are repeated here;
# tests/test_comfyui_nodes.py checks the two lists agree). "default" is sized as stored in the file.
DIT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e5m2", "bf16", "fp16", "fp32")
# (min, max, default): the node's widgets and the route accept the same numbers.
INT_LIMITS = {"width": (16, 16384, 832), "height": (16, 16384, 480), "frames": (1, 16384, 81), "batch": (1, 64, 1),
              "lora_rank": (1, 128, 8), "grad_accumulation": (1, 1024, 1), "dataset": (1, 100000, 1)}
BOOL_DEFAULTS = {"cfg": True, "allow_offload": False, "prefer_speed": False, "train": False}
# A training plan's choices (the optional MGPU Plan inputs, POST /mgpu/plan's fields): name -> (options, default)
CHOICES = {"optimizer": (tuple(OPTIMIZER_STATES), "AdamW"), "gradient_checkpointing": (CHECKPOINTING, "auto")}
MAX_DEVICE_SPEC = 200
# Where an all-in-one checkpoint (LTX-Video's) keeps its VAE; MGPU Load VAE and the plan both look there.
VAE_PREFIX_IN_CHECKPOINT = "vae."
_CHECKPOINT_PREFIX = {"dit": "model.diffusion_model.", "vae": VAE_PREFIX_IN_CHECKPOINT}

ListFiles = Callable[[str], list[str]]
FullPath = Callable[[str, str], "str | None"]


class BadRequest(MgpuError, ValueError):
    """A request the client must change (HTTP 400)."""


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: file names (None = not planned) as ComfyUI lists them, the workload, devices and policy."""

    dit: str
    dit_low_noise: str | None = None   # Wan 2.2 A14B: the low-noise expert; dit is then the high-noise one
    text_encoder: str | None = None
    vae: str | None = None
    width: int = 832
    height: int = 480
    frames: int = 81
    batch: int = 1
    cfg: bool = True
    dit_weight_dtype: str = "default"   # one name everywhere: the MGPU Plan node, POST /mgpu/plan, --dit-weight-dtype
    devices: str = AUTO_DEVICES
    allow_offload: bool = False
    prefer_speed: bool = False
    # train: plan one MGPU Train LoRA step (``mgpu.planning.training``) instead of sampling: the size is one dataset
    # item's, batch the rows per step, no CFG
    train: bool = False
    lora_rank: int = 8   # MGPU Train LoRA's default rank
    optimizer: str = "AdamW"
    gradient_checkpointing: str = "auto"
    grad_accumulation: int = 1
    dataset: int = 1

    def workload(self) -> Workload:
        train = Training(lora_rank=self.lora_rank, optimizer=self.optimizer, checkpointing=self.gradient_checkpointing,
                         grad_accumulation=self.grad_accumulation, dataset=self.dataset) if self.train else None
        return Workload(width=self.width, height=self.height, frames=self.frames, batch=self.batch,
                        cfg=self.cfg and not self.train, train=train)


def check_name(role: str, name: object, listed: list[str]) -> str:
    """The name if ComfyUI lists it in the role's folder; BadRequest saying why not otherwise."""
    folder = FOLDERS[role]
    if not isinstance(name, str) or not name.strip():
        raise BadRequest(f"{role}: give a file name from ComfyUI's {folder} folder, got {name!r}")
    if posixpath.isabs(name) or ntpath.isabs(name) or name.startswith(("/", "\\", "~")):
        raise BadRequest(f"{role}: {name!r} is a path; give a file name as listed in ComfyUI's {folder} folder")
    if ".." in name.replace("\\", "/").split("/"):
        raise BadRequest(f"{role}: {name!r} leaves the {folder} folder ('..'); give a file name as ComfyUI lists it")
    if name not in listed:
        hint = f"e.g. {', '.join(listed[:3])}" if listed else "it is empty: put the model file there first"
        raise BadRequest(f"{role}: {name!r} is not in ComfyUI's {folder} folder ({hint})")
    return name


def _int(body: dict, key: str) -> int:
    low, high, default = INT_LIMITS[key]
    value = body.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{key} must be a whole number from {low} to {high}, got {value!r}")
    if not low <= value <= high:
        raise BadRequest(f"{key} must be from {low} to {high}, got {value}")
    return value


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, BOOL_DEFAULTS[key])
    if not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false, got {value!r}")
    return value


def parse_plan_request(body: Any, list_files: ListFiles) -> PlanRequest:
    """Validate a POST /mgpu/plan body (JSON object); every problem is a BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object such as {\"dit\": \"wan2.1_t2v_14B_bf16.safetensors\"}")
    known = {*FOLDERS, "dit_weight_dtype", "devices", *INT_LIMITS, *BOOL_DEFAULTS, *CHOICES}
    if "dit_dtype" in body:
        raise BadRequest("dit_dtype is now called dit_weight_dtype, as on the MGPU Plan node")
    if unknown := sorted(set(body) - known):
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
    if "dit" not in body:
        raise BadRequest("dit is required: a file name from ComfyUI's diffusion_models folder")
    names: dict[str, str | None] = {}
    for role in FOLDERS:
        value = body.get(role)
        names[role] = None if role != "dit" and value in (None, NONE) else check_name(role, value, list_files(FOLDERS[role]))
    dit_weight_dtype = body.get("dit_weight_dtype", "default")
    if dit_weight_dtype not in DIT_DTYPES:
        raise BadRequest(f"dit_weight_dtype must be one of {', '.join(DIT_DTYPES)}, got {dit_weight_dtype!r}")
    devices = body.get("devices", AUTO_DEVICES)
    if not isinstance(devices, str) or len(devices) > MAX_DEVICE_SPEC:
        raise BadRequest(f"devices must be 'auto' or a device spec such as 2x24GiB (at most {MAX_DEVICE_SPEC} "
                         f"characters), got {str(devices)[:50]!r}")
    choices = {}
    for key, (options, default) in CHOICES.items():
        choices[key] = body.get(key, default)
        if choices[key] not in options:
            raise BadRequest(f"{key} must be one of {', '.join(options)}, got {choices[key]!r}")
    return PlanRequest(dit=names["dit"], dit_low_noise=names["dit_low_noise"], text_encoder=names["text_encoder"],
                       vae=names["vae"],
                       **{k: _int(body, k) for k in INT_LIMITS}, **{k: _bool(body, k) for k in BOOL_DEFAULTS},
                       **choices, dit_weight_dtype=dit_weight_dtype, devices=check_devices(devices))


def check_devices(spec: str) -> str:
    """'auto' (also for blank) or a device spec that parses; BadRequest with the accepted forms otherwise."""
    spec = spec.strip() or AUTO_DEVICES
    if spec.lower() != AUTO_DEVICES:
        try:
            parse_spec(spec)
        except MgpuError as exc:
            raise BadRequest(f"devices: {exc}") from None
    return spec


def plan_devices(request: PlanRequest, live: Callable[[], list[Device]] | None = None) -> list[Device]:
    """'auto': this machine as the loaders see it; otherwise the simulated spec (host RAM added if absent)."""
    if check_devices(request.devices).lower() == AUTO_DEVICES:
        return (live or live_devices)()
    return inventory(request.devices)


def component_size(role: str, path: str) -> ComponentSize:
    """The component's size; in an all-in-one checkpoint (DiT + VAE), the part the role names."""
    role = "dit" if role in EXPERT_ROLES else role
    size = size_component(path)
    prefix = _CHECKPOINT_PREFIX.get(role)
    if prefix is None or size.kind == role:
        return size
    try:
        part = size_component(path, prefix=prefix)
    except SizingError:
        return size
    return part if part.kind == role else size


def make_plan_for(request: PlanRequest, full_path: FullPath, live: Callable[[], list[Device]] | None = None) -> Plan:
    """Size the named files from their headers and plan them. SizingError/PlanError pass through with the
    file named; a file ComfyUI listed but cannot find any more is a SizingError too."""
    components = []
    for role, folder in FOLDERS.items():
        name = getattr(request, role)
        if name is None:
            continue
        path = full_path(folder, name)
        if path is None:
            raise SizingError(f"{role}: {name!r} is not in ComfyUI's {folder} folder; put the file there and refresh "
                              "the node list (press r in the ComfyUI page), or pick another")
        dtype = None if role not in EXPERT_ROLES or request.dit_weight_dtype == "default" else request.dit_weight_dtype
        components.append(Component(role, component_size(role, path), dtype))
    workload = request.workload()
    dits = [c.size.path for c in components if c.role in EXPERT_ROLES]   # their loaders replace the loaded copies
    devices = plan_devices(request, live or (lambda: available_devices(dits)))
    policy = Policy(allow_offload=request.allow_offload, prefer_speed=request.prefer_speed,
                    host_context_gpus=host_context_gpus(devices))
    return make_plan(components, devices, workload, policy)


def comfy_folders() -> tuple[ListFiles, FullPath]:
    """ComfyUI's folder lookups (only inside ComfyUI): a model folder lists checkpoints' files too
    (``folder_names``), the DiT's .gguf files too (``dit_names``)."""

    def list_files(folder: str) -> list[str]:
        return dit_names() if folder == FOLDERS["dit"] else folder_names(folder)

    def full_path(folder: str, name: str) -> str | None:
        return dit_path(name) if folder == FOLDERS["dit"] else folder_path(folder, name)

    return list_files, full_path


# ComfyUI's own templates keep an all-in-one file in checkpoints, where its CheckpointLoaderSimple,
# LTXAVTextEncoderLoader (Gemma's text projection) and LTXVAudioVAELoader read it: LTX-2 (DiT, video and audio VAE,
# text projection in one file) and LTX-Video. Every MGPU loader and MGPU Plan offer that folder's files beside their
# own folder's, so one copy serves them all, without links; a name in both is their own folder's file.
CHECKPOINTS = "checkpoints"


def folder_names(folder: str) -> list[str]:
    """The files ComfyUI lists in ``folder`` and in checkpoints, sorted, each name once."""
    import folder_paths

    names = set(folder_paths.get_filename_list(folder))
    if folder != CHECKPOINTS and CHECKPOINTS in folder_paths.folder_names_and_paths:
        names.update(folder_paths.get_filename_list(CHECKPOINTS))
    return sorted(names)


def folder_path(folder: str, name: str) -> str | None:
    """The file behind a name ``folder_names`` lists: ComfyUI's lookup in ``folder``, then in checkpoints; None if
    neither has it."""
    import folder_paths

    for key in (folder, CHECKPOINTS):
        if key in folder_paths.folder_names_and_paths and (path := folder_paths.get_full_path(key, name)):
            return path
    return None


# Where .gguf diffusion models are found: ComfyUI's diffusion_models folders (models/unet included), and the folder
# ComfyUI-GGUF registers for its loader, if it is installed (it shares those folders unless configured otherwise).
GGUF_FOLDERS = ("diffusion_models", "unet_gguf")


def gguf_names() -> list[str]:
    """The .gguf files in ``GGUF_FOLDERS``, as paths relative to their folder (subfolders as ComfyUI shows them).

    Read from the folders themselves: the stock diffusion_models list (UNETLoader's) keeps its extensions."""
    import folder_paths

    names: set[str] = set()
    for key in GGUF_FOLDERS:
        if key not in folder_paths.folder_names_and_paths:
            continue
        for folder in folder_paths.get_folder_paths(key):
            files, _ = folder_paths.recursive_search(folder, excluded_dir_names=[".git"])
            names.update(folder_paths.filter_files_extensions(files, {".gguf"}))
    return sorted(names)


def dit_names() -> list[str]:
    """What MGPU Load Diffusion Model and MGPU Plan offer: ComfyUI's diffusion_models and checkpoints files
    (``folder_names``) plus the .gguf ones."""
    return sorted(set(folder_names(FOLDERS["dit"])) | set(gguf_names()))


def dit_path(name: str) -> str | None:
    """The file behind a name ``dit_names`` lists, None if there is none: ComfyUI's lookup in diffusion_models,
    then (.gguf names only) in ComfyUI-GGUF's folder, then in checkpoints."""
    import folder_paths

    keys = GGUF_FOLDERS if name.lower().endswith(".gguf") else GGUF_FOLDERS[:1]
    for key in (*keys, CHECKPOINTS):
        if key in folder_paths.folder_names_and_paths and (path := folder_paths.get_full_path(key, name)):
            return path
    return None


_ROLE_LABEL = {"text_encoder": "text encoder", "dit": "DiT", "dit_low_noise": "DiT", "vae": "VAE"}
_EXPERT_LABEL = {"dit": " (high noise)", "dit_low_noise": " (low noise)"}
_RUNS_IN = {"encode": "text_encoder", "sample": "dit", "decode": "vae"}


def _resident(plan: Plan, device: str) -> list:
    """The placements holding weights on ``device``; of two experts taken one at a time, only the larger one (the
    plan counts one expert's weights there, never both)."""
    held = [p for p in plan.placements if device in p.resident_bytes]
    turns = [p for p in held if p.experts == ONE_AT_A_TIME]
    if len(turns) > 1:
        larger = max(turns, key=lambda p: p.resident_bytes[device])
        held = [p for p in held if p not in turns or p is larger]
    return held


def chart(plan: Plan) -> list[dict]:
    """Per device and phase (encode, sample, decode): the weights resident then and the running component's
    working memory, which add up to the phase's bytes; the largest phase is the device's peak. The web extension
    draws one bar per phase, so a text encoder freed before sampling still shows where it ran."""
    policy = Policy(**plan.policy)
    names = {d["id"]: d["name"] for d in plan.devices}
    rows = []
    for use in plan.usage:
        phases = []
        for phase in PHASES:
            segments = [{"kind": "dit", "label": "FSDP rank process (CUDA context, NCCL)", "bytes": b}
                        for p in plan.placements if (b := p.process_bytes.get(use.device))]   # every phase
            for p in _resident(plan, use.device):
                if phase in phases_resident(p.role, p.strategy, policy):
                    what = _ROLE_LABEL[p.role] + (" shard" if p.strategy == "fsdp" else "")
                    which = (" (one expert at a time)" if p.experts == ONE_AT_A_TIME
                             else _EXPERT_LABEL[p.role] if p.experts else "")
                    segments.append({"kind": "dit" if p.role in EXPERT_ROLES else p.role,
                                     "label": f"{what} weights{which}", "bytes": p.resident_bytes[use.device]})
            working = max((p.working_bytes.get(use.device, 0) for p in plan.placements
                           if phase == PHASE_OF[p.role]), default=0)   # of two experts, one runs at a time
            if working:
                segments.append({"kind": "working", "label": f"{_ROLE_LABEL[_RUNS_IN[phase]]} working",
                                 "bytes": working})
            dataset = max((p.training.get("dataset_bytes", {}).get(use.device, 0) for p in plan.placements
                           if p.training and phase == "sample"), default=0)   # the experts share one dataset
            if dataset:
                segments.append({"kind": "working", "label": "training dataset (latents, conditioning)",
                                 "bytes": dataset})
            phases.append({"phase": phase, "bytes": use.by_phase[phase], "segments": segments})
        rows.append({"device": use.device, "name": names.get(use.device, ""), "budget_bytes": use.budget_bytes,
                     "peak_bytes": use.peak_bytes, "headroom_bytes": use.headroom_bytes, "phases": phases})
    return rows
