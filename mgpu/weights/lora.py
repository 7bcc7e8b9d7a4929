"""Weight patches (LoRA and friends) on an FSDP-sharded model: each rank patches only its own rows, or, for a weight
stored in a form that cannot take a row delta (fp8, GGUF, quantized tensors), adds the patch's term in the forward.

Host side: ``PatchedModule`` (a ShardedModule) sends a ``PatchSet`` when it changes, before the next forward.
Rank side: ``apply`` (the op ``"mgpu.weights.lora:apply"``).

The host sends the adapter tensors (LoRA up/down, small diffs), never the model: bytes sent are about the LoRA
file. FSDP2 shards every parameter by dim-0 rows, and row ``i`` of ``up @ down`` is ``up[i] @ down``, so each rank
adds ``scale * (up[lo:hi] @ down)`` to its local shard and nobody forms the full delta.

A weight whose shard is not a plain fp32/bf16/fp16 tensor (decided by its stored form, not by a list of formats)
is never written: ``mgpu.weights.lora_forward`` hooks the module that owns it, which adds ``s · up (down x)`` to its
output, with the whole (small) adapters on every rank.

A patch set replaces the previous one. Each patched shard's original rows are kept (in host RAM, as ComfyUI keeps
its backups on the offload device) and restored before the next set applies: a changed strength, another LoRA
stacked, or none at all costs no reload of the base weights, and removing every patch gives back the base bit for
bit; forward hooks are removed (their weights were never touched).

Wire format (plain data; tensors travel through the pool's shared memory): ``payload["patches"]`` maps a
parameter name of the rank model to the ops applied in order, as ComfyUI's ``calculate_weight`` does, in fp32:

- ``{"kind": "lora", "up": t, "down": t, "scale": strength * alpha / rank}``: ``w += scale * up @ down``
- ``{"kind": "diff", "diff": t, "scale": strength}``: ``w += scale * diff``
- ``{"kind": "set", "set": t}``: ``w = set``

each optionally with ``"model_scale": strength_model`` (``w *= model_scale`` first). ``t`` names a tensor of the call.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from mgpu.errors import ShardingError
from mgpu.ranks.rank import RankContext, Tensors
from mgpu.sharding.sharded import ShardedModule
from mgpu.sharding.slice_load import shard_row_range
from mgpu.weights import lora_forward

BACKUP = "weight_patch_backup"   # in the model's ctx.objects entry: parameter name -> its original local rows (CPU)
HOOKS = "weight_patch_hooks"     # in the same entry: the forward hooks of the patches on quantized weights
KINDS = ("lora", "diff", "set")
Ops = list[dict[str, Any]]
APPLY = "mgpu.weights.lora:apply"
BASE = "base"   # the key of the empty patch set: the weights as loaded
log = logging.getLogger("mgpu")


@dataclass
class PatchSet:
    """What the ranks should hold on top of the loaded weights. ``key`` identifies the content (ComfyUI's
    ``patches_uuid``): the same key is never sent twice. ``unmatched``: names the host already found no weight for."""

    patches: dict[str, Ops] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    key: Any = BASE
    unmatched: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class PatchedModule(ShardedModule):
    """A ShardedModule whose weights carry a patch set: ``set_patches`` takes effect before the next forward (or at
    ``sync_patches``), and again after every reload, since a reload reads the base weights from disk."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.wanted = PatchSet()
        self._on_ranks: Any = BASE

    def load(self, timeout: float | None = None, cancelled: Callable[[], bool] | None = None) -> list[dict]:
        self._on_ranks = object()   # unknown until the load succeeds
        replies = super().load(timeout, cancelled)
        self._on_ranks = BASE
        return replies

    def set_patches(self, patch_set: PatchSet) -> None:
        self.wanted = patch_set

    def sync_patches(self, timeout: float | None = None, cancelled: Callable[[], bool] | None = None) -> list[dict]:
        """Send the wanted patch set if the ranks hold another; returns the ranks' replies ([] if nothing was sent)."""
        if not self.loaded:
            self.load(cancelled=cancelled)
        wanted = self.wanted
        if wanted.key == self._on_ranks:
            return []
        self._on_ranks = object()   # a failed or cancelled call leaves the ranks in doubt: send again next time
        replies = [r.payload for r in self.pool.call(APPLY, {"handle": self.handle, "patches": wanted.patches},
                                                     wanted.tensors, timeout=timeout, cancelled=cancelled,
                                                     generation=self._generation)]
        self._on_ranks = wanted.key
        if wanted.patches:
            log.info("weight patches for %d weights sent to the ranks: %d bytes (%d weights stored quantized patched "
                     "in the forward, %d bytes of fp32 adapters kept per rank)", len(wanted.patches), wanted.nbytes,
                     replies[0]["at_forward"], replies[0]["forward_bytes"])
        unmatched = sorted(set(wanted.unmatched) | set(replies[0]["unmatched"]))
        if unmatched:
            log.warning("weight patches for %d keys match no weight of the sharded model, not applied: %s",
                        len(unmatched), ", ".join(unmatched))
        return replies

    def forward(self, *args: Any, timeout: float | None = None, cancelled: Callable[[], bool] | None = None,
                **kwargs: Any) -> torch.Tensor:
        self.sync_patches(timeout, cancelled)
        return super().forward(*args, timeout=timeout, cancelled=cancelled, **kwargs)

    def call(self, method: str, *args: Any, timeout: float | None = None,
             cancelled: Callable[[], bool] | None = None, **kwargs: Any) -> Any:
        self.sync_patches(timeout, cancelled)   # the method may read patched weights (LTX-2's connectors)
        return super().call(method, *args, timeout=timeout, cancelled=cancelled, **kwargs)


