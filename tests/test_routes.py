"""GET /mgpu/devices and POST /mgpu/plan.

Unit tier (no ComfyUI): the request checks in loaders/model_files.py, on a fake folder listing.
Live tier (real ComfyUI, skipped without one): the routes as a browser calls them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import ckpt_layouts as L
from comfy_checkpoints import write_tiny_wan21_t2v, write_wan21_vae
from comfyui_env import ComfyServer
from loaders import model_files as mf
from mgpu.planning.devices import parse_spec
from mgpu.errors import PlanError, SizingError
from mgpu.planning.partition import Plan

LISTED = {"diffusion_models": ["wan2.1_t2v_14B_bf16.safetensors", "wan/sub.safetensors"],
          "text_encoders": ["umt5_xxl_fp8_e4m3fn_scaled.safetensors"], "vae": ["wan_2.1_vae.safetensors"]}


def listing(folder: str) -> list[str]:
    return LISTED[folder]


def body(**fields):
    return {"dit": "wan2.1_t2v_14B_bf16.safetensors", **fields}


# --- unit tier ----------------------------------------------------------------------------------------------------

def test_a_full_request_parses():
    req = mf.parse_plan_request(body(text_encoder="umt5_xxl_fp8_e4m3fn_scaled.safetensors", vae="none", width=1280,
                                     height=720, frames=81, batch=2, cfg=False, dit_weight_dtype="fp8_e4m3fn",
                                     devices=" 2x24GiB ", allow_offload=True, prefer_speed=True), listing)
    assert req == mf.PlanRequest(dit="wan2.1_t2v_14B_bf16.safetensors",
                                 text_encoder="umt5_xxl_fp8_e4m3fn_scaled.safetensors", vae=None, width=1280,
                                 height=720, frames=81, batch=2, cfg=False, dit_weight_dtype="fp8_e4m3fn", devices="2x24GiB",
                                 allow_offload=True, prefer_speed=True)
    assert mf.parse_plan_request(body(), listing) == mf.PlanRequest(dit="wan2.1_t2v_14B_bf16.safetensors")
    # a subfolder name exactly as ComfyUI lists it is a name, not a path
    assert mf.parse_plan_request({"dit": "wan/sub.safetensors"}, listing).dit == "wan/sub.safetensors"


@pytest.mark.parametrize("name, why", [
    ("/etc/passwd", "is a path"),
    ("C:\\models\\x.safetensors", "is a path"),
    ("\\\\server\\share\\x.safetensors", "is a path"),
    ("~/x.safetensors", "is a path"),
    ("../../secrets.safetensors", "leaves the diffusion_models folder"),
    ("wan/../../x.safetensors", "leaves the diffusion_models folder"),
    ("wan\\..\\x.safetensors", "leaves the diffusion_models folder"),
    ("other.safetensors", "is not in ComfyUI's diffusion_models folder (e.g. wan2.1_t2v_14B_bf16"),
    ("", "give a file name"),
    (7, "give a file name"),
])
def test_only_listed_names_are_accepted(name, why):
    with pytest.raises(mf.BadRequest, match="^dit: ") as info:
        mf.parse_plan_request({"dit": name}, listing)
    assert why in str(info.value)


def test_names_are_checked_against_their_own_folder():
    with pytest.raises(mf.BadRequest, match="^vae: 'umt5_xxl_fp8_e4m3fn_scaled.safetensors' is not in ComfyUI's vae"):
        mf.parse_plan_request(body(vae="umt5_xxl_fp8_e4m3fn_scaled.safetensors"), listing)
    with pytest.raises(mf.BadRequest, match="it is empty: put the model file there first"):
        mf.parse_plan_request(body(), lambda folder: [])


@pytest.mark.parametrize("fields, message", [
    ({"width": 8}, "width must be from 16 to 16384, got 8"),
    ({"frames": 0}, "frames must be from 1 to 16384, got 0"),
    ({"batch": 65}, "batch must be from 1 to 64, got 65"),
    ({"height": 480.5}, "height must be a whole number"),
    ({"height": "480"}, "height must be a whole number"),
    ({"width": True}, "width must be a whole number"),
    ({"cfg": 1}, "cfg must be true or false, got 1"),
    ({"dit_weight_dtype": "int4"}, "dit_weight_dtype must be one of default, fp8_e4m3fn"),
    ({"dit_dtype": "fp8_e4m3fn"}, "dit_dtype is now called dit_weight_dtype, as on the MGPU Plan node"),
    ({"devices": "2x"}, "devices: bad device spec '2x'"),
    ({"devices": 2}, "devices must be 'auto' or a device spec"),
    ({"devices": "1x24GiB," * 40}, "at most 200 characters"),
    ({"steps": 20}, "unknown field(s) steps"),
    ({"train": "yes"}, "train must be true or false"),
    ({"lora_rank": 0}, "lora_rank must be from 1 to 128"),
    ({"optimizer": "Lion"}, "optimizer must be one of AdamW, Adam, RMSprop, SGD, got 'Lion'"),
    ({"gradient_checkpointing": True}, "gradient_checkpointing must be one of auto, on, off"),
])
def test_bad_values_name_the_field(fields, message):
    with pytest.raises(mf.BadRequest) as info:
        mf.parse_plan_request(body(**fields), listing)
    assert message in str(info.value)


def test_whole_floats_and_blank_devices_are_accepted():
    req = mf.parse_plan_request(body(width=1280.0, devices="  "), listing)
    assert (req.width, req.devices) == (1280, "auto")


def test_not_an_object_and_missing_dit():
    with pytest.raises(mf.BadRequest, match="JSON object"):
        mf.parse_plan_request(["dit"], listing)
    with pytest.raises(mf.BadRequest, match="dit is required"):
        mf.parse_plan_request({"vae": "wan_2.1_vae.safetensors"}, listing)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models")
    L.write_safetensors(d / "wan14b.safetensors", L.wan21_t2v_14b(), sparse=True)
    L.write_safetensors(d / "umt5.safetensors", L.umt5_xxl(), sparse=True)
    L.write_safetensors(d / "vae.safetensors", L.wan_vae(), sparse=True)
    return d


def test_make_plan_for_sizes_the_named_files(model_dir):
    def full_path(folder, name):
        return str(model_dir / name) if (model_dir / name).exists() else None

    req = mf.PlanRequest(dit="wan14b.safetensors", text_encoder="umt5.safetensors", vae="vae.safetensors",
                         width=1280, height=720, dit_weight_dtype="fp8_e4m3fn", devices="2x24GiB,cpu=64GiB")
    plan = mf.make_plan_for(req, full_path)
    assert [p.role for p in plan.placements] == ["dit", "text_encoder", "vae"]
    assert (plan.placement("dit").strategy, plan.placement("dit").weight_dtype) == ("fsdp", "fp8_e4m3fn")
    assert [u.device for u in plan.usage] == ["cuda:0", "cuda:1", "cpu"]
    with pytest.raises(PlanError, match="cannot place the dit"):
        mf.make_plan_for(mf.PlanRequest(dit="wan14b.safetensors", devices="1x8GiB,cpu=8GiB"), full_path)
    with pytest.raises(SizingError, match="'gone.safetensors' is not in ComfyUI's vae folder; put the file there"):
        mf.make_plan_for(mf.PlanRequest(dit="wan14b.safetensors", vae="gone.safetensors"), full_path)
    # "auto" plans for the live machine the loaders see
    auto = mf.make_plan_for(mf.PlanRequest(dit="wan14b.safetensors", dit_weight_dtype="fp8_e4m3fn"), full_path,
                            live=lambda: parse_spec("1x80GiB,cpu=64GiB"))
    assert auto.placement("dit").devices == ["cuda:0"]


def test_a_training_request_plans_one_train_lora_step(model_dir):
    """train plans MGPU Train LoRA's step: no CFG whatever cfg says, the training fields in the plan's workload,
    the DiT's training choices; the same request without train plans sampling."""
    def full_path(folder, name):
        return str(model_dir / name) if (model_dir / name).exists() else None

    fields = body(dit="wan14b.safetensors", width=512, height=512, frames=17, dit_weight_dtype="fp8_e4m3fn",
                  devices="2x24GiB,cpu=64GiB", train=True, lora_rank=16, optimizer="SGD",
                  gradient_checkpointing="on", grad_accumulation=2, dataset=40)
    LISTED["diffusion_models"].append("wan14b.safetensors")
    try:
        req = mf.parse_plan_request(fields, listing)
    finally:
        LISTED["diffusion_models"].remove("wan14b.safetensors")
    assert (req.train, req.lora_rank, req.optimizer, req.gradient_checkpointing, req.dataset) == (
        True, 16, "SGD", "on", 40)
    plan = mf.make_plan_for(req, full_path)
    assert plan.workload["cfg"] is False and plan.workload["train"] == {
        "lora_rank": 16, "optimizer": "SGD", "checkpointing": "on", "training_dtype": "bf16", "lora_dtype": "bf16",
        "dataset": 40, "grad_accumulation": 2}
    dit = plan.placement("dit")
    assert dit.training["gradient_checkpointing"] and dit.training["grad_accumulation_steps"] == 2
    for row in mf.chart(plan):   # the dataset's bytes in host RAM are drawn too: every phase adds up
        for phase in row["phases"]:
            assert sum(seg["bytes"] for seg in phase["segments"]) == phase["bytes"], (row["device"], phase)
    host = next(row for row in mf.chart(plan) if row["device"] == "cpu")
    assert [seg["label"] for seg in host["phases"][1]["segments"]] == ["training dataset (latents, conditioning)"]
    sampling = mf.make_plan_for(replace(req, train=False), full_path)
    assert sampling.workload["train"] is None and sampling.placement("dit").training is None


