"""ComfyUI's quantized checkpoints (scaled-fp8 files converted by ComfyUI 0.33, ``_quantization_metadata`` files)
sharded: the fp8 rows split over the ranks and all-gathered as bytes, one scale per layer held whole by every rank,
and for each forward the gathered bytes are ComfyUI's own QuantizedTensor again, so ComfyUI's ops compute.

The FSDP mechanics are checked with a stand-in quantized tensor on any torch (also the 2.11 floor); the ComfyUI tests
compare the sharded network with stock ComfyUI's on the same file; the end-to-end sampler check is
``test_comfyui_quant.py``. Which fp8 compute path a device takes is checked with fake capabilities.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiny_models as tm
import torch
from rank_runs import gloo_mesh, run_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from scaled_fp8_files import FP8, write_quantized, write_scaled_fp8
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from mgpu.errors import ShardingError
from mgpu.planning.devices import parse_spec
from mgpu.sharding.fsdp import build_meta, materialize, shard
from mgpu.sharding.slice_load import load_sharded
from mgpu.weights.quant import fp8_compute_line, fp8_compute_path, fp8_plan_line, view_weight_as

RUN_TIMEOUT_S = 300
HAVE_COMFY = tm.comfyui_path() is not None


# ------------------------------------------------------------------------ FSDP mechanics, stand-in quantized tensor

class StandInQuantized(torch.Tensor):
    """Like ComfyUI's QuantizedTensor: it reports the compute dtype, holds fp8 data and a scale, and any op on it
    runs on the dequantized value."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> StandInQuantized:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.qdata, self.scale = qdata, scale

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.dtype) * self.scale.to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain = lambda t: t.dequantize() if isinstance(t, StandInQuantized) else t  # noqa: E731
        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


class QuantLinear(nn.Module):
    """A layer that computes only from a quantized weight, as ComfyUI's mixed-precision Linear does."""

    def __init__(self, inp: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, inp, dtype=FP8), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones(()))
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(type(self.weight).__name__)
        assert isinstance(self.weight, StandInQuantized), type(self.weight)
        return nn.functional.linear(x, self.weight, self.bias)


def as_stand_in(module: QuantLinear, gathered: torch.Tensor) -> torch.Tensor:
    return StandInQuantized(gathered.detach(), module.weight_scale, torch.float32)


