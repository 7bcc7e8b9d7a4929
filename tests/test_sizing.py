"""mgpu.planning.sizing: header reading, validation, family detection and block groups, on real and sparse files."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ckpt_layouts as L
from mgpu.errors import MgpuError, SizingError
from mgpu.planning.sizing import (
    LTX2_TEXT_PROJECTION,
    ComponentSize,
    read_header,
    read_headers,
    size_component,
    text_encoder_for,
)

REPO = Path(__file__).resolve().parents[1]


def _bytes_under(layout: L.Layout, prefix: str) -> int:
    return L.layout_bytes({k: v for k, v in layout.items() if k.startswith(prefix)})


# ------------------------------------------------------------------------------------ small real files

MIXED = {
    "blocks.0.attn.weight": ((32, 16), "BF16"), "blocks.0.attn.bias": ((32,), "F32"),
    "blocks.1.attn.weight": ((32, 16), "F8_E4M3"), "blocks.1.attn.bias": ((32,), "F16"),
    "embed.weight": ((100, 16), "F16"), "scale": ((), "F32"), "ids": ((7,), "I64"), "mask": ((5,), "BOOL"),
}


def test_small_mixed_file_matches_safetensors_loader(tmp_path):
    from safetensors.torch import load_file

    path = L.write_safetensors(tmp_path / "mixed.safetensors", MIXED, metadata={"format": "pt"})
    loaded = load_file(path)
    size = size_component(path)
    assert size.total_bytes == sum(t.numel() * t.element_size() for t in loaded.values())
    assert size.params == sum(t.numel() for t in loaded.values())
    by_dtype: dict[str, int] = {}
    for name, (_, dtype) in MIXED.items():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + loaded[name].numel() * loaded[name].element_size()
    assert size.bytes_by_dtype == by_dtype
    assert read_header(path).metadata == {"format": "pt"}


def test_offsets_are_absolute_and_point_at_the_tensor_bytes(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(10, dtype=torch.int32),
               "c": torch.randn(4, 4).to(torch.float8_e4m3fn), "d": torch.randn(2, 3, dtype=torch.float16)}
    path = tmp_path / "theirs.safetensors"
    save_file(tensors, path)  # written by safetensors itself, not by our fixture writer
    header = read_header(path)
    raw = path.read_bytes()
    loaded = load_file(path)
    for name, info in header.tensors.items():
        assert raw[info.start:info.end] == loaded[name].contiguous().view(torch.uint8).numpy().tobytes()
        assert info.numel == loaded[name].numel() and info.shape == tuple(loaded[name].shape)
    assert header.file_size == len(raw) and header.data_offset <= min(t.start for t in header.tensors.values())


def test_fp8_scaled_layout_counts_every_dtype(tmp_path):
    layout = L.recast(L.wan_dit_tiny(), "F8_E4M3")
    layout["scaled_fp8"] = ((2,), "F8_E4M3")
    path = L.write_safetensors(tmp_path / "fp8.safetensors", layout)
    size = size_component(path)
    assert size.total_bytes == L.layout_bytes(layout) == os.path.getsize(path) - read_header(path).data_offset
    assert set(size.bytes_by_dtype) == {"F8_E4M3", "BF16"}  # 1-D norms/biases stay bf16
    assert size.family == "wan2.1-t2v"


# --------------------------------------------------------------------------------- sparse full sizes

@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sparse")


def test_sparse_28gb_wan_sized_from_header_with_little_memory(sparse_dir):
    layout = L.wan21_t2v_14b()
    path = L.write_safetensors(sparse_dir / "wan2.1_t2v_14B_bf16.safetensors", layout, sparse=True)
    assert os.path.getsize(path) > 28 * 10**9 and os.stat(path).st_blocks * 512 < 10**7  # really sparse
    script = textwrap.dedent(f"""
        import resource, sys, json
        sys.path.insert(0, {str(REPO)!r})
        from mgpu.planning.sizing import size_component
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        s = size_component({str(path)!r})
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({{"total": s.total_bytes, "grew_kib": after - before, "torch": "torch" in sys.modules}}))
    """)
    out = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert out["total"] == L.layout_bytes(layout)
    assert 28.5e9 < out["total"] < 28.7e9
    assert out["grew_kib"] * 1024 < 64 * 2**20, "sizing must read the header, not the data"
    assert out["torch"] is False, "mgpu.planning.sizing must stay importable without torch"


def test_sizing_never_maps_the_file(sparse_dir, monkeypatch):
    import mmap

    path = L.write_safetensors(sparse_dir / "umt5.safetensors", L.umt5_xxl(), sparse=True)

    def refuse(*args, **kwargs):
        raise AssertionError("mmap used")

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert size_component(path).total_bytes == L.layout_bytes(L.umt5_xxl())


# (layout builder, kind, family, main block prefix, block count, dims that must be read from shapes)
FAMILIES = {
    "wan21_t2v_14b": (L.wan21_t2v_14b, "dit", "wan2.1-t2v-14b", "blocks", 40,
                      dict(hidden=5120, ffn=13824, heads=40, layers=40, in_channels=16, patch_h=2, vae_s=8)),
    "wan21_t2v_1_3b": (L.wan21_t2v_1_3b, "dit", "wan2.1-t2v-1.3b", "blocks", 30,
                       dict(hidden=1536, ffn=8960, heads=12, layers=30, in_channels=16)),
    "wan22_ti2v_5b": (L.wan22_ti2v_5b, "dit", "wan2.2-ti2v-5b", "blocks", 30,
                      dict(hidden=3072, layers=30, in_channels=48, out_channels=48, z_channels=48, vae_s=16)),
    "wan21_i2v_14b": (L.wan21_i2v_14b, "dit", "wan2.1-i2v-14b", "blocks", 40,
                      dict(hidden=5120, layers=40, in_channels=36, out_channels=16)),
    "ltxv_2b": (L.ltxv_2b, "dit", "ltxv", "transformer_blocks", 28,
                dict(hidden=2048, heads=32, head_dim=64, layers=28, in_channels=128, vae_t=8, vae_s=32, patch_h=1)),
    "ltxv_13b": (L.ltxv_13b, "dit", "ltxv", "transformer_blocks", 48, dict(hidden=4096, layers=48, cross_dim=4096)),
    # LTX-2: not "ltxv" (LTX-Video's sequence-parallel adapter and memory rules do not apply to its two streams)
    "ltx2_19b": (lambda: L.ltx2_19b(prefix=""), "dit", "ltx2-av", "transformer_blocks", 48,
                 dict(hidden=4096, ffn=16384, heads=32, head_dim=128, layers=48, in_channels=128, audio_hidden=2048,
                      audio_channels=128, text_dim=3840, cross_dim=4096, text_len=1024, vae_t=8, vae_s=32, patch_h=1)),
    "umt5_xxl": (L.umt5_xxl, "text_encoder", "umt5-xxl", "encoder.block", 24,
                 dict(hidden=4096, ffn=10240, heads=64, layers=24, vocab=256384)),
    "t5_xxl": (L.t5_xxl, "text_encoder", "t5-xxl", "encoder.block", 24, dict(hidden=4096, vocab=32128)),
    "gemma3_12b": (L.gemma3_12b, "text_encoder", "gemma3-12b", "language_model.model.layers", 48,
                   dict(hidden=3840, ffn=15360, heads=16, kv_heads=8, head_dim=256, layers=48)),
    "gemma3_12b_new": (lambda: L.gemma3_12b("hf_new"), "text_encoder", "gemma3-12b", "model.language_model.layers",
                       48, dict(hidden=3840, layers=48)),
    "gemma3_12b_comfy": (lambda: L.gemma3_12b("comfy"), "text_encoder", "gemma3-12b", "model.layers", 48,
                         dict(hidden=3840)),
    "wan_vae": (L.wan_vae, "vae", "wan-vae", None, None, dict(z_channels=16, vae_t=4, vae_s=8, out_patch=1)),
    "wan22_vae": (lambda: L.wan_vae("2.2"), "vae", "wan2.2-vae", None, None,
                  dict(z_channels=48, vae_t=4, vae_s=16, out_patch=2)),
    "ltxv_vae": (L.ltxv_vae, "vae", "ltxv-vae", None, None, dict(z_channels=128, vae_t=8, vae_s=32, out_patch=4)),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_family_detection_on_full_size_layouts(sparse_dir, name):
    build, kind, family, main, count, dims = FAMILIES[name]
    layout = build()
    size = size_component(L.write_safetensors(sparse_dir / f"{name}.safetensors", layout, sparse=True))
    assert (size.kind, size.family) == (kind, family)
    assert size.total_bytes == L.layout_bytes(layout) and size.params == L.layout_params(layout)
    assert {k: size.dims[k] for k in dims} == dims
    assert not size.warnings and size.key_prefix == ""
    if main is not None:
        group = size.blocks[0]
        assert (group.prefix, group.count) == (main, count)
        assert group.bytes_per_block == [_bytes_under(layout, f"{main}.{i}.") for i in range(count)]
        assert size.bytes_outside_blocks == size.total_bytes - _bytes_under(layout, main + ".")
        assert all(not g.prefix.startswith(("text_embedding", "time_embedding")) for g in size.blocks)


def test_full_size_totals_match_the_published_files(sparse_dir):
    """Sizes of the files users download (Comfy-Org repackaged bf16, HF gemma-3-12b-it)."""
    expected_gb = {"wan21_t2v_14b": 28.6, "umt5_xxl": 11.4, "wan21_t2v_1_3b": 2.84, "wan22_ti2v_5b": 10.0,
                   "wan21_i2v_14b": 32.8, "gemma3_12b": 24.4, "wan_vae": 0.254}
    for name, gb in expected_gb.items():
        assert L.layout_bytes(FAMILIES[name][0]()) / 1e9 == pytest.approx(gb, rel=0.01), name


# ------------------------------------------------------------------------------------------ prefixes

@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "diffusion_model."])
def test_dit_prefix_is_stripped_and_recorded(tmp_path, prefix):
    size = size_component(L.write_safetensors(tmp_path / "w.safetensors", L.wan_dit_tiny(prefix=prefix)))
    assert size.key_prefix == prefix and size.kind == "dit" and size.blocks[0].prefix == "blocks"


def test_text_encoder_prefix_from_a_full_checkpoint(sparse_dir):
    layout = L.umt5_xxl(prefix="text_encoders.umt5xxl.transformer.")
    size = size_component(L.write_safetensors(sparse_dir / "te.safetensors", layout, sparse=True))
    assert (size.family, size.key_prefix) == ("umt5-xxl", "text_encoders.umt5xxl.transformer.")


def test_combined_checkpoint_sizes_the_biggest_part_and_names_the_rest(sparse_dir):
    dit, vae = L.ltxv_2b(prefix="model.diffusion_model."), L.with_prefix(L.ltxv_vae(), "vae.")
    path = L.write_safetensors(sparse_dir / "ltx-video-2b-v0.9.5.safetensors", L.combine(dit, vae), sparse=True)
    size = size_component(path)
    assert size.family == "ltxv" and size.total_bytes == L.layout_bytes(dit)
    assert any("'vae.'" in w and str(L.layout_bytes(vae)) in w for w in size.warnings)
    vae_size = size_component(path, prefix="vae.")
    assert vae_size.family == "ltxv-vae" and vae_size.total_bytes == L.layout_bytes(vae)
    with pytest.raises(SizingError, match="no tensor whose name starts with 'text_encoders.'"):
        size_component(path, prefix="text_encoders.")


def test_full_wan_checkpoint_with_text_encoder_and_vae(sparse_dir):
    dit = L.wan21_t2v_1_3b(prefix="model.diffusion_model.")
    te = L.umt5_xxl(prefix="text_encoders.umt5xxl.transformer.")
    vae = L.with_prefix(L.wan_vae(), "vae.")
    path = L.write_safetensors(sparse_dir / "wan_all_in_one.safetensors", L.combine(dit, te, vae), sparse=True)
    biggest = size_component(path)  # the 11.4 GB text encoder outweighs the 2.8 GB DiT
    assert (biggest.family, biggest.total_bytes) == ("umt5-xxl", L.layout_bytes(te))
    assert "'model.diffusion_model.'" in biggest.warnings[0] and "'vae.'" in biggest.warnings[0]
    dit_size = size_component(path, prefix="model.diffusion_model.")
    assert (dit_size.family, dit_size.total_bytes) == ("wan2.1-t2v-1.3b", L.layout_bytes(dit))


def test_unknown_model_is_sized_with_a_warning(tmp_path):
    layout = {f"layers.{i}.{p}.weight": ((24, 24), "F16") for i in range(4) for p in ("fc1", "fc2")}
    layout["readout.weight"] = ((10, 24), "F16")
    size = size_component(L.write_safetensors(tmp_path / "mystery.safetensors", layout))
    assert (size.kind, size.family) == ("unknown", "unknown")
    assert size.total_bytes == L.layout_bytes(layout)
    assert size.blocks[0].prefix == "layers" and size.blocks[0].count == 4
    assert len(size.warnings) == 1 and "mystery.safetensors" in size.warnings[0]
    assert "not a recognised model family" in size.warnings[0] and "layers.0.fc1.weight" in size.warnings[0]


def test_component_size_round_trips_through_json(tmp_path):
    size = size_component(L.write_safetensors(tmp_path / "t.safetensors", L.t5_tiny()))
    back = ComponentSize.from_dict(json.loads(json.dumps(size.to_dict())))
    assert back == size and back.blocks[0].bytes_per_block == size.blocks[0].bytes_per_block


# --------------------------------------------------------------- LTX-2's text encoder: Gemma + its checkpoint's parts

ltx2_checkpoint = L.ltx2_checkpoint


def test_an_ltx2_text_encoder_is_planned_with_the_projection_its_checkpoint_holds(tmp_path):
    """The tiny LTX-2 (connectors 48 wide: no compatibility mode): the plan's text encoder bytes are Gemma's plus the
    projection's, read from the checkpoint's header; the projection follows the last block."""
    from mgpu.planning.devices import parse_spec
    from mgpu.planning.estimates import Workload
    from mgpu.planning.partition import Component, make_plan

    ckpt = L.write_safetensors(tmp_path / "ltx-2.safetensors", ltx2_checkpoint(L.ltx2_tiny(), 64, 3, 48), sparse=True)
    gemma = size_component(L.write_safetensors(tmp_path / "gemma.safetensors", L.gemma3_tiny("comfy"), sparse=True))
    dit = size_component(ckpt)
    projection = 48 * 64 * 4 * 2
    assert (dit.family, dit.text_encoder_parts.total_bytes) == ("ltx2-av", projection)
    te = text_encoder_for(gemma, dit)
    assert (te.total_bytes, te.params) == (gemma.total_bytes + projection, gemma.params + projection // 2)
    assert te.bytes_after_blocks == projection and te.bytes_outside_blocks == gemma.bytes_outside_blocks + projection
    assert te.blocks == gemma.blocks and te.matrix_bytes == gemma.matrix_bytes + projection
    plan = make_plan([Component("dit", dit), Component("text_encoder", gemma)], parse_spec("cpu=64GiB"),
                     Workload(64, 64, 9, 1, cfg=True))
    assert plan.placement("text_encoder").weight_bytes == gemma.total_bytes + projection
    other = size_component(L.write_safetensors(tmp_path / "ltxv.safetensors", L.ltxv_tiny(), sparse=True))
    assert text_encoder_for(gemma, other) is gemma and text_encoder_for(gemma, gemma) is gemma
    bare = size_component(L.write_safetensors(tmp_path / "dit.safetensors", L.ltx2_tiny(), sparse=True))
    assert bare.text_encoder_parts is None and text_encoder_for(gemma, bare) is gemma   # no projection: no parts
    back = ComponentSize.from_dict(json.loads(json.dumps(dit.to_dict())))
    assert back == dit and isinstance(back.text_encoder_parts, ComponentSize)
    # the projection is counted with the text encoder, so the DiT's sizing does not call it "not counted"; what the
    # checkpoint holds besides (its VAE) still is
    assert not any("text_embedding_projection" in w for w in dit.warnings)
    with_vae = {**ltx2_checkpoint(L.ltx2_tiny(), 64, 3, 48), **L.with_prefix(L.wan_vae_tiny(), "vae.")}
    whole = size_component(L.write_safetensors(tmp_path / "ltx-2-all.safetensors", with_vae, sparse=True))
    (warning,) = [w for w in whole.warnings if "not counted" in w]
    assert "'vae.'" in warning and "text_embedding_projection" not in warning


def test_a_gemma_file_holding_the_projection_puts_it_after_its_blocks_and_is_not_counted_twice(tmp_path):
    layout = {**L.gemma3_tiny("comfy"), LTX2_TEXT_PROJECTION + "weight": ((48, 256), "BF16")}
    te = size_component(L.write_safetensors(tmp_path / "gemma+projection.safetensors", layout, sparse=True))
    dit = size_component(L.write_safetensors(tmp_path / "ltx-2.safetensors", ltx2_checkpoint(L.ltx2_tiny(), 64, 3, 48),
                                             sparse=True))
    assert te.family == "gemma3" and te.bytes_after_blocks == 48 * 256 * 2 and te.total_bytes == L.layout_bytes(layout)
    assert text_encoder_for(te, dit) is te


def test_ltx2_19b_in_comfyuis_compatibility_mode_also_brings_both_text_connectors(sparse_dir):
    """LTX-2 19B's connectors are 3840 wide with two blocks: ComfyUI 0.33 loads a second copy of both into the text
    encoder (LTXAVTEModel.enable_compat_mode), beside the 1.4 GB projection."""
    layout = {**ltx2_checkpoint(L.ltx2_19b(), 3840, 48, 3840), **L.ltxv_vae(prefix="vae.")}
    dit = size_component(L.write_safetensors(sparse_dir / "ltx-2-19b-dev.safetensors", layout, sparse=True))
    projection = _bytes_under(layout, LTX2_TEXT_PROJECTION)
    connectors = sum(_bytes_under(layout, f"model.diffusion_model.{stream}_embeddings_connector.")
                     for stream in ("video", "audio"))
    assert projection / 1e9 == pytest.approx(1.445, rel=0.01) and connectors / 1e9 == pytest.approx(1.42, rel=0.01)
    assert dit.text_encoder_parts.total_bytes == projection + connectors
    assert dit.total_bytes == _bytes_under(layout, "model.diffusion_model.")   # the DiT keeps its own connectors


# ------------------------------------------------------------------------------------------- sharded

def test_sharded_folder_and_index_agree_with_single_file(sparse_dir):
    layout = L.gemma3_12b()
    index = L.write_sharded(sparse_dir / "gemma-3-12b-it", layout, shards=5, sparse=True)
    single = size_component(L.write_safetensors(sparse_dir / "gemma_single.safetensors", layout, sparse=True))
    for path in (index.parent, index):
        size = size_component(path)
        assert (size.family, size.total_bytes, size.blocks[0].count) == ("gemma3-12b", single.total_bytes, 48)
    assert len(read_headers(index.parent)) == 5


def test_sharded_missing_shard(tmp_path):
    index = L.write_sharded(tmp_path / "m", L.t5_tiny(), shards=3)
    (index.parent / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(SizingError, match=r"1 are missing .*model-00002-of-00003\.safetensors.*download every shard"):
        read_headers(index.parent)


def test_index_pointing_at_the_wrong_shard(tmp_path):
    index = L.write_sharded(tmp_path / "m", L.t5_tiny(), shards=2)
    data = json.loads(index.read_text())
    data["weight_map"]["shared.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(SizingError, match="'shared.weight' is in model-00002-of-00002.safetensors but"):
        read_headers(index)


def test_folder_without_index_and_several_files_is_ambiguous(tmp_path):
    for name in ("a", "b"):
        L.write_safetensors(tmp_path / f"{name}.safetensors", L.t5_tiny())
    with pytest.raises(SizingError, match=r"2 \*\.safetensors files; point at one"):
        read_headers(tmp_path)


# ---------------------------------------------------------------------------------------- bad input

SMALL = {"a.weight": ((8, 4), "BF16"), "b.weight": ((4,), "F32"), "c.weight": ((2, 2), "F16")}


def _raises(path, *fragments) -> SizingError:
    with pytest.raises(SizingError) as info:
        size_component(path)
    message = str(info.value)
    assert isinstance(info.value, MgpuError) and isinstance(info.value, ValueError)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    return info.value


def test_missing_file(tmp_path):
    _raises(tmp_path / "nope.safetensors", "not found", "check the path")


def test_folder_instead_of_file(tmp_path):
    with pytest.raises(SizingError, match="is a folder, not a file"):
        read_header(tmp_path)


def test_truncated_data(tmp_path):
    path = L.write_truncated(tmp_path / "cut.safetensors", L.wan_dit_tiny(), keep=0.5)
    _raises(path, "only", "data bytes follow the header", "truncated or corrupt; re-download it")


@pytest.mark.parametrize("defect, fragments", [
    ("past_end", ["'a.weight'", "ends at byte", "truncated or corrupt; re-download it"]),
    ("size_mismatch", ["'a.weight'", "BF16 [8, 4]", "needs 64 bytes", "span 62", "re-download it"]),
    ("overlap", ["'a.weight'", "'b.weight'", "overlap", "re-download it"]),
    ("unknown_dtype", ["'a.weight'", "unknown dtype 'Q4_K'"]),
    ("bad_shape", ["'a.weight'", "not a list of non-negative integers"]),
    ("not_json", ["not valid JSON", "re-download it"]),
    ("header_past_end", ["header bytes follow but the file has only", "truncated or corrupt"]),
])
def test_lying_headers(tmp_path, defect, fragments):
    _raises(L.write_bad_header(tmp_path / f"{defect}.safetensors", SMALL, defect), *fragments)


@pytest.mark.parametrize("kind, what", [
    ("zip", "zip archive"), ("pickle", "pickle"), ("text", "not a safetensors header"),
])
def test_not_safetensors(tmp_path, kind, what):
    path = L.write_not_safetensors(tmp_path / f"model.{kind}", kind)
    _raises(path, "is not a safetensors file", what, "only .safetensors and .gguf files are accepted")


def test_gguf_without_tensors(tmp_path):
    """GGUF files are sized (tests/test_gguf_sharded.py); one that holds nothing is refused as such."""
    _raises(L.write_not_safetensors(tmp_path / "model.gguf", "gguf"), "holds no tensors", "re-download it")


def test_empty_file(tmp_path):
    _raises(L.write_not_safetensors(tmp_path / "empty.safetensors", "empty"), "0 bytes", "re-download it")


# ------------------------------------------------------------------------- layouts match ComfyUI itself

def _comfyui_path() -> Path | None:
    for candidate in (os.environ.get("COMFYUI_PATH"), REPO.parent.parent):
        if candidate and (Path(candidate) / "comfy" / "ldm" / "wan" / "model.py").is_file():
            return Path(candidate)
    return None


LTXV_VAE_STATISTICS = {f"per_channel_statistics.{k}" for k in
                       ("channel", "mean-of-stds", "mean-of-stds_over_std-of-means")}


@pytest.mark.comfyui
def test_full_layouts_match_comfyui_modules():
    """Build ComfyUI's own modules on the meta device and compare every key and shape with our layouts."""
    comfy = _comfyui_path()
    if comfy is None:
        pytest.skip("no ComfyUI checkout (set COMFYUI_PATH)")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(comfy)!r})
        import torch
        import comfy.options
        comfy.options.enable_args_parsing()
        sys.argv = ["x", "--cpu"]
        import comfy.ops
        import comfy.ldm.wan.model as wan, comfy.ldm.wan.vae as wv, comfy.ldm.wan.vae2_2 as wv2
        import comfy.ldm.lightricks.model as ltx, comfy.ldm.lightricks.vae.causal_video_autoencoder as lvae
        import comfy.text_encoders.t5 as t5
        ops = comfy.ops.disable_weight_init
        cfg = lambda n: json.load(open({str(comfy)!r} + "/comfy/text_encoders/" + n + ".json"))
        vae = dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True])
        out = {{}}
        with torch.device("meta"):
            models = {{
                "wan21_t2v_14b": wan.WanModel(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40, operations=ops),
                "wan21_i2v_14b": wan.WanModel(model_type="i2v", in_dim=36, dim=5120, ffn_dim=13824, num_heads=40,
                                              num_layers=40, operations=ops),
                "wan22_ti2v_5b": wan.WanModel(in_dim=48, out_dim=48, dim=3072, ffn_dim=14336, num_heads=24,
                                              num_layers=30, operations=ops),
                "ltxv_2b": ltx.LTXVModel(operations=ops),
                "ltxv_13b": ltx.LTXVModel(attention_head_dim=128, cross_attention_dim=4096, num_layers=48,
                                          operations=ops),
                "umt5_xxl": t5.T5(cfg("umt5_config_xxl"), None, None, ops),
                "t5_xxl": t5.T5(cfg("t5_config_xxl"), None, None, ops),
                "wan_vae": wv.WanVAE(dim=96, z_dim=16, **vae),
                "wan22_vae": wv2.WanVAE(dim=160, z_dim=48, **vae),
                "ltxv_vae": lvae.VideoVAE(version=2),
            }}
            for name, model in models.items():
                out[name] = {{k: list(v.shape) for k, v in model.state_dict().items()}}
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = {"wan21_t2v_14b": L.wan21_t2v_14b(), "wan21_i2v_14b": L.wan21_i2v_14b(), "wan22_ti2v_5b": L.wan22_ti2v_5b(),
            "ltxv_2b": L.ltxv_2b(), "ltxv_13b": L.ltxv_13b(), "umt5_xxl": L.umt5_xxl(), "t5_xxl": L.t5_xxl(),
            "wan_vae": L.wan_vae(), "wan22_vae": L.wan_vae("2.2"), "ltxv_vae": L.ltxv_vae()}
    for name, layout in ours.items():
        shapes = {k: list(s) for k, (s, _) in layout.items()}
        if name == "ltxv_vae":   # in the released files; ComfyUI >= 0.33's VideoVAE no longer registers (ignores) them
            dropped = {k: v for k, v in shapes.items() if k not in theirs[name]}
            assert set(dropped) <= LTXV_VAE_STATISTICS, (name, sorted(dropped))
            shapes = {k: v for k, v in shapes.items() if k not in dropped}
        assert shapes == theirs[name], name


