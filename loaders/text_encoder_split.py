"""ComfyUI's CLIP with its encoder's layers split over several devices (``mgpu.sharding.layer_split``).

The CLIP stays ComfyUI's own (tokenizer, encode path, conditioning); only its ModelPatcher changes.
``SplitModelPatcher`` (carried through ``clone()``, as ComfyUI-GGUF carries its state) loads by placing each unit
on its device instead of moving the module to ``load_device``, patches LoRA weights on the device each weight lives
on, and never unloads partly: when ComfyUI unloads it (to make room, or "Unload models" / POST /free) every device
is released to the offload device (host RAM). ``DeviceShare`` patchers stand for what the encoder holds on each
other device, so ComfyUI's model management sees the right bytes on the right devices: loading the encoder first
frees room on each of them, and making room on any of them (for the DiT) unloads the whole encoder.
"""

from __future__ import annotations

import logging
import weakref

import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils
import torch
from comfy.patcher_extension import CallbacksMP

from mgpu.planning.devices import format_bytes
from mgpu.sharding.layer_split import LayerSplit, units_of

log = logging.getLogger("mgpu")

_live: weakref.WeakSet = weakref.WeakSet()   # every SplitModelPatcher, for release_all


class SplitModelPatcher(comfy.model_patcher.ModelPatcher):
    """A CLIP's ModelPatcher whose model is placed by ``split``; ``load_device`` is the split's first device, where
    ComfyUI makes the tokens and the activations return between units."""

    split: LayerSplit

    @classmethod
    def adopt(cls, patcher: comfy.model_patcher.ModelPatcher, split: LayerSplit) -> SplitModelPatcher:
        """A SplitModelPatcher with everything ``patcher`` carries (a clone, re-classed)."""
        n = patcher.clone()
        n.__class__ = cls
        n.parent = None
        n.load_device = torch.device(split.devices[0])
        n._adopt(split)
        return n

    def _adopt(self, split: LayerSplit) -> None:
        self.split = split
        self._shares: list[DeviceShare] | None = None
        _live.add(self)

    def clone(self, *args, **kwargs) -> SplitModelPatcher:
        n = super().clone(*args, **kwargs)
        n._adopt(self.split)
        return n

    def model_size(self) -> int:
        """What ComfyUI counts on ``load_device``; the other devices' bytes are the shares'. (ComfyUI 0.3.64 asks
        inside ``__init__``, before ``clone`` hands over the split.)"""
        split = getattr(self, "split", None)
        return split.bytes_per_device()[0] if split is not None else super().model_size()

    def device_shares(self) -> list[DeviceShare]:
        """One per device after the first. A clone's shares have the parent's as parents, so when the clone is
        dropped ComfyUI's records follow the parent's, as its record of the clone itself does."""
        if self._shares is None:
            parent = self.parent if isinstance(self.parent, SplitModelPatcher) and self.parent.split is self.split \
                else None
            parents = parent.device_shares() if parent is not None else [None] * (len(self.split.devices) - 1)
            self._shares = [DeviceShare(self, i, parents[i - 1]) for i in range(1, len(self.split.devices))]
        return self._shares

    def model_patches_models(self) -> list:
        """ComfyUI loads these with the patcher (comfy.model_management.load_models_gpu): the device shares."""
        return super().model_patches_models() + self.device_shares()

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False) -> None:
        """Place every unit on its device and patch the weights there; never partly (the split was sized to fit)."""
        with self.use_ejected():
            self.unpatch_hooks()
            if self.model.current_weight_patches_uuid not in (None, self.patches_uuid):
                self.unpatch_model(None)   # another patch set's weights: back to the originals first
            self.split.place(self.model)
            if self.model.current_weight_patches_uuid != self.patches_uuid:
                for key in self.patches:
                    self.patch_weight_to_device(key, device_to=comfy.utils.get_attr(self.model, key).device)
            self.model.model_lowvram = False
            self.model.lowvram_patch_counter = 0
            self.model.device = self.load_device
            self.model.model_loaded_weight_memory = self.model_size()
            self.model.current_weight_patches_uuid = self.patches_uuid
            for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
                callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)
            self.apply_hooks(self.forced_hooks, force_apply=True)

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False) -> int:
        """ComfyUI's, except that another patch set (a LoRA'd clone) only restores the patched weights instead of
        moving the whole encoder to host RAM and back (ComfyUI's unpatch with its offload device)."""
        current = self.model.current_weight_patches_uuid
        if current is not None and (current != self.patches_uuid or force_patch_weights):
            self.unpatch_model(None)
        return super().partially_load(device_to, extra_memory, force_patch_weights)

    def unpatch_model(self, device_to=None, unpatch_weights=True) -> None:
        """ComfyUI's, which moves the whole module to ``device_to`` (release); restored weights are on the offload
        device: either way the units are no longer where the split put them."""
        super().unpatch_model(device_to, unpatch_weights)
        if unpatch_weights:
            self.split.placed = False

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs) -> int:
        """Nothing: a split encoder is loaded whole or not at all, so ComfyUI unloads it from every device."""
        return 0

    def release(self) -> None:
        """Every device's part to host RAM (ComfyUI's detach), LoRA weights restored."""
        if self.split.placed:
            log.info("MGPU: text encoder released from %s", ", ".join(dict.fromkeys(self.split.devices)))
            self.detach(unpatch_all=True)