class QuantStack(nn.Module):
    """Blocks of 21 rows: over 2 ranks 11 + 10, so FSDP pads the last chunk."""

    def __init__(self, dim: int = 21, layers: int = 3):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(QuantLinear(dim, dim) for _ in range(layers))
        for block in self.blocks:
            view_weight_as(block, as_stand_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = nn.functional.gelu(block(h))
        return h


def quant_stack_state() -> dict[str, torch.Tensor]:
    """A seeded stack's state as a quantized file holds it: fp8 weights, one fp32 scale per layer (far from 1)."""
    torch.manual_seed(0)
    state = {"embed.weight": torch.randn(21, 8), "embed.bias": torch.randn(21)}
    for i in range(3):
        weight = torch.randn(21, 21) * (i + 1)
        scale = weight.abs().max() / torch.finfo(FP8).max
        state |= {f"blocks.{i}.weight": (weight / scale).to(FP8), f"blocks.{i}.weight_scale": scale,
                  f"blocks.{i}.bias": torch.randn(21)}
    return state


def stand_in_reference(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = nn.functional.linear(x, state["embed.weight"], state["embed.bias"])
    for i in range(3):
        w = state[f"blocks.{i}.weight"].float() * state[f"blocks.{i}.weight_scale"]
        h = nn.functional.gelu(nn.functional.linear(h, w, state[f"blocks.{i}.bias"]))
    return h


@torch.no_grad()
def _stand_in_rank(rank: int, world: int, workdir: str) -> None:
    with gloo_mesh(rank, world, workdir) as mesh:
        model = shard(build_meta(QuantStack), mesh)
        materialize(model, "cpu")
        load_sharded(model, f"{workdir}/quant.safetensors")
        x = tm.mlp_inputs(2)["x"]
        out = {"y": model.eval()(x), "y_again": model(x)}
        for i, block in enumerate(model.blocks):
            out[f"seen{i}"] = torch.tensor([name == "StandInQuantized" for name in block.seen])
            out[f"weight_sharded{i}"] = torch.tensor(isinstance(block.weight, DTensor))
            out[f"weight_local_rows{i}"] = torch.tensor(block.weight.to_local().shape[0])
            out[f"scale{i}"] = block.weight_scale.clone()
        save_file(out, f"{workdir}/rank{rank}.safetensors")


def test_gathered_fp8_rows_reach_the_layer_as_its_quantized_tensor(tmp_path: Path) -> None:
    """2 gloo ranks, rows that do not split evenly: each layer computes from a quantized tensor of the gathered fp8
    rows and the replicated scale (twice: the parameter FSDP reshards is put back), and the output is the
    single-device dequantized model's."""
    state = quant_stack_state()
    save_file(state, tmp_path / "quant.safetensors")
    run_ranks(_stand_in_rank, 2, (2, str(tmp_path)), ["tiny_models"], RUN_TIMEOUT_S)
    want = stand_in_reference(state, tm.mlp_inputs(2)["x"])
    for rank, out in enumerate(load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)):
        assert torch.allclose(out["y"], want, rtol=1e-5, atol=1e-6), (out["y"] - want).abs().max()
        assert torch.equal(out["y_again"], out["y"])
        for i in range(3):
            assert out[f"seen{i}"].tolist() == [True, True]
            assert out[f"weight_sharded{i}"] and out[f"weight_local_rows{i}"] == (11, 10)[rank]
            assert torch.equal(out[f"scale{i}"], state[f"blocks.{i}.weight_scale"])


def test_a_forward_that_raises_leaves_the_layer_its_own_weight() -> None:
    """The quantized view lives for one call only, also when the call fails: the next unshard must find FSDP's
    parameter, not a view of freed bytes."""
    layer = QuantLinear(4, 3)
    view_weight_as(layer, as_stand_in)
    own = layer.weight
    layer(torch.ones(2, 4))
    assert layer.weight is own
    with pytest.raises(RuntimeError):
        layer(torch.ones(2, 5))   # wrong width: the matmul raises
    assert layer.weight is own and layer.seen == ["StandInQuantized", "StandInQuantized"]


# ----------------------------------------------------------------------------- the fp8 compute path

@pytest.mark.parametrize(("device", "capability", "kwargs", "expected"), [
    ("cuda:0", (9, 0), {}, "torch._scaled_mm on cuda:0 (sm_90)"),
    ("cuda:1", (8, 9), {}, "torch._scaled_mm on cuda:1 (sm_89)"),
    ("cuda:0", (12, 0), {}, "torch._scaled_mm on cuda:0 (sm_120)"),
    ("cuda:0", (8, 6), {}, "dequantize per layer on cuda:0 (sm_86: fp8 matmul needs sm_89)"),
    ("cuda:0", (7, 5), {}, "dequantize per layer on cuda:0 (sm_75: fp8 matmul needs sm_89)"),
    ("cuda:0", None, {}, "dequantize per layer on cuda:0 (no NVIDIA compute capability known for it)"),
    ("cpu", None, {}, "dequantize per layer on cpu (no fp8 matmul on a CPU)"),
    ("cuda:0", (8, 6), {"forced": True}, "torch._scaled_mm on cuda:0 (--supports-fp8-compute)"),
    ("cuda:0", (9, 0), {"full_precision": True},
     "dequantize per layer on cuda:0 (the checkpoint asks for full-precision matmul)"),
    ("cuda:0", (9, 0), {"plain_cast": True},
     "dequantize per layer on cuda:0 (plain fp8 weights: fp8 matmul only with --fast fp8_matrix_mult)"),
    ("cuda:0", (8, 6), {"plain_cast": True}, "dequantize per layer on cuda:0 (sm_86: fp8 matmul needs sm_89)"),
])
def test_fp8_compute_path_follows_comfyui_rules(device, capability, kwargs, expected) -> None:
    path = fp8_compute_path(device, capability, **kwargs)
    assert str(path) == expected
    assert path.matmul == expected.startswith("torch._scaled_mm")
    assert path.to_dict()["summary"] == expected


def test_the_log_line_names_each_path_once() -> None:
    paths = [fp8_compute_path("cpu", None), fp8_compute_path("cpu", None)]
    assert fp8_compute_line(paths) == "fp8 compute: dequantize per layer on cpu (no fp8 matmul on a CPU)"
    mixed = [fp8_compute_path("cuda:0", (9, 0)), str(fp8_compute_path("cuda:1", (8, 6)))]
    assert fp8_compute_line(mixed) == ("fp8 compute: torch._scaled_mm on cuda:0 (sm_90); "
                                       "dequantize per layer on cuda:1 (sm_86: fp8 matmul needs sm_89)")


def test_the_plan_says_how_an_fp8_dit_computes(tmp_path: Path) -> None:
    """An fp8 DiT's placement names the path of each GPU it computes on (not the host RAM of an offload); other
    dtypes get no such line."""
    import ckpt_layouts as L
    from mgpu.planning.estimates import Workload
    from mgpu.planning.partition import Component, Policy, make_plan
    from mgpu.planning.sizing import size_component

    def dit_reasons(layout: L.Layout) -> list[str]:
        size = size_component(L.write_safetensors(tmp_path / "wan.safetensors", layout, sparse=True))
        plan = make_plan([Component("dit", size)], devices, Workload(frames=17), Policy(prefer_speed=True))
        assert plan.placement("dit").devices == ["cuda:0", "cuda:1"]
        return plan.placement("dit").reasons

    gpu0, gpu1, host = parse_spec("2x24GiB,cpu=64GiB")
    devices = [dataclasses.replace(gpu0, capability=(9, 0)), dataclasses.replace(gpu1, capability=(8, 6)), host]
    assert ("fp8 compute: torch._scaled_mm on cuda:0 (sm_90); dequantize per layer on cuda:1 (sm_86: fp8 matmul "
            "needs sm_89) (ComfyUI's choice for scaled-fp8 and quantized fp8 layers; plain fp8 weights: fp8 matmul "
            "only with --fast fp8_matrix_mult, else dequantize per layer)") in dit_reasons(L.wan21_t2v_1_3b("F8_E4M3"))
    assert not [r for r in dit_reasons(L.wan21_t2v_1_3b()) if "fp8 compute" in r]
    assert fp8_plan_line("bf16", [("cuda:0", (9, 0))]) is None
    assert fp8_plan_line("fp8_e4m3fn", [("cuda:0", (9, 0)), ("cpu", None)]).startswith(
        "fp8 compute: torch._scaled_mm on cuda:0 (sm_90) (ComfyUI's choice")
    assert fp8_plan_line("F8_E5M2", [("cpu", None)]) == ("fp8 compute: dequantize per layer on cpu (no fp8 matmul "
                                                         "on a CPU) (ComfyUI's choice for scaled-fp8 and quantized "
                                                         "fp8 layers)")


# ----------------------------------------------------------------------------- ComfyUI's quantized checkpoints

def comfy_version() -> str:
    tm._import_comfy()
    from comfyui_version import __version__

    return __version__


def converts_quantized() -> bool:
    """Whether this ComfyUI loads scaled-fp8 and _quantization_metadata files as quantized tensors (0.33+)."""
    tm._import_comfy()
    import comfy.utils

    return hasattr(comfy.utils, "convert_old_quants")


needs_comfy = pytest.mark.skipif(not HAVE_COMFY, reason="needs a ComfyUI checkout (COMFYUI_PATH)")


def detect_on_0_3(path: Path):
    """ComfyUI 0.3.x's model config for ``path``, as the ranks would build it."""
    tm._import_comfy()
    from loaders.rank_factory import detect

    return detect(str(path))[0]


def assert_refused_on_0_3(path: Path) -> None:
    """ComfyUI 0.3.x does not know quantized files (it would compute with unscaled fp8): refused by name."""
    tm._import_comfy()
    from loaders.rank_factory import detect

    with pytest.raises(ShardingError, match=rf"{path.name} is a ComfyUI quantized checkpoint.*"
                                            rf"this ComfyUI \({comfy_version()}\) does not know"):
        detect(str(path))


def quantized_files(folder: Path) -> dict[str, Path]:
    """A tiny Wan (3 blocks; ffn rows 255: over 2 ranks 128 + 127, padded) as each quantized layout."""
    import comfy_checkpoints as cc

    plain = cc.write_tiny_wan21_t2v(folder / "wan.safetensors", cc.WanDiTConfig(dim=128, ffn_dim=255, num_layers=3))
    prefixed = cc.write_tiny_wan21_t2v(folder / "wan_prefixed.safetensors", prefix="model.diffusion_model.")
    return {"scaled_fp8": write_scaled_fp8(plain, folder / "wan_fp8_scaled.safetensors", scale_input=0.5),
            "float8_e4m3fn": write_quantized(plain, folder / "wan_e4m3fn.safetensors"),
            "float8_e5m2": write_quantized(plain, folder / "wan_e5m2.safetensors", "float8_e5m2"),
            "prefixed": write_quantized(prefixed, folder / "wan_prefixed_e4m3fn.safetensors",
                                        prefix="model.diffusion_model.")}


def wan_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(1, 16, 2, 8, 8, generator=g), "timestep": torch.tensor([500.0]),
            "context": torch.randn(1, 8, 4096, generator=g)}


