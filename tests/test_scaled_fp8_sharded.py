"""Scaled fp8 under FSDP: per-layer scalar scales are replicated on every rank (FSDP2 cannot shard a scalar) while
the fp8 weights are sharded and all-gathered as fp8 bytes; ComfyUI 0.3.x's scaled-fp8 files are detected for its
scaled-fp8 ops, newer ComfyUI converts them to its quantized layers (``test_comfy_quant_sharded.py``). The end-to-end
check against stock UNETLoader is ``test_comfyui_quant.py::test_scaled_fp8_file_matches_stock``."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models as tm
from rank_runs import gloo_mesh, run_ranks
import torch
from safetensors.torch import load_file, save_file
from scaled_fp8_files import FP8, scaled_fp8_state, write_scaled_fp8
from torch import nn
from torch.distributed.tensor import DTensor

from mgpu.sharding.fsdp import build_meta, materialize, shard
from mgpu.sharding.slice_load import load_sharded

RUN_TIMEOUT_S = 180


class ScaledLinear(nn.Linear):
    """A layer like ComfyUI's scaled-fp8 Linear: fp8 weight times a scalar parameter, in the input's dtype."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_weight = nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype) * self.scale_weight.to(x.dtype), self.bias)


class ScaledStack(nn.Module):
    """Three blocks of 20 rows (10/10 over 2 ranks), each with its own scale."""

    def __init__(self, dim: int = 20, layers: int = 3):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(ScaledLinear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = nn.functional.gelu(block(h))
        return h


def scaled_stack_state() -> dict[str, torch.Tensor]:
    """A seeded ScaledStack's state as a scaled-fp8 file holds it (scales far from 1, so ignoring one shows)."""
    state = {k: v for k, v in tm.seeded_init(ScaledStack()).state_dict().items() if not k.endswith("scale_weight")}
    state = scaled_fp8_state(state)
    del state["scaled_fp8"]
    return {k: v.contiguous() for k, v in state.items() if not k.endswith("scale_input")}


def reference(state: dict[str, torch.Tensor]) -> nn.Module:
    """The same model on one device: the file's fp8 weights and scales as they are."""
    model = ScaledStack()
    for block in model.blocks:
        block.weight = nn.Parameter(block.weight.data.to(FP8), requires_grad=False)
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def _rank_main(rank: int, world: int, workdir: str) -> None:
    with gloo_mesh(rank, world, workdir) as mesh:
        model = shard(build_meta(ScaledStack), mesh)
        materialize(model, "cpu")
        load_sharded(model, f"{workdir}/scaled.safetensors")
        out = {"y": model.eval()(tm.mlp_inputs(2)["x"])}
        for i, block in enumerate(model.blocks):
            out[f"scale{i}"] = block.scale_weight.clone()
            out[f"weight_is_dtensor{i}"] = torch.tensor(isinstance(block.weight, DTensor))
            out[f"scale_is_dtensor{i}"] = torch.tensor(isinstance(block.scale_weight, DTensor))
        save_file(out, f"{workdir}/rank{rank}.safetensors")


def rank_outputs(world: int, workdir: Path) -> list[dict[str, torch.Tensor]]:
    run_ranks(_rank_main, world, (world, str(workdir)), ["tiny_models"], RUN_TIMEOUT_S)
    return [load_file(workdir / f"rank{r}.safetensors") for r in range(world)]


def test_scalar_scales_are_replicated_and_the_fp8_rows_sharded(tmp_path: Path) -> None:
    """Sharded over 2 gloo ranks (fully_shard alone refuses scalar parameters): every rank holds every scale
    whole, with the file's value, the fp8 weights stay sharded, and the output is the single-device model's."""
    state = scaled_stack_state()
    save_file(state, tmp_path / "scaled.safetensors")
    with torch.no_grad():
        want = reference(state)(tm.mlp_inputs(2)["x"])
    for out in rank_outputs(2, tmp_path):
        assert torch.allclose(out["y"], want, rtol=1e-5, atol=1e-6), (out["y"] - want).abs().max()
        for i in range(3):
            assert torch.equal(out[f"scale{i}"], state[f"blocks.{i}.scale_weight"])
            assert out[f"weight_is_dtensor{i}"] and not out[f"scale_is_dtensor{i}"]


HAVE_COMFY = tm.comfyui_path() is not None


def comfy_version() -> str:
    tm._import_comfy()
    from comfyui_version import __version__

    return __version__


@pytest.mark.comfyui
@pytest.mark.skipif(not HAVE_COMFY, reason="needs a ComfyUI checkout (COMFYUI_PATH)")
def test_scaled_fp8_file_is_detected_as_this_comfyui_builds_it(tmp_path: Path) -> None:
    """ComfyUI 0.3.x builds scaled-fp8 files with its scaled-fp8 ops, which the ranks run; newer ComfyUI converts
    them to its quantized layers (convert_old_quants: every scaled layer float8_e4m3fn), which the ranks shard."""
    import comfy_checkpoints as cc

    tm._import_comfy()
    from loaders.rank_factory import detect, quantized, quantized_layers, scaled_fp8

    path = write_scaled_fp8(cc.write_tiny_wan21_t2v(tmp_path / "wan.safetensors"), tmp_path / "wan_scaled.safetensors")
    model_config, sd, prefix = detect(str(path))
    assert type(model_config).__name__ == "WAN21_T2V" and "scaled_fp8" not in sd and prefix == ""
    if comfy_version().startswith("0.3."):
        assert scaled_fp8(model_config) and model_config.scaled_fp8 == FP8 and not quantized(model_config)
    else:
        layers = quantized_layers(sd)
        assert quantized(model_config) and not scaled_fp8(model_config)
        assert len(layers) == 20 and {c["format"] for c in layers.values()} == {"float8_e4m3fn"}
    plain = detect(str(tmp_path / "wan.safetensors"))[0]
    assert not scaled_fp8(plain) and not quantized(plain)
