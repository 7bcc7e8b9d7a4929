"""Host-side handle of a model sharded over a rank pool: call it like the module it stands for.

The host never joins a collective and never holds the weights: it writes the inputs once into shared memory, every
rank computes its rows of the batch (CFG cond/uncond on 2 ranks: one branch each), and the host concatenates the
rows. Tensors that repeat across steps (the text context) are sent once and cached on the ranks by content hash,
so a denoising step moves only the latent and the timestep. If the pool was rebuilt after a rank failure, the model
is loaded again on the next call.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import xxhash

from mgpu.errors import CallCancelled, RankFailure
from mgpu.ranks.pool import RankPool
from mgpu.torch_support import require_fsdp_torch

log = logging.getLogger(__name__)
OPS = "mgpu.sharding.model_ops:"
LOAD_TIMEOUT_S = 1800.0   # 15 GB per rank at ~10 MB/s (a network drive) still loads
_handles = itertools.count()


@dataclass
class ModelSpec:
    """Plain data the ranks need to build and load the model (nothing here is pickled code)."""

    factory: str                           # "package.module:function" returning the nn.Module (run under meta)
    checkpoint: str                        # .safetensors file or sharded folder
    factory_kwargs: dict = field(default_factory=dict)
    key_prefix: str | None = None          # None: detected ("", "model.diffusion_model.", ...)
    blocks: list[str] | None = None        # None: the largest same-class ModuleLists
    param_dtype: str | None = None         # all-gather/compute dtype: "bf16" | "fp16" | "fp32" | None (as stored)
    reshard_after_forward: bool = True     # False: keep gathered weights between forwards (faster, full memory)
    prefetch: int = 1                      # blocks all-gathered ahead of the one computing
    cached_inputs: tuple[str, ...] = ()    # kwargs sent once and cached by content (e.g. "context")
    split_batch: bool = True               # False: every rank computes the whole batch (for comparison only)
    sp_degree: int = 1                     # ranks that split each sample's tokens (Ulysses, mgpu.families); the
                                           # ranks / sp_degree groups split the batch. Lowered to one that divides
                                           # the heads and the ranks (mgpu.families.sequence.choose_sp_degree)


@dataclass(frozen=True)
class PerChunk:
    """Inside a dict argument: a list or tensor with one entry per equal chunk of the batch rows (ComfyUI's
    ``cond_or_uncond``: one per cond/uncond chunk; ``sigmas``: one per row). Each rank gets the entries of its rows."""

    value: Any


def _holds_tensor(values: list | tuple) -> bool:
    return any(isinstance(v, torch.Tensor) or isinstance(v, (list, tuple)) and _holds_tensor(v) for v in values)


def first_tensor(values: list | tuple) -> torch.Tensor:
    """The first tensor among ``values``, looking into lists and tuples (the batch is its dim 0)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
        if isinstance(v, (list, tuple)) and _holds_tensor(v):
            return first_tensor(v)
    raise ValueError("no tensor among the arguments: nothing tells the batch size")


def _digest(t: torch.Tensor) -> str:
    """Content hash of a tensor: xxh3-128 hashes 16 MB in ~1.5 ms, where blake2b takes ~20 ms, every step."""
    t = t.detach().to("cpu").contiguous()
    data = memoryview(t.view(torch.uint8).numpy()) if t.numel() else b""
    return f"{t.dtype}{tuple(t.shape)}:{xxhash.xxh3_128_hexdigest(data)}"


class _ContentCache:
    """Which tensors the ranks hold, by content hash; the host mirrors the ranks' LRU so both drop the same ones.

    A tensor object seen again unchanged (alive all along, same version counter) is not hashed again. Identity is
    tracked with weak references: an address can be reused by a new tensor, an object that is still alive cannot.
    """

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self.on_ranks: OrderedDict[str, None] = OrderedDict()
        self._known: dict[int, tuple[weakref.ref, int, str]] = {}

    def digest(self, t: torch.Tensor) -> str:
        if t.is_inference():   # no version counter (ComfyUI samples under inference_mode): hash every time
            return _digest(t)
        key = id(t)
        entry = self._known.get(key)
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        digest = _digest(t)
        self._known[key] = (weakref.ref(t, lambda _, k=key: self._known.pop(k, None)), t._version, digest)
        return digest

    def reset(self) -> None:
        self.on_ranks.clear()


