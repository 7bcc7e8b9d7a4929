"""GGUF files (city96's ComfyUI-GGUF quantizations) sharded over gloo ranks: dequantized exactly as gguf-py does,
sharded and all-gathered as their stored blocks (``mgpu.weights.gguf.GGUFWeight``), read by rows, sized from the
header; corrupt, truncated and unsupported files refused by name. No ComfyUI needed."""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

import ckpt_layouts as cl
import gguf_files as gf
from mgpu.errors import ShardingError, SizingError
from mgpu.planning.devices import parse_spec
from mgpu.planning.estimates import Workload
from mgpu.planning.partition import Component, make_plan
from mgpu.planning.sizing import read_gguf_header, read_header, size_component
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import ModelSpec, ShardedModule
from mgpu.sharding.slice_load import shard_row_range
from mgpu.weights.gguf import (PLAIN, QUANTIZED, SUPPORTED, GGUFWeight, check_supported, dequantize,
                               load_gguf_sharded, wrap_gguf_parameters)
from rank_runs import gloo_mesh, run_ranks

TESTS = os.path.dirname(os.path.abspath(__file__))
RUN_TIMEOUT_S = 420
# Wan 1.3B-size blocks as a Q4_K_M-style file mixes them: attention Q8_0/Q4_K, FFN Q4_K and Q6_K.
WAN13B_LAYOUT = {f"blocks.{i}.{k}.weight": t for i in range(2) for k, t in
                 (("q", "Q8_0"), ("k", "Q4_K"), ("v", "Q8_0"), ("o", "Q4_K"), ("ffn.0", "Q4_K"), ("ffn.2", "Q6_K"))}


# ------------------------------------------------------------------------------------------ dequantization

def _blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    return gf.encode(values, qtype, rng)


@pytest.mark.parametrize("qtype", [*QUANTIZED, "BF16"])
def test_torch_dequantization_equals_gguf_py(qtype: str):
    """Bit for bit, on 2-D rows of several blocks each (K types: random blocks with finite fp16 scales)."""
    rng = np.random.default_rng(1)
    stored = _blocks(qtype, 24, 512, rng)
    want = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[qtype])
    got = dequantize(torch.from_numpy(stored), qtype)
    assert got.shape == (24, 512) and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want), qtype
    assert torch.equal(dequantize(torch.from_numpy(stored), qtype, torch.bfloat16),
                       torch.from_numpy(want).to(torch.bfloat16))


def test_plain_types_dequantize_to_their_values():
    values = torch.randn(3, 64)
    for qtype, dtype in PLAIN.items():
        stored = values.to(dtype).view(torch.uint8)
        assert torch.equal(dequantize(stored, qtype), values.to(dtype).float()), qtype


@pytest.mark.parametrize("qtype", list(QUANTIZED))
def test_dequantization_makes_no_constant_tensor_per_call(qtype: str, monkeypatch):
    """A tensor made from host values in the step (``torch.tensor([0, 2, 4, 6], device=...)``, which Q6_K did for
    every chunk of every weight) is a host-to-device copy that waits for the GPU: after a device's first call,
    dequantizing (as ``fsdp_post_all_gather`` does every forward) makes no tensor from host values at all."""
    stored = torch.from_numpy(_blocks(qtype, 8, 512, np.random.default_rng(3)))
    first = dequantize(stored, qtype)
    made = []
    for name in ("tensor", "as_tensor", "arange"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _f=original, _n=name, **k: made.append(_n) or _f(*a, **k))
    again = dequantize(stored, qtype)
    assert made == [], f"{qtype} dequantization made {made} per call"
    assert torch.equal(again, first)


# ------------------------------------------------------------------------------------------ header and sizing

