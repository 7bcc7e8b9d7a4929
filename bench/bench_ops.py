"""Rank ops used only by the benchmark (called by path, with bench/ on the ranks' sys.path)."""

from __future__ import annotations

import time
from functools import partial

from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from mgpu.sharding.fsdp import build_meta, materialize, shard
from mgpu.sharding.model_ops import _local_bytes, batch_rows
from mgpu.ranks.rank import import_path


def echo(ctx, payload: dict, tensors: dict) -> tuple[dict, dict]:
    """Send back this rank's rows of the input: the per-step traffic pattern of a batch-split forward."""
    x = tensors["x"]
    lo, hi = batch_rows(x.shape[0], ctx.world_size, ctx.rank)
    return {}, ({"out": x[lo:hi].clone()} if hi > lo else {})


def load_broadcast(ctx, payload: dict, tensors: dict) -> dict:
    """The usual way (raylight, torch docs): rank 0 reads the whole checkpoint, FSDP broadcasts it to the others."""
    t0 = time.perf_counter()
    model = build_meta(partial(import_path(payload["factory"]), **payload["factory_kwargs"]))
    shard(model, ctx.mesh)
    materialize(model, ctx.torch_device)
    full = load_file(payload["checkpoint"]) if ctx.rank == 0 else {}
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    ctx.objects[payload["handle"]] = {"model": model, "param_dtype": None, "cache": {}}
    return {"seconds": time.perf_counter() - t0, "local_param_bytes": _local_bytes(model)}


def warm(ctx, payload: dict, tensors: dict) -> dict:
    """Import the model code, so that load time and RSS measure the weights, not the import of diffusers."""
    import_path(payload["factory"])
    from diffusers import WanTransformer3DModel  # noqa: F401  (the factory imports it lazily)

    return {}
