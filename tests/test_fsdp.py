"""FSDP2 sharding and per-rank slice loading, checked against the single-device result of real model code.

The distributed runs start their own gloo process groups (2 and 3 ranks; 3 gives uneven and empty shards). Each run
does every scenario once; ranks write tensors (safetensors) and numbers (JSON) that the tests compare here.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest
import tiny_models as tm
from rank_runs import gloo_mesh, run_ranks
import torch
import torch.distributed as dist
from comfyui_env import SKIP_REASON
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from mgpu.errors import ShardingError, SizingError
from mgpu.sharding.fsdp import build_meta, compute_dtype_for, find_block_lists, materialize, shard
from mgpu.sharding.slice_load import load_sharded, shard_row_range

HAVE_COMFY = tm.comfyui_path() is not None
COMFY_MODELS = ["comfy_wan", "comfy_wan_bf16"]
MODELS = ["mlp", "diffusers_wan"] + (COMFY_MODELS if HAVE_COMFY else [])          # what the ranks run
MODEL_PARAMS = ["mlp", "diffusers_wan"] + [
    pytest.param(m, marks=[pytest.mark.comfyui, pytest.mark.skipif(not HAVE_COMFY, reason=SKIP_REASON)])
    for m in COMFY_MODELS]
FROM_BF16 = "mlp_from_bf16"   # the fp32 MLP loaded from a bf16 checkpoint: 2-byte rows converted on load
# Ranks fork from a server that imported torch and diffusers once: spawning each rank from scratch costs ~10 s of
# imports per rank on a small CPU, far more than the work.
PRELOAD = ["tiny_models", "diffusers.models.transformers.transformer_wan"]
SPLIT_SEED = 100          # rank r of the batch-split check feeds inputs seeded SPLIT_SEED + r
RUN_TIMEOUT_S = 150


# ----------------------------------------------------------------------------------------------- rank side

def _sharded(name: str, mesh, ckpt: str, *, restore_buffers: bool = True, **shard_kwargs) -> tuple[nn.Module, dict]:
    model = shard(build_meta(tm.MODELS[name][0]), mesh, **shard_kwargs)
    if restore_buffers:
        materialize(model, "cpu")
    else:
        model.to_empty(device="cpu")   # what materialize must do better: rotary tables become garbage
    report = load_sharded(model, ckpt)
    return model.eval(), report.to_dict()


def _resident_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage this rank keeps between forwards (FSDP's padded shards)."""
    storages = {}
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


@torch.no_grad()
def _rank_main(rank: int, world: int, workdir: str, models: list[str]) -> None:
    with gloo_mesh(rank, world, workdir) as mesh:
        tensors: dict[str, torch.Tensor] = {}
        numbers: dict[str, object] = {}
        for name in models:
            _, make_inputs, run = tm.MODELS[name]
            ckpt = f"{workdir}/{name}.safetensors"
            model, numbers[f"{name}/report"] = _sharded(name, mesh, ckpt)
            for key, p in model.named_parameters():
                tensors[f"{name}/local/{key}"] = p.to_local().clone()
            for batch in (1, 2):
                tensors[f"{name}/out{batch}"] = run(model, make_inputs(batch))
            tensors[f"{name}/split"] = run(model, make_inputs(1, seed=SPLIT_SEED + rank))
            numbers[f"{name}/resident"] = _resident_bytes(model)
            del model
        # bf16 all-gather and compute; and a model that keeps gathered weights, prefetching two blocks.
        model, _ = _sharded("diffusers_wan", mesh, f"{workdir}/diffusers_wan.safetensors",
                            param_dtype=compute_dtype_for("cpu", torch.bfloat16))
        tensors["diffusers_wan/bf16"] = tm.run_diffusers_wan(model, tm.diffusers_wan_inputs(2, dtype=torch.bfloat16))
        model, _ = _sharded("mlp", mesh, f"{workdir}/mlp.safetensors", reshard_after_forward=False, prefetch=2)
        tensors["mlp/kept1"] = model(**tm.mlp_inputs(2))
        tensors["mlp/kept2"] = model(**tm.mlp_inputs(2))
        model, _ = _sharded("diffusers_wan", mesh, f"{workdir}/diffusers_wan.safetensors", restore_buffers=False)
        tensors["diffusers_wan/no_restore"] = tm.run_diffusers_wan(model, tm.diffusers_wan_inputs(2))
        # a bf16 checkpoint: 2-byte rows, converted on load
        model, numbers[f"{FROM_BF16}/report"] = _sharded("mlp", mesh, f"{workdir}/{FROM_BF16}.safetensors")
        for key, p in model.named_parameters():
            tensors[f"{FROM_BF16}/local/{key}"] = p.to_local().clone()
        save_file({k: v.contiguous() for k, v in tensors.items()}, f"{workdir}/rank{rank}.safetensors")
        Path(f"{workdir}/rank{rank}.json").write_text(json.dumps(numbers))