def test_header_matches_gguf_reader(tmp_path):
    """Our plain-read parser and gguf-py's reader see the same tensors, types, shapes and byte ranges; shapes in
    torch's order, a 5-D patch embedding and a tensor stored reshaped (comfy.gguf.orig_shape) included."""
    g = torch.Generator().manual_seed(0)
    state = {"patch_embedding.weight": torch.randn(32, 4, 1, 2, 2, generator=g),
             "conv.weight": torch.randn(16, 8, 4, 4, generator=g),      # 2048 values, rows of 128: stored reshaped
             "blocks.0.q.weight": torch.randn(64, 256, generator=g), "blocks.0.k.weight": torch.randn(64, 256,
                                                                                                      generator=g),
             "blocks.0.v.weight": torch.randn(8, 256, generator=g), "blocks.0.q.bias": torch.randn(64, generator=g)}
    types = {"patch_embedding.weight": "F32", "conv.weight": "Q8_0", "blocks.0.q.weight": "Q4_K",
             "blocks.0.k.weight": "BF16", "blocks.0.v.weight": "F16", "blocks.0.q.bias": "F32"}
    path = tmp_path / "m.gguf"
    gf.write_gguf(path, state, types, orig_shapes={"conv.weight": (16, 8, 4, 4)})
    ours = read_gguf_header(path)
    reader = gguf.GGUFReader(path)
    assert ours.format == "gguf" and ours.metadata["general.architecture"] == "wan"
    assert read_header(path).tensors == ours.tensors    # the generic reader answers GGUF files too
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.dtype == t.tensor_type.name
        assert (info.start, info.nbytes) == (t.data_offset, int(t.n_bytes))
        assert info.shape == tuple(state[t.name].shape)
        if t.name != "conv.weight":
            assert info.shape == tuple(int(d) for d in reversed(t.shape))


def test_sizing_a_wan_gguf_from_its_header(tmp_path):
    """Wan 2.1 1.3B as city96's Q4_K file lays it out: the family and dims as for safetensors, the bytes as stored."""
    layout = gf.city96_types(cl.wan21_t2v_1_3b(), "Q4_K")
    path = tmp_path / "wan2.1-t2v-1.3b-Q4_K.gguf"
    gf.write_sparse_gguf(path, layout)
    size = size_component(path)
    stored = {name: info.nbytes for name, info in read_gguf_header(path).tensors.items()}
    assert size.kind == "dit" and size.family == "wan2.1-t2v-1.3b" and size.warnings == []
    assert size.dims["hidden"] == 1536 and size.dims["ffn"] == 8960 and size.dims["layers"] == 30
    assert size.total_bytes == sum(stored.values())
    assert size.params == cl.layout_params(cl.wan21_t2v_1_3b())
    assert set(size.bytes_by_dtype) == {"Q4_K", "F16", "F32"}
    assert size.blocks[0].prefix == "blocks" and size.blocks[0].count == 30
    per_block = sum(n for k, n in stored.items() if k.startswith("blocks.0."))
    assert size.blocks[0].bytes_per_block == [per_block] * 30
    bf16 = cl.layout_bytes(cl.wan21_t2v_1_3b())
    assert 0.25 < size.total_bytes / bf16 < 0.35   # Q4_K: 4.5 bits per weight in the blocks


def test_planner_plans_a_gguf_dit_with_its_stored_bytes(tmp_path):
    layout = gf.city96_types(cl.wan21_t2v_14b(), "Q4_K")
    path = tmp_path / "wan14b-Q4_K.gguf"
    gf.write_sparse_gguf(path, layout)
    size = size_component(path)
    plan = make_plan([Component("dit", size)], parse_spec("2x24GiB"), Workload())
    dit = plan.placement("dit")
    assert (dit.strategy, dit.devices) == ("fsdp", ["cuda:0"])   # the loader shards GGUF files only: one rank
    assert dit.weight_bytes == size.total_bytes
    held = sum(dit.resident_bytes.values())
    if dit.reshard_after_forward:   # the shard as stored (one rank: the whole file), and FSDP's unit padding
        assert size.total_bytes <= held <= size.total_bytes * 1.1
    else:                           # the weights kept gathered between steps count dequantized
        from mgpu.planning.estimates import gathered_size

        assert size.total_bytes < held <= gathered_size(size).total_bytes * 1.01
    assert size.total_bytes < 0.3 * cl.layout_bytes(cl.wan21_t2v_14b())


