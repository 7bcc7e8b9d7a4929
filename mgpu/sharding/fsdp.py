"""FSDP2 sharding of a diffusion model, torchtitan style: the model stays a plain ``nn.Module`` and the
functions here apply the parallelism to it in place.

Flow on every rank: ``build_meta`` (no weight memory) -> ``shard`` (each block, then the root, becomes an FSDP2
unit) -> ``materialize`` (allocates only this rank's shards) -> ``mgpu.sharding.slice_load.load_sharded`` (reads only them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import accelerate
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from mgpu.errors import ShardingError
from mgpu.weights.quant import FP8_DTYPES, wrap_fp8_parameters

# A block list must hold at least this share of the model's parameters to be sharded automatically: small
# ModuleLists (norms, per-block projections) are not worth an FSDP unit of their own.
_MIN_BLOCK_SHARE = 0.10


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_list_candidates(model: nn.Module) -> list[tuple[str, int]]:
    """Every ModuleList of two or more same-class children, with its parameter count, in definition order."""
    return [(name, _numel(mod)) for name, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(m) for m in mod}) == 1]


def _describe_module_lists(model: nn.Module) -> str:
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return "it has no nn.ModuleList at all"
    return "its ModuleLists: " + ", ".join(
        f"{n or '<root>'} ({len(m)} x {'/'.join(sorted({type(c).__name__ for c in m})) or 'empty'}, "
        f"{_numel(m):,} params)" for n, m in lists[:20])


def find_block_lists(model: nn.Module, names: Sequence[str] | None = None) -> list[str]:
    """Names of the repeated block lists to shard one block per FSDP unit.

    Auto-detection keeps the outermost same-class ModuleLists that hold at least 10% of the parameters (so Flux-style
    models with two block stacks get both), in definition order; prefetching follows the recorded execution order.
    ``names`` overrides it and is only validated.
    """
    modules = dict(model.named_modules())
    if names is not None:
        bad = [n for n in names if not isinstance(modules.get(n), (nn.ModuleList, nn.Sequential))]
        if bad:
            raise ShardingError(
                f"{type(model).__name__} has no block list named {bad}: a block name must be an nn.ModuleList or "
                f"nn.Sequential attribute path; {_describe_module_lists(model)}.")
        return list(names)
    total = _numel(model)
    candidates = _block_list_candidates(model)
    chosen: list[str] = []
    for name, count in sorted(candidates, key=lambda c: -c[1]):   # biggest first, so outer lists win over nested
        nested = any(name.startswith(c + ".") or c.startswith(name + ".") for c in chosen)
        if count > 0 and count >= _MIN_BLOCK_SHARE * total and not nested:
            chosen.append(name)
    if not chosen:
        raise ShardingError(
            f"Cannot find the repeated transformer blocks of {type(model).__name__}: no nn.ModuleList of same-class "
            f"blocks holds {_MIN_BLOCK_SHARE:.0%} of its {total:,} parameters ({_describe_module_lists(model)}). "
            f"Pass the block list names explicitly, e.g. blocks=['blocks'].")
    return [name for name, _ in candidates if name in chosen]


def build_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """Build the model with parameters on meta (no memory, no init work) but buffers real.

    Buffers stay real because non-persistent ones (rotary tables) are not in any checkpoint: the constructor is the
    only place they are computed, and ``materialize`` puts them back after ``to_empty``.
    """
    with accelerate.init_empty_weights(include_buffers=False):
        return factory()


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate the (sharded) parameters on ``device`` and restore the real buffers that ``to_empty`` wipes.

    Without the restore the rotary tables of e.g. diffusers' Wan are uninitialised memory and the output is NaN.
    Parameters are left uninitialised: load them next (``mgpu.sharding.slice_load.load_sharded``).
    """
    saved = [(mod, key, buf) for mod in model.modules() for key, buf in mod._buffers.items() if buf is not None]
    lost = [f"{type(mod).__name__}.{key}" for mod, key, buf in saved
            if buf.is_meta and key in mod._non_persistent_buffers_set]
    if lost:
        raise ShardingError(
            f"{type(model).__name__} has non-persistent buffers on meta ({lost[:10]}); they are in no checkpoint "
            f"and cannot be recovered. Build the model with mgpu.sharding.fsdp.build_meta, which keeps buffers real.")
    model.to_empty(device=device)
    for mod, key, buf in saved:
        if not buf.is_meta:
            mod._buffers[key] = buf.to(device)
    return model


