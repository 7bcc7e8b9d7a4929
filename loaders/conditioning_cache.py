"""Text encoder outputs kept in host RAM by what was encoded, so a prompt queued again with the same text neither
loads nor runs the encoder (LTX-2's Gemma 3 12B is 24 GB to move to the GPUs).

MGPU Load Text Encoder returns ComfyUI's CLIP as ``CachedCLIP``: the same object with a subclass whose
``encode_from_tokens`` looks here first. That is the path of stock CLIPTextEncode (through
``encode_from_tokens_scheduled``, ComfyUI 0.3.64 and 0.33) and of the other text nodes; ``clone()`` keeps the
subclass, so CLIPs from CLIPSetLastLayer or LoraLoader are cached too. The key hashes (xxh3-128):

* the encoder: its files with size and modification time, the CLIP type, the devices;
* the tokens: the prompt text as the tokenizer and its options made it, weights and embeddings included;
* the layer (clip skip) and the output form asked for;
* the weight patches: ``patches_uuid``, which ComfyUI renews whenever patches are added (a LoRA'd CLIP never hits
  an entry of the CLIP without it; loading the same LoRA again is a new key).

Object patches of plain values (ComfyUI 0.33 sets ``manual_cast_dtype``) are part of the key; CLIPs carrying
hooks, weight wrappers or other object patches are not cached (their output depends on more than the key holds).
Entries are CPU copies, least recently used dropped first beyond MGPU_CONDITIONING_CACHE_MB (default 1024; 0 turns
the cache off); a hit returns fresh copies on the devices the encoder gave.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import OrderedDict
from typing import Any

import torch
import xxhash

log = logging.getLogger("mgpu")

DEFAULT_MB = 1024


class Uncacheable(Exception):
    """A value the key cannot describe exactly (an object of unknown type)."""


def _feed(h, value: Any) -> None:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"tensor:{t.dtype}:{tuple(value.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}:{len(value)}[".encode())
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(value, dict):
        h.update(f"dict:{len(value)}{{".encode())
        for k in sorted(value, key=repr):
            _feed(h, k)
            _feed(h, value[k])
        h.update(b"}")
    else:
        raise Uncacheable(type(value).__name__)


def digest(value: Any) -> str:
    """A hash of nested None/bool/int/float/str/dtype/device/tensor/list/tuple/dict values; Uncacheable for
    anything else."""
    h = xxhash.xxh3_128()
    _feed(h, value)
    return h.hexdigest()


class _OnDevice:
    """A stored tensor and the device to hand it back on."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach().to("cpu", copy=True)
        self.device = tensor.device


def _map(value: Any, fn) -> Any:
    if isinstance(value, (torch.Tensor, _OnDevice)):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


class HostCache:
    """An LRU of encoder outputs in host RAM, bounded by their tensor bytes. Thread-safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        """Fresh copies of the stored value on its devices, or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
        return _map(entry[0], lambda s: s.tensor.to(s.device, copy=True))

    def put(self, key: str, value: Any) -> None:
        sizes: list[int] = []
        stored = _map(value, lambda t: sizes.append(t.numel() * t.element_size()) or _OnDevice(t))
        nbytes = sum(sizes)
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                self._bytes -= self._entries.pop(key)[1]
            self._entries[key] = (stored, nbytes)
            self._bytes += nbytes
            while self._bytes > self.max_bytes:
                self._bytes -= self._entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


CACHE = HostCache(int(float(os.environ.get("MGPU_CONDITIONING_CACHE_MB", DEFAULT_MB)) * (1 << 20)))


def encoder_key(paths: list[str], clip_type: str, devices: list[str]) -> tuple:
    """What names one loaded encoder: a replaced file (other size or time) is another encoder."""
    files = tuple((p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths)
    return files, clip_type, tuple(devices)


def clip_key(clip, tokens: Any, return_pooled: Any, return_dict: bool) -> str | None:
    """The cache key of one encode, or None when this CLIP's output depends on more than the key holds."""
    patcher = clip.patcher
    if (patcher.forced_hooks is not None or getattr(clip, "apply_hooks_to_conds", None)
            or patcher.weight_wrapper_patches or patcher.hook_patches):
        return None
    patches = str(patcher.patches_uuid) if patcher.patches else None
    try:   # object patches of plain values (ComfyUI 0.33's manual_cast_dtype) are part of the key; others bypass
        return digest([list(clip.mgpu_encoder_key), clip.layer_idx, return_pooled, return_dict, patches,
                       patcher.object_patches, tokens])
    except Uncacheable:
        return None


@functools.cache
def cached_clip_class() -> type:
    """``comfy.sd.CLIP`` whose encode looks in CACHE first (defined once ComfyUI is importable)."""
    import comfy.sd

    class CachedCLIP(comfy.sd.CLIP):
        mgpu_encoder_key: tuple

        def clone(self, *args, **kwargs):
            n = super().clone(*args, **kwargs)
            n.__class__ = type(self)
            n.mgpu_encoder_key = self.mgpu_encoder_key
            return n

        def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
            key = clip_key(self, tokens, return_pooled, return_dict) if CACHE.max_bytes > 0 else None
            if key is not None and (hit := CACHE.get(key)) is not None:
                log.info("MGPU: text encoder output from the cache (same text, encoder and patches)")
                return hit
            out = super().encode_from_tokens(tokens, return_pooled=return_pooled, return_dict=return_dict)
            if key is not None:
                CACHE.put(key, out)
            return out

    return CachedCLIP


def cached(clip, key: tuple):
    """``clip`` itself, its encodes cached under the encoder ``key`` (``encoder_key``)."""
    clip.__class__ = cached_clip_class()
    clip.mgpu_encoder_key = key
    return clip