class ShardedModule:
    """A model sharded with FSDP2 over ``pool``'s ranks. ``load()`` then call it; ``free()`` when done."""

    def __init__(self, pool: RankPool, spec: ModelSpec, handle: str | None = None):
        self.pool = pool
        self.spec = spec
        self.handle = handle or f"model-{next(_handles)}"
        self.load_replies: list[dict] = []
        self._generation = -1
        self._cache = _ContentCache()
        self.split: tuple[int, int] | None = None   # (cfg groups, sequence degree) of the last forward

    @property
    def generation(self) -> int:
        """The pool generation this model was loaded in (-1: not loaded); calls for it carry it."""
        return self._generation

    @property
    def loaded(self) -> bool:
        return self._generation == self.pool.generation and self.pool.alive

    def load(self, timeout: float | None = None, cancelled: Callable[[], bool] | None = None) -> list[dict]:
        """Build, shard and load on every rank; returns each rank's load report.

        A load reads 1/N of a checkpoint that can be 30 GB, from a disk that can be slow: it gets at least
        LOAD_TIMEOUT_S, not the per-step timeout of the pool. ``cancelled`` stops it (the ranks are restarted)."""
        require_fsdp_torch()
        timeout = max(self.pool.config.call_timeout_s, LOAD_TIMEOUT_S) if timeout is None else timeout
        payload = {"handle": self.handle, **asdict(self.spec)}
        payload.pop("cached_inputs")
        payload.pop("split_batch")
        replies = self.pool.call(OPS + "load", payload, timeout=timeout, cancelled=cancelled)
        self._generation = self.pool.generation
        self._cache.reset()
        self.load_replies = [r.payload for r in replies]
        note = self.load_replies[0].get("layout", {}).get("note")
        if note:
            log.warning("%s", note)
        return self.load_replies

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, timeout: float | None = None, cancelled: Callable[[], bool] | None = None,
                **kwargs: Any) -> torch.Tensor:
        """Run the sharded forward; the batch (dim 0 of the first tensor) is split over the ranks.

        A tensor argument is split with it when its dim 0 equals the batch; anything else reaches every rank whole.
        So is each tensor of a list or tuple argument (ComfyUI 0.33's LTX-2 gets its video and audio latents, and
        their timesteps, as pairs). A dict argument travels entry by entry (tensors through shared memory), whole,
        except its ``PerChunk`` entries. A model that answers with a list of tensors (one per stream) gets the list,
        each stream's rows joined.
        """
        if not self.loaded:
            self.load(cancelled=cancelled)
        payload, tensors = self.pack_forward(args, kwargs)
        try:
            replies = self.pool.call(OPS + "forward", payload, tensors, timeout=timeout, cancelled=cancelled,
                                     generation=self._generation)
        except (RankFailure, CallCancelled):
            self._cache.reset()
            raise
        return self.join_rows(replies)

    def pack_forward(self, args: tuple, kwargs: dict) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The payload and tensors of a forward (``model_ops.step_inputs`` reads them on the ranks): tensors by
        reference through shared memory, cached inputs by content digest, batched ones marked for the row split.
        A call that fails must ``reset_cache``: the ranks may not hold what this one put there."""
        batch = first_tensor([*args, *kwargs.values()]).shape[0]
        tensors: dict[str, torch.Tensor] = {}
        payload: dict[str, Any] = {"handle": self.handle, "batch": batch, "cache_put": {}, "batched": [],
                                   "split": self.spec.split_batch}
        used: list[str] = []

        def ref(name: str, value: Any, nested: bool = False) -> dict:
            if isinstance(value, dict):   # its tensors travel through shared memory too, never split by shape
                return {"d": {k: ref(f"{name}.{k}", v, nested=True) for k, v in value.items()}}
            if isinstance(value, PerChunk):
                return {"chunks": ref(name, value.value, nested=True)}
            if isinstance(value, (list, tuple)) and _holds_tensor(value):   # split on the ranks item by item
                if not nested and any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch
                                      for v in value):
                    payload["batched"].append(name)
                return {"l": [ref(f"{name}.{i}", v, nested=True) for i, v in enumerate(value)],
                        "tuple": isinstance(value, tuple)}
            if not isinstance(value, torch.Tensor):
                return {"v": value}
            if not nested and value.dim() > 0 and value.shape[0] == batch:
                payload["batched"].append(name)
            if not nested and name in self.spec.cached_inputs:
                digest = self._cache.digest(value)
                used.append(digest)
                if digest not in self._cache.on_ranks:
                    tensors[f"cache:{digest}"] = value.detach().to("cpu")
                    payload["cache_put"][digest] = f"cache:{digest}"
                return {"c": digest}
            tensors[name] = value.detach().to("cpu")
            return {"t": name}

        payload["args"] = [ref(f"arg{i}", a) for i, a in enumerate(args)]
        payload["kwargs"] = {k: ref(k, v) for k, v in kwargs.items()}
        payload["cache_drop"] = self._plan_cache(used)
        return payload, tensors

    def reset_cache(self) -> None:
        """Forget which inputs the ranks cache (after a failed call, which may have left them without)."""
        self._cache.reset()

    def join_rows(self, replies: list) -> torch.Tensor | list[torch.Tensor]:
        """The forward's output from the ranks' replies: the answering ranks' rows in order (per stream)."""
        batch_rows = sum(r.payload["rows"][1] - r.payload["rows"][0] for r in replies)
        split = tuple(replies[0].payload.get("layout", ()))
        if split and split != self.split:
            log.info("%s: %d batch row%s per step split %d (CFG/batch) x %d (sequence) over %d ranks",
                     self.spec.checkpoint, batch_rows, "s" if batch_rows != 1 else "", *split, len(replies))
        self.split = split or None
        answers = sorted((tuple(r.payload["rows"]), r) for r in replies if r.payload["rows"][0] < r.payload["rows"][1])
        streams = answers[0][1].payload.get("streams")

        def rows_of(key: str) -> torch.Tensor:
            parts = [r.tensors[key] for _, r in answers]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        return rows_of("out") if streams is None else [rows_of(f"out.{i}") for i in range(streams)]

    def call(self, method: str, *args: Any, timeout: float | None = None,
             cancelled: Callable[[], bool] | None = None, **kwargs: Any) -> Any:
        """Run ``method`` of the sharded model (not its forward) on every rank with the whole input, the root's
        parameters gathered; rank 0's answer comes back. For what ComfyUI computes with the network outside its
        forward: LTX-2's text connectors (``preprocess_text_embeds``), run once per conditioning."""
        if not self.loaded:
            self.load(cancelled=cancelled)
        tensors: dict[str, torch.Tensor] = {}

        def ref(name: str, value: Any) -> dict:
            if isinstance(value, torch.Tensor):
                tensors[name] = value.detach().to("cpu")
                return {"t": name}
            return {"v": value}

        payload = {"handle": self.handle, "method": method, "args": [ref(f"arg{i}", a) for i, a in enumerate(args)],
                   "kwargs": {k: ref(k, v) for k, v in kwargs.items()}}
        replies = self.pool.call(OPS + "call", payload, tensors, timeout=timeout, cancelled=cancelled,
                                 generation=self._generation)
        return replies[0].tensors.get("out", replies[0].payload.get("out"))

    def _plan_cache(self, used: list[str]) -> list[str]:
        """Mark ``used`` most recent; return the digests both sides drop to stay within capacity."""
        for d in used:
            self._cache.on_ranks[d] = None
            self._cache.on_ranks.move_to_end(d)
        drop = []
        while len(self._cache.on_ranks) > self._cache.capacity:
            d, _ = self._cache.on_ranks.popitem(last=False)
            if d in used:  # never drop what this call needs
                self._cache.on_ranks[d] = None
                break
            drop.append(d)
        return drop

    def release_cached_memory(self, timeout: float | None = None,
                              cancelled: Callable[[], bool] | None = None) -> list[dict]:
        """Give each rank's cached working memory back to its device (sampling ended: the host's VAE or text
        encoder needs it); one reply per rank with ``released_bytes``. A model not loaded now (its pool rebuilt or
        closed, its shards freed) has nothing there: no call, and no rank started for it."""
        if not self.loaded:
            return []
        replies = self.pool.call(OPS + "release_cached_memory", {"handle": self.handle}, timeout=timeout,
                                 cancelled=cancelled, generation=self._generation)
        return [r.payload for r in replies]

    def describe(self) -> list[dict]:
        if not self.loaded:
            self.load()
        return [r.payload for r in self.pool.call(OPS + "describe", {"handle": self.handle})]

    def free(self) -> None:
        if self.loaded:
            self.pool.call("free", {"handles": [self.handle]})
        self._generation = -1
