"""mgpu.planning.estimates: token counts, working-memory formulas and weight recasting on full-size layouts."""

from __future__ import annotations

import math

import pytest

import ckpt_layouts as L
from mgpu.errors import SizingError
from mgpu.planning.estimates import (ACTIVATION_SAFETY, COMFYUI_MIN_INFERENCE_BYTES, CUDA_OVERHEAD_BYTES, MiB, GiB, Workload,
                            comfyui_memory_required, comfyui_reservation_bytes, comfyui_vae_decode_bytes,
                            dit_activation_bytes, dit_tokens, dit_working_bytes, fsdp_buffer_bytes,
                            GPU_PROCESS_GUESSES, nccl_communicator_bytes, nccl_communicators, rank_process_bytes,
                            text_encoder_activation_bytes, text_encoder_working_bytes,
                            vae_activation_bytes, vae_decode_bytes, weight_bytes)
from mgpu.planning.sizing import size_component, size_from_bytes

P720 = Workload(width=1280, height=720, frames=81)


@pytest.fixture(scope="module")
def sizes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("est")
    layouts = {"wan14": L.wan21_t2v_14b(), "wan1": L.wan21_t2v_1_3b(), "wan5": L.wan22_ti2v_5b(), "ltxv": L.ltxv_2b(),
               "ltxv13": L.ltxv_13b(), "umt5": L.umt5_xxl(),
               "gemma": L.gemma3_12b(), "wan_vae": L.wan_vae(), "wan22_vae": L.wan_vae("2.2"), "ltxv_vae": L.ltxv_vae()}
    return {n: size_component(L.write_safetensors(folder / f"{n}.safetensors", lay, sparse=True))
            for n, lay in layouts.items()}


# ---------------------------------------------------------------------------------------------- tokens

def test_wan_720p_81_frames_is_75600_tokens(sizes):
    assert dit_tokens(sizes["wan14"], P720) == 75_600  # 21 latent frames x 45 x 80 patches


def test_tokens_of_other_compressions(sizes):
    # Wan2.2 5B: 4x16x16 VAE then 2x2 patches; 1280x704x121 -> 31 x 22 x 40
    assert dit_tokens(sizes["wan5"], Workload(1280, 704, 121)) == 31 * 22 * 40
    # LTXV: 8x32x32 VAE, 1x1x1 patches; 768x512x97 -> 13 x 16 x 24
    assert dit_tokens(sizes["ltxv"], Workload(768, 512, 97)) == 13 * 16 * 24
    # odd latent sizes are padded up to whole patches: 832x488 -> latent 61 x 104 -> 31 x 52 patches
    assert dit_tokens(sizes["wan14"], Workload(832, 488, 1)) == 31 * 52


def test_cfg_doubles_the_dit_batch():
    assert Workload(batch=3, cfg=True).dit_batch == 6 and Workload(batch=3, cfg=False).dit_batch == 3


# ------------------------------------------------------------------------------------------------- DiT

def test_dit_working_memory_grows_with_frames_resolution_and_batch(sizes):
    wan = sizes["wan14"]
    base = dit_working_bytes(wan, Workload(832, 480, 33))
    assert dit_working_bytes(wan, Workload(832, 480, 81)) > base
    assert dit_working_bytes(wan, Workload(1280, 720, 33)) > base
    assert dit_working_bytes(wan, Workload(832, 480, 33), batch=4) > dit_working_bytes(wan, Workload(832, 480, 33))
    assert dit_working_bytes(wan, Workload(832, 480, 33, cfg=False)) < base


def test_dit_activations_scale_linearly_with_batch_under_sdpa(sizes):
    n = dit_tokens(sizes["wan14"], P720)
    one, two = dit_activation_bytes(sizes["wan14"], n, 1), dit_activation_bytes(sizes["wan14"], n, 2)
    assert 1.95 < two / one <= 2.0  # the RoPE table is per forward, shared by the batch


def test_math_attention_needs_more_and_grows_quadratically(sizes):
    wan = sizes["wan14"]
    assert dit_working_bytes(wan, P720, attention="math") > dit_working_bytes(wan, P720, attention="sdpa")
    short, long = Workload(1280, 720, 21), Workload(1280, 720, 81)  # 6 vs 21 latent frames
    growth_math = dit_working_bytes(wan, long, attention="math") / dit_working_bytes(wan, short, attention="math")
    growth_sdpa = dit_working_bytes(wan, long) / dit_working_bytes(wan, short)
    assert growth_math > growth_sdpa