def test_the_vae_of_an_all_in_one_checkpoint_is_sized_not_its_dit(tmp_path):
    """LTX-Video ships DiT and VAE in one file; the same file can be named as DiT and as VAE."""
    both = L.combine(L.with_prefix(L.ltxv_tiny(), "model.diffusion_model."), L.ltxv_vae(prefix="vae."))
    L.write_safetensors(tmp_path / "ltxv_all_in_one.safetensors", both, sparse=True)
    req = mf.PlanRequest(dit="ltxv_all_in_one.safetensors", vae="ltxv_all_in_one.safetensors", width=256,
                         height=256, frames=9, devices="1x24GiB,cpu=64GiB")
    plan = mf.make_plan_for(req, lambda folder, name: str(tmp_path / name))
    assert (plan.placement("dit").family, plan.placement("vae").family) == ("ltxv", "ltxv-vae")
    assert plan.placement("vae").weight_bytes < plan.placement("dit").weight_bytes + L.layout_bytes(L.ltxv_vae())


def test_chart_shows_each_phase_and_its_parts_add_up(model_dir):
    def full_path(folder, name):
        return str(model_dir / name)

    req = mf.PlanRequest(dit="wan14b.safetensors", text_encoder="umt5.safetensors", vae="vae.safetensors",
                         width=1280, height=720, dit_weight_dtype="fp8_e4m3fn", devices="2x24GiB,cpu=64GiB")
    plan = mf.make_plan_for(req, full_path)
    rows = mf.chart(plan)
    assert [r["device"] for r in rows] == ["cuda:0", "cuda:1", "cpu"]
    for row, use in zip(rows, plan.usage):
        assert [ph["phase"] for ph in row["phases"]] == ["encode", "sample", "decode"]
        for ph in row["phases"]:
            assert sum(s["bytes"] for s in ph["segments"]) == ph["bytes"] == use.by_phase[ph["phase"]]
        assert row["peak_bytes"] == max(ph["bytes"] for ph in row["phases"]) == use.peak_bytes
        assert row["headroom_bytes"] == use.budget_bytes - use.peak_bytes and row["name"]
    labels = {(r["device"], ph["phase"]): [s["label"] for s in ph["segments"]] for r in rows for ph in r["phases"]}
    te = plan.placement("text_encoder").devices[0]
    # FSDP shards stay resident in every phase; the text encoder only while encoding (freed before sampling)
    for gpu in ("cuda:0", "cuda:1"):
        assert all("DiT shard weights" in labels[(gpu, ph)] for ph in ("encode", "sample", "decode"))
        assert "DiT working" in labels[(gpu, "sample")]
    assert labels[(te, "encode")][-2:] == ["text encoder weights", "text encoder working"]
    assert not any("text encoder" in label for label in labels[(te, "sample")])