def replicate_scalars(model: nn.Module) -> list[str]:
    """Turn every 0-d parameter into a (persistent) buffer, which every rank holds whole; returns their names.

    FSDP2 refuses to shard a scalar, and one number is not worth a collective: per-layer scales (ComfyUI's scaled
    fp8 ``scale_weight`` / ``scale_input``) stay replicated, keep their state-dict keys, and the slice loader reads
    them whole like any buffer. Modules read them as attributes, so a buffer serves them as the parameter did.
    """
    names = []
    for module_name, sub in model.named_modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and param.ndim == 0:
                del sub._parameters[name]
                sub.register_buffer(name, param.data)
                names.append(f"{module_name}.{name}" if module_name else name)
    return names


def compute_dtype_for(device: torch.device | str, requested: torch.dtype | None,
                      capability: tuple[int, int] | None = None) -> torch.dtype | None:
    """The dtype to all-gather and compute in: ``requested`` unless the device cannot run it.

    bf16 needs compute capability 8.0 (Ampere) on CUDA, older GPUs get fp16. ``None`` keeps the stored dtype.
    """
    if requested in FP8_DTYPES:
        raise ShardingError(f"{requested} is a storage dtype, not a compute dtype: ask for torch.bfloat16 or "
                            f"torch.float16 compute on {device}.")
    device = torch.device(device)
    if requested is torch.bfloat16 and device.type == "cuda":
        major, minor = capability or torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return torch.float16
    return requested


def shard(model: nn.Module, mesh: DeviceMesh, *, blocks: Sequence[str] | None = None,
          param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
          prefetch: int = 1) -> nn.Module:
    """Make every block, then the root (embeddings, head), an FSDP2 unit on ``mesh``; returns ``model`` itself.

    One unit per block bounds the all-gathered working set to about ``1 + prefetch`` blocks; prefetching the next
    block(s) in forward overlaps their all-gather with the current block's compute. What runs next is what the first
    forward ran next (``_prefetch_in_execution_order``), not the definition order. ``reshard_after_forward=False``
    keeps the gathered weights between forwards (faster, full-model memory). ``param_dtype`` is the all-gather and
    compute dtype (see ``compute_dtype_for``). Forward inputs are not cast: the sharded model computes exactly like
    the single-device model with its weights in ``param_dtype`` (casting would round e.g. timesteps to bf16).
    The parameters are frozen: this is inference, and FSDP lets a unit of frozen parameters mix dtypes (ComfyUI
    keeps Wan's patch embedding in fp32 beside bf16 weights). fp8 parameters travel as their fp8 bytes whatever
    ``param_dtype`` (``mgpu.weights.quant.Fp8Weight``): they reach the block upcast to ``param_dtype``, or as fp8 without one.
    Scalar parameters (per-layer scales) are replicated, not sharded (``replicate_scalars``).
    """
    model.requires_grad_(False)
    replicate_scalars(model)
    wrap_fp8_parameters(model)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, cast_forward_inputs=False)
    units: list[FSDPModule] = []
    for name in find_block_lists(model, blocks):
        for block in model.get_submodule(name):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            units.append(block)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if prefetch > 0:
        _prefetch_in_execution_order(model, units, prefetch)
    return model