def test_wan14b_720p_numbers_are_in_a_plausible_range(sizes):
    """Lower bound from first principles: one bf16 copy of the hidden states is 0.77 GB per batch item and a block
    holds at least eight. Upper bound: one 80 GB GPU runs this model with CFG once the weights are offloaded."""
    b2 = dit_working_bytes(sizes["wan14"], P720)
    b1 = dit_working_bytes(sizes["wan14"], P720, batch=1)
    assert 8 * GiB < b1 < b2 < 40 * GiB
    assert 6 * GiB < dit_activation_bytes(sizes["wan14"], dit_tokens(sizes["wan14"], P720)) < 8 * GiB


# Live-tensor peaks of ComfyUI's own networks, one real-dimension block, bytes per token and batch item: the
# larger of ComfyUI 0.3.64 and 0.33.0 (bench/calibrate_memory.py, table in bench/RESULTS.md).
MEASURED_BYTES_PER_TOKEN = {"wan1": 49_408, "wan14": 97_536, "wan5": 83_712, "ltxv": 57_650, "ltxv13": 115_000}


@pytest.mark.parametrize("family", sorted(MEASURED_BYTES_PER_TOKEN))
def test_calibrated_dit_formula_covers_the_measured_peaks_without_waste(sizes, family):
    """The formula per token is at least the measured peak and at most 15% above it (the safety factor is separate)."""
    size = sizes[family]
    per_token = (dit_activation_bytes(size, 4096) - dit_activation_bytes(size, 2048)) / 2048
    assert 1.0 <= per_token / MEASURED_BYTES_PER_TOKEN[family] < 1.15


def test_one_gpu_reserves_comfyuis_own_memory_required_when_it_is_larger(sizes):
    """ComfyUI loads the weights fully only with its reservation free beside them (else it streams them): for Wan 14B
    at 720p that is 13.6 GiB of memory_required (ComfyUI's own figure, measured with ComfyUI 0.3.64 and 0.33.0)
    plus its 400 MiB reserve, more than our 8.4 GiB."""
    wan = sizes["wan14"]
    required = comfyui_memory_required(wan, P720, batch=1)
    assert required == pytest.approx(14_612_940_034, abs=1)  # BaseModel.memory_required([1, 16, 21, 90, 160]), GPU
    ours = ACTIVATION_SAFETY * dit_activation_bytes(wan, dit_tokens(wan, P720))
    assert ours < required
    assert dit_working_bytes(wan, P720, batch=1) == required + 400 * MiB + CUDA_OVERHEAD_BYTES
    # FSDP ranks: ComfyUI reserves nothing there, so only ours counts (their process memory: rank_process_bytes)
    assert dit_working_bytes(wan, P720, batch=1, comfyui=False) == math.ceil(ours)


def test_small_models_get_at_least_comfyuis_minimum_inference_memory(sizes):
    tiny = Workload(256, 256, 1, cfg=False)
    assert dit_working_bytes(sizes["ltxv"], tiny) == COMFYUI_MIN_INFERENCE_BYTES + CUDA_OVERHEAD_BYTES
    assert comfyui_reservation_bytes(0) == COMFYUI_MIN_INFERENCE_BYTES == int(0.8 * GiB) + 400 * MiB


# ----------------------------------------------------------------------------------- text encoders

def test_text_encoder_memory_grows_with_tokens_and_batch(sizes):
    for name in ("umt5", "gemma"):
        te = sizes[name]
        assert text_encoder_activation_bytes(te, tokens=1024) > text_encoder_activation_bytes(te, tokens=512)
        assert text_encoder_activation_bytes(te, batch=4) > text_encoder_activation_bytes(te, batch=2)
        assert text_encoder_working_bytes(te, tokens=4096) > text_encoder_working_bytes(te, tokens=512)


def test_text_encoder_gets_comfyuis_minimum_inference_memory(sizes):
    """UMT5 at 512 tokens needs 0.3 GiB of activations, but ComfyUI keeps 1.19 GiB free to load it fully."""
    te = sizes["umt5"]
    assert ACTIVATION_SAFETY * text_encoder_activation_bytes(te) < COMFYUI_MIN_INFERENCE_BYTES
    assert text_encoder_working_bytes(te) == COMFYUI_MIN_INFERENCE_BYTES + CUDA_OVERHEAD_BYTES


# ------------------------------------------------------------------------------------------------ VAE

@pytest.mark.parametrize("vae", ["wan_vae", "wan22_vae", "ltxv_vae"])
def test_tiled_decode_needs_less_than_untiled(sizes, vae):
    size = sizes[vae]
    wl = Workload(1280, 720, 121)
    assert vae_decode_bytes(size, wl, tiled=True) < vae_decode_bytes(size, wl, tiled=False)


