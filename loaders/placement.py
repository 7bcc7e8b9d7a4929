"""Which device an MGPU loader uses: the stable combo values, their labels, and how a choice resolves.

Combo VALUES are plain ids ("auto", "cpu", "cuda:N", "fsdp") so a saved workflow keeps working when free
memory or GPU names change; only the LABELS (web extension, GET /mgpu/devices) carry names and memory.
"auto" and "fsdp" follow a plan: the MGPU Plan connected to the loader, else one the loader makes for its own file
(``plan_to_follow``), so a loader decides the same way with or without one.

Importable without ComfyUI: inside ComfyUI, ``comfy.model_management`` is already loaded and its device list
(``get_all_torch_devices``, ComfyUI 2026) is used when it exists; outside, it is never imported (importing it
probes devices and parses ComfyUI's command line).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass, replace

from mgpu.planning.devices import Device, format_bytes, gpus, host, inventory, reclaim
from mgpu.errors import MgpuError, PlanError
from mgpu.planning.estimates import CUDA_CONTEXT_BYTES, Workload
from mgpu.planning.partition import Component, Policy, make_plan

log = logging.getLogger("mgpu")

AUTO, CPU, FSDP = "auto", "cpu", "fsdp"
SPLIT = "split"   # a plan strategy: a text encoder's layers, or a VAE's decode tiles, over several GPUs
ROLES = ("dit", "text_encoder", "vae")
NODE_OF_ROLE = {"dit": "MGPU Load Diffusion Model", "text_encoder": "MGPU Load Text Encoder", "vae": "MGPU Load VAE"}
_LABEL_OF_ROLE = {"dit": "diffusion model", "text_encoder": "text encoder", "vae": "VAE"}
# Weight dtypes a plan can ask a loader to recast to (ComfyUI's UNETLoader names); anything else is "as stored".
RECAST_DTYPES = ("fp8_e4m3fn", "fp8_e5m2")
# FSDP with no GPU: gloo ranks on the CPU. Correct but slow; it exists so workflows can be tried anywhere.
CPU_FSDP_RANKS = 2


@dataclass
class Choice:
    """What a loader should do: ``strategy`` "single" | "cpu" | "fsdp" | "offload" on ``devices``.

    ``devices``: one entry for single/cpu, one per rank for fsdp, [compute GPU, "cpu"] for offload.
    ``weight_dtype``: the recast the plan sized the model for (one of RECAST_DTYPES), None = as stored.
    """

    strategy: str
    devices: list[str]
    weight_dtype: str | None
    reason: str
    # fsdp: False keeps the gathered weights between steps (the plan's call)
    reshard_after_forward: bool = True
    # fsdp: the sequence-parallel degree the plan has the ranks set up (mgpu.planning.partition.sequence_degree)
    sp_degree: int | None = None


# --- the machine --------------------------------------------------------------------------------------------------

def _comfy_device_ids() -> list[str] | None:
    """ComfyUI's own GPU list when this ComfyUI has one (2026+), else None."""
    mm = sys.modules.get("comfy.model_management")
    list_devices = getattr(mm, "get_all_torch_devices", None)
    if list_devices is None:
        return None
    try:
        return [str(d) for d in list_devices() if str(d).startswith("cuda:")]
    except Exception as exc:  # a ComfyUI whose device query breaks must not break our nodes
        log.warning("MGPU: comfy.model_management.get_all_torch_devices() failed (%s); using NVML/torch instead", exc)
        return None


def _comfy_record(device_id: str) -> Device:
    """A GPU ComfyUI knows but NVML/torch did not list: memory as ComfyUI reports it."""
    import torch

    mm = sys.modules["comfy.model_management"]
    dev = torch.device(device_id)
    return Device(id=device_id, kind="cuda", index=dev.index, name=str(mm.get_torch_device_name(dev)),
                  total_bytes=int(mm.get_total_memory(dev)), free_bytes=int(mm.get_free_memory(dev)), source="torch")