# --- live tier ----------------------------------------------------------------------------------------------------

WAN = "mgpu_routes_wan.safetensors"
VAE = "mgpu_routes_vae.safetensors"


@pytest.fixture(scope="module")
def server(comfyui_server: ComfyServer) -> ComfyServer:
    write_tiny_wan21_t2v(comfyui_server.diffusion_models / WAN)
    if not (comfyui_server.vae / VAE).exists():
        write_wan21_vae(comfyui_server.vae / VAE)
    return comfyui_server


@pytest.mark.comfyui
def test_devices_route_lists_the_machine_and_labels(server: ComfyServer):
    for prefix in ("", "/api"):
        got = server.get(prefix + "/mgpu/devices")
        assert [d["id"] for d in got["devices"]][-1] == "cpu"
        assert got["choices"][0] == "auto" and got["choices"][-1] == "fsdp"
        # the values the nodes offer, unchanged; the labels add names and memory
        options = server.object_info("MgpuLoadVAE")["input"]["required"]["device"][1]["options"]
        assert options == [c for c in got["choices"] if c != "fsdp"]
        assert set(got["labels"]) == set(got["choices"])
        assert "free of" in got["labels"]["cpu"]


@pytest.mark.comfyui
def test_plan_route_plans_listed_files(server: ComfyServer):
    status, got = server._request("POST", "/mgpu/plan", {"dit": WAN, "vae": VAE, "width": 64, "height": 64,
                                                          "frames": 5, "devices": "2x24GiB,cpu=64GiB"})
    assert status == 200, got
    plan = Plan.from_dict(got["plan"])
    assert [u.device for u in plan.usage] == ["cuda:0", "cuda:1", "cpu"]
    assert plan.placement("vae").file.endswith(VAE) and got["table"] == plan.table()
    status, got = server._request("POST", "/mgpu/plan", {"dit": WAN, "width": 64, "height": 64, "frames": 5,
                                                          "devices": "2x24GiB,cpu=64GiB", "train": True,
                                                          "lora_rank": 8})
    assert status == 200, got
    trained = Plan.from_dict(got["plan"]).placement("dit")
    assert trained.strategy == "fsdp" and trained.training["gradient_checkpointing"] is False, got["table"]
    assert "LoRA rank 8" in got["table"]