@pytest.mark.parametrize("vae", ["wan_vae", "ltxv_vae"])
def test_vae_decode_grows_with_resolution_and_frames(sizes, vae):
    size = sizes[vae]
    small = vae_activation_bytes(size, Workload(832, 480, 33), tiled=False)
    assert vae_activation_bytes(size, Workload(1280, 720, 33), tiled=False) > small
    assert vae_activation_bytes(size, Workload(832, 480, 97), tiled=False) > small
    assert vae_activation_bytes(size, Workload(832, 480, 33, batch=2), tiled=False) > small


def test_tiling_a_small_video_changes_nothing(sizes):
    wl = Workload(320, 256, 17)  # smaller than one tile in every direction
    for vae in ("wan_vae", "ltxv_vae"):
        assert vae_activation_bytes(sizes[vae], wl, tiled=True) == vae_activation_bytes(sizes[vae], wl, tiled=False)


def test_untiled_decode_reserves_comfyuis_figure_when_it_is_larger(sizes):
    """Wan 2.2's VAE: ComfyUI reserves 8000 x 256 bytes per latent pixel (13.4 GiB at 1280x704), above our 8.1."""
    wl = Workload(1280, 704, 121)
    vae = sizes["wan22_vae"]
    comfyui = comfyui_vae_decode_bytes(vae, wl)
    assert comfyui == 14_417_920_000  # VAE.memory_used_decode([1, 48, 31, 44, 80], bfloat16), ComfyUI's own
    assert vae_activation_bytes(vae, wl, tiled=False) < comfyui
    assert vae_decode_bytes(vae, wl, tiled=False) == comfyui_reservation_bytes(comfyui) + CUDA_OVERHEAD_BYTES
    # tiled: ComfyUI's untiled figure only decides how much of the VAE weights it keeps loaded
    assert vae_decode_bytes(vae, wl, tiled=True) == vae_activation_bytes(vae, wl, tiled=True) + CUDA_OVERHEAD_BYTES


def test_causal_wan_decode_barely_depends_on_frames_but_ltxv_does(sizes):
    """Wan decodes one latent frame at a time (only the output buffer grows); LTXV decodes all frames at once."""
    def growth(vae):
        return (vae_decode_bytes(sizes[vae], Workload(832, 480, 161), tiled=False)
                / vae_decode_bytes(sizes[vae], Workload(832, 480, 17), tiled=False))
    assert growth("wan_vae") < 1.5 < growth("ltxv_vae")


# ----------------------------------------------------------------------------------------------- FSDP

def test_nccl_communicators_are_world_plus_one_group_per_sequence_degree():
    """WORLD for FSDP, and one group per sequence degree d > 1 the load sets up: d divides the ranks and the heads,
    up to the load's sequence degree. The gloo control group holds no GPU memory; a lone rank has none."""
    assert nccl_communicators(1, 40, 1) == []
    assert nccl_communicators(2, 40, 1) == [2]              # CFG split only
    assert nccl_communicators(2, 40, 2) == [2, 2]
    assert nccl_communicators(8, 40, 8) == [8, 2, 4, 8]     # 40 heads: 2, 4 and 8 divide them
    assert nccl_communicators(6, 40, 6) == [6, 2]           # 3 and 6 do not divide 40
    assert nccl_communicators(4, None, 4) == [4]            # no heads known: no sequence groups


def test_a_rank_keeps_its_context_and_every_communicator_for_its_whole_life():
    g = GPU_PROCESS_GUESSES
    assert CUDA_OVERHEAD_BYTES == g["cuda_context"] + g["libraries"] >= 1 * GiB   # the issue's >= 1 GiB per GPU
    assert nccl_communicator_bytes(2) == g["nccl_communicator"] + g["nccl_ring_neighbour"]   # one neighbour
    assert nccl_communicator_bytes(3) == nccl_communicator_bytes(8) == g["nccl_communicator"] + 2 * g["nccl_ring_neighbour"]
    assert nccl_communicator_bytes(8, nvls=True) == nccl_communicator_bytes(8) + g["nccl_nvls"]
    assert rank_process_bytes(1, 40, 1) == CUDA_OVERHEAD_BYTES
    two = rank_process_bytes(2, 40, 2)
    eight = rank_process_bytes(8, 40, 8)
    assert two == CUDA_OVERHEAD_BYTES + 2 * nccl_communicator_bytes(2)
    assert eight == CUDA_OVERHEAD_BYTES + nccl_communicator_bytes(2) + 3 * nccl_communicator_bytes(8)
    assert eight > two + 1 * GiB    # 8 ranks: 4 communicators, each with two ring neighbours


