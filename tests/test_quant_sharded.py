"""fp8 checkpoints sharded over gloo ranks: all-gathered as their fp8 bytes (``mgpu.weights.quant.Fp8Weight``), computed
exactly like the same model dequantized on one device, at about half the all-gather bytes of bf16."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import tiny_models as tm
from rank_runs import gloo_mesh, run_ranks
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from mgpu.sharding.fsdp import build_meta, materialize, shard
from mgpu.weights.quant import Fp8Weight, store_as
from mgpu.sharding.slice_load import load_sharded

FP8 = torch.float8_e4m3fn
RUN_TIMEOUT_S = 180


class CastingLinear(nn.Linear):
    """A layer that casts its stored weight to the input's dtype itself, as ComfyUI's manual-cast ops do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.to(x.dtype))


class CastingStack(nn.Module):
    """Blocks of nothing but fp8 weights (20 rows: 7/7/6 over 3 ranks), so each FSDP unit gathers only fp8."""

    def __init__(self, dim: int = 20, layers: int = 3):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(CastingLinear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = nn.functional.gelu(block(h))
        return h


def fp8_mlp(factory=tm.tiny_mlp, kinds: tuple[type[nn.Module], ...] = (nn.Linear,)) -> nn.Module:
    """The model with the weights of its ``kinds`` layers stored in fp8 (biases, norms, buffers keep their dtype)."""
    model = factory()
    store_as(model, FP8, kinds=kinds)
    return model


def casting_stack() -> nn.Module:
    """Its fp8 version, under FSDP without a param_dtype: the blocks get the gathered fp8 weights as stored."""
    return fp8_mlp(CastingStack, kinds=(CastingLinear,))


def bf16_wide_mlp() -> nn.Module:
    return tm.wide_mlp().to(torch.bfloat16)


def fp8_wide_mlp() -> nn.Module:
    return fp8_mlp(bf16_wide_mlp)


def quantized_state(model: nn.Module, dtype: torch.dtype | None = None,
                    kinds: tuple[type[nn.Module], ...] = (nn.Linear,)) -> dict[str, torch.Tensor]:
    """``model``'s state with the weights of ``kinds`` layers in fp8 and the rest in ``dtype`` (or as they are)."""
    fp8 = {f"{name}.weight" for name, sub in model.named_modules() if isinstance(sub, kinds)}
    return {k: (v.to(FP8) if k in fp8 else v.to(dtype) if dtype else v).contiguous()
            for k, v in model.state_dict().items()}


def dequantized(state: dict[str, torch.Tensor], factory=tm.tiny_mlp) -> nn.Module:
    """The single-device reference: the same model with the fp8 weights upcast to fp32."""
    model = factory()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model.eval()


@contextmanager
def counting_all_gathers(counter: dict[str, int]):
    """Count the bytes each all-gather this rank joins receives, whatever name this torch's FSDP calls it by."""
    saved = {}
    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(output, *args, _original=original, **kwargs):
            counter["bytes"] = counter.get("bytes", 0) + output.numel() * output.element_size()
            return _original(output, *args, **kwargs)

        saved[name] = original
        setattr(dist, name, counted)
    try:
        yield counter
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _sharded(factory, mesh, ckpt: str, param_dtype: torch.dtype | None) -> nn.Module:
    model = shard(build_meta(factory), mesh, param_dtype=param_dtype)
    materialize(model, "cpu")
    load_sharded(model, ckpt)
    return model.eval()


@torch.no_grad()
def _rank_main(rank: int, world: int, workdir: str) -> None:
    with gloo_mesh(rank, world, workdir) as mesh:
        out: dict[str, torch.Tensor] = {}
        numbers: dict[str, object] = {}
        x = tm.mlp_inputs(2)["x"]
        model = _sharded(fp8_mlp, mesh, f"{workdir}/fp8.safetensors", torch.float32)
        numbers["wrapped"] = sum(isinstance(p.to_local(), Fp8Weight) for p in model.parameters())
        out["upcast"] = model(x)
        out["upcast_again"] = model(x)   # the second gather refills FSDP's buffers in place
        model = _sharded(casting_stack, mesh, f"{workdir}/casting.safetensors", None)
        out["as_fp8"] = model(x)
        for name, factory, dtype in (("bf16", bf16_wide_mlp, torch.bfloat16), ("fp8", fp8_wide_mlp, torch.bfloat16)):
            model = _sharded(factory, mesh, f"{workdir}/wide_{name}.safetensors", dtype)
            wide_x = tm.mlp_inputs(1)["x"].to(torch.bfloat16)
            with counting_all_gathers({}) as counter:
                out[f"wide_{name}"] = model(wide_x)
            numbers[f"gathered_{name}"] = counter["bytes"]
        save_file({k: v.contiguous() for k, v in out.items()}, f"{workdir}/rank{rank}.safetensors")
        Path(f"{workdir}/rank{rank}.json").write_text(json.dumps(numbers))


class Run:
    def __init__(self, world: int, workdir: Path):
        self.world = world
        self.fp8 = quantized_state(tm.reference("mlp"))
        save_file(self.fp8, workdir / "fp8.safetensors")
        self.casting = quantized_state(tm.seeded_init(CastingStack()), kinds=(CastingLinear,))
        save_file(self.casting, workdir / "casting.safetensors")
        wide = tm.seeded_init(tm.wide_mlp())
        self.wide_bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in wide.state_dict().items()}
        save_file(self.wide_bf16, workdir / "wide_bf16.safetensors")
        self.wide_fp8 = quantized_state(wide, torch.bfloat16)
        save_file(self.wide_fp8, workdir / "wide_fp8.safetensors")
        run_ranks(_rank_main, world, (world, str(workdir)), ["tiny_models"], RUN_TIMEOUT_S)
        self.out = [load_file(workdir / f"rank{r}.safetensors") for r in range(world)]
        self.numbers = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def run(request, tmp_path_factory) -> Run:
    return Run(request.param, tmp_path_factory.mktemp(f"quant{request.param}"))