# ----------------------------------------------------------------------------------------------- test side

class Run:
    """One distributed run: the references, the checkpoints and what each rank sent back."""

    def __init__(self, world: int, workdir: Path):
        self.world, self.workdir = world, workdir
        self._expected: dict[tuple, torch.Tensor] = {}
        self.refs = {name: tm.reference(name) for name in MODELS}
        self.state = {name: tm.save_checkpoint(m, workdir / f"{name}.safetensors") for name, m in self.refs.items()}
        self.state[FROM_BF16] = tm.save_checkpoint(self.refs["mlp"], workdir / f"{FROM_BF16}.safetensors",
                                                   dtype=torch.bfloat16)
        run_ranks(_rank_main, world, (world, str(workdir), MODELS), PRELOAD, RUN_TIMEOUT_S)
        self.tensors = [load_file(workdir / f"rank{r}.safetensors") for r in range(world)]
        self.numbers = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]

    @torch.no_grad()
    def expected(self, name: str, batch: int = 1, seed: int = 0) -> torch.Tensor:
        """The single-device output, computed once per input."""
        key = (name, batch, seed)
        if key not in self._expected:
            _, make_inputs, run = tm.MODELS[name]
            self._expected[key] = run(self.refs[name], make_inputs(batch, seed=seed))
        return self._expected[key]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def run(request, tmp_path_factory) -> Run:
    return Run(request.param, tmp_path_factory.mktemp(f"fsdp{request.param}"))


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    scale = want.abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= rel * max(scale, 1.0), f"{what}: max abs diff {diff:.3g} vs output scale {scale:.3g}"


@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_sharded_forward_matches_single_device(run: Run, name: str):
    for batch in (1, 2):
        want = run.expected(name, batch)
        for r, t in enumerate(run.tensors):
            _assert_close(t[f"{name}/out{batch}"], want, 1e-5, f"{name} batch {batch} rank {r}/{run.world}")


@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_batch_split_each_rank_gets_its_own_result(run: Run, name: str):
    """How the sampler splits cond/uncond: every rank feeds its own input through the one sharded model."""
    outs = [t[f"{name}/split"] for t in run.tensors]
    for r, got in enumerate(outs):
        _assert_close(got, run.expected(name, 1, seed=SPLIT_SEED + r), 1e-5, f"{name} split rank {r}")
    assert not torch.allclose(outs[0], outs[1]), "ranks fed different inputs but got the same output"


@torch.no_grad()
def test_bf16_compute_matches_single_device_bf16(run: Run):
    """param_dtype=bf16 computes like the one-GPU model with bf16 weights, and within bf16 error of fp32."""
    fp32 = run.expected("diffusers_wan", 2)
    single = copy.deepcopy(run.refs["diffusers_wan"])
    for p in single.parameters():
        p.data = p.data.to(torch.bfloat16)
    want = tm.run_diffusers_wan(single, tm.diffusers_wan_inputs(2, dtype=torch.bfloat16))
    for r, t in enumerate(run.tensors):
        got = t["diffusers_wan/bf16"]
        assert got.dtype == torch.bfloat16, f"rank {r} computed in {got.dtype}"
        _assert_close(got, want, 1e-2, f"bf16 rank {r} vs single-device bf16")
        _assert_close(got, fp32, 0.05, f"bf16 rank {r} vs fp32")


def test_reshard_after_forward_false_and_deeper_prefetch(run: Run):
    want = run.expected("mlp", 2)
    for t in run.tensors:
        _assert_close(t["mlp/kept1"], want, 1e-5, "first forward")
        _assert_close(t["mlp/kept2"], want, 1e-5, "second forward on kept weights")