def reset_after_failed_forward(root: FSDPModule) -> None:
    """Make the next forward of ``root`` start as a first one does, after a forward that raised midway (a cancel
    between blocks, CUDA OOM, bad input): every unit resharded, no all-gather pending, no forward in progress.

    ``reshard()`` alone is not enough: the unit the failed forward prefetched keeps its pending all-gather, which
    its next ``unshard`` reuses (weights changed since, e.g. LoRA rows, are missed for one step: the output was off
    by 0.4 to 1.95 on CPU ranks); the root stays in its forward, so a kept-gathered root is never resharded (writes to
    its shard never show) and the next forward skips the root pre-forward and, on GPUs, its
    ``all_gather_copy_in_stream.wait_stream(current_stream)``: the first all-gathers race the default stream's
    writes. torch >= 2.13 has ``FSDPModule.reset_iter_state()`` for this; torch 2.11 (and 2.12) lack it,
    so the same forward-side reset is done on their FSDP2 internals (read from 2.11's source; nothing here runs a
    backward): wait for and drop pending all-gathers, every state and parameter group back to idle, then reshard.
    A root that never started a forward has nothing to reset.
    """
    state = root._get_fsdp_state()
    if state._is_root is None:
        return
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
        return
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    stream = state._device_handle.current_stream()
    if (saved := state._comm_ctx.all_gather_state) is not None:
        if saved.event is not None:
            stream.wait_event(saved.event)
        state._comm_ctx.all_gather_state = None
    state._comm_ctx.post_forward_order.clear()   # backward's record of the forward: grows every no-grad step
    for unit in state._state_ctx.all_states:
        unit._training_state = TrainingState.IDLE
        group = unit._fsdp_param_group
        if group is None:
            continue
        if (pending := group._all_gather_result) is not None:
            if pending.all_gather_event is not None:
                stream.wait_event(pending.all_gather_event)
            if isinstance(pending.all_gather_work, dist.distributed_c10d.Work):
                pending.all_gather_work.wait()
            group._all_gather_result = None
        group._post_forward_indices.clear()
        group._training_state = TrainingState.IDLE   # reshard() skips a kept-gathered group still in FORWARD
        group.reshard()
    state._state_ctx.iter_forward_root = None
    # a backward that raised left its end-of-backward callback marked as queued (it never ran): the next backward
    # would not queue it, and FSDP would never leave its backward state (the next forward would run on shards)
    if hasattr(state._state_ctx, "post_backward_final_callback_queued"):
        state._state_ctx.post_backward_final_callback_queued = False
    if hasattr(state._comm_ctx, "reduce_scatter_state"):   # 2.11's one pending reduce-scatter (a later torch: a list)
        state._comm_ctx.reduce_scatter_state = None
    if isinstance(getattr(state._comm_ctx, "reduce_scatter_states", None), list):
        state._comm_ctx.reduce_scatter_states.clear()


def _prefetch_in_execution_order(root: FSDPModule, units: list[FSDPModule], depth: int) -> None:
    """Make each unit prefetch the ``depth`` units that run after it, in the order the first forward runs them.

    Definition order is not execution order: Wan VACE runs a ``vace_blocks`` entry between ``blocks``, so prefetching
    by definition would gather blocks long before they run (memory) and miss the ones that run next (speed). The first
    forward runs without prefetch and records the order; a forward that fails midway records again next time.
    """
    order: list[FSDPModule] = []

    def start(module, args) -> None:
        order.clear()

    def ran(module, args) -> None:
        if module not in order:
            order.append(module)

    def finish(module, args, output) -> None:
        for handle in handles:
            handle.remove()
        chain = [root, *order]
        for i, unit in enumerate(chain[:-1]):
            unit.set_modules_to_forward_prefetch(chain[i + 1:i + 1 + depth])

    handles = [root.register_forward_pre_hook(start), *(u.register_forward_pre_hook(ran) for u in units),
               root.register_forward_hook(finish)]