def layer_configs(network: nn.Module) -> dict[str, list]:
    """Per quantized layer what ComfyUI decided and holds: format, layout, full-precision flag, scale (stock keeps
    it in its QuantizedTensor, the ranks in a buffer)."""
    configs = {}
    for name, m in network.named_modules():
        if getattr(m, "quant_format", None):
            scale = m.weight.params.scale if hasattr(m.weight, "params") else m.weight_scale
            configs[name] = [m.quant_format, m.layout_type, bool(m._full_precision_mm), scale.item()]
    return configs


@torch.no_grad()
def _comfy_rank(rank: int, world: int, files: dict[str, str], workdir: str) -> None:
    from functools import partial

    tm._import_comfy()
    from loaders.rank_factory import diffusion_model

    with gloo_mesh(rank, world, workdir) as mesh:
        for kind, path in files.items():
            net = build_meta(partial(diffusion_model, path, "float32", ["cpu"] * world, {}))
            shard(net, mesh)
            materialize(net, "cpu")
            report = load_sharded(net, path)
            q = net.blocks[0].ffn[0]
            seen = []
            q.register_forward_pre_hook(lambda m, a: seen.append((type(m.weight).__name__, str(m.weight._qdata.dtype))))
            out = net.eval()(**wan_inputs())
            meta = {"configs": layer_configs(net), "seen": seen, "unexpected": report.unexpected,
                    "weight_sharded": isinstance(q.weight, DTensor), "local_rows": q.weight.to_local().shape[0],
                    "scale_sharded": isinstance(q.weight_scale, DTensor)}
            save_file({"y": out}, f"{workdir}/{kind}_rank{rank}.safetensors", metadata={"meta": json.dumps(meta)})


