"""The partitioner's decisions for Wan 2.1 T2V 14B on the machines users have, and its invariants.

Checkpoints are sparse files in the real key layouts (header only, no weights on disk), sized by mgpu.planning.sizing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpt_layouts as L
from mgpu.planning.devices import parse_spec
from mgpu.errors import PlanError
import math

from mgpu.planning.estimates import (Workload, dit_working_bytes, fsdp_buffer_bytes,
                                     rank_process_bytes, vae_decode_bytes, vae_parallel_decode_bytes, weight_bytes)
from mgpu.planning.partition import PHASES, Component, Plan, Policy, make_plan, rank_need
from mgpu.planning.sizing import size_component

GiB = 1 << 30
HD_81 = Workload(width=1280, height=720, frames=81, batch=1, cfg=True)
SD_81 = Workload(width=832, height=480, frames=81, batch=1, cfg=True)


@pytest.fixture(scope="module")
def wan14b(tmp_path_factory):
    d = tmp_path_factory.mktemp("wan14b")
    sizes = {
        "dit": size_component(L.write_safetensors(d / "wan2.1_t2v_14B_bf16.safetensors", L.wan21_t2v_14b(), sparse=True)),
        "text_encoder": size_component(L.write_safetensors(d / "umt5_xxl_bf16.safetensors", L.umt5_xxl(), sparse=True)),
        "vae": size_component(L.write_safetensors(d / "wan_2.1_vae.safetensors", L.wan_vae(), sparse=True)),
    }
    # The sizes the issue quotes: 28.6 GB DiT, 11.4 GB encoder, 0.25 GB VAE.
    assert sizes["dit"].total_bytes == pytest.approx(28.6e9, rel=0.01)
    assert sizes["text_encoder"].total_bytes == pytest.approx(11.4e9, rel=0.01)
    assert sizes["vae"].total_bytes == pytest.approx(0.25e9, rel=0.05)
    return sizes


def components(sizes, dit_dtype=None):
    return [Component("dit", sizes["dit"], dit_dtype), Component("text_encoder", sizes["text_encoder"]),
            Component("vae", sizes["vae"])]


def plan(sizes, spec, workload=HD_81, dit_dtype=None, **policy):
    return make_plan(components(sizes, dit_dtype), parse_spec(spec), workload, Policy(**policy))


def strategies(p: Plan) -> dict[str, tuple[str, list[str]]]:
    return {pl.role: (pl.strategy, pl.devices) for pl in p.placements}


def assert_within_budgets(p: Plan) -> None:
    for u in p.usage:
        assert u.peak_bytes <= u.budget_bytes, (u.device, u.peak_bytes, u.budget_bytes)


# --- the scenarios: Wan2.1 T2V 14B bf16 + UMT5-XXL + Wan VAE, 1280x720, 81 frames, CFG ---------------------

def test_one_80gib_gpu_holds_everything(wan14b):
    p = plan(wan14b, "1x80GiB,cpu=64GiB")
    assert strategies(p) == {r: ("single", ["cuda:0"]) for r in ("dit", "text_encoder", "vae")}
    assert_within_budgets(p)
    gpu = next(u for u in p.usage if u.device == "cuda:0")
    # The encoder is freed before sampling: encode and sample phases do not add up.
    assert gpu.by_phase["encode"] < gpu.by_phase["sample"]
    assert gpu.by_phase["sample"] < wan14b["dit"].total_bytes + wan14b["text_encoder"].total_bytes + 12 * GiB


def test_two_24gib_gpus_bf16_720p_does_not_fit_and_says_why(wan14b):
    with pytest.raises(PlanError) as info:
        plan(wan14b, "2x24GiB,cpu=64GiB")
    msg = str(info.value)
    assert "sharded over 2 GPUs" in msg and "cuda:0" in msg and "cuda:1" in msg
    assert "fp8" in msg and "fewer frames" in msg and "offload" in msg
    assert {n["device"] for n in info.value.needs} == {"cuda:0", "cuda:1", "cpu"}


def test_two_24gib_gpus_fp8_shard_the_dit_and_split_cfg(wan14b):
    p = plan(wan14b, "2x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    dit = p.placement("dit")
    assert (dit.strategy, dit.devices, dit.batch_per_rank) == ("fsdp", ["cuda:0", "cuda:1"], 1)
    assert dit.weight_bytes < 0.55 * wan14b["dit"].total_bytes
    # The encoder reuses a GPU before sampling; the ranks give their working memory back when sampling ends, so one
    # GPU decodes the whole video beside its shard (13.6 GiB of the 16.6 GiB left).
    assert p.placement("text_encoder").devices[0].startswith("cuda")
    vae = p.placement("vae")
    assert (vae.strategy, vae.devices, vae.tiled) == ("single", ["cuda:0"], False)
    assert_within_budgets(p)


def test_two_24gib_gpus_bf16_480p_shards_and_splits_the_encoder_beside_the_shards(wan14b):
    # No GPU keeps room for all of UMT5-XXL beside its DiT shard; both together do, and they encode far faster than
    # the host would. It is freed before sampling.
    p = plan(wan14b, "2x24GiB,cpu=64GiB", workload=SD_81)
    assert strategies(p)["dit"] == ("fsdp", ["cuda:0", "cuda:1"])
    te = p.placement("text_encoder")
    assert (te.strategy, te.devices) == ("split", ["cuda:0", "cuda:1"])
    assert sum(te.resident_bytes.values()) == te.weight_bytes
    assert_within_budgets(p)


def test_four_16gib_gpus(wan14b):
    # bf16 fits only with the sequence split: CFG over 2 rank pairs, each pair splitting the 75,600 tokens.
    p = plan(wan14b, "4x16GiB:pcie,cpu=64GiB")
    dit = p.placement("dit")
    assert (dit.strategy, len(dit.devices), dit.cfg_degree, dit.sp_degree) == ("fsdp", 4, 2, 2)
    assert_within_budgets(p)
    with pytest.raises(PlanError, match="sharded over 4 GPUs"):
        plan(wan14b, "4x16GiB:pcie,cpu=64GiB", sequence_parallel=False)
    p = plan(wan14b, "4x16GiB:pcie,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    # All four: on three, the calibrated Wan 14B activations (9.75 bytes x hidden per token, x 1.2 safety: 8.4 GiB per
    # batch item at 720p) beside a third of the fp8 weights, its all-gather buffers and the rank process (context,
    # libraries and a 3-rank NCCL communicator: 1.7 GiB) need 15.9 GiB of the 15.5 GiB budget.
    with pytest.raises(PlanError, match=r"sharded over 3 GPUs needs 15.9 GiB per rank .* 1.7 GiB rank process"):
        make_plan([Component("dit", wan14b["dit"], "fp8_e4m3fn")], parse_spec("3x16GiB:pcie,cpu=64GiB"), HD_81)
    assert strategies(p)["dit"] == ("fsdp", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    assert p.placement("dit").batch_per_rank == 1
    # untiled decode (13.4 GiB by the rule) does not fit beside a shard and the rank process: its tiles are split
    vae = p.placement("vae")
    assert (vae.strategy, vae.devices, vae.tiled) == ("split", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], True)
    assert "FSDP rank process 2.2 GiB" in " ".join(vae.reasons)
    assert_within_budgets(p)


def test_mixed_24_and_12gib(wan14b):
    with pytest.raises(PlanError) as info:
        plan(wan14b, "cuda:0=24GiB,cuda:1=12GiB,cpu=64GiB")
    assert "smallest budget is 11.5 GiB" in str(info.value)
    p = plan(wan14b, "cuda:0=24GiB,cuda:1=12GiB,cpu=64GiB", allow_offload=True)
    assert strategies(p)["dit"] == ("offload", ["cuda:0", "cpu"])
    assert_within_budgets(p)


def test_fsdp_is_bounded_by_the_smallest_gpu(wan14b):
    # 24+16 GiB has more memory in total than 2x24 GiB needs per rank x 2, but FSDP shards evenly.
    assert strategies(plan(wan14b, "2x24GiB,cpu=64GiB", workload=SD_81))["dit"][0] == "fsdp"
    with pytest.raises(PlanError, match="smallest budget is 15.5 GiB"):
        plan(wan14b, "cuda:0=24GiB,cuda:1=16GiB,cpu=64GiB", workload=SD_81)
    p = plan(wan14b, "cuda:0=24GiB,cuda:1=22GiB,cpu=64GiB", workload=SD_81)
    assert any("smallest member bounds" in r for r in p.placement("dit").reasons)


def _fsdp_rank_need(sizes, workload: Workload, ranks: int, sp: int = 1) -> int:
    """A rank's need recomputed from the estimates: its shard, the root unit, activations, FSDP's buffers and the
    rank process's own memory (context, libraries, NCCL communicators)."""
    dit = sizes["dit"]
    resident = math.ceil(dit.total_bytes / ranks) + dit.bytes_outside_blocks
    buffers = fsdp_buffer_bytes(dit, gather_itemsize=2)
    process = rank_process_bytes(ranks, dit.dims["heads"], sp)
    return resident + dit_working_bytes(dit, workload, batch=1, comfyui=False) + buffers + process