def test_sizing_a_big_sparse_gguf_reads_only_its_header(tmp_path):
    """A 15 GB Wan 14B Q8_0 file: sizing reads its ~70 KB header (the kernel's count) and maps nothing."""
    path = tmp_path / "wan14b-Q8_0.gguf"
    file_size = gf.write_sparse_gguf(path, gf.city96_types(cl.wan21_t2v_14b(), "Q8_0"))
    assert file_size > 15e9
    proc = psutil.Process()
    read_before, rss_before = proc.io_counters().read_chars, proc.memory_info().rss
    size = size_component(path)
    read = proc.io_counters().read_chars - read_before
    grown = proc.memory_info().rss - rss_before
    assert size.family == "wan2.1-t2v-14b" and size.total_bytes > 0.99 * file_size
    assert read < 1 << 20, read
    assert grown < 64 << 20, grown
    assert not any(m.path == str(path) for m in proc.memory_maps())


def _corrupt_cases(good: bytes, data_start: int) -> dict[str, bytes]:
    version_at, count_at = 4, 8
    return {
        "empty": b"",
        "magic only": good[:4],
        "inside the counts": good[:12],
        "inside the metadata": good[:40],
        "inside the tensor infos": good[:data_start - 40],
        "inside the data": good[:data_start + (len(good) - data_start) // 2],
        "version 1": good[:version_at] + (1).to_bytes(4, "little") + good[version_at + 4:],
        "big-endian": good[:version_at] + (3).to_bytes(4, "big") + good[version_at + 4:],
        "absurd tensor count": good[:count_at] + (1 << 60).to_bytes(8, "little") + good[count_at + 8:],
    }


def test_truncated_or_corrupt_gguf_is_a_sizing_error_naming_the_file(tmp_path):
    path = tmp_path / "good.gguf"
    gf.write_stack(path, gf.quant_stack(), gf.ALL_TYPES_LAYOUT)
    good = path.read_bytes()
    data_start = read_gguf_header(path).data_offset
    for label, content in _corrupt_cases(good, data_start).items():
        bad = tmp_path / f"{label.replace(' ', '_')}.gguf"
        bad.write_bytes(content)
        with pytest.raises(SizingError) as info:
            size_component(bad)
        assert str(bad) in str(info.value), label
        if label.startswith("inside"):
            assert "truncated" in str(info.value) or "ends" in str(info.value), (label, str(info.value))
    for label in ("version 1", "big-endian"):
        with pytest.raises(SizingError, match="version"):
            read_gguf_header(tmp_path / f"{label.replace(' ', '_')}.gguf")


def test_random_header_damage_never_escapes_as_another_error(tmp_path):
    """Flipped bytes anywhere in the header: either the file still parses or it is a SizingError, never a numpy,
    struct or unicode traceback."""
    path = tmp_path / "good.gguf"
    gf.write_stack(path, gf.quant_stack(), gf.ALL_TYPES_LAYOUT)
    good = bytearray(path.read_bytes())
    header_end = read_gguf_header(path).data_offset
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    for _ in range(300):
        damaged = bytearray(good)
        for at in rng.integers(4, header_end, size=3):
            damaged[at] = int(rng.integers(0, 256))
        bad.write_bytes(damaged)
        try:
            read_gguf_header(bad)
        except SizingError as exc:
            assert str(bad) in str(exc)


def test_unsupported_types_are_refused_by_name_before_loading(tmp_path):
    """Q2_K and IQ4_NL blocks: the error names the file, each tensor, its type and the supported list, from the
    header alone."""
    state = gf.seeded_state(gf.quant_stack())
    odd = {"blocks.0.q.weight": "Q2_K", "blocks.1.ffn.0.weight": "IQ4_NL"}
    path = tmp_path / "mixed.gguf"
    gf.write_gguf(path, state, {**gf.comfy_gguf_types(state, "Q8_0"), **odd})
    assert size_component(path).total_bytes > 0   # sizing still sizes it: the loaders refuse it
    for attempt in (lambda: check_supported(read_gguf_header(path)),
                    lambda: wrap_gguf_parameters(gf.quant_stack(), path)):
        with pytest.raises(ShardingError) as info:
            attempt()
        message = str(info.value)
        for needle in (str(path), "blocks.0.q.weight (Q2_K)", "blocks.1.ffn.0.weight (IQ4_NL)", *SUPPORTED):
            assert needle in message, (needle, message)


def test_loader_refuses_a_file_of_another_model_before_reading(tmp_path):
    path = tmp_path / "m.gguf"
    gf.write_stack(path, gf.quant_stack(), gf.ALL_TYPES_LAYOUT)
    other = gf.QuantStack(dim=512, ffn=512)
    with pytest.raises(ShardingError, match="shape mismatches"):
        wrap_gguf_parameters(other, path)
    model = gf.quant_stack()
    wrap_gguf_parameters(model, path)
    del model.head
    with pytest.raises(ShardingError, match=r"unexpected keys 2 \(head.bias, head.weight\)"):
        load_gguf_sharded(model, path)


def test_single_process_load_and_a_quantized_tensor_that_is_not_whole_rows(tmp_path):
    """Without FSDP: GGUFWeights load whole and dequantize on demand; a tensor stored reshaped whose rows split
    blocks (as ComfyUI-GGUF's converter stores some) loads dequantized as a plain tensor."""
    model = torch.nn.Linear(128, 16)
    state = {"weight": torch.randn(16, 128) * 0.05, "bias": torch.randn(16) * 0.05}
    path = tmp_path / "lin.gguf"
    ref = gf.write_gguf(path, state, {"weight": "Q8_0", "bias": "F32"})
    assert wrap_gguf_parameters(model, path) == ["weight"]
    model.to_empty(device="cpu")
    report = load_gguf_sharded(model, path)
    assert isinstance(model.weight, GGUFWeight) and model.weight.logical_shape == (16, 128)
    assert torch.equal(model.weight.dequantized(torch.float32), ref["weight"])
    assert report.bytes_read == sum(i.nbytes for i in read_gguf_header(path).tensors.values())

    conv = torch.nn.Conv2d(8, 16, 4)   # rows of 8 x 4 x 4 = 128 values, stored as (8, 256): not whole rows
    state = {"weight": torch.randn(16, 8, 4, 4) * 0.05, "bias": torch.randn(16) * 0.05}
    path = tmp_path / "conv.gguf"
    ref = gf.write_gguf(path, state, {"weight": "Q4_K", "bias": "F32"}, orig_shapes={"weight": (16, 8, 4, 4)})
    assert read_gguf_header(path).tensors["weight"].shape == (16, 8, 4, 4)
    assert wrap_gguf_parameters(conv, path) == []
    load_gguf_sharded(conv, path)
    assert torch.equal(conv.weight.detach(), ref["weight"])


# ------------------------------------------------------------------------------------------ sharded over ranks

@contextmanager
def counting_all_gathers(counter: dict):
    """Count every all-gather this rank joins, by the bytes and dtype of its output (the process group's calls),
    whatever name this torch's FSDP calls it by."""
    saved = {}
    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(output, *args, _original=original, **kwargs):
            counter["bytes"] = counter.get("bytes", 0) + output.numel() * output.element_size()
            counter.setdefault("dtypes", set()).add(str(output.dtype))
            return _original(output, *args, **kwargs)

        saved[name] = original
        setattr(dist, name, counted)
    try:
        yield counter
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


CASES = {   # name: (factory, file, param_dtype name, input dtype name, reshard after forward)
    "all_types": (gf.quant_stack, "all_types.gguf", "float32", "float32", True),
    "bf16_network": (partial(gf.quant_stack, dtype=torch.bfloat16), "all_types.gguf", None, "bfloat16", True),
    "kept_gathered": (gf.quant_stack, "all_types.gguf", "float32", "float32", False),
    "wan13b": (gf.wan13b_stack, "wan13b.gguf", "float32", "float32", True),
}


def _read_chars() -> int:
    return psutil.Process().io_counters().read_chars


@torch.no_grad()
def _rank_main(rank: int, world: int, workdir: str) -> None:
    from mgpu.sharding.fsdp import build_meta, materialize, shard

    with gloo_mesh(rank, world, workdir) as mesh:
        out, numbers = {}, {}
        for case, (factory, file, param_dtype, x_dtype, reshard) in CASES.items():
            path = f"{workdir}/{file}"
            model = build_meta(factory)
            wrapped = wrap_gguf_parameters(model, path)
            shard(model, mesh, param_dtype=param_dtype and getattr(torch, param_dtype), reshard_after_forward=reshard)
            materialize(model, "cpu")
            before = _read_chars()
            report = load_gguf_sharded(model, path)
            read = _read_chars() - before
            meta = {}
            for name, p in model.named_parameters():
                local = p.to_local()
                if isinstance(local, GGUFWeight):
                    meta[name] = [local.qtype, list(local.row_shape), str(local.compute_dtype), local.shape[0]]
            x = gf.stack_inputs(model.embed.in_features).to(getattr(torch, x_dtype))
            gathered = []
            for run in ("first", "again"):
                with counting_all_gathers({}) as counter:
                    out[f"{case}_{run}"] = model(x).float()
                gathered.append({"bytes": counter.get("bytes", 0), "dtypes": sorted(counter.get("dtypes", ()))})
            numbers[case] = {"wrapped": wrapped, "meta": meta, "report": report.to_dict(), "rchar": read,
                             "gathered": gathered}
            del model
        torch.save(out, f"{workdir}/rank{rank}.pt")
        Path(f"{workdir}/rank{rank}.json").write_text(json.dumps(numbers))


class Run:
    def __init__(self, world: int, workdir: Path):
        self.world, self.workdir = world, workdir
        self.reference = {"all_types.gguf": gf.write_stack(workdir / "all_types.gguf", gf.quant_stack(),
                                                           gf.ALL_TYPES_LAYOUT),
                          "wan13b.gguf": gf.write_stack(workdir / "wan13b.gguf", gf.wan13b_stack(), WAN13B_LAYOUT)}
        run_ranks(_rank_main, world, (world, str(workdir)), ["gguf_files"], RUN_TIMEOUT_S)
        self.out = [torch.load(workdir / f"rank{r}.pt") for r in range(world)]
        self.numbers = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]

    def header(self, case: str):
        return read_gguf_header(self.workdir / CASES[case][1])

    @torch.no_grad()
    def expected(self, case: str) -> torch.Tensor:
        factory, file, _, x_dtype, _ = CASES[case]
        model = gf.reference_model(factory, self.reference[file]).to(getattr(torch, x_dtype))
        return model(gf.stack_inputs(model.embed.in_features).to(getattr(torch, x_dtype))).float()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def run(request, tmp_path_factory) -> Run:
    return Run(request.param, tmp_path_factory.mktemp(f"gguf{request.param}"))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("case", ["all_types", "wan13b", "kept_gathered"])