def _probe(own_pids: Collection[int] = ()) -> list[Device]:
    found = inventory(own_pids=own_pids)
    ids = _comfy_device_ids()
    if ids is None:
        return found
    by_id = {d.id: d for d in found}
    listed = [by_id[i] if i in by_id else _comfy_record(i) for i in ids]
    return listed + [h for h in [host(found)] if h]


@functools.cache
def _live_gpu_ids() -> tuple[str, ...]:
    """GPU ids, read once: ComfyUI asks for a node's inputs on every /object_info and validation, and GPUs do
    not come and go while it runs. A broken NVML or MGPU_DEVICES leaves cpu only, said in one log line."""
    try:
        return tuple(d.id for d in gpus(_probe()))
    except Exception as exc:
        log.warning("MGPU: cannot list GPUs (%s); device choices offer cpu only", exc)
        return ()


def live_devices() -> list[Device]:
    """This machine's GPUs with their current free memory, then the host. Never raises for a missing driver.

    Without GPUs at the first look, only host RAM is read again: no repeated driver probing, and no repeated
    "no GPU" warning each time the web page refreshes its device labels.
    """
    return _probe() if _live_gpu_ids() else inventory(CPU)


def available_devices(replacing: Collection[str] = ()) -> list[Device]:
    """``live_devices`` as a plan may use them: what this pack's rank processes hold on each GPU (NVML, per process)
    and ComfyUI's cached models there count as available (``Device.reclaimable_bytes``), less what the loaded
    models other than those of ``replacing`` (checkpoint paths the caller's loads replace) keep on their ranks; the
    host's own context is added back where the plan counts it itself. A re-plan then does not count our own shards,
    contexts and communicators as someone else's."""
    from . import pools   # imports torch: only when planning for this machine

    devices = _probe(pools.rank_pids()) if _live_gpu_ids() else inventory(CPU)
    change = comfyui_held()
    for device in host_context_gpus(devices):   # in use now; the plan counts it itself (Policy.host_context_gpus)
        change[device] = change.get(device, 0) + CUDA_CONTEXT_BYTES
    for device, nbytes in pools.staying_bytes(replacing).items():
        change[device] = change.get(device, 0) - nbytes
    return reclaim(devices, change)


def comfyui_held() -> dict[str, int]:
    """Per GPU, the bytes of the models ComfyUI's model management holds there now, which it unloads when a load
    needs the room; {} outside ComfyUI."""
    mm = sys.modules.get("comfy.model_management")
    held: dict[str, int] = {}
    for loaded in list(getattr(mm, "current_loaded_models", ())):
        try:
            device, nbytes = str(loaded.device), int(loaded.model_loaded_memory()) if loaded.model is not None else 0
        except Exception:   # noqa: BLE001 - a model being unloaded on another thread: it holds nothing to count
            continue
        if device.startswith("cuda:") and nbytes > 0:
            held[device] = held.get(device, 0) + nbytes
    return held


def host_context_gpus(devices: list[Device]) -> tuple[str, ...]:
    """The GPUs of ``devices`` on which this ComfyUI process keeps a CUDA context while it runs: every GPU when
    ComfyUI 0.33's dynamic VRAM is on (main.py: comfy-aimdo's ``init_devices`` over every GPU torch lists, when
    ``enables_dynamic_vram()`` (no --disable-dynamic-vram, --highvram, --gpu-only, --novram, --cpu), an NVIDIA GPU
    and torch >= 2.8, or --enable-dynamic-vram; it sets ``comfy.memory_management.aimdo_enabled``), else its main
    GPU, whose memory it reads at import. None outside ComfyUI or on a CPU-only ComfyUI."""
    mm = sys.modules.get("comfy.model_management")
    if mm is None:
        return ()
    ids = [d.id for d in gpus(devices)]
    if getattr(sys.modules.get("comfy.memory_management"), "aimdo_enabled", False):
        return tuple(ids)
    try:
        main = str(mm.get_torch_device())
    except Exception:   # noqa: BLE001 - a ComfyUI whose device query breaks: nothing known
        return ()
    return (main,) if main in ids else ()


