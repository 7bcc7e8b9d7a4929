"""A module's layers placed on several devices in order, each computing where its weights are.

For text encoders too big for one GPU (LTX-2's Gemma 3 12B, 24 GB in bf16; UMT5-XXL on small GPUs): no sharding,
no pipelining, just each layer on a device with room for it. The units are the repeated blocks (the members of any
``ModuleList`` of two or more modules of one class: T5Block, Gemma's decoder layers, CLIP's layers) and, outside
them, the largest parts that contain no block (embeddings, final norms, projections), in registration order.

Forward hooks on each unit move the unit's inputs to its device (accelerate's ``send_to_device``, which walks nested
arguments) and its outputs back to the device they came from, so the activations between units stay on the first
device: code between units (attention masks, the intermediate layers ComfyUI collects for LTX-2, in-place adds) sees
one device, for the cost of two copies of the activations per unit. accelerate's ``dispatch_model`` and
``infer_auto_device_map`` are not used: the first treats "cpu" entries as offload (weights on meta, streamed), wraps
``.to()`` with warnings (the host that owns the module, ComfyUI, moves it to host RAM to free the devices) and
replaces each unit's ``forward`` with a closure over the unit, a reference cycle that keeps a dropped encoder alive
until a full garbage collection (ComfyUI reports it as a leak); the second reserves the largest layer on the first
GPU for CPU offload and names devices by CUDA ordinal only. ``split_in_order`` (shared with the planner) makes the
map instead; torch's own hook registry holds the hooks, which reference no module.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from mgpu.errors import ShardingError
from mgpu.planning.devices import format_bytes
from mgpu.planning.partition import split_in_order


@dataclass
class Unit:
    """One placed part: ``name`` in the split module, its weight bytes and its device index. ``whole`` False: a
    container of blocks whose own tensors stay on the first device, unhooked (its forward runs there)."""

    name: str
    nbytes: int
    device: int
    whole: bool = True


def _tensor_bytes(module: torch.nn.Module, recurse: bool) -> int:
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    return sum(t.numel() * t.element_size() for t in tensors)


def block_classes(module: torch.nn.Module) -> set[type]:
    """Classes of repeated blocks: the members of every ModuleList of two or more modules of one class."""
    found = set()
    for m in module.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            found.add(type(m[0]))
    return found


def units_of(module: torch.nn.Module) -> list[tuple[str, int, bool]]:
    """(name, bytes, whole) of each unit in registration order (see the module docstring)."""
    blocks = block_classes(module)
    out: list[tuple[str, int, bool]] = []

    def walk(name: str, m: torch.nn.Module) -> None:
        if type(m) in blocks or not any(type(c) in blocks for c in m.modules()):
            if size := _tensor_bytes(m, recurse=True):
                out.append((name, size, True))
            return
        if size := _tensor_bytes(m, recurse=False):
            out.append((name, size, False))
        for child, sub in m.named_children():
            walk(f"{name}.{child}" if name else child, sub)

    walk("", module)
    return out


class _OnDevice:
    """A unit's forward hooks: inputs to ``device``, outputs back to the device of the first input tensor. On a GPU
    the unit also runs with its device current: kernels that launch on the current device (Triton's, e.g. sage
    attention) would otherwise run on the first GPU with the unit's tensors on another."""

    def __init__(self, device: torch.device):
        self.device = device
        self._calls: list[tuple[torch.device | None, int | None]] = []   # a stack: units may nest

    def pre(self, module, args, kwargs):
        from accelerate.utils import find_device, send_to_device

        on_gpu = self.device.type == "cuda" and self.device.index is not None
        current = torch.cuda.current_device() if on_gpu else None
        self._calls.append((find_device([args, kwargs]), current))
        if current is not None and current != self.device.index:
            torch.cuda.set_device(self.device)
        return send_to_device(args, self.device), send_to_device(kwargs, self.device)

    def post(self, module, args, kwargs, output):
        from accelerate.utils import send_to_device

        came_from, current = self._calls.pop() if self._calls else (None, None)
        if current is not None:
            torch.cuda.set_device(current)
        return output if came_from is None or output is None else send_to_device(output, came_from)


class LayerSplit:
    """Where each unit of one module lives. ``placed``: the units are on their devices now (the owner clears it
    when it moves the module elsewhere, e.g. to host RAM)."""

    def __init__(self, devices: list[str], units: list[Unit]):
        self.devices = list(devices)
        self.units = units
        self.placed = False
        self._hooks: dict[str, _OnDevice] = {}

    @classmethod
    def plan(cls, module: torch.nn.Module, devices: list[str], capacities: list[int], what: str) -> LayerSplit:
        """Units over ``devices`` in order, each device's bytes proportional to its capacity and within it.
        Raises ShardingError naming ``what``, each device's room and the total when they do not fit."""
        if len(devices) != len(capacities) or not devices:
            raise ValueError(f"{len(devices)} devices but {len(capacities)} capacities")
        parts = units_of(module)
        index = split_in_order([size for _, size, whole in parts if whole], capacities)
        if index is None:
            total = sum(size for _, size, _ in parts)
            rooms = ", ".join(f"{d} {format_bytes(c)}" for d, c in zip(devices, capacities))
            raise ShardingError(f"{what} ({format_bytes(total)} of weights) does not fit on {', '.join(devices)}: "
                                f"they have room for {rooms}")
        placed = iter(index)
        units = [Unit(name, size, next(placed) if whole else 0, whole) for name, size, whole in parts]
        return cls(devices, units)

    def bytes_per_device(self) -> list[int]:
        out = [0] * len(self.devices)
        for u in self.units:
            out[u.device] += u.nbytes
        return out

    def describe(self) -> str:
        """ "cuda:0 11.2 GiB (25 parts), cuda:1 11.9 GiB (24 parts)": what the loader logs."""
        parts = Counter(u.device for u in self.units)
        return ", ".join(f"{d} {format_bytes(b)} ({parts[i]} parts)"
                         for i, (d, b) in enumerate(zip(self.devices, self.bytes_per_device())))

    def place(self, module: torch.nn.Module) -> None:
        """Each unit on its device (no-op for those already there); hooks attached the first time."""
        from accelerate.utils import set_module_tensor_to_device

        for u in self.units:
            sub = module.get_submodule(u.name)
            device = torch.device(self.devices[u.device])
            if not u.whole:
                for key, _ in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
                    set_module_tensor_to_device(sub, key, device)
                continue
            sub.to(device)
            if u.name not in self._hooks:
                hook = self._hooks[u.name] = _OnDevice(device)
                sub.register_forward_pre_hook(hook.pre, with_kwargs=True)
                sub.register_forward_hook(hook.post, with_kwargs=True, always_call=True)
        self.placed = True

    def where(self, module: torch.nn.Module) -> dict[str, list[str]]:
        """Unit name -> the devices its tensors are on now (one entry when placed)."""
        out = {}
        for u in self.units:
            sub = module.get_submodule(u.name)
            tensors = [*sub.parameters(recurse=u.whole), *sub.buffers(recurse=u.whole)]
            out[u.name] = sorted({str(t.device) for t in tensors})
        return out

    def execution_devices(self) -> dict[str, str]:
        """Unit name -> the device its hooks compute on (once placed)."""
        return {name: str(hook.device) for name, hook in self._hooks.items()}
