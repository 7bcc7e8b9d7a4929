"""Rank ops of a training run, called by path (``"mgpu.training.ops:forward"``) on a model ``model_ops.load`` loaded.

Every network call of a step takes the split a sampling step of its rows would (``mgpu.families.Layouts``): its
batch rows over the ranks, or, with fewer rows than ranks and a model loaded with sequence parallelism, each row's
tokens over a group of ranks (the exchanges carry gradients, ``mgpu.families.sequence``). Each rank keeps its part of
the autograd graph until the host sends the gradient of the call's output, so the host computes the loss exactly as
ComfyUI's Train LoRA does (its own ``model_sampling``, loss function and averaging over the conditionings) and only
the output and its gradient travel per call. The adapters are replicated: their gradients are partial sums over each
rank's rows or tokens, summed by one all-reduce per bucket at ``step``, and then every rank runs the same optimizer
update on the same values, so they stay identical without ever being broadcast. Adapters are a few hundred MB even
for a 14B model at rank 32, which is why they are not sharded (see ARCHITECTURE.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.fsdp import FSDPModule

from mgpu.errors import TrainingError
from mgpu.ranks.rank import RankContext, Tensors, import_path
from mgpu.sharding import model_ops
from mgpu.sharding.fsdp import reset_after_failed_forward
from mgpu.training import adapters as adapter_mod
from mgpu.training.checkpoints import LORA_PREFIX, OPTIM_PREFIX

RUN = "training"   # in the model's ctx.objects entry
OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD,
              "RMSprop": torch.optim.RMSprop}   # ComfyUI's Train LoRA's choices, with torch's defaults as there
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}   # fp32: no autocast (torch disables it for fp32)
BUCKET_BYTES = 25 << 20   # fp32 gradient bytes per all-reduce: DDP's default bucket


@dataclass
class Run:
    adapters: dict[str, nn.Module]
    params: dict[str, nn.Parameter]
    optimizer: torch.optim.Optimizer
    attached: dict
    autocast: torch.dtype | None
    mode: Any   # the host library's training switch (``payload["mode"]``, a path): on for the run, off after
    checkpointed: list[nn.Module] = field(default_factory=list)
    graphs: dict[int, tuple[torch.Tensor, model_ops.StepInputs]] = field(default_factory=dict)
    steps: int = 0
    reduced_bytes: int = 0


def start(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Install the adapters (built by ``payload["adapters"]``, a factory path, from the host's first values) in the
    model's layers, turn the host library's training paths on (``payload["mode"]``, a path called with True now and
    False when the run ends; None: the model has no such switch), switch gradient checkpointing per FSDP unit on if
    asked, and make the optimizer. A run this model still carries (its host went away mid-run) ends first."""
    entry = ctx.objects[payload["handle"]]
    if RUN in entry:
        _end(ctx, entry)
    model: nn.Module = entry["model"]
    if payload["optimizer"] not in OPTIMIZERS:
        raise TrainingError(f"optimizer {payload['optimizer']!r}: choose one of {', '.join(OPTIMIZERS)}")
    build = import_path(payload["adapters"])
    mode = import_path(payload["mode"]) if payload.get("mode") else _no_switch
    found = build(payload["specs"], tensors, payload["lora_dtype"], ctx.torch_device)
    reset_after_failed_forward(model)   # whatever the last sampling step left, the first forward starts afresh
    attached = adapter_mod.attach(model, found)
    params = adapter_mod.trainable(found)
    run = Run(found, params, OPTIMIZERS[payload["optimizer"]](list(params.values()), lr=payload["learning_rate"]),
              attached, AUTOCAST.get(payload["training_dtype"]), mode)
    if payload.get("gradient_checkpointing"):
        run.checkpointed = _checkpoint_units(model)
    model.train()
    mode(True)
    entry[RUN] = run
    return {"adapters": len(found), "trainable_params": sum(p.numel() for p in params.values()),
            "adapter_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "checkpointed_units": len(run.checkpointed)}


def forward(ctx: RankContext, payload: dict, tensors: Tensors) -> tuple[dict, Tensors]:
    """One network call of a step on this rank's rows, gradients on; the graph waits for ``backward``."""
    entry = ctx.objects[payload["handle"]]
    run: Run = entry[RUN]
    step = model_ops.step_inputs(ctx, entry, payload, tensors)   # the split sampling would take for these rows
    try:
        with torch.enable_grad(), _autocast(ctx.torch_device, run.autocast):
            out = model_ops.output_of(entry["model"](*step.args, **step.kwargs))
        if not isinstance(out, torch.Tensor):
            raise TrainingError("this network answers with several streams (LTX-2's video and audio): training it "
                                "over the ranks is not supported yet")
    except Exception:
        _failed(ctx, entry)
        raise
    run.graphs[payload["graph"]] = (out, step)
    return model_ops.answer(step, out.detach(), ctx.torch_device)


def backward(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """The gradient of one forward's output enters where that output left: on the rank that answered for its rows
    (the others backpropagate zeros: a rank without rows, which still joins the backward's all-gathers, and the other
    ranks of a sequence-parallel group, whose tokens get their share through the output gather's backward,
    ``mgpu.families.sequence``); the adapters' gradients accumulate."""
    entry = ctx.objects[payload["handle"]]
    run: Run = entry[RUN]
    out, step = run.graphs.pop(payload["graph"])
    # the split this graph's forward took: a checkpointed block's recompute exchanges tokens over its group again
    # (another forward since may have selected another; one resolution per run keeps the token sizes)
    entry["layouts"].use(step.layout)
    grad = (tensors["grad"][step.lo:step.hi].to(out.device, out.dtype) if step.answers else
            torch.zeros_like(out))
    try:
        out.backward(grad)
    except Exception:
        _failed(ctx, entry)
        raise
    return {}


def step(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Sum the gradients over the ranks, then the optimizer step on every rank (same values, same update)."""
    entry = ctx.objects[payload["handle"]]
    run: Run = entry[RUN]
    grads = [p.grad for p in run.params.values() if p.grad is not None]
    sent = _all_reduce(grads) if ctx.world_size > 1 else 0
    run.optimizer.step()
    run.optimizer.zero_grad()
    run.steps += 1
    run.reduced_bytes += sent
    return {"step": run.steps, "reduced_bytes": sent}


def state(ctx: RankContext, payload: dict, tensors: Tensors) -> tuple[dict, Tensors]:
    """The adapters under their LoRA keys (rank 0 answers: every rank holds the same)."""
    run: Run = ctx.objects[payload["handle"]][RUN]
    if ctx.rank != 0:
        return {}, {}
    found = adapter_mod.state(run.adapters)
    return {"keys": list(found), "steps": run.steps}, found


def save_state(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Write the run's adapters and optimizer state to ``payload["path"]`` with ``torch.distributed.checkpoint``:
    each tensor as a DTensor sharded on dim 0 over all ranks (every rank holds it whole, so this costs no
    communication), so every rank writes its own shard in parallel and a later load may use another rank count;
    tensors too small to shard (``_sharded``) once, by one rank. (DCP reads its data files with
    ``torch.load(weights_only=True)`` and its metadata with pickle: the host reads only folders it signed.)"""
    import torch.distributed.checkpoint as dcp

    run: Run = ctx.objects[payload["handle"]][RUN]
    state = {name: _sharded(ctx, t) for name, t in checkpoint_tensors(run).items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(payload["path"]))
    return {"tensors": len(state)}


def load_state(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """Read what ``save_state`` wrote (the host verified the folder first) into the run: the adapters' values and
    the optimizer's state, whatever rank count wrote it. The optimizer state is made from the checkpoint's own
    entries, so a run that has not stepped yet takes it."""
    import torch.distributed.checkpoint as dcp

    run: Run = ctx.objects[payload["handle"]][RUN]
    reader = dcp.FileSystemReader(payload["path"])
    saved = reader.read_metadata().state_dict_metadata
    live = adapter_mod.tensors(run.adapters)
    missing = [k for k in live if LORA_PREFIX + k not in saved]
    if missing:
        raise TrainingError(f"the checkpoint has no values for {len(missing)} adapters (first: {missing[0]}): it "
                            "was written for another model or LoRA rank")
    index = {name: i for i, name in enumerate(run.params)}
    targets = {LORA_PREFIX + k: _sharded(ctx, torch.empty_like(t)) for k, t in live.items()}
    optim: dict[str, tuple[int, str]] = {}   # checkpoint name -> (parameter index, state name)
    for name, meta in saved.items():
        if name.startswith(OPTIM_PREFIX):
            key, _, what = name[len(OPTIM_PREFIX):].rpartition("/")
            if key not in index:
                raise TrainingError(f"the checkpoint's optimizer state names {key!r}, which this run does not train")
            optim[name] = (index[key], what)
            device = "cpu" if what == "step" else ctx.torch_device   # torch keeps an optimizer's step on the CPU
            targets[name] = _sharded(ctx, torch.empty(meta.size, dtype=meta.properties.dtype, device=device))
    dcp.load(targets, storage_reader=reader)
    for k, t in live.items():
        t.copy_(_whole(targets[LORA_PREFIX + k]))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, (i, what) in optim.items():
        state.setdefault(i, {})[what] = _whole(targets[name])
    run.optimizer.load_state_dict({"state": state, "param_groups": run.optimizer.state_dict()["param_groups"]})
    return {"tensors": len(targets)}


def checkpoint_tensors(run: Run) -> dict[str, torch.Tensor]:
    """The adapters under ``lora/<key>`` and the optimizer's per-parameter state under ``optim/<key>/<name>``."""
    found = {LORA_PREFIX + k: t for k, t in adapter_mod.tensors(run.adapters).items()}
    names = list(run.params)
    for i, values in run.optimizer.state_dict()["state"].items():
        for what, value in values.items():
            if isinstance(value, torch.Tensor):
                found[f"{OPTIM_PREFIX}{names[i]}/{what}"] = value.detach()
    return found


def _sharded(ctx: RankContext, t: torch.Tensor):
    """``t`` (whole on every rank) as a DTensor sharded on dim 0 over the ranks without communication, or ``t``
    itself when some rank's chunk would be empty (``Shard(0)`` cuts as ``torch.chunk``: 6 rows on 5 ranks are
    2, 2, 2, 0, 0) or it lives elsewhere than the mesh (an optimizer's step on the CPU)."""
    n, ranks = (t.shape[0] if t.ndim else 0), ctx.world_size
    if n < ranks or -(-n // ranks) * (ranks - 1) >= n or t.device.type != ctx.mesh.device_type:
        return t
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(t, ctx.mesh, [Shard(0)], src_data_rank=None)


def _whole(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def stop(ctx: RankContext, payload: dict, tensors: Tensors) -> dict:
    """End the run: the layers get their function lists back, checkpointing and training mode off, graphs and
    gradients dropped, FSDP reset; the model samples as before the run. A model without a run: nothing to do."""
    entry = ctx.objects.get(payload["handle"])
    if entry is None or RUN not in entry:
        return {"stopped": False}
    _end(ctx, entry)
    return {"stopped": True}


def _end(ctx: RankContext, entry: dict) -> None:
    run: Run = entry.pop(RUN)
    run.mode(False)
    run.graphs.clear()
    adapter_mod.detach(run.attached)
    for unit in run.checkpointed:
        unit.__dict__.pop("forward", None)
    model = entry["model"]
    model.eval()
    model_ops.clean_after_failed_forward(ctx, entry)


def _failed(ctx: RankContext, entry: dict) -> None:
    """A forward or backward raised (Cancel between blocks, OOM): drop the graphs and this micro step's gradients
    and reset FSDP, so the pool and the model stay usable; the host ends the run."""
    run: Run = entry[RUN]
    run.graphs.clear()
    run.optimizer.zero_grad()
    model_ops.clean_after_failed_forward(ctx, entry)


def _no_switch(on: bool) -> None:
    """The training switch of a model whose library has none."""


def _autocast(device: torch.device, dtype: torch.dtype | None):
    """ComfyUI's Train LoRA runs the network under ``torch.autocast`` in the training dtype; fp32 runs plain."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _checkpoint_units(model: nn.Module) -> list[nn.Module]:
    """Recompute each FSDP block unit in its backward instead of keeping its activations (ComfyUI's Train LoRA
    checkpoints the same blocks). The unit's FSDP hooks stay outside: the recompute runs while the backward has the
    block gathered again. Returns the units, whose instance ``forward`` ``_end`` removes."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for unit in units:
        inner = unit.forward

        def checkpointed(*args: Any, _inner=inner, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        unit.forward = checkpointed
    return units


def _all_reduce(grads: list[torch.Tensor]) -> int:
    """Sum ``grads`` over the ranks in place, in fp32 buckets of ``BUCKET_BYTES``; returns the bytes reduced."""
    sent = 0
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1).float() for g in bucket])
        dist.all_reduce(flat)
        sent += flat.numel() * 4
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return sent


def _buckets(grads: list[torch.Tensor]):
    """``grads`` in order, cut into runs of at most ``BUCKET_BYTES`` in fp32 (a larger gradient alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and size + g.numel() * 4 > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * 4
    if bucket:
        yield bucket