def device_choices(include_fsdp: bool = True, devices: list[Device] | None = None) -> list[str]:
    """Combo values: "auto", "cpu", "cuda:0", ... in ordinal order, then "fsdp" (also offered without GPUs:
    it then runs gloo ranks on the CPU). ``devices`` replaces the live machine (tests, simulated specs)."""
    ids = _live_gpu_ids() if devices is None else tuple(d.id for d in gpus(devices))
    return [AUTO, CPU, *ids, *([FSDP] if include_fsdp else [])]


def describe(device: Device) -> str:
    """ "cuda:0 NVIDIA RTX 4090, 22.1 GiB free of 24 GiB": what a label and an error message show."""
    return f"{device.id} {device.name}, {format_bytes(device.free_bytes)} free of {format_bytes(device.total_bytes)}"


def choice_labels(include_fsdp: bool = True, devices: list[Device] | None = None) -> dict[str, str]:
    """Combo value -> label for the web extension; values stay as ``device_choices`` gives them."""
    devices = live_devices() if devices is None else devices
    by_id = {d.id: d for d in devices}
    gpu_list = gpus(devices)
    labels = {AUTO: "auto (follows the plan)"}
    for value in device_choices(include_fsdp, devices):
        if value in by_id:
            labels[value] = describe(by_id[value])
    if include_fsdp:
        labels[FSDP] = (f"fsdp (shard over {len(gpu_list)} GPUs)" if gpu_list
                        else f"fsdp ({CPU_FSDP_RANKS} CPU ranks, slow: no GPU)")
    labels.setdefault(CPU, "cpu")
    return labels


# --- resolving a choice -------------------------------------------------------------------------------------------

def _machine(devices: list[Device]) -> str:
    return "; ".join(describe(d) for d in devices) or "no devices"