def test_nonpersistent_buffers_restored(run: Run):
    """diffusers' Wan rotary tables are in no checkpoint: after a bare to_empty they are garbage."""
    want = run.expected("diffusers_wan", 2)
    for t in run.tensors:
        got = t["diffusers_wan/no_restore"]
        assert not torch.allclose(got, want, atol=1e-3), "bare to_empty gave the right output: test is vacuous"
        _assert_close(t["diffusers_wan/out2"], want, 1e-5, "materialize")


@pytest.mark.parametrize("name", MODEL_PARAMS)
def test_resident_parameter_bytes_about_one_nth(run: Run, name: str):
    model = run.refs[name]
    total = sum(_nbytes(p) for p in model.parameters())
    block = max(sum(_nbytes(p) for p in b.parameters()) for b in model.blocks)
    for r, numbers in enumerate(run.numbers):
        resident = numbers[f"{name}/resident"]
        assert abs(resident - total / run.world) <= 0.1 * total / run.world + block, (
            f"{name} rank {r}: {resident} resident bytes, model {total} / {run.world} ranks")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rows(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """The rows FSDP2 gives ``rank``, from torch.chunk itself (independent of mgpu's own computation)."""
    chunks = torch.chunk(full, world, dim=0)
    return chunks[rank] if rank < len(chunks) else full[:0]


@pytest.mark.parametrize("name", [*MODEL_PARAMS, FROM_BF16])
def test_slice_load_reads_only_own_rows(run: Run, name: str):
    model = run.refs["mlp" if name == FROM_BF16 else name]
    dtypes = {k: p.dtype for k, p in model.named_parameters()}
    prefix = tm.checkpoint_prefix(model)
    state = run.state[name]
    params = {k for k, _ in model.named_parameters()}
    ckpt_bytes = sum(_nbytes(v) for v in state.values())
    sharded_total = sum(_nbytes(state[prefix + k]) for k in params)
    one_row_each = sum(_nbytes(state[prefix + k][:1]) for k in params)   # what uneven chunks can add to 1/N
    reports = [numbers[f"{name}/report"] for numbers in run.numbers]
    assert sum(rep["sharded_bytes_read"] for rep in reports) == sharded_total, "ranks together read each row once"
    for r, report in enumerate(reports):
        own = {k: _rows(state[prefix + k], run.world, r) for k in params}
        # exactly this rank's rows of every parameter, plus every persistent buffer whole
        assert report["sharded_bytes_read"] == sum(_nbytes(v) for v in own.values())
        assert report["unsharded_bytes_read"] == ckpt_bytes - sharded_total
        assert report["sharded_bytes_read"] <= sharded_total / run.world + one_row_each
        assert report["bytes_read"] < 0.75 * ckpt_bytes, f"rank {r} read most of the checkpoint"
        assert report["max_read_bytes"] == max([_nbytes(v) for v in own.values()] + [
            _nbytes(v) for k, v in state.items() if k.removeprefix(prefix) not in params])
        assert report["checkpoint_bytes"] == ckpt_bytes and report["prefix"] == prefix
        for k, rows in own.items():
            local = run.tensors[r][f"{name}/local/{k}"]
            assert local.dtype == dtypes[k]
            assert torch.equal(local, rows.to(local.dtype)), f"{name} rank {r}: shard of {k} != checkpoint rows"


# ------------------------------------------------------------------------------------- single-process checks

@pytest.mark.parametrize("rows,world", [(r, w) for r in range(12) for w in range(1, 6)])
def test_shard_row_range_is_torch_chunk(rows: int, world: int):
    full = torch.arange(rows)
    for rank in range(world):
        start, stop = shard_row_range(rows, world, rank)
        assert torch.equal(full[start:stop], _rows(full, world, rank))


class _TwoStacks(nn.Module):
    """Flux-like: two block stacks of different classes, and small ModuleLists nested inside blocks."""

    def __init__(self):
        super().__init__()
        self.double = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.LayerNorm(8)] * 2))
                                    for _ in range(3))
        self.single = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.pair = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])   # too small to shard
        self.head = nn.Linear(8, 8)