def test_sharded_forward_equals_the_dequantized_single_device_model(run: Run, case: str):
    """fp32 compute: every rank's output is the single-device model's holding gguf-py's dequantized weights, and
    the second forward (FSDP refills the same unsharded parameters, or, kept gathered, gathers nothing) is the
    same."""
    want = run.expected(case)
    for rank, out in enumerate(run.out):
        assert _relative(out[f"{case}_first"], want) <= 1e-4, (rank, _relative(out[f"{case}_first"], want))
        assert torch.equal(out[f"{case}_again"], out[f"{case}_first"]), rank
    if case == "kept_gathered":
        assert all(n[case]["gathered"][1]["bytes"] == 0 for n in run.numbers)


def test_large_layers_dequantize_in_chunks_of_rows(monkeypatch):
    """After a gather, a layer dequantizes a few rows at a time (bounded temporaries), to the same values."""
    import mgpu.weights.gguf as g

    stored = torch.from_numpy(_blocks("Q4_K", 40, 512, np.random.default_rng(3)))
    whole = dequantize(stored, "Q4_K", torch.bfloat16)
    calls = []
    real = g.dequantize
    monkeypatch.setattr(g, "dequantize", lambda data, qtype, dtype=torch.float32: calls.append(len(data))
                        or real(data, qtype, dtype))
    monkeypatch.setattr(g, "CHUNK_VALUES", 512 * 16)
    out = g.dequantize_rows(stored, "Q4_K", torch.empty(40, 512, dtype=torch.bfloat16))
    assert torch.equal(out, whole) and calls == [16, 16, 8]