def _node(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    return NODE_OF_ROLE[role]


def _check_exists(role: str, wanted: list[str], devices: list[Device], choices: list[str], why: str) -> None:
    known = {d.id for d in devices} | {CPU}
    missing = [w for w in wanted if w not in known]
    if missing:
        names = list(dict.fromkeys(missing))
        what = f"device {names[0]} does not" if len(names) == 1 else f"devices {', '.join(names)} do not"
        raise MgpuError(f"{_node(role)}: {what} exist{why}; "
                        f"this machine has {_machine(devices)}; pick one of {', '.join(choices)}")


def _recast(dtype: str | None) -> str | None:
    return dtype if dtype in RECAST_DTYPES else None


def is_own(plan) -> bool:
    """Whether ``plan`` is a loader's own (``plan_to_follow``), not an MGPU Plan's."""
    return bool(plan.policy.get("implicit"))


def _fsdp(role: str, plan, devices: list[Device], choices: list[str]) -> Choice:
    placed = plan.placement("dit") if plan is not None else None
    if placed is None or placed.strategy != "fsdp":
        raise ValueError("fsdp follows a plan that shards the DiT: loaders.placement.plan_to_follow gives one")
    _check_exists(role, placed.devices, devices, choices, " (the MGPU Plan shards the DiT over it)")
    n, on = len(placed.devices), ", ".join(placed.devices)
    reason = (f"fsdp over the plan's {n} GPUs: {on}" if not is_own(plan)
              else f"fsdp over {n} GPUs: {on}" if placed.devices[0] != CPU
              else f"no GPU: fsdp over {n} CPU ranks (gloo; correct but slow)")
    return Choice("fsdp", list(placed.devices), _recast(placed.weight_dtype), reason, placed.reshard_after_forward,
                  placed.sp_degree)


def _auto(role: str, plan, devices: list[Device], choices: list[str]) -> Choice:
    placed = plan.placement(role) if plan is not None else None
    if placed is None:
        raise ValueError(f"auto follows a plan that places the {_LABEL_OF_ROLE[role]}: "
                         "loaders.placement.plan_to_follow gives one")
    following = "following a plan for this file alone" if is_own(plan) else "following the plan"
    if role == "vae" and placed.strategy == SPLIT:
        return _split_decode_home(placed, devices, choices, following)
    _check_exists(role, placed.devices, devices, choices,
                  f" (the MGPU Plan places the {_LABEL_OF_ROLE[role]} there: make the plan with devices "
                  f"'auto' for this machine, or pick a device on this node)")
    fsdp = placed.strategy == "fsdp"
    return Choice(placed.strategy, list(placed.devices), _recast(placed.weight_dtype),
                  f"auto: {following} ({placed.strategy} on {', '.join(placed.devices)})",
                  placed.reshard_after_forward if fsdp else True, placed.sp_degree if fsdp else None)


def _split_decode_home(placed, devices: list[Device], choices: list[str], following: str) -> Choice:
    """A plan that splits the VAE's decode over several GPUs (MGPU VAE Decode) loads the VAE on the first of them;
    the others get their copies from MGPU VAE Decode, which checks them itself."""
    home = placed.devices[0]
    _check_exists("vae", [home], devices, choices,
                  " (the MGPU Plan loads the VAE there: make the plan with devices 'auto' for this machine, or pick "
                  "a device on this node)")
    return Choice("single", [home], None, f"auto: {following} (the VAE on {home}; MGPU VAE Decode splits "
                                          f"its decode over {', '.join(placed.devices)})")


def check_plan_file(plan, role: str, path: str) -> None:
    """Refuse a connected plan made for another file than the one this loader loads: its placement and memory
    numbers are that file's, and following them would load a model nobody planned. A two-expert plan names two
    DiT files, and either loader may load either."""
    if plan is None:
        return
    roles = ("dit", "dit_low_noise") if role == "dit" else (role,)
    planned = [p.file for p in plan.placements if p.role in roles]
    if not planned or any(os.path.realpath(f) == os.path.realpath(path) for f in planned):
        return
    names = " and ".join(os.path.basename(f) for f in planned)
    raise MgpuError(f"{_node(role)}: the connected MGPU Plan was made for {names}, and this loader loads "
                    f"{os.path.basename(path)}: the plan's devices and memory are that file's. Pick the same file in "
                    "MGPU Plan and here, or disconnect the plan")


def plan_to_follow(role: str, path: str, choice: str, plan=None, *, weight_dtype: str | None = None,
                   fsdp_ranks: int = 0, devices: list[Device] | None = None):
    """The one plan the loader for ``role`` follows with device ``choice``: the connected MGPU Plan where it decides
    for this loader, else the loader's own (``Policy.implicit``), made by the planner MGPU Plan uses
    (``partition.make_plan``, the file sized as ``model_files.make_plan_for`` sizes it) for what the loader knows: its
    own file at ``path`` (``weight_dtype``: the node's,
    one of ``model_files.DIT_DTYPES``; "default": the connected plan's recast, or as stored), the connected plan's
    workload and policy or the defaults, and this machine as ``available_devices`` sees it (``devices`` replaces it:
    tests). ``resolve(choice, role, plan)`` then decides with the same code either way. An explicit device needs no
    plan: ``plan`` comes back as it is.

    A DiT on fsdp, or a plan sharding it over other ranks than ``fsdp_ranks`` keeps (``pools.fsdp_devices``), gets a
    plan for exactly those ranks (``Policy.fsdp_devices``): the connected plan's group, else every GPU, else cpu
    ranks. The loader's own plan is logged with its reasons, after why it was made ("no MGPU Plan: ...")."""
    from . import model_files as mf   # it imports this module

    if choice not in (AUTO, FSDP):
        return plan
    placed = plan.placement(role) if plan is not None else None
    if placed is not None and (choice == AUTO or placed.strategy == "fsdp"):
        followed, why = plan, None
    else:
        followed = None
        why = ("no MGPU Plan" if plan is None else f"the MGPU Plan does not place the {_LABEL_OF_ROLE[role]}"
               if placed is None else "the MGPU Plan does not shard the DiT (device fsdp chosen here)")
    machine: list[Device] = []

    def this_machine() -> list[Device]:
        if not machine:   # read once, and only when a plan is made
            machine.extend(available_devices() if devices is None else devices)
        return machine

    def own(fsdp_devices: list[str] = ()):
        """The loader's own plan for its file alone; sharded over ``fsdp_devices`` if given."""
        dtype = None
        if role == "dit":
            dtype = (weight_dtype if weight_dtype not in (None, "default")
                     else _recast(placed.weight_dtype) if placed is not None else None)
        policy = replace(Policy(**plan.policy) if plan is not None else Policy(), implicit=True,
                         host_context_gpus=host_context_gpus(this_machine()), fsdp_devices=tuple(fsdp_devices))
        workload = Workload.from_dict(plan.workload) if plan is not None else Workload()
        try:
            return make_plan([Component(role, mf.component_size(role, path), dtype)], this_machine(), workload,
                             policy)
        except PlanError as exc:
            raise PlanError(f"{_node(role)}: {why}: {exc}", exc.needs) from None

    if followed is None and not (role == "dit" and choice == FSDP):
        followed = own()
    if role == "dit":
        sharded = followed.placement("dit") if followed is not None else None
        group = (list(sharded.devices) if sharded is not None and sharded.strategy == "fsdp"
                 else None if followed is not None   # auto, and the plan does not shard it
                 else [d.id for d in gpus(this_machine())] or [CPU] * CPU_FSDP_RANKS)   # fsdp: every GPU, or cpu
        if group is not None:
            from . import pools   # imports torch: only for a sharded DiT

            ranks = pools.fsdp_devices(group, fsdp_ranks)
            if followed is None or ranks != group:
                why = why or f"fsdp_ranks {fsdp_ranks}: {len(ranks)} ranks where the MGPU Plan has {len(group)}"
                followed = own(ranks)
    if why is not None:
        from mgpu.weights.quant import FP8_COMPUTE   # imports torch, as the plan's fp8 line did

        for reason in followed.placement(role).reasons:
            if role == "dit" and reason.startswith(FP8_COMPUTE):
                continue   # the load logs what the ranks compute fp8 with, from the ranks themselves
            log.info("%s: %s: %s", _node(role), why, reason)
    return followed


def resolve(choice: str, role: str, plan=None, devices: list[Device] | None = None) -> Choice:
    """Turn a combo value into what the loader for ``role`` ("dit" | "text_encoder" | "vae") does.

    explicit "cuda:N" -> single on it; "cpu" -> cpu; "fsdp" (DiT only) -> the plan's FSDP group; "auto" -> the
    plan's placement for the role. ``plan`` is an ``mgpu.planning.partition.Plan``: for auto and fsdp the one
    ``plan_to_follow`` gives, connected or the loader's own; ``devices`` replaces the live machine (tests).
    Raises MgpuError naming the node, the device and the choices when a device does not exist here.
    """
    node = _node(role)
    devices = live_devices() if devices is None else devices
    choices = device_choices(role == "dit", devices)
    if choice == AUTO:
        return _auto(role, plan, devices, choices)
    if choice == FSDP:
        if role != "dit":
            raise MgpuError(f"{node}: fsdp shards only the diffusion model; pick one of {', '.join(choices)}")
        return _fsdp(role, plan, devices, choices)
    if choice == CPU:
        return Choice("cpu", [CPU], None, "cpu, as chosen")
    if isinstance(choice, str) and choice.startswith("cuda:"):
        _check_exists(role, [choice], devices, choices, "")
        return Choice("single", [choice], None, f"{choice}, as chosen")
    raise MgpuError(f"{node}: {choice!r} is not a device choice; pick one of {', '.join(choices)}")