def test_find_block_lists():
    assert find_block_lists(tm.reference("mlp")) == ["blocks"]
    assert find_block_lists(build_meta(tm.tiny_diffusers_wan)) == ["blocks"]
    assert find_block_lists(_TwoStacks()) == ["double", "single"]   # definition order, for prefetching
    assert find_block_lists(_TwoStacks(), ["double"]) == ["double"]


def test_find_block_lists_errors_name_the_model_and_the_fix():
    with pytest.raises(ShardingError, match=r"_TwoStacks has no block list named \['nope'\].*double"):
        find_block_lists(_TwoStacks(), ["nope"])
    with pytest.raises(ShardingError, match=r"(?s)repeated transformer blocks of Sequential.*blocks=\['blocks'\]"):
        find_block_lists(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def test_compute_dtype_for():
    assert compute_dtype_for("cpu", torch.bfloat16) is torch.bfloat16
    assert compute_dtype_for("cuda:1", torch.bfloat16, capability=(7, 5)) is torch.float16
    assert compute_dtype_for("cuda:0", torch.bfloat16, capability=(8, 0)) is torch.bfloat16
    assert compute_dtype_for("cuda:0", torch.float16, capability=(6, 1)) is torch.float16
    assert compute_dtype_for("cpu", None) is None
    with pytest.raises(ShardingError, match="storage dtype"):
        compute_dtype_for("cpu", torch.float8_e4m3fn)


@torch.no_grad()
def test_materialize_restores_nonpersistent_buffers(tmp_path):
    ref = tm.reference("diffusers_wan")
    tm.save_checkpoint(ref, tmp_path / "wan.safetensors")
    inputs = tm.diffusers_wan_inputs(1)
    want = tm.run_diffusers_wan(ref, inputs)
    bare = build_meta(tm.tiny_diffusers_wan).to_empty(device="cpu")
    bare.rope.freqs_cos.fill_(float("nan"))   # uninitialised memory, made deterministic
    load_sharded(bare, tmp_path / "wan.safetensors")
    assert not torch.isfinite(tm.run_diffusers_wan(bare.eval(), inputs)).all()
    model = materialize(build_meta(tm.tiny_diffusers_wan), "cpu")
    load_sharded(model, tmp_path / "wan.safetensors")
    assert torch.equal(tm.run_diffusers_wan(model.eval(), inputs), want)


def test_materialize_refuses_nonpersistent_buffers_on_meta():
    with torch.device("meta"):
        model = tm.tiny_mlp()
    with pytest.raises(ShardingError, match=r"TinyMLP has non-persistent buffers on meta.*build_meta"):
        materialize(model, "cpu")


@torch.no_grad()
def test_load_detects_prefix_and_converts_dtypes(tmp_path):
    ref = tm.reference("mlp")
    state = {f"model.diffusion_model.{k}": v.to(torch.float8_e4m3fn) for k, v in ref.state_dict().items()}
    state["first_stage_model.decoder.weight"] = torch.zeros(3)   # other components of a combined file
    state["model.diffusion_model.scaled_fp8"] = torch.zeros(1)   # a marker this model has no use for
    save_file(state, tmp_path / "combined.safetensors")
    model = materialize(build_meta(tm.tiny_mlp), "cpu")
    with pytest.raises(ShardingError, match=r"unexpected keys 1 \(model.diffusion_model.scaled_fp8\)"):
        load_sharded(model, tmp_path / "combined.safetensors")
    report = load_sharded(model, tmp_path / "combined.safetensors", strict=False)
    assert report.unexpected == ["model.diffusion_model.scaled_fp8"]
    assert report.prefix == "model.diffusion_model." and report.world_size == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, state["model.diffusion_model." + k].float()), k
    assert report.bytes_read == report.unsharded_bytes_read == sum(v.numel() for k, v in ref.state_dict().items())