def stock_outputs(path: Path) -> tuple[torch.Tensor, dict]:
    import comfy.sd

    model = comfy.sd.load_diffusion_model(str(path))
    with torch.no_grad():
        return model.model.diffusion_model(**wan_inputs()), layer_configs(model.model.diffusion_model)


@pytest.mark.comfyui
@needs_comfy
def test_quantized_files_shard_and_compute_exactly_as_stock(tmp_path: Path) -> None:
    """ComfyUI 0.33 (scaled-fp8, float8_e4m3fn, float8_e5m2, a prefixed file): the network on 2 gloo ranks gives
    stock ComfyUI's output bit for bit on the CPU; every layer's format, layout, compute flag and scale are stock's
    and the same on both ranks after fully_shard; the layer computes from ComfyUI's QuantizedTensor of fp8 bytes;
    its weight rows are sharded (padded: 128 + 127), its scale held whole."""
    files = quantized_files(tmp_path)
    if not converts_quantized():   # 0.3.x: scaled-fp8 files get its scaled-fp8 ops (test_scaled_fp8_sharded.py)
        for kind, path in files.items():
            if kind == "scaled_fp8":
                assert detect_on_0_3(path).scaled_fp8 is not None
            else:
                assert_refused_on_0_3(path)
        return
    run_ranks(_comfy_rank, 2, (2, {k: str(p) for k, p in files.items()}, str(tmp_path)), ["tiny_models"],
              RUN_TIMEOUT_S)
    for kind, path in files.items():
        want, stock_configs = stock_outputs(path)
        assert stock_configs and {c[0] for c in stock_configs.values()} == {kind if kind.startswith("float8") else
                                                                          "float8_e4m3fn"}
        ranks = []
        for rank in range(2):
            with safe_open(str(tmp_path / f"{kind}_rank{rank}.safetensors"), "pt") as f:
                y, meta = f.get_tensor("y"), json.loads(f.metadata()["meta"])
            assert torch.equal(y, want), (kind, rank, (y - want).abs().max())
            assert meta["configs"] == stock_configs
            assert meta["seen"] == [["QuantizedTensor", str(FP8 if kind != "float8_e5m2" else torch.float8_e5m2)]]
            assert meta["weight_sharded"] and not meta["scale_sharded"] and meta["unexpected"] == []
            ranks.append(meta)
        if kind != "prefixed":
            assert [m["local_rows"] for m in ranks] == [128, 127]