@pytest.mark.comfyui
@pytest.mark.parametrize("payload, status, message", [
    ({"dit": "/etc/passwd"}, 400, "dit: '/etc/passwd' is a path"),
    ({"dit": "../" + WAN}, 400, "leaves the diffusion_models folder"),
    ({"dit": "nope.safetensors"}, 400, "'nope.safetensors' is not in ComfyUI's diffusion_models folder"),
    ({"dit": WAN, "frames": -1}, 400, "frames must be from 1"),
    ({"dit": WAN, "devices": "3xlots"}, 400, "devices: bad device spec"),
    ({"dit": WAN, "vae": VAE, "width": 1920, "height": 1080, "frames": 4001, "devices": "1x1GiB,cpu=1GiB"}, 422,
     "cannot place the dit"),
])
def test_plan_route_refuses_with_a_json_error(server: ComfyServer, payload, status, message):
    got_status, got = server._request("POST", "/mgpu/plan", payload)
    assert got_status == status and message in got["error"], got
    if status == 422:
        assert {n["device"] for n in got["needs"]} == {"cuda:0", "cpu"}


@pytest.mark.comfyui
def test_plan_route_needs_a_json_body(server: ComfyServer):
    import urllib.request
    req = urllib.request.Request(server.base_url + "/mgpu/plan", data=b"dit=x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400 and json.loads(info.value.read()) == {"error": "the body must be JSON"}


# --- a second DiT expert (Wan 2.2 A14B) ------------------------------------------------------------------------------

EXPERTS = {"diffusion_models": ["high.safetensors", "low.safetensors"], "text_encoders": ["umt5.safetensors"],
           "vae": ["vae.safetensors"]}


def test_a_second_expert_is_an_optional_field_named_like_the_node_input():
    req = mf.parse_plan_request({"dit": "high.safetensors", "dit_low_noise": "low.safetensors"}, EXPERTS.get)
    assert (req.dit, req.dit_low_noise) == ("high.safetensors", "low.safetensors")
    assert mf.parse_plan_request({"dit": "high.safetensors", "dit_low_noise": "none"}, EXPERTS.get).dit_low_noise is None
    assert mf.parse_plan_request({"dit": "high.safetensors"}, EXPERTS.get).dit_low_noise is None
    with pytest.raises(mf.BadRequest, match="dit_low_noise: '../x.safetensors' leaves the diffusion_models folder"):
        mf.parse_plan_request({"dit": "high.safetensors", "dit_low_noise": "../x.safetensors"}, EXPERTS.get)


@pytest.fixture(scope="module")
def expert_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("experts")
    for name in ("high.safetensors", "low.safetensors"):
        L.write_safetensors(d / name, L.wan21_t2v_14b(), sparse=True)   # bf16, recast to fp8 by the request
    L.write_safetensors(d / "umt5.safetensors", L.recast(L.umt5_xxl(), "F8_E4M3"), sparse=True)
    L.write_safetensors(d / "vae.safetensors", L.wan_vae(), sparse=True)
    return d


@pytest.mark.parametrize("width, height, experts", [(640, 640, "both_resident"), (1280, 720, "one_at_a_time")])
def test_two_experts_are_planned_together_and_the_chart_adds_up(expert_dir, width, height, experts):
    req = mf.PlanRequest(dit="high.safetensors", dit_low_noise="low.safetensors", text_encoder="umt5.safetensors",
                         vae="vae.safetensors", width=width, height=height, dit_weight_dtype="fp8_e4m3fn",
                         devices="2x24GiB,cpu=64GiB")
    plan = mf.make_plan_for(req, lambda folder, name: str(expert_dir / name))
    assert [p.role for p in plan.placements] == ["dit", "dit_low_noise", "text_encoder", "vae"]
    high, low = plan.placement("dit"), plan.placement("dit_low_noise")
    assert (high.experts, low.experts, low.weight_dtype) == (experts, experts, "fp8_e4m3fn")   # dtype for both
    assert low.file.endswith("low.safetensors") and high.devices == low.devices == ["cuda:0", "cuda:1"]
    for row, use in zip(mf.chart(plan), plan.usage):
        for ph in row["phases"]:
            assert sum(s["bytes"] for s in ph["segments"]) == ph["bytes"] == use.by_phase[ph["phase"]]
        labels = [s["label"] for ph in row["phases"] for s in ph["segments"]]
        if use.device != "cpu":
            expected = (["DiT shard weights (one expert at a time)"] if experts == "one_at_a_time"
                        else ["DiT shard weights (high noise)", "DiT shard weights (low noise)"])
            assert [lb for lb in labels if "weights (" in lb][:len(expected)] == expected
            assert {s["kind"] for ph in row["phases"] for s in ph["segments"]} <= {"dit", "working", "text_encoder",
                                                                                   "vae"}


@pytest.mark.comfyui
def test_plan_route_plans_a_second_expert(server: ComfyServer):
    status, got = server._request("POST", "/mgpu/plan", {"dit": WAN, "dit_low_noise": WAN, "width": 64, "height": 64,
                                                          "frames": 5, "devices": "2x24GiB,cpu=64GiB"})
    assert status == 200, got
    plan = Plan.from_dict(got["plan"])
    assert [(p.role, p.experts) for p in plan.placements] == [("dit", "both_resident"),
                                                               ("dit_low_noise", "both_resident")]
    status, got = server._request("POST", "/mgpu/plan", {"dit": WAN, "dit_low_noise": "../" + WAN})
    assert status == 400 and "dit_low_noise" in got["error"]