def test_fsdp_buffers_hold_three_blocks_in_the_gather_dtype(sizes):
    """Computing + prefetched block, and the prefetched block's all-gather output until its copy-out."""
    wan = sizes["wan14"]
    block = max(wan.blocks[0].bytes_per_block)  # 702.8 MB in bf16
    assert fsdp_buffer_bytes(wan, gather_itemsize=2) == pytest.approx(3 * block, abs=8)
    # fp8 weights travel as fp8; ComfyUI's ops then cast one layer at a time (the FFN's 5120 x 13824) to bf16
    fp8 = fsdp_buffer_bytes(wan, gather_itemsize=1)
    assert fp8 == pytest.approx(3 * block / 2 + 5120 * 13824 * 2, rel=1e-3)
    fewer = fsdp_buffer_bytes(wan, gather_itemsize=2, gathered_blocks=1)
    assert fewer < fsdp_buffer_bytes(wan, gather_itemsize=2)


# -------------------------------------------------------------------------------------------- weights

def test_fp8_weights_are_about_half_of_bf16(sizes):
    wan = sizes["wan14"]
    bf16, fp8 = weight_bytes(wan, "bf16"), weight_bytes(wan, "fp8_e4m3fn")
    assert bf16 == wan.total_bytes  # the file is bf16 already
    assert 0.49 < fp8 / bf16 < 0.51
    assert fp8 == L.layout_bytes(L.recast(L.wan21_t2v_14b(), "F8_E4M3"))  # norms and biases stay bf16
    assert weight_bytes(wan, "fp32") == L.layout_bytes(L.recast(L.wan21_t2v_14b(), "F32"))
    assert weight_bytes(wan, None) == wan.total_bytes


def test_recasting_an_fp8_file_back_to_bf16(tmp_path):
    layout = L.recast(L.wan_dit_tiny(), "F8_E4M3")
    size = size_component(L.write_safetensors(tmp_path / "fp8.safetensors", layout, sparse=True))
    assert weight_bytes(size, "bf16") == L.layout_bytes(L.wan_dit_tiny())


def test_size_from_bytes_supports_sizes_only_planning():
    size = size_from_bytes("dit", "wan2.1-t2v-14b", 28 * 10**9, dims={"hidden": 5120}, layers=40,
                           bytes_outside_blocks=10**9)
    assert size.blocks[0].count == 40 and sum(size.blocks[0].bytes_per_block) == 27 * 10**9
    assert weight_bytes(size, "fp8_e4m3fn") == 14 * 10**9
    with pytest.raises(SizingError, match="bytes_outside_blocks"):
        size_from_bytes("dit", "x", 10, bytes_outside_blocks=20)


# --------------------------------------------------------------------------------------- bad requests

def test_bad_requests_raise_clear_errors(sizes):
    with pytest.raises(SizingError, match="needs a recognised dit"):
        dit_tokens(sizes["wan_vae"], P720)
    with pytest.raises(SizingError, match="needs a recognised vae"):
        vae_decode_bytes(sizes["wan14"], P720, tiled=True)
    with pytest.raises(SizingError, match="'flash2' is not one of"):
        dit_working_bytes(sizes["wan14"], P720, attention="flash2")
    with pytest.raises(SizingError, match="weight dtype 'q4_k' is not known"):
        weight_bytes(sizes["wan14"], "q4_k")
    with pytest.raises(SizingError, match="must all be >= 1"):
        Workload(frames=0)
    with pytest.raises(SizingError, match="smaller than one latent pixel"):
        dit_tokens(sizes["ltxv"], Workload(16, 16, 9))


def test_sequence_parallelism_divides_the_activations_except_ltx2s(tmp_path):
    """Wan's ranks each hold 1/sp of the tokens' activations; LTX-2's keep the audio stream and much of the video's
    per-token state whole (0.79 of one rank's activation peak at 2 ranks, bench/bench_sp.py --model ltx2): the plan
    does not count on SP to shrink them."""
    wl = Workload(1280, 720, 81, 1, cfg=False)
    wan = size_component(L.write_safetensors(tmp_path / "wan.safetensors", L.wan21_t2v_14b(), sparse=True))
    ltx2 = size_component(L.write_safetensors(tmp_path / "ltx2.safetensors", L.ltx2_19b(), sparse=True))
    one, two = (dit_working_bytes(wan, wl, comfyui=False, sp=sp) for sp in (1, 2))
    assert two < 0.6 * one
    assert dit_working_bytes(ltx2, wl, comfyui=False, sp=2) == dit_working_bytes(ltx2, wl, comfyui=False, sp=1)