@torch.no_grad()
def test_load_sharded_folder_with_index_and_key_map(tmp_path):
    ref = tm.reference("mlp")
    state = {k.replace("blocks.", "layers."): v for k, v in ref.state_dict().items()}
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, tmp_path / "part-1.safetensors")
    save_file({k: state[k] for k in names[half:]}, tmp_path / "part-2.safetensors")
    weight_map = {k: "part-1.safetensors" if i < half else "part-2.safetensors" for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = materialize(build_meta(tm.tiny_mlp), "cpu")
    load_sharded(model, tmp_path, key_map=lambda k: k.replace("blocks.", "layers."))
    assert torch.equal(model(**tm.mlp_inputs(2)), ref(**tm.mlp_inputs(2)))


def test_key_mismatch_lists_missing_unexpected_and_shapes(tmp_path):
    state = dict(tm.reference("mlp").state_dict())
    del state["blocks.1.fc1.weight"]
    state["blocks.9.fc1.weight"] = torch.zeros(1)
    state["head.weight"] = torch.zeros(3, 20)
    save_file(state, tmp_path / "other.safetensors")
    model = materialize(build_meta(tm.tiny_mlp), "cpu")
    with pytest.raises(ShardingError) as info:
        load_sharded(model, tmp_path / "other.safetensors")
    msg = str(info.value)
    for needle in ("other.safetensors", "TinyMLP", "missing keys 1 (blocks.1.fc1.weight)",
                   "unexpected keys 1 (blocks.9.fc1.weight)", "head.weight: checkpoint (3, 20) vs model (2, 20)",
                   "key_map="):
        assert needle in msg, f"{needle!r} not in: {msg}"


def test_many_missing_keys_are_capped(tmp_path):
    save_file({f"unrelated.{i}": torch.zeros(1) for i in range(30)}, tmp_path / "vae.safetensors")
    with pytest.raises(ShardingError, match=r"missing keys 29 \((\S+, ){9}\S+, \.\.\.\); unexpected keys 30"):
        load_sharded(materialize(build_meta(tm.tiny_mlp), "cpu"), tmp_path / "vae.safetensors")


def test_load_before_materialize_and_bad_files(tmp_path):
    tm.save_checkpoint(tm.reference("mlp"), tmp_path / "mlp.safetensors")
    with pytest.raises(ShardingError, match="call mgpu.sharding.fsdp.materialize"):
        load_sharded(build_meta(tm.tiny_mlp), tmp_path / "mlp.safetensors")
    (tmp_path / "model.ckpt.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(SizingError, match="model.ckpt.safetensors"):
        load_sharded(tm.reference("mlp"), tmp_path / "model.ckpt.safetensors")
    data = (tmp_path / "mlp.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-16])
    with pytest.raises(SizingError, match="cut.safetensors.*truncated"):
        load_sharded(tm.reference("mlp"), tmp_path / "cut.safetensors")
    with pytest.raises(SizingError, match="absent.safetensors"):
        load_sharded(tm.reference("mlp"), tmp_path / "absent.safetensors")


class _Interleaved(nn.Module):
    """Wan VACE's shape: a second block stack whose entries run between the main blocks, not after them."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.side = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if i % 2 == 0:
                x = x + self.side[i // 2](x)
        return self.head(x)


@torch.no_grad()
def test_prefetch_follows_execution_order_not_definition_order(tmp_path, monkeypatch):
    """Each unit prefetches the unit that runs after it (blocks[0] -> side[0] -> blocks[1] ...), as the test observes
    the forward run, and the output stays the unsharded one."""
    from torch.distributed.fsdp import FSDPModule

    prefetches: dict[nn.Module, list[nn.Module]] = {}
    real = FSDPModule.set_modules_to_forward_prefetch

    def spy(self, modules):
        prefetches[self] = list(modules)
        return real(self, modules)

    monkeypatch.setattr(FSDPModule, "set_modules_to_forward_prefetch", spy)
    torch.manual_seed(0)
    reference = _Interleaved()
    x = torch.randn(3, 8)
    want = reference(x)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = copy.deepcopy(reference)
        shard(model, init_device_mesh("cpu", (1,)))
        ran: list[nn.Module] = []
        for unit in [*model.blocks, *model.side]:
            unit.register_forward_pre_hook(lambda m, a: ran.append(m))
        assert not prefetches, "prefetch set before the first forward could show the execution order"
        got = [model(x) for _ in range(2)]
    finally:
        dist.destroy_process_group()
    order = ran[:len(ran) // 2]
    assert order == [model.blocks[0], model.side[0], model.blocks[1], model.blocks[2], model.side[1],
                     model.blocks[3]]
    chain = [model, *order]
    assert prefetches == {unit: [chain[i + 1]] for i, unit in enumerate(chain[:-1])}
    for out in got:
        torch.testing.assert_close(out, want)