def _gpus(budget: int, count: int) -> str:
    reserve = Policy().reserve_bytes
    return ",".join(f"cuda:{i}={budget + reserve}B" for i in range(count)) + ",cpu=64GiB"


def test_fsdp_need_includes_the_all_gather_and_nccl_buffers(wan14b):
    """Two GPUs with exactly a rank's need shard the DiT; one byte less is refused, so the buffers (2 GiB of gathered
    blocks in bf16 for Wan 14B) and the rank process (1.5 GiB) are counted, not just shard + activations."""
    dit = [Component("dit", wan14b["dit"])]
    need = _fsdp_rank_need(wan14b, SD_81, 2)
    p = make_plan(dit, parse_spec(_gpus(need, 2)), SD_81)
    placed = p.placement("dit")
    assert (placed.strategy, placed.devices, placed.reshard_after_forward) == ("fsdp", ["cuda:0", "cuda:1"], True)
    assert all(u.headroom_bytes == 0 for u in p.usage if u.device != "cpu")
    with pytest.raises(PlanError, match="sharded over 2 GPUs needs"):
        make_plan(dit, parse_spec(_gpus(need - 1, 2)), SD_81)
    buffers = fsdp_buffer_bytes(wan14b["dit"], gather_itemsize=2)
    assert buffers + rank_process_bytes(2, 40, 1) > 3 * GiB  # what a plan without them would have wrongly accepted


def test_one_gpu_needs_comfyuis_reservation_beside_the_weights(wan14b):
    """720p on one GPU: ComfyUI keeps 14.0 GiB free to load the 14B model fully (more than our 8.4 GiB), so a GPU
    that holds the weights plus our estimate but not ComfyUI's reservation does not get the DiT."""
    dit = wan14b["dit"]
    ours = dit.total_bytes + dit_working_bytes(dit, HD_81, batch=1, comfyui=False)
    theirs = dit.total_bytes + dit_working_bytes(dit, HD_81, batch=1)
    assert theirs - ours > 5 * GiB
    only_dit = [Component("dit", dit)]
    assert strategies(make_plan(only_dit, parse_spec(_gpus(theirs, 1)), HD_81))["dit"] == ("single", ["cuda:0"])
    with pytest.raises(PlanError, match="DiT on one GPU needs"):
        make_plan(only_dit, parse_spec(_gpus(theirs - 1, 1)), HD_81)


@pytest.mark.parametrize("offload", [True, False])
def test_one_24gib_gpu(wan14b, offload):
    if not offload:
        with pytest.raises(PlanError, match="allow CPU offload"):
            plan(wan14b, "1x24GiB,cpu=64GiB", allow_offload=False)
        return
    p = plan(wan14b, "1x24GiB,cpu=64GiB", allow_offload=True)
    assert strategies(p)["dit"] == ("offload", ["cuda:0", "cpu"])
    host = next(u for u in p.usage if u.device == "cpu")
    assert host.peak_bytes >= wan14b["dit"].total_bytes * 0.9
    assert_within_budgets(p)


def test_cpu_only(wan14b):
    p = plan(wan14b, "cpu=128GiB")
    assert strategies(p) == {r: ("cpu", ["cpu"]) for r in ("dit", "text_encoder", "vae")}
    with pytest.raises(PlanError, match="host RAM"):
        plan(wan14b, "cpu=16GiB")


# --- the VAE decode: one GPU, or its tiles split over the GPUs (MGPU VAE Decode) -------------------------------------

def _decode_plan(sizes, spec: str, workload: Workload = HD_81, **policy) -> Plan:
    """Wan 14B in fp8 and its VAE: at decode time each rank GPU holds its 6.9 GiB shard (the ranks gave their
    working memory back when sampling ended)."""
    return make_plan([Component("dit", sizes["dit"], "fp8_e4m3fn"), Component("vae", sizes["vae"])],
                     parse_spec(spec), workload, Policy(**policy))