class _Share(torch.nn.Module):
    """The model ComfyUI's LoadedModel tracks for a DeviceShare: holds nothing itself. A clone's share has its
    parent's, so ComfyUI's record outlives the clone (it keeps a record only while its model lives)."""


class DeviceShare(comfy.model_patcher.ModelPatcher):
    """The part of a split encoder on its device ``index`` (> 0), as ComfyUI's model management sees it: loaded
    while the encoder is placed; unloading it (ComfyUI making room there) releases the whole encoder."""

    def __init__(self, owner: SplitModelPatcher, index: int, parent: DeviceShare | None):
        self.split, self.index = owner.split, index
        self._owner = weakref.ref(owner)
        super().__init__(parent.model if parent is not None else _Share(),
                         load_device=torch.device(owner.split.devices[index]),
                         offload_device=owner.offload_device, size=owner.split.bytes_per_device()[index])
        self.parent = parent

    def model_size(self) -> int:
        return self.split.bytes_per_device()[self.index]

    def loaded_size(self) -> int:
        return self.model_size() if self.split.placed else 0

    def current_loaded_device(self) -> torch.device:
        return self.load_device

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False) -> int:
        return 0   # the owner places every part

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs) -> int:
        return 0

    def detach(self, unpatch_all=True):
        owner = self._owner()
        if unpatch_all and owner is not None:
            owner.release()
        return self.model


def _forget(patcher: comfy.model_patcher.ModelPatcher) -> None:
    """Drop ComfyUI's record of the CLIP's own patcher (CLIP() loads it at once when its device is the initial
    one): the split patcher replaces it, and a record of a dead patcher reads as a leak to ComfyUI."""
    for i in reversed(range(len(mm.current_loaded_models))):
        if mm.current_loaded_models[i].model is patcher:
            mm.current_loaded_models.pop(i).model_unload()


def room_on(devices: list[str], total: int, largest: int) -> list[int]:
    """Weight bytes each device can take now: a GPU's free memory plus what ComfyUI's models hold there (it unloads
    them to load the encoder's part), less ComfyUI's minimum inference memory. CPU entries (no GPU: a split only in
    name, for trying workflows) share the weights evenly; the weights are already in host RAM."""
    rooms = []
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cpu":
            rooms.append(-(-total // len(devices)) + largest)
            continue
        held = sum(m.model_loaded_memory() for m in mm.current_loaded_models if m.model is not None and m.device == dev)
        rooms.append(max(0, int(mm.get_free_memory(dev) + held - mm.minimum_inference_memory())))
    return rooms


def split_clip(clip, devices: list[str], planned: list[int] | None, what: str):
    """``clip`` (built on the offload device) with its encoder split over ``devices`` in order: each device's share
    in proportion to ``planned`` (an MGPU Plan's bytes per device, from the header) when given, else to the memory
    free on it now (``room_on``). Raises ShardingError when it does not fit."""
    model = clip.cond_stage_model
    units = [size for _, size, _ in units_of(model)]
    total, largest = sum(units), max(units, default=0)
    if planned and sum(planned):   # header bytes to module bytes, with room for where unit boundaries fall
        rooms = [-(-b * (total + len(planned) * largest) // sum(planned)) for b in planned]
    else:
        rooms = room_on(devices, total, largest)
    split = LayerSplit.plan(model, devices, rooms, what)
    stock = clip.patcher
    clip.patcher = SplitModelPatcher.adopt(stock, split)
    _forget(stock)
    log.info("%s: %s of weights split over %s", what, format_bytes(total), split.describe())
    return clip


def release_all() -> None:
    """Every split encoder's devices released (ComfyUI 0.3.x's "Unload models" frees only its main device)."""
    for patcher in list(_live):
        patcher.release()