def test_without_a_param_dtype_the_weights_dequantize_to_the_networks_dtype(run: Run):
    """As ComfyUI's network on the ranks: no FSDP param_dtype, weights built in bf16, so the blocks come out of
    the gather in bf16 (and the layers would fail on any other dtype)."""
    want = run.expected("bf16_network")
    for rank, out in enumerate(run.out):
        assert _relative(out["bf16_network_first"], want) <= 1e-2, rank
        assert all(m[2] == "torch.bfloat16" for m in run.numbers[rank]["bf16_network"]["meta"].values())


def test_quantization_metadata_is_the_same_on_every_rank_after_fully_shard(run: Run):
    for case in ("all_types", "wan13b"):
        metas = [n[case]["meta"] for n in run.numbers]
        header = run.header(case)
        for name, (qtype, row_shape, dtype, _) in metas[0].items():
            info = header.tensors[name]
            assert (qtype, tuple(row_shape), dtype) == (info.dtype, info.shape[1:], "torch.float32"), name
            assert all(m[name][:3] == [qtype, row_shape, dtype] for m in metas), name
            rows = [m[name][3] for m in metas]
            assert rows == [b - a for a, b in (shard_row_range(info.shape[0], run.world, r)
                                               for r in range(run.world))], (name, rows)
        assert sorted(metas[0]) == sorted(run.numbers[0][case]["wrapped"])
    wrapped = set(run.numbers[0]["all_types"]["wrapped"])
    assert wrapped == {k for k, t in gf.ALL_TYPES_LAYOUT.items() if t in QUANTIZED}