@pytest.mark.comfyui
@needs_comfy
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "int8_tensorwise", "float8_e4m3fn"])
def test_a_quantized_file_the_ranks_cannot_shard_is_refused_by_name(tmp_path: Path, fmt: str) -> None:
    """Refused by ``detect``, which the host runs before any rank starts: the file, the layer format, a layer,
    and what to do. ComfyUI 0.3.x does not know the quantized format at all (it would drop the scales)."""
    import comfy_checkpoints as cc

    tm._import_comfy()
    from loaders.rank_factory import detect

    plain = cc.write_tiny_wan21_t2v(tmp_path / "wan.safetensors")
    path = write_quantized(plain, tmp_path / f"wan_{fmt}.safetensors", fmt)
    if not converts_quantized():
        with pytest.raises(ShardingError, match=rf"wan_{fmt}.safetensors is a ComfyUI quantized checkpoint.*"
                                                rf"this ComfyUI \({comfy_version()}\) does not know.*Update ComfyUI"):
            detect(str(path))
    elif fmt.startswith("float8"):
        assert detect(str(path))[0].quant_config is not None
    else:
        with pytest.raises(ShardingError, match=rf"wan_{fmt}.safetensors: MGPU Load Diffusion Model cannot shard "
                                                rf"these quantized layers: {fmt}: 20 layers \(blocks.0.*"
                                                r"load this file on one device"):
            detect(str(path))


