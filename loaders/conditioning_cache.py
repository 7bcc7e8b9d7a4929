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

A hit loads nothing, also when ComfyUI runs the loader node again (its plan or another input changed, which drops the
CLIP it returned before): an encoder this process has loaded before comes back ``deferred``, ComfyUI's CLIP (this
subclass) with its tokenizer and the state a fresh load has, whose weights load at the first use that needs them: an
encode not in the cache, ``clone()`` (LoRA loaders, CLIPSetLastLayer), anything reading its patcher or model. Keeping
the old CLIP instead would hold the encoder's GBs in host RAM.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
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


def patcher_facts(patcher) -> str | None:
    """What of an encoder's patcher its output depends on, hashed: the weight patches (``patches_uuid``) and object
    patches of plain values; None when it carries hooks, weight wrappers or other object patches."""
    if patcher.forced_hooks is not None or patcher.weight_wrapper_patches or patcher.hook_patches:
        return None
    try:   # object patches of plain values (ComfyUI 0.33's manual_cast_dtype) are part of the key; others bypass
        return digest([str(patcher.patches_uuid) if patcher.patches else None, patcher.object_patches])
    except Uncacheable:
        return None


def clip_key(clip, tokens: Any, return_pooled: Any, return_dict: bool) -> str | None:
    """The cache key of one encode, or None when this CLIP's output depends on more than the key holds. A CLIP whose
    weights are not loaded yet (``deferred``) has the patcher of a fresh load, whose facts it carries."""
    state = vars(clip)
    if state.get("apply_hooks_to_conds"):
        return None
    facts = patcher_facts(clip.patcher) if "patcher" in state else state["mgpu_fresh_facts"]
    if facts is None:
        return None
    try:
        return digest([list(clip.mgpu_encoder_key), clip.layer_idx, return_pooled, return_dict, facts, tokens])
    except Uncacheable:
        return None


# What a freshly loaded encoder holds that a cache lookup needs and that is no weight (its tokenizer, shared as
# ComfyUI's clone() shares it), and its patcher's facts, for the last few encoders loaded, by encoder key.
_WITHOUT_WEIGHTS = ("tokenizer", "tokenizer_options", "layer_idx", "use_clip_schedule", "apply_hooks_to_conds")
_FRESH_ENCODERS = 8
_fresh: OrderedDict[tuple, tuple[dict, str]] = OrderedDict()
_fresh_lock = threading.Lock()


def _remember(clip, key: tuple) -> None:
    state = vars(clip)
    if not all(a in state for a in _WITHOUT_WEIGHTS):   # a CLIP of another layout: never deferred
        return
    facts = patcher_facts(clip.patcher)
    if facts is None:
        return
    with _fresh_lock:
        _fresh[key] = ({a: state[a] for a in _WITHOUT_WEIGHTS}, facts)
        _fresh.move_to_end(key)
        while len(_fresh) > _FRESH_ENCODERS:
            _fresh.popitem(last=False)


@functools.cache
def cached_clip_class() -> type:
    """``comfy.sd.CLIP`` whose encode looks in CACHE first (defined once ComfyUI is importable)."""
    import comfy.sd

    class CachedCLIP(comfy.sd.CLIP):
        mgpu_encoder_key: tuple

        def __getattr__(self, name):
            # Only for what the instance lacks: the weights (cond_stage_model, patcher) of a ``deferred`` CLIP, which
            # load now. ComfyUI 0.33's bookkeeping of the models a prompt uses (comfy/model_patcher.py:
            # PromptModelTracker.add, is_model_patcher_output) only looks for them: an encoder not loaded has none.
            state = vars(self)
            if "_mgpu_load" not in state or name.startswith("__") or \
                    sys._getframe(1).f_globals.get("__name__") == "comfy.model_patcher":
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            self.mgpu_load_now()
            return getattr(self, name)

        def mgpu_load_now(self) -> None:
            """Load the weights of a ``deferred`` CLIP (nothing if loaded); what was set on it before stays."""
            state = vars(self)
            load = state.pop("_mgpu_load", None)
            if load is None:
                return
            try:
                clip = load()
            except BaseException:
                state["_mgpu_load"] = load   # a later use tries again
                raise
            _remember(clip, self.mgpu_encoder_key)
            for k, v in vars(clip).items():
                state.setdefault(k, v)
            del state["mgpu_fresh_facts"]

        if hasattr(comfy.sd.CLIP, "is_dynamic"):   # ComfyUI 0.33
            def is_dynamic(self):
                # its RAM cache asks every output before each prompt (comfy_execution/caching.py): an encoder not
                # loaded holds no memory to keep
                return "_mgpu_load" not in vars(self) and super().is_dynamic()

        def clone(self, *args, **kwargs):
            n = super().clone(*args, **kwargs)
            n.__class__ = type(self)
            n.mgpu_encoder_key = self.mgpu_encoder_key
            return n

        def encode_from_tokens_scheduled(self, tokens, unprojected=False, add_dict: dict | None = None,
                                         show_pbar=True, **kwargs):
            add_dict = {} if add_dict is None else add_dict
            if "_mgpu_load" not in vars(self) or kwargs:
                return super().encode_from_tokens_scheduled(tokens, unprojected=unprojected, add_dict=add_dict,
                                                            show_pbar=show_pbar, **kwargs)
            # Weights not loaded: a fresh encoder has no hooks (patcher.forced_hooks is None), for which ComfyUI's
            # method (comfy/sd.py, 0.3.64 and 0.33) runs these lines; they read no weights on a cache hit.
            pooled_dict = self.encode_from_tokens(tokens, return_pooled="unprojected" if unprojected else True,
                                                  return_dict=True)
            cond = pooled_dict.pop("cond")
            pooled_dict.update(add_dict)
            return [[cond, pooled_dict]]

        def encode_from_tokens(self, tokens, return_pooled=False, return_dict=False):
            key = clip_key(self, tokens, return_pooled, return_dict) if CACHE.max_bytes > 0 else None
            if key is not None and (hit := CACHE.get(key)) is not None:
                log.info("MGPU: text encoder output from the cache (same text, encoder and patches)")
                return hit
            self.mgpu_load_now()
            out = super().encode_from_tokens(tokens, return_pooled=return_pooled, return_dict=return_dict)
            if key is not None:
                CACHE.put(key, out)
            return out

    return CachedCLIP


def cached(clip, key: tuple):
    """``clip`` itself, freshly loaded, its encodes cached under the encoder ``key`` (``encoder_key``)."""
    _remember(clip, key)
    clip.__class__ = cached_clip_class()
    clip.mgpu_encoder_key = key
    return clip


def deferred(key: tuple, load: Callable[[], Any], what: str):
    """A CachedCLIP of the encoder ``key`` whose weights ``load()`` (a fresh ComfyUI CLIP) loads at their first use,
    if this process loaded that encoder before (its tokenizer and fresh state are known) and the cache is on; else
    None (load it now)."""
    with _fresh_lock:
        known = _fresh.get(key)
    if known is None or CACHE.max_bytes <= 0:
        return None
    attrs, facts = known

    def load_now():
        log.info("%s: loading the encoder now: this encode is not in the cache", what)
        return load()

    clip = cached_clip_class()(no_init=True)
    vars(clip).update({k: v.copy() if isinstance(v, dict) else v for k, v in attrs.items()},
                      mgpu_encoder_key=key, mgpu_fresh_facts=facts, _mgpu_load=load_now)
    log.info("%s: loaded before, so not loaded now: its weights load at their first use (an encode not in the cache, "
             "or a node that needs them)", what)
    return clip