@torch.no_grad()
def test_fp8_sharded_upcast_matches_dequantized_single_device(run: Run):
    want = dequantized(run.fp8)(tm.mlp_inputs(2)["x"])
    for rank, out in enumerate(run.out):
        assert run.numbers[rank]["wrapped"] == 10   # embed, 4 x (fc1, fc2), head
        assert torch.allclose(out["upcast"], want, rtol=1e-6, atol=1e-6), rank
        assert torch.equal(out["upcast_again"], out["upcast"]), rank


@torch.no_grad()
def test_fp8_gathered_as_fp8_reaches_layers_that_cast_themselves(run: Run):
    """No param_dtype: the blocks get the fp8 weights as stored, like ComfyUI's manual-cast ops on CPU ranks; gloo
    has no float8 all-gather, so units of only fp8 weights fail unless they travel as bytes."""
    want = dequantized(run.casting, CastingStack)(tm.mlp_inputs(2)["x"])
    for rank, out in enumerate(run.out):
        assert torch.allclose(out["as_fp8"], want, rtol=1e-6, atol=1e-6), rank


def test_fp8_all_gathers_about_half_the_bytes_of_bf16(run: Run):
    for numbers in run.numbers:
        ratio = numbers["gathered_fp8"] / numbers["gathered_bf16"]
        assert 0.49 < ratio < 0.52, (numbers, ratio)


@torch.no_grad()
def test_wide_fp8_sharded_matches_dequantized(run: Run):
    model = dequantized(run.wide_fp8, tm.wide_mlp).to(torch.bfloat16)
    want = model(tm.mlp_inputs(1)["x"].to(torch.bfloat16))
    for out in run.out:
        assert torch.allclose(out["wide_fp8"].float(), want.float(), rtol=1e-2, atol=1e-2)