@pytest.mark.comfyui
@needs_comfy
def test_per_row_fp8_scales_are_refused_by_name(tmp_path: Path) -> None:
    """A float8 layer with one scale per row: stock ComfyUI 0.33 cannot compute it either (its fp8 layout is per
    tensor), so the ranks refuse it up front rather than fail mid-sampling."""
    import comfy_checkpoints as cc

    from loaders.rank_factory import detect

    state = load_file(cc.write_tiny_wan21_t2v(tmp_path / "wan.safetensors"))
    layers = {}
    for key in [k for k, v in state.items() if k.startswith("blocks.") and k.endswith(".weight") and v.ndim == 2]:
        scale = state[key].float().abs().amax(dim=1, keepdim=True) / 448
        state[key], state[key.replace(".weight", ".weight_scale")] = (state[key].float() / scale).to(FP8), scale
        layers[key.removesuffix(".weight")] = {"format": "float8_e4m3fn"}
    path = tmp_path / "wan_rows.safetensors"
    save_file(state, path, metadata={"_quantization_metadata": json.dumps({"layers": layers})})
    if not converts_quantized():
        assert_refused_on_0_3(path)
        return
    with pytest.raises(ShardingError, match=r"float8_e4m3fn with 128 weight_scale values: \d+ layers"):
        detect(str(path))


@pytest.mark.comfyui
@needs_comfy
def test_the_prepare_reply_says_how_the_rank_computes_fp8(tmp_path: Path) -> None:
    """Each rank's prepare reply carries its fp8 compute path (here a CPU: dequantize), and the dtype ComfyUI
    computes a quantized model in whatever the storage candidates; the host's line names the path once."""
    tm._import_comfy()
    from loaders.rank_factory import fp8_compute_summary, prepare

    files = quantized_files(tmp_path)
    ctx = SimpleNamespace(device="cpu", world_size=2)
    plain = prepare(ctx, {"checkpoint": str(tmp_path / "wan.safetensors"), "flags": {}}, {})
    assert plain["fp8_compute"] is None and fp8_compute_summary([plain, plain]) is None
    kinds = ["scaled_fp8", "float8_e4m3fn"] if converts_quantized() else ["scaled_fp8"]
    for kind in kinds:
        reply = prepare(ctx, {"checkpoint": str(files[kind]), "flags": {}}, {})
        assert reply["fp8_compute"]["summary"] == "dequantize per layer on cpu (no fp8 matmul on a CPU)"
        assert fp8_compute_summary([reply, reply]) == ("fp8 compute: dequantize per layer on cpu "
                                                      "(no fp8 matmul on a CPU)")
        if converts_quantized():
            assert set(reply["manual_cast"].values()) == {"float32"}


@pytest.mark.comfyui
@needs_comfy
def test_the_hosts_meta_model_has_stocks_quantized_weights(tmp_path: Path) -> None:
    """The host's meta BaseModel of a quantized file (as MGPU Load Diffusion Model builds it) has the weights, and so
    the state-dict keys, shapes and dtypes, of stock ComfyUI's: weight patches are matched against them. ComfyUI's
    mixed-precision layers have no weight until loaded."""
    if not converts_quantized():   # 0.3.x refuses the file before building any model
        assert_refused_on_0_3(quantized_files(tmp_path)["float8_e4m3fn"])
        return
    import comfy.sd

    from loaders.rank_factory import detect, load_layers_on_meta

    path = quantized_files(tmp_path)["float8_e4m3fn"]
    model_config, sd, _ = detect(str(path))
    model_config.set_inference_dtype(torch.float32, torch.float32)   # what the CPU ranks agree on
    host = model_config.get_model(sd, "", device="meta")
    names = load_layers_on_meta(host.diffusion_model, sd)
    stock = comfy.sd.load_diffusion_model(str(path)).model
    def described(model: nn.Module) -> dict[str, tuple]:
        return {k: (tuple(v.shape), v.dtype) for k, v in model.diffusion_model.state_dict().items()}

    assert len(names) == 30 and described(host) == described(stock)