def test_a_long_video_that_no_gpu_decodes_beside_the_shards_is_split_over_them(wan14b):
    """720p, 81 frames on 2 x 20 GiB: at decode time each GPU holds its DiT shard and its rank process (context,
    libraries, NCCL), 11.1 GiB left of 19.5; the untiled decode needs 13.6 GiB on one GPU, a split decode 5.3 GiB on
    each (a VAE copy, one tile, a CUDA context). The DiT's working memory is not held then: its ranks released it
    when sampling ended."""
    p = _decode_plan(wan14b, "2x20GiB,cpu=64GiB")
    dit, vae = p.placement("dit"), p.placement("vae")
    assert (vae.strategy, vae.devices, vae.tiled) == ("split", ["cuda:0", "cuda:1"], True)
    each = vae_parallel_decode_bytes(wan14b["vae"], HD_81)
    untiled = weight_bytes(wan14b["vae"], None) + vae_decode_bytes(wan14b["vae"], HD_81, tiled=False)
    for use in p.usage[:2]:
        dev = use.device
        assert vae.resident_bytes[dev] == weight_bytes(wan14b["vae"], None)
        assert vae.resident_bytes[dev] + vae.working_bytes[dev] == each
        held = dit.resident_bytes[dev] + dit.process_bytes[dev]   # the working memory counts while sampling only
        assert use.by_phase["sample"] == held + dit.working_bytes[dev]
        assert use.by_phase["decode"] == held + each <= use.budget_bytes
        assert held + untiled > use.budget_bytes   # the one-GPU decode does not fit beside it
    text = p.table()
    assert ("vae: split on cuda:0, cuda:1 (wan-vae, bf16, 242 MiB)\n"
            "  - untiled on one GPU needs 13.6 GiB (242 MiB weights + 13.4 GiB working, the whole video at once); "
            "free at decode: cuda:0 11.1 GiB (beside DiT shard 6.9 GiB + FSDP rank process 1.5 GiB), cuda:1 11.1 GiB "
            "(beside DiT shard 6.9 GiB + FSDP rank process 1.5 GiB)\n"
            "  - decoded in tiles split over 2 GPUs by MGPU VAE Decode (devices auto, this plan connected): 5.3 GiB "
            "on each GPU (242 MiB VAE copy + 4 GiB one tile of 512 px x 64 frames + 1 GiB CUDA context and "
            "libraries), whatever the video's length\n"
            "  - cuda:0 loads the VAE (MGPU Load VAE on auto) and decodes with it, cuda:1 with a copy") in text
    assert "VAE (split decode)" in p.usage[0].holds
    assert Plan.from_json(p.to_json()) == p


def test_a_split_decode_starts_on_the_gpu_with_most_room_and_leaves_out_those_without(wan14b):
    """The shards take the two 19 GiB GPUs (11.6 GiB left beside each at decode); the idle 13 GiB one has the most
    room at decode (12.5 GiB, under the 13.6 GiB of an untiled decode), so the VAE loads there; a 4 GiB one has no
    room for a copy and a tile."""
    p = _decode_plan(wan14b, "cuda:0=19GiB,cuda:1=19GiB,cuda:2=13GiB,cuda:3=4GiB,cpu=64GiB")
    assert p.placement("dit").devices == ["cuda:0", "cuda:1"]
    vae = p.placement("vae")
    assert (vae.strategy, vae.devices) == ("split", ["cuda:2", "cuda:0", "cuda:1"])
    assert "left out: cuda:3 (3.5 GiB free at decode)" in vae.reasons
    assert "cuda:3" not in vae.resident_bytes
    assert_within_budgets(p)


@pytest.mark.parametrize("speed", [False, True])
def test_a_short_video_decodes_on_one_gpu(wan14b, speed):
    """480p, 33 frames: the untiled decode (6.8 GiB) fits one GPU, beside a shard too (when asked for speed the DiT
    shards over both GPUs)."""
    short = Workload(832, 480, 33, 1, True)
    p = _decode_plan(wan14b, "2x24GiB,cpu=64GiB", short, prefer_speed=speed)
    vae = p.placement("vae")
    assert (vae.strategy, len(vae.devices), vae.tiled) == ("single", 1, False)
    assert vae.working_bytes[vae.devices[0]] == vae_decode_bytes(wan14b["vae"], short, tiled=False)
    assert not any("MGPU VAE Decode" in r for r in vae.reasons)
    if speed:
        dit = p.placement("dit")
        assert dit.strategy == "fsdp" and vae.devices[0] in dit.devices
        use = p.usage[0]
        assert use.by_phase["decode"] == (dit.resident_bytes["cuda:0"] + dit.process_bytes["cuda:0"]
                                          + vae.resident_bytes["cuda:0"] + vae.working_bytes["cuda:0"])
    assert_within_budgets(p)


def test_a_decode_that_fits_nowhere_names_each_device_and_its_bytes(wan14b):
    """720p, 9 frames on 2 x 12.5 GiB: 3.6 GiB left per GPU at decode beside the shard and the rank process, under the 4.9 GiB a split
    decode needs on each and the 4.3 GiB of a tiled one; 8 GiB of host RAM (4 GiB budget) cannot decode it either."""
    brief = Workload(1280, 720, 9, 1, True)
    with pytest.raises(PlanError) as info:
        _decode_plan(wan14b, "2x12.5GiB,cpu=8GiB", brief)
    msg = str(info.value)
    assert msg.startswith("cannot place the vae (")
    beside = "(beside DiT shard 6.9 GiB + FSDP rank process 1.5 GiB)"
    assert (f"VAE untiled on one GPU needs 13.6 GiB (242 MiB weights + 13.4 GiB working, the whole video at once); "
            f"free at decode: cuda:0 3.6 GiB {beside}, cuda:1 3.6 GiB {beside}") in msg
    assert ("VAE split over GPUs by MGPU VAE Decode needs 4.9 GiB on each GPU (242 MiB VAE copy + 3.7 GiB one tile "
            "of 512 px x 64 frames + 1 GiB CUDA context and libraries) on at least 2 GPUs; no GPU has that room") in msg
    assert "VAE tiled on one GPU needs 4.3 GiB" in msg
    assert "VAE on the CPU needs 4.3 GiB of host RAM (tiled); budget left is 4 GiB" in msg
    assert "ways out: use more GPUs; give the host more free RAM" in msg and "offload" not in msg
    assert {n["device"] for n in info.value.needs} == {"cuda:0", "cuda:1", "cpu"}
    # with host RAM to spare it decodes there, and says why no GPU does
    vae = _decode_plan(wan14b, "2x12.5GiB,cpu=64GiB", brief).placement("vae")
    assert vae.strategy == "cpu" and "no GPU has room left: decodes on the CPU (slow)" in vae.reasons