def _row_share(info, world: int, rank: int) -> int:
    start, stop = shard_row_range(info.shape[0], world, rank)
    return (stop - start) * (info.nbytes // info.shape[0])


@pytest.mark.parametrize("case", ["all_types", "wan13b"])
def test_each_rank_reads_only_its_rows(run: Run, case: str):
    """The loader's count is exactly each rank's rows of each sharded tensor; the kernel's count (rchar) is that
    plus the header; together the ranks read the file's sharded tensors once."""
    header = run.header(case)
    file_size = os.path.getsize(header.path)
    for rank, numbers in enumerate(run.numbers):
        report = numbers[case]["report"]
        assert report["sharded_bytes_read"] == sum(_row_share(i, run.world, rank) for i in header.tensors.values())
        assert report["unsharded_bytes_read"] == 0   # every tensor of the stack is a parameter FSDP shards
        assert report["bytes_read"] <= file_size / run.world * 1.1, (rank, report)
        assert numbers[case]["rchar"] <= report["bytes_read"] + 256 * 1024, (rank, numbers[case]["rchar"], report)
    total = sum(n[case]["report"]["bytes_read"] for n in run.numbers)
    assert total == sum(i.nbytes for i in header.tensors.values())


@pytest.mark.parametrize("case", ["all_types", "wan13b"])
def test_a_forward_all_gathers_the_stored_blocks(run: Run, case: str):
    """Counted at the process group: every quantized weight travels as its padded rows of blocks (uint8), the rest
    in the compute dtype; against fp32 values of the same weights, the all-gather moves a fraction."""
    header = run.header(case)
    world = run.world
    expected = dequantized = 0
    for info in header.tensors.values():   # every tensor is a parameter; all compute in fp32
        rows = info.shape[0]
        padded = -(-rows // world) * world
        row_values = math.prod(info.shape[1:])
        stored = info.nbytes // rows if info.dtype in QUANTIZED else row_values * 4
        expected += padded * stored
        dequantized += padded * row_values * 4
    for rank, numbers in enumerate(run.numbers):
        for forward in numbers[case]["gathered"]:
            assert forward["dtypes"] == ["torch.uint8"], forward   # mixed units travel as bytes, gloo included
            assert expected <= forward["bytes"] <= expected * 1.01, (rank, forward["bytes"], expected)
            assert forward["bytes"] / dequantized < 0.35, forward["bytes"] / dequantized


# ------------------------------------------------------------------------------------------ through the rank pool

def test_rank_pool_loads_a_gguf_checkpoint_and_reports_gathered_bytes(tmp_path):
    """``mgpu.sharding.model_ops:load`` picks the GGUF loader for a .gguf checkpoint: the ranks wrap, shard and read
    their rows, ``gathered_bytes_per_forward`` counts the blocks as stored, and the forward is the reference."""
    path = tmp_path / "m.gguf"
    reference = gf.write_stack(path, gf.quant_stack(), gf.ALL_TYPES_LAYOUT)
    pool = RankPool(PoolConfig(devices=["cpu", "cpu"], extra_sys_path=[TESTS], call_timeout_s=180))
    try:
        model = ShardedModule(pool, ModelSpec(factory="gguf_files:quant_stack", checkpoint=str(path),
                                              param_dtype="fp32"))
        replies = model.load()
        x = gf.stack_inputs()
        got = model(x=x)
    finally:
        pool.close()
    want = gf.reference_model(gf.quant_stack, reference)(x)
    assert _relative(got, want) <= 1e-4
    header = read_gguf_header(path)
    stored = sum(i.nbytes for i in header.tensors.values())
    for reply in replies:
        assert reply["report"]["bytes_read"] < stored / 2 * 1.15 + 4096
        assert reply["gathered_bytes_per_forward"] < 0.4 * sum(math.prod(i.shape) * 4
                                                               for i in header.tensors.values())


def test_kept_gathered_a_gguf_counts_as_its_dequantized_weights(tmp_path):
    """Plans (a loader's own too) keep the gathered weights only if they fit: for a GGUF those are dequantized
    (bf16 here), 3.5 times the stored Q4_K bytes, not the stored bytes; the shards stay the stored bytes."""
    from mgpu.planning.estimates import Workload, gathered_size, weight_bytes
    from mgpu.planning.partition import Component, Policy, make_plan

    path = tmp_path / "wan14b-Q4_K.gguf"
    gf.write_sparse_gguf(path, gf.city96_types(cl.wan21_t2v_14b(), "Q4_K"))
    stored = size_component(path)
    kept = gathered_size(stored)
    bf16 = cl.layout_bytes(cl.recast(cl.wan21_t2v_14b(), "BF16"))
    assert kept.params == stored.params and abs(kept.total_bytes - bf16) < 0.03 * bf16, (kept.total_bytes, bf16)
    assert sum(kept.blocks[0].bytes_per_block) + kept.bytes_outside_blocks == pytest.approx(kept.total_bytes, 1e-3)
    assert weight_bytes(kept, "float32") > 1.9 * kept.total_bytes   # the compute dtype recasts them
    gpus = parse_spec("2x24GiB")   # 8 GB of Q4_K blocks would fit kept; the 28.6 GB they dequantize to do not
    plan = make_plan([Component("dit", stored)], gpus, Workload(width=480, height=272, frames=17),
                     Policy(implicit=True, fsdp_devices=("cuda:0", "cuda:1")))
    placed = plan.placement("dit")
    assert placed.reshard_after_forward and placed.reasons[-1].endswith("does not fit")
    assert placed.rank_need.kept == weight_bytes(kept, None)