def test_diffusers_wan_layout_is_detected(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    from safetensors.torch import save_file

    model = diffusers.WanTransformer3DModel(num_attention_heads=2, attention_head_dim=64, in_channels=16,
                                            out_channels=16, text_dim=64, freq_dim=32, ffn_dim=256, num_layers=3)
    path = tmp_path / "wan_diffusers.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    size = size_component(path)
    assert (size.kind, size.family) == ("dit", "wan-t2v-diffusers")
    assert {k: size.dims[k] for k in ("hidden", "ffn", "layers", "text_dim", "in_channels")} == {
        "hidden": 128, "ffn": 256, "layers": 3, "text_dim": 64, "in_channels": 16}
    assert size.blocks[0].prefix == "blocks" and size.blocks[0].count == 3


@pytest.mark.comfyui
def test_ltx2_layouts_match_comfyuis_ltxav_where_it_has_one():
    """ComfyUI 0.33 builds LTX-2 (LTXAVModel) with exactly the 19B layout's keys and shapes, and the tiny one's from
    its metadata config; ComfyUI 0.3.64 has no LTX-2 model at all (its loaders refuse such a file by name)."""
    comfy = _comfyui_path()
    if comfy is None:
        pytest.skip("no ComfyUI checkout (set COMFYUI_PATH)")
    if not (comfy / "comfy" / "ldm" / "lightricks" / "av_model.py").is_file():
        assert "LTXAV" not in (comfy / "comfy" / "supported_models.py").read_text()
        return
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(comfy)!r})
        import torch
        import comfy.options
        comfy.options.enable_args_parsing()
        sys.argv = ["x", "--cpu"]
        import comfy.ops
        import comfy.ldm.lightricks.av_model as av
        ops = comfy.ops.disable_weight_init
        with torch.device("meta"):
            models = {{"19b": av.LTXAVModel(operations=ops), "tiny": av.LTXAVModel(**{L.ltx2_tiny_config()!r},
                                                                                  num_layers=3, operations=ops)}}
        print(json.dumps({{n: {{k: list(v.shape) for k, v in m.state_dict().items()}} for n, m in models.items()}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    for name, layout in {"19b": L.ltx2_19b(prefix=""), "tiny": L.ltx2_tiny(prefix="")}.items():
        assert {k: list(s) for k, (s, _) in layout.items()} == theirs[name], name


@pytest.mark.comfyui
def test_ltx2_text_encoder_parts_are_what_comfyuis_encoder_holds_and_come_after_gemmas_layers(sparse_dir):
    """ComfyUI 0.33's LTX-2 text encoder (LTXAVTEModel, in its compatibility mode for LTX-2 19B) holds exactly the
    projection and connectors the checkpoint's header gives, under ComfyUI's names for them, registered after
    Gemma's layers (where a layer split puts them). ComfyUI 0.3.64 has no LTX-2 text encoder."""
    comfy = _comfyui_path()
    if comfy is None:
        pytest.skip("no ComfyUI checkout (set COMFYUI_PATH)")
    if "class LTXAVTEModel" not in (comfy / "comfy" / "text_encoders" / "lt.py").read_text():
        return
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(comfy)!r}, {str(REPO)!r}]
        import torch
        import comfy.options
        comfy.options.enable_args_parsing()
        sys.argv = ["x", "--cpu"]
        import comfy.sd
        import comfy.text_encoders.llama
        import comfy.text_encoders.lt as lt
        from mgpu.sharding.layer_split import units_of
        model = lt.ltxav_te()(device="meta", dtype=torch.bfloat16)
        model.enable_compat_mode()
        ours = ("text_embedding_projection.", "video_embeddings_connector.", "audio_embeddings_connector.")
        parts = {{k: [list(v.shape), v.element_size()] for k, v in model.state_dict().items() if k.startswith(ours)}}
        print(json.dumps({{"parts": parts, "units": [n for n, _, _ in units_of(model)]}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    layout = ltx2_checkpoint(L.ltx2_19b(), 3840, 48, 3840)
    dit = size_component(L.write_safetensors(sparse_dir / "ltx-2-19b.safetensors", layout, sparse=True))
    renamed = {k.replace("aggregate_embed.", "").removeprefix("model.diffusion_model."): list(shape)
               for k, (shape, _) in layout.items()
               if k.startswith(LTX2_TEXT_PROJECTION) or "_embeddings_connector." in k}
    assert {k: shape for k, (shape, _) in theirs["parts"].items()} == renamed
    assert dit.text_encoder_parts.total_bytes == sum(math.prod(s) * n for s, n in theirs["parts"].values())
    units = theirs["units"]
    last_layer = units.index("gemma3_12b.transformer.model.layers.47")
    assert all(units.index(n) > last_layer for n in units if n.startswith(("text_embedding_projection",
                                                                          "video_embeddings", "audio_embeddings")))