def test_speed_shards_over_all_gpus_even_when_one_would_do(wan14b):
    assert strategies(plan(wan14b, "4x80GiB:nvlink,cpu=64GiB"))["dit"] == ("single", ["cuda:0"])
    p = plan(wan14b, "4x80GiB:nvlink,cpu=64GiB", prefer_speed=True)
    dit = p.placement("dit")
    assert dit.devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"] and dit.batch_per_rank == 1


def test_gathered_weights_are_kept_between_steps_only_when_they_fit(wan14b):
    roomy = plan(wan14b, "4x80GiB:nvlink,cpu=64GiB", prefer_speed=True).placement("dit")
    assert not roomy.reshard_after_forward
    assert roomy.resident_bytes["cuda:0"] >= roomy.weight_bytes  # the full gathered model on every rank
    tight = plan(wan14b, "2x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn").placement("dit")
    assert tight.reshard_after_forward and tight.resident_bytes["cuda:0"] < tight.weight_bytes


def test_keeping_the_encoder_costs_memory_during_sampling(wan14b):
    freed = plan(wan14b, "1x80GiB,cpu=64GiB")
    kept = plan(wan14b, "1x80GiB,cpu=64GiB", free_text_encoder_before_sampling=False)
    phase = lambda p: next(u for u in p.usage if u.device == "cuda:0").by_phase["sample"]  # noqa: E731
    assert phase(kept) - phase(freed) == kept.placement("text_encoder").weight_bytes