def apply(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Restore the base rows and remove the forward hooks of the previous patch set, then patch this rank's rows
    with ``payload["patches"]`` and hook on the patches of weights that cannot take rows.

    Everything is checked before any weight changes, so a refused set leaves the model as it was. Returns the
    names that match no weight (``unmatched``; the host warns once), how many weights are patched in the forward
    and the bytes their adapters keep on this rank, and the bytes this rank received."""
    entry = ctx.objects[payload["handle"]]
    model: nn.Module = entry["model"]
    patches: dict[str, Ops] = payload["patches"]
    _reshard(model)   # gathered weights kept between forwards would hide the patched shards
    targets = model.state_dict(keep_vars=True)
    unmatched = sorted(name for name in patches if name not in targets)
    patches = {name: ops for name, ops in patches.items() if name in targets}
    for name, ops in patches.items():
        _check(name, targets[name], ops, tensors)
    rows = {name: ops for name, ops in patches.items() if lora_forward.row_patchable(targets[name])}
    terms = lora_forward.collect(model, {n: ops for n, ops in patches.items() if n not in rows}, targets, tensors)
    backup: dict[str, torch.Tensor] = entry.setdefault(BACKUP, {})
    restored = _restore(targets, backup, keep=rows.keys())
    for handle in entry.pop(HOOKS, []):
        handle.remove()
    with torch.no_grad():
        for name, ops in rows.items():
            _patch(name, targets[name], ops, tensors, backup)
    entry[HOOKS] = lora_forward.install(model, terms)
    return {"patched": len(rows), "restored": restored, "unmatched": unmatched,
            "at_forward": len(patches) - len(rows), "forward_bytes": sum(t.nbytes for t in terms.values()),
            "received_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def _reshard(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """Global dim-0 rows ``[lo, hi)`` this rank holds of ``t``: its FSDP2 Shard(0) rows, or all of an unsharded one."""
    sharded = [(d, p) for d, p in enumerate(t.placements) if not isinstance(p, Replicate)] \
        if isinstance(t, DTensor) else []
    if not sharded:
        return 0, t.shape[0]
    (mesh_dim, placement), = sharded
    if type(placement) is not Shard or placement.dim != 0:
        raise ShardingError(f"placements {t.placements}: weight patches support FSDP's Shard(0) only")
    return shard_row_range(t.shape[0], t.device_mesh.size(mesh_dim), t.device_mesh.get_coordinate()[mesh_dim])


def _check(name: str, target: torch.Tensor, ops: Ops, tensors: Tensors) -> None:
    """Refuse what would patch wrong: a 0-d weight, mismatched shapes, an unknown kind."""
    shape = tuple(lora_forward.value_shape(target))
    if not shape:
        raise ShardingError(f"{name} is a 0-d tensor: weight patches need a weight with rows")
    for op in ops:
        kind = op.get("kind")
        if kind not in KINDS:
            raise ShardingError(f"{name}: unknown weight patch kind {kind!r} (known: {', '.join(KINDS)})")
        if kind == "lora":
            up, down = tensors[op["up"]], tensors[op["down"]]
            if not (up.dim() >= 2 and down.dim() >= 2 and up[0].numel() == down.shape[0] and up.shape[0] == shape[0]
                    and shape[0] * down[0].numel() == math.prod(shape)):
                raise ShardingError(f"{name}: LoRA up {tuple(up.shape)} / down {tuple(down.shape)} do not make a "
                                    f"{shape} delta")
        elif tuple(tensors[op[kind]].shape) != shape:
            raise ShardingError(f"{name}: {kind} patch of shape {tuple(tensors[op[kind]].shape)} on a {shape} weight")


def _restore(targets: dict[str, torch.Tensor], backup: dict[str, torch.Tensor], keep) -> int:
    """Copy every saved original back (bit-identical: same dtype); forget the ones the new set does not patch."""
    with torch.no_grad():
        for name in list(backup):
            _local(targets[name]).copy_(backup[name])
            if name not in keep:
                del backup[name]
    return len(backup)


def _patch(name: str, target: torch.Tensor, ops: Ops, tensors: Tensors, backup: dict[str, torch.Tensor]) -> None:
    """This rank's rows of ``target`` = its original rows with ``ops`` applied in fp32, rounded to the stored dtype."""
    local = _local(target)
    if name not in backup:
        backup[name] = local.detach().to("cpu", copy=True)
    lo, hi = local_rows(target)
    if hi == lo:
        return   # an uneven split left this rank no rows of it
    w = backup[name].to(local.device, torch.float32, copy=True)
    for op in ops:
        w = _step(w, op, lo, hi, tensors)
    local.copy_(w)


def _step(w: torch.Tensor, op: dict, lo: int, hi: int, tensors: Tensors) -> torch.Tensor:
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t[lo:hi].to(w.device, torch.float32)

    if op.get("model_scale", 1.0) != 1.0:
        w *= op["model_scale"]
    kind = op["kind"]
    if kind == "lora":
        up = rows(tensors[op["up"]].flatten(1))
        down = tensors[op["down"]].flatten(1).to(w.device, torch.float32)
        w += op["scale"] * (up @ down).view(w.shape)
    elif kind == "diff":
        if op["scale"] != 0.0:
            w += op["scale"] * rows(tensors[op["diff"]])
    else:
        w.copy_(rows(tensors[op["set"]]))
    return w