def test_deterministic_and_json_round_trip(wan14b):
    a = plan(wan14b, "2x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    b = plan(wan14b, "2x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    assert a.to_json() == b.to_json()
    back = Plan.from_json(a.to_json())
    assert back == a and back.to_json() == a.to_json()
    assert "DiT shard" in a.table() and "headroom" in a.table()


def test_bad_roles_are_rejected(wan14b):
    with pytest.raises(ValueError, match="unknown component role"):
        make_plan([Component("unet", wan14b["dit"])], parse_spec("1x80GiB"), HD_81)
    with pytest.raises(ValueError, match="once"):
        make_plan([Component("dit", wan14b["dit"])] * 2, parse_spec("1x80GiB"), HD_81)


# --- property: no plan over-commits any device ---------------------------------------------------------------------

def _recomputed_usage(p: Plan) -> dict[str, dict[str, int]]:
    """Per device and phase, weights resident plus working memory, recomputed from the placements alone."""
    free_te = p.policy["free_text_encoder_before_sampling"]
    use: dict[str, dict[str, int]] = {}
    for pl in p.placements:
        if pl.role == "dit":
            resident = PHASES if pl.strategy in ("fsdp", "offload") else ("sample", "decode")
        elif pl.role == "text_encoder":
            resident = ("encode",) if free_te else PHASES
        else:
            resident = ("decode",)
        # working memory only while it runs: an FSDP DiT's ranks give theirs back when sampling ends
        working = ({"text_encoder": "encode", "dit": "sample", "vae": "decode"}[pl.role],)
        for dev, b in pl.resident_bytes.items():
            for ph in resident:
                use.setdefault(dev, dict.fromkeys(PHASES, 0))[ph] += b
        for dev, b in pl.working_bytes.items():
            for ph in working:
                use.setdefault(dev, dict.fromkeys(PHASES, 0))[ph] += b
        for dev, b in pl.process_bytes.items():   # FSDP rank processes: every phase
            for ph in PHASES:
                use.setdefault(dev, dict.fromkeys(PHASES, 0))[ph] += b
    return use


gpu_sizes = st.lists(st.sampled_from([8, 12, 16, 20, 24, 32, 40, 48, 80, 96]), min_size=0, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=gpu_sizes, host=st.sampled_from([16, 32, 64, 256]),
       width=st.sampled_from([512, 832, 1280]), height=st.sampled_from([480, 720]),
       frames=st.sampled_from([1, 17, 49, 81, 121]), batch=st.integers(1, 3), cfg=st.booleans(),
       fp8=st.booleans(), offload=st.booleans(), speed=st.booleans(), free_te=st.booleans())
def test_no_plan_overcommits_a_device(wan14b, sizes, host, width, height, frames, batch, cfg, fp8, offload, speed,
                                      free_te):
    spec = ",".join([f"cuda:{i}={s}GiB" for i, s in enumerate(sizes)] + [f"cpu={host}GiB"])
    try:
        p = plan(wan14b, spec, Workload(width, height, frames, batch, cfg), "fp8_e4m3fn" if fp8 else None,
                 allow_offload=offload, prefer_speed=speed, free_text_encoder_before_sampling=free_te)
    except PlanError as e:
        assert e.needs and "ways out" in str(e)
        return
    recomputed = _recomputed_usage(p)
    for u in p.usage:
        assert u.by_phase == recomputed.get(u.device, dict.fromkeys(PHASES, 0))
        assert max(u.by_phase.values()) == u.peak_bytes <= u.budget_bytes
    dit = p.placement("dit")
    if dit.strategy == "fsdp":
        assert len(dit.devices) >= 2 and dit.batch_per_rank * len(dit.devices) >= batch * (2 if cfg else 1)
    assert Plan.from_json(p.to_json()) == p


def test_a_loaders_fsdp_plan_shards_over_its_ranks_and_keeps_the_gathered_weights_when_they_fit(wan14b):
    """Device fsdp on the loader (``Policy.fsdp_devices``): the DiT sharded over exactly those ranks, with the fit test
    every plan makes for the gathered weights; cpu ranks share one host budget. Shards that do not fit by the
    estimates are placed all the same, and the plan says so: the node asked for them."""
    dit = [Component("dit", wan14b["dit"])]

    def forced(spec: str, ranks: list[str]):
        return make_plan(dit, parse_spec(spec), SD_81, Policy(implicit=True, fsdp_devices=tuple(ranks))).placement("dit")

    roomy = forced("2x80GiB,cpu=64GiB", ["cuda:0", "cuda:1"])
    assert (roomy.strategy, roomy.devices, roomy.reshard_after_forward) == ("fsdp", ["cuda:0", "cuda:1"], False)
    assert any(r.startswith("the gathered weights stay between steps (26.6 GiB per rank)") for r in roomy.reasons)
    tight = forced("2x24GiB,cpu=64GiB", ["cuda:0", "cuda:1"])
    assert tight.reshard_after_forward and any(r.startswith("the gathered weights are freed after every step")
                                               for r in tight.reasons)
    assert forced("4x80GiB,cpu=64GiB", ["cuda:2"]).devices == ["cuda:2"]   # one rank, where the loader says
    host = forced("cpu=64GiB", ["cpu", "cpu"])   # 2 x 28.6 GB + working > 60 GiB of host budget
    assert host.devices == ["cpu", "cpu"] and host.reshard_after_forward
    assert host.resident_bytes == {"cpu": 2 * host.rank_need.shard} and host.process_bytes == {"cpu": 0}
    assert not forced("cpu=256GiB", ["cpu", "cpu"]).reshard_after_forward
    small = forced("2x8GiB,cpu=64GiB", ["cuda:0", "cuda:1"])
    assert (small.strategy, small.devices, small.reshard_after_forward) == ("fsdp", ["cuda:0", "cuda:1"], True)
    assert small.reasons[1].startswith("warning: DiT sharded over 2 GPUs needs ")
    assert small.reasons[1].endswith("as the loader's device fsdp asks")
    with pytest.raises(PlanError, match="sharded over 2 GPUs needs"):   # an MGPU Plan refuses it
        make_plan(dit, parse_spec("2x8GiB,cpu=64GiB"), SD_81)


def test_a_loaders_own_plan_sets_up_the_sequence_degree_for_any_batch(wan14b):
    """A loader's own plan guesses the workload (CFG on): the ranks still set up every sequence degree the heads
    allow, so a cfg-1 prompt splits its tokens over every rank; an MGPU Plan sets up its workload's split."""
    dit = [Component("dit", wan14b["dit"])]
    devices = parse_spec("2x80GiB,cpu=64GiB")
    planned = make_plan(dit, devices, SD_81, Policy(prefer_speed=True)).placement("dit")
    own = make_plan(dit, devices, SD_81, Policy(prefer_speed=True, implicit=True)).placement("dit")
    assert (planned.cfg_degree, planned.sp_degree) == (2, 1)
    assert (own.cfg_degree, own.sp_degree) == (2, 2)
    assert own.rank_need.process > planned.rank_need.process   # the communicator of the sequence groups too


def test_a_loaders_own_plan_refuses_nothing(wan14b):
    """What fits nowhere by the estimates goes, in a loader's own plan, to the GPU with the most room (ComfyUI loads
    what fits there and offloads the rest, as the loaders did before plans); an MGPU Plan refuses it."""
    comps = [Component("dit", wan14b["dit"]), Component("text_encoder", wan14b["text_encoder"]),
             Component("vae", wan14b["vae"])]
    devices = parse_spec("cuda:0=4GiB,cuda:1=6GiB,cpu=8GiB")
    with pytest.raises(PlanError):
        make_plan(comps, devices, SD_81)
    p = make_plan(comps, devices, SD_81, Policy(implicit=True))
    assert [(x.role, x.strategy, x.devices) for x in p.placements] == [
        ("dit", "single", ["cuda:1"]), ("text_encoder", "single", ["cuda:0"]), ("vae", "single", ["cuda:0"])]
    assert p.placement("dit").reasons[0].endswith("do not fit on cuda:1")
    assert p.placement("dit").reasons[1].startswith("warning: nothing fits by these estimates (")
    assert p.placement("vae").tiled


# --- text encoders too big for one GPU: their layers split over several ----------------------------------------------

@pytest.fixture(scope="module")
def gemma12b(tmp_path_factory):
    """LTX-2's text encoder: Gemma 3 12B with its vision tower, as google/gemma-3-12b-it ships it (24.4 GB bf16)."""
    d = tmp_path_factory.mktemp("gemma12b")
    size = size_component(L.write_safetensors(d / "gemma_3_12B_it.safetensors", L.gemma3_12b(), sparse=True))
    assert size.total_bytes == pytest.approx(24.4e9, rel=0.01) and size.family == "gemma3-12b"
    return size


def encoder_plan(size, spec, **policy) -> Plan:
    return make_plan([Component("text_encoder", size)], parse_spec(spec), HD_81, Policy(**policy))


def test_gemma3_12b_is_split_over_two_16gib_gpus_with_bytes_per_device(gemma12b):
    p = encoder_plan(gemma12b, "2x16GiB,cpu=64GiB")
    te = p.placement("text_encoder")
    assert (te.strategy, te.devices) == ("split", ["cuda:0", "cuda:1"])
    first, second = te.resident_bytes["cuda:0"], te.resident_bytes["cuda:1"]
    assert first + second == te.weight_bytes and abs(first - second) < 0.1 * te.weight_bytes   # equal GPUs: halves
    (a0, b0), (a1, b1) = te.layers_by_device["cuda:0"], te.layers_by_device["cuda:1"]
    assert (a0, b1) == (0, 47) and a1 == b0 + 1   # every block once, in order
    for use in p.usage[:2]:   # freed before sampling: its bytes count in the encode phase only
        assert use.by_phase["encode"] == te.resident_bytes[use.device] + te.working_bytes[use.device]
        assert use.by_phase["sample"] == 0
    assert "layers split in order over 2 GPUs: cuda:0" in p.table()
    assert_within_budgets(p)
    assert Plan.from_json(p.to_json()).placement("text_encoder") == te


def test_a_split_follows_each_gpus_room_and_is_only_a_last_resort_before_the_host(gemma12b):
    p = encoder_plan(gemma12b, "cuda:0=24GiB,cuda:1=12GiB,cpu=64GiB")
    te = p.placement("text_encoder")
    assert te.strategy == "split" and te.resident_bytes["cuda:0"] > 1.5 * te.resident_bytes["cuda:1"]
    assert_within_budgets(p)
    assert strategies(encoder_plan(gemma12b, "1x40GiB,cpu=64GiB"))["text_encoder"] == ("single", ["cuda:0"])
    # the fewest GPUs that hold it: two of four
    assert len(encoder_plan(gemma12b, "4x16GiB,cpu=64GiB").placement("text_encoder").devices) == 2


def test_an_encoder_kept_through_sampling_holds_its_split_in_every_phase(gemma12b):
    p = encoder_plan(gemma12b, "2x16GiB,cpu=64GiB", free_text_encoder_before_sampling=False)
    te = p.placement("text_encoder")
    assert te.strategy == "split"
    for use in p.usage[:2]:
        assert use.by_phase["sample"] == use.by_phase["decode"] == te.resident_bytes[use.device]


def test_no_split_fits_then_the_host_and_else_the_numbers(gemma12b):
    assert strategies(encoder_plan(gemma12b, "2x8GiB,cpu=64GiB"))["text_encoder"] == ("cpu", ["cpu"])
    with pytest.raises(PlanError) as info:
        encoder_plan(gemma12b, "2x8GiB,cpu=8GiB")
    msg = str(info.value)
    assert "text encoder split over up to 2 GPUs needs 22.7 GiB of weights in all" in msg
    assert "room for weights: cuda:0" in msg


# --- Wan 2.2 A14B: two experts on the same devices, both resident or one at a time -----------------------------------

from mgpu.planning.partition import BOTH_RESIDENT, DISK_BYTES_PER_S, ONE_AT_A_TIME, fits_beside  # noqa: E402


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    """ComfyUI's Wan 2.2 A14B template files: two fp8 experts in the Wan 14B layout, UMT5-XXL fp8, the Wan VAE."""
    d = tmp_path_factory.mktemp("wan22")
    fp8_14b = L.recast(L.wan21_t2v_14b(), "F8_E4M3")
    sizes = {
        "dit": size_component(L.write_safetensors(d / "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", fp8_14b,
                                                  sparse=True)),
        "dit_low_noise": size_component(L.write_safetensors(d / "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
                                                            fp8_14b, sparse=True)),
        "text_encoder": size_component(L.write_safetensors(d / "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                                           L.recast(L.umt5_xxl(), "F8_E4M3"), sparse=True)),
        "vae": size_component(L.write_safetensors(d / "wan_2.1_vae.safetensors", L.wan_vae(), sparse=True)),
    }
    assert sizes["dit"].total_bytes == pytest.approx(14.3e9, rel=0.01)
    return sizes


def plan22(sizes, spec, workload=HD_81, **policy):
    return make_plan([Component(role, size) for role, size in sizes.items()], parse_spec(spec), workload,
                     Policy(**policy))


def _experts(p: Plan):
    return p.placement("dit"), p.placement("dit_low_noise")


def test_two_experts_on_one_big_gpu_are_both_resident(wan22):
    p = plan22(wan22, "1x80GiB,cpu=64GiB")
    high, low = _experts(p)
    assert (high.strategy, high.devices, high.experts) == ("single", ["cuda:0"], BOTH_RESIDENT)
    assert (low.strategy, low.devices, low.experts) == ("single", ["cuda:0"], BOTH_RESIDENT)
    gpu = next(u for u in p.usage if u.device == "cuda:0")
    assert gpu.by_phase["sample"] >= high.weight_bytes + low.weight_bytes
    assert "switching experts moves no weights" in high.reasons[0]
    assert_within_budgets(p)


def test_two_experts_sharded_both_resident_when_both_shards_and_one_working_fit(wan22):
    """640x640 (ComfyUI's Wan 2.2 template size) on 2x24GiB: 6.9 + 6.9 GiB of shards + 1.5 GiB rank process + 4.9 GiB
    working for one expert at a time fit in 23.5 GiB per rank, so switching experts reloads nothing."""
    p = plan22(wan22, "2x24GiB,cpu=64GiB", Workload(640, 640, 81, 1, True))
    high, low = _experts(p)
    for placed in (high, low):
        assert (placed.strategy, placed.devices, placed.experts) == ("fsdp", ["cuda:0", "cuda:1"], BOTH_RESIDENT)
        assert placed.switch_s is None
    for u in p.usage[:2]:
        assert u.by_phase["sample"] == (high.resident_bytes[u.device] + low.resident_bytes[u.device]
                                        + high.process_bytes[u.device]   # one rank process for both experts
                                        + max(high.working_bytes[u.device], low.working_bytes[u.device]))
        assert not low.process_bytes
        assert "DiT shards (2 experts)" in u.holds
    assert any("both resident" in r and "reloads nothing" in r for r in high.reasons)
    assert_within_budgets(p)


def test_wan22_a14b_fp8_on_two_24gib_gpus_at_720p_takes_the_experts_one_at_a_time(wan22):
    """The README's plan: both shards (2 x 6.9 GiB), the rank process (1.5 GiB) and one expert's 720p working memory
    (9.5 GiB) is 24.8 GiB per rank, over the 23.5 GiB budget; one at a time needs 18 GiB. Each switch reads the next expert's 1/2 per
    rank, 14.3 GB from one disk: ~7.1 s at 2 GB/s, two switches per prompt."""
    p = plan22(wan22, "2x24GiB,cpu=64GiB")
    high, low = _experts(p)
    assert (high.strategy, high.devices, high.experts) == ("fsdp", ["cuda:0", "cuda:1"], ONE_AT_A_TIME)
    assert (low.strategy, low.devices, low.experts) == ("fsdp", ["cuda:0", "cuda:1"], ONE_AT_A_TIME)
    assert high.reshard_after_forward and low.reshard_after_forward
    assert high.switch_s == pytest.approx(wan22["dit"].total_bytes / DISK_BYTES_PER_S, abs=0.01)
    assert high.switch_s == pytest.approx(7.1, abs=0.1)
    shard, working, process = (high.resident_bytes["cuda:1"], high.working_bytes["cuda:1"],
                               high.process_bytes["cuda:1"])
    budget = p.usage[1].budget_bytes
    assert 2 * shard + process + working > budget >= shard + process + working   # both do not fit, one does
    assert p.usage[1].by_phase["sample"] == shard + process + working   # one expert's shard, never both
    assert p.usage[1].by_phase["decode"] == shard + process   # the rank process stays after sampling
    text = "\n".join(high.reasons)
    assert "both experts resident would need 24.8 GiB per rank" in text and "over the 23.5 GiB budget" in text
    assert "one expert at a time (18 GiB per rank)" in text
    assert "~7.1 s at an assumed 2 GB/s (NVMe)" in text and "~14.3 s per prompt" in text
    assert "page cache" in text   # 64 GiB of host RAM holds both files
    assert low.reasons == ["the low-noise expert: fsdp on the same devices as the high-noise one (one at a time; "
                           "see dit)"]
    assert "DiT shard (1 expert at a time)" in p.usage[0].holds
    assert_within_budgets(p)
    assert Plan.from_json(p.to_json()) == p
    # streaming both experts from host RAM every step is the last resort, after taking turns
    assert _experts(plan22(wan22, "2x24GiB,cpu=64GiB", allow_offload=True))[0].experts == ONE_AT_A_TIME
    assert p.expert(low.file) is low and p.expert(high.file) is high and p.expert("other.safetensors") is None


def test_one_expert_at_a_time_on_one_gpu_keeps_the_other_in_host_ram(wan22):
    p = plan22(wan22, "1x24GiB,cpu=64GiB", Workload(640, 640, 81, 1, True))
    high, low = _experts(p)
    assert (high.strategy, high.experts) == ("single", ONE_AT_A_TIME)
    host = next(u for u in p.usage if u.device == "cpu")
    assert host.by_phase["sample"] == high.weight_bytes   # the idle expert, where ComfyUI moves it
    assert "moves the other to host RAM" in high.reasons[0] and "~1.4 s at an assumed 10 GB/s" in high.reasons[0]
    assert_within_budgets(p)


def test_experts_that_do_not_fit_even_one_at_a_time_say_both_needs(wan22):
    with pytest.raises(PlanError) as info:
        plan22(wan22, "2x16GiB,cpu=64GiB")
    msg = str(info.value)
    assert msg.startswith("cannot place the DiT experts (") and "low_noise" in msg
    assert "both DiT experts (resident together) sharded over 2 GPUs needs 24.8 GiB per rank" in msg
    assert "one DiT expert at a time sharded over 2 GPUs needs 18 GiB per rank" in msg
    assert "smallest budget is 15.5 GiB" in msg and "fewer frames" in msg


def test_a_low_noise_expert_needs_the_first_one(wan22):
    with pytest.raises(ValueError, match="give the first .* expert as dit"):
        make_plan([Component("dit_low_noise", wan22["dit"])], parse_spec("1x80GiB"), HD_81)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=gpu_sizes, host=st.sampled_from([16, 32, 64, 256]), width=st.sampled_from([640, 832, 1280]),
       height=st.sampled_from([480, 640, 720]), frames=st.sampled_from([1, 49, 81, 121]), cfg=st.booleans(),
       offload=st.booleans(), speed=st.booleans())
def test_two_experts_never_overcommit_a_device(wan22, sizes, host, width, height, frames, cfg, offload, speed):
    """Whatever the machine: both experts on the same devices with one strategy, and each phase's bytes are the
    placements' (of two experts one at a time, the larger one's; the working memory of one expert at a time)."""
    spec = ",".join([f"cuda:{i}={s}GiB" for i, s in enumerate(sizes)] + [f"cpu={host}GiB"])
    try:
        p = plan22(wan22, spec, Workload(width, height, frames, 1, cfg), allow_offload=offload, prefer_speed=speed)
    except PlanError as e:
        assert e.needs and "ways out" in str(e)
        return
    high, low = _experts(p)
    assert (high.strategy, high.devices, high.experts) == (low.strategy, low.devices, low.experts)
    assert high.experts in (BOTH_RESIDENT, ONE_AT_A_TIME)
    for u in p.usage:
        assert max(u.by_phase.values()) == u.peak_bytes <= u.budget_bytes
        held = [pl.resident_bytes.get(u.device, 0) for pl in (high, low)]
        dit = max(held) if high.experts == ONE_AT_A_TIME else sum(held)
        working = max(pl.working_bytes.get(u.device, 0) for pl in (high, low))
        others = sum(pl.working_bytes.get(u.device, 0) for pl in p.placements if pl.role == "vae")
        if dit or working:
            assert u.by_phase["sample"] >= dit + working
        assert u.by_phase["decode"] >= others
    assert Plan.from_json(p.to_json()) == p


def test_a_loader_without_a_plan_weighs_a_second_model_against_the_ranks_free_memory(wan22):
    """What the ranks report is what is left beside the models already there: the low-noise expert's shard and
    working memory (and its kept gathered weights, if it keeps them, and what the others keep) against it."""
    low = Component("dit", wan22["dit_low_noise"])
    ranks = lambda free: [d for d in parse_spec(f"2x{free}GiB") if d.kind == "cuda"]  # noqa: E731
    need = rank_need(low, ranks(16), SD_81)
    fits, why = fits_beside(need, ranks(16), keep=False)
    assert fits and "per rank (6.9 GiB shard + " in why and "cuda:0 needs" in why
    fits, why = fits_beside(need, ranks(12), keep=False)
    assert not fits and "has 11.5 GiB" in why
    assert not fits_beside(need, ranks(16), keep=True)[0]            # + its whole gathered model
    assert not fits_beside(need, ranks(16), keep=False, held=4 * GiB)[0]
    host = next(d for d in parse_spec("cpu=24GiB") if d.kind == "cpu")
    assert not fits_beside(rank_need(low, [host, host], SD_81), [host, host], keep=False)[0]   # one host's RAM


# --- LTX-2 (audio + video, 19B) + Gemma 3 12B on 2 x 24 GiB -------------------------------------------------------

LTX2_720P = Workload(width=1280, height=720, frames=121, batch=1, cfg=True)   # ComfyUI's LTX-2 template: 720p, 121


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory):
    """LTX-2 19B as Lightricks ship it (bf16 and an fp8 recast) and Gemma 3 12B in ComfyUI's text-only layout
    (Comfy-Org's gemma_3_12B_it.safetensors, ComfyUI's LTX-2 text encoder)."""
    d = tmp_path_factory.mktemp("ltx2")
    sizes = {
        "bf16": size_component(L.write_safetensors(d / "ltx-2-19b-dev.safetensors", L.ltx2_19b(), sparse=True)),
        "fp8": size_component(L.write_safetensors(d / "ltx-2-19b-dev-fp8.safetensors",
                                                  L.recast(L.ltx2_19b(), "F8_E4M3"), sparse=True)),
        "gemma": size_component(L.write_safetensors(d / "gemma_3_12B_it.safetensors", L.gemma3_12b("comfy"),
                                                    sparse=True)),
    }
    assert sizes["bf16"].family == sizes["fp8"].family == "ltx2-av"
    assert sizes["bf16"].params == pytest.approx(19.6e9, rel=0.01)
    return sizes


def ltx2_plan(sizes, dit: str, spec: str = "2x24GiB,cpu=64GiB", workload: Workload = LTX2_720P, **policy) -> Plan:
    return make_plan([Component("dit", sizes[dit]), Component("text_encoder", sizes["gemma"])], parse_spec(spec),
                     workload, Policy(**policy))


def test_ltx2_bf16_does_not_fit_two_24gib_gpus_and_says_fp8(ltx2):
    with pytest.raises(PlanError) as info:
        ltx2_plan(ltx2, "bf16")
    msg = str(info.value)
    assert "DiT sharded over 2 GPUs needs" in msg and "fp8" in msg


def test_ltx2_fp8_samples_on_one_gpu_after_gemma_encodes_split_over_both(ltx2):
    """The fp8 DiT (18.2 GiB) fits one 24 GiB GPU with its working memory; Gemma 3 12B (21.9 GiB) fits neither GPU
    beside it, so it encodes split over both and is freed before sampling."""
    p = ltx2_plan(ltx2, "fp8")
    assert strategies(p) == {"dit": ("single", ["cuda:0"]), "text_encoder": ("split", ["cuda:0", "cuda:1"])}
    te = p.placement("text_encoder")
    assert sum(te.resident_bytes.values()) == te.weight_bytes
    for use in p.usage[:2]:   # the encoder's shares only while encoding; cuda:1 idles while cuda:0 samples
        assert use.by_phase["encode"] == te.resident_bytes[use.device] + te.working_bytes[use.device]
    assert next(u for u in p.usage if u.device == "cuda:1").by_phase["sample"] == 0
    assert_within_budgets(p)


def test_ltx2_fp8_for_speed_shards_over_both_and_splits_cfg_or_its_video_tokens(ltx2):
    """Asked for speed, the DiT shards over both GPUs, one CFG row each; a cfg-1 (distilled) run splits the video
    tokens instead (LTX-2's own adapter, mgpu.families.ltxav), its audio queries' key/value gather priced in."""
    p = ltx2_plan(ltx2, "fp8", prefer_speed=True)
    dit = p.placement("dit")
    assert (dit.strategy, dit.devices, dit.cfg_degree, dit.sp_degree) == ("fsdp", ["cuda:0", "cuda:1"], 2, 1)
    assert_within_budgets(p)
    distilled = ltx2_plan(ltx2, "fp8", workload=Workload(1280, 720, 121, 1, cfg=False), prefer_speed=True)
    assert (distilled.placement("dit").cfg_degree, distilled.placement("dit").sp_degree) == (1, 2)
    assert any("Ulysses sequence parallel over 2 ranks" in r for r in distilled.placement("dit").reasons)
    assert_within_budgets(distilled)


def test_a_host_short_of_ram_says_it_is_free_memory_now_and_what_others_hold(wan14b):
    """No GPU, 24 GiB of RAM of which other processes hold all but 1 GiB: the refusal names the free memory now
    and the others' share, not a "budget is 0 B" that reads as a limit of this machine."""
    from mgpu.planning.devices import Device

    host = Device(id="cpu", kind="cpu", index=None, name="host RAM", total_bytes=24 * GiB, free_bytes=1 * GiB,
                  source="host")
    with pytest.raises(PlanError) as info:
        make_plan(components(wan14b), [host], SD_81, Policy())
    msg = str(info.value)
    assert "host RAM free now for this plan: " in msg and "of 24 GiB, 23 GiB of it held by other processes" in msg
    assert "budget is 0 B" not in msg


@pytest.fixture(scope="module")
def wan_gguf(tmp_path_factory):
    """A small Wan DiT as a GGUF file (Q8_0 matrices), the way city96's files quantize it."""
    import torch

    from mgpu.weights.gguf_write import write_gguf

    layout = L.wan_dit(dim=256, ffn=512, layers=2)
    state = {k: torch.randn(shape) * 0.02 for k, (shape, _) in layout.items()}
    types = {k: "Q8_0" if t.ndim == 2 and t.shape[-1] % 32 == 0 else "F32" for k, t in state.items()}
    path = tmp_path_factory.mktemp("gguf") / "wan_small-Q8_0.gguf"
    write_gguf(path, state, types)
    size = size_component(path)
    assert size.gguf and size.family.startswith("wan")
    return size


@pytest.mark.parametrize("spec, devices", [("2x24GiB,cpu=64GiB", ["cuda:0"]), ("cpu=64GiB", ["cpu"])])
def test_a_gguf_dit_is_planned_only_where_the_loader_can_load_it(wan_gguf, spec, devices):
    """MGPU Load Diffusion Model shards GGUF files and loads them no other way: the plan for one that fits one GPU
    shards it over one rank, and without a GPU over cpu ranks, never "single" or "cpu" (the loader refuses those).
    A weight dtype does not recast a GGUF file: the plan says so and carries none to the loader."""
    p = make_plan([Component("dit", wan_gguf, "fp8_e4m3fn")], parse_spec(spec), SD_81, Policy())
    dit = p.placement("dit")
    assert (dit.strategy, dit.devices) == ("fsdp", devices)
    assert dit.weight_bytes == wan_gguf.total_bytes and "fp8" not in dit.weight_dtype
    text = "\n".join(dit.reasons)
    assert "a GGUF file: sharded with its quantized blocks kept" in text
    assert "weight dtype fp8_e4m3fn does not apply to a GGUF file" in text


def test_words_say_what_happened_on_a_machine_without_gpus(wan14b):
    """No GPU at all: the text encoder runs on the CPU because there is none, not because none "has room left";
    a step of one row is "1 batch row"."""
    from mgpu.planning.parallel import choose

    p = make_plan([Component("text_encoder", wan14b["text_encoder"])], parse_spec("cpu=64GiB"), SD_81, Policy())
    reasons = p.placement("text_encoder").reasons
    assert "no GPU on this machine: runs on the CPU (once per prompt)" in reasons
    assert not any("room left" in r for r in reasons)
    one = choose(2, 1, 40, "wan2.1-t2v-14b", sequence_parallel=False)
    assert any("1 batch row " in r for r in one.reasons) and not any("1 batch rows" in r for r in one.reasons)


def test_a_text_encoder_loaded_into_host_ram_counts_its_weights_twice():
    """ComfyUI 0.3.64 loading UMT5-XXL fp8 (5.7 GB) on the CPU peaked at 12.3 GB of host RAM, where weights +
    working planned 7.5 GiB: the file's tensors and the built encoder are alive at once."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        te = size_component(L.write_safetensors(Path(d) / "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                                L.recast(L.umt5_xxl(), "F8_E4M3"), sparse=True))
    p = make_plan([Component("text_encoder", te)], parse_spec("cpu=64GiB"), SD_81, Policy())
    placed = p.placement("text_encoder")
    peak = p.usage[0].by_phase["encode"]
    assert placed.strategy == "cpu" and peak >= 12.3e9 and peak >= 2 * placed.weight_bytes
    assert any("weights are counted twice" in r for r in placed.reasons)
