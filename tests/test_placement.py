"""Device choices of the MGPU loaders and how a choice resolves, on simulated machines (no ComfyUI, no GPU)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types

import pytest
import torch

import ckpt_layouts as L
from loaders import placement
from loaders.placement import Choice, choice_labels, device_choices, plan_to_follow, resolve
from mgpu.planning.devices import parse_spec
from mgpu.errors import MgpuError
from mgpu.planning.estimates import Workload
from mgpu.planning.partition import Component, Plan, Policy, make_plan
from mgpu.planning.sizing import size_component

GiB = 1 << 30
TWO = parse_spec("2x24GiB,cpu=64GiB")
CPU_ONLY = parse_spec("cpu=64GiB")


@pytest.fixture(scope="module")
def wan14b(tmp_path_factory):
    d = tmp_path_factory.mktemp("wan14b")
    return {
        "dit": size_component(L.write_safetensors(d / "wan_14b.safetensors", L.wan21_t2v_14b(), sparse=True)),
        "text_encoder": size_component(L.write_safetensors(d / "umt5.safetensors", L.umt5_xxl(), sparse=True)),
        "vae": size_component(L.write_safetensors(d / "vae.safetensors", L.wan_vae(), sparse=True)),
    }


def make(sizes, spec: str, dit_dtype: str | None = None, **policy) -> Plan:
    comps = [Component("dit", sizes["dit"], dit_dtype), Component("text_encoder", sizes["text_encoder"]),
             Component("vae", sizes["vae"])]
    return make_plan(comps, parse_spec(spec), Workload(1280, 720, 81, 1, True), Policy(**policy))


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    """Each test sees the machine it sets up: no cached GPU list, and no real ComfyUI's device list (a ComfyUI test
    tier in the same process may have imported comfy.model_management; tests that want one install a fake)."""
    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    placement._live_gpu_ids.cache_clear()
    yield
    placement._live_gpu_ids.cache_clear()


def with_free(devices, **free_gib):
    return [dataclasses.replace(d, free_bytes=free_gib[d.id.replace(":", "")] * GiB)
            if d.id.replace(":", "") in free_gib else d for d in devices]


def test_choices_are_stable_ids_in_ordinal_order():
    assert device_choices(devices=TWO) == ["auto", "cpu", "cuda:0", "cuda:1", "fsdp"]
    assert device_choices(include_fsdp=False, devices=TWO) == ["auto", "cpu", "cuda:0", "cuda:1"]
    # free memory does not change the values (saved workflows keep working); only the labels carry it
    assert device_choices(devices=with_free(TWO, cuda1=3)) == device_choices(devices=TWO)
    assert device_choices(devices=CPU_ONLY) == ["auto", "cpu", "fsdp"]


def test_labels_name_devices_and_memory_but_keep_the_values():
    devices = with_free(TWO, cuda1=3)
    labels = choice_labels(devices=devices)
    assert list(labels) == device_choices(devices=devices)
    assert labels["cuda:1"] == "cuda:1 simulated 24 GiB, 3 GiB free of 24 GiB"
    assert "2 GPUs" in labels["fsdp"]
    assert "fsdp" not in choice_labels(include_fsdp=False, devices=devices)
    assert "CPU ranks" in choice_labels(devices=CPU_ONLY)["fsdp"]


def test_explicit_devices():
    assert resolve("cuda:1", "vae", None, TWO) == Choice("single", ["cuda:1"], None, "cuda:1, as chosen")
    assert resolve("cpu", "text_encoder", None, TWO).strategy == "cpu"
    assert resolve("cpu", "dit", None, TWO).devices == ["cpu"]


def test_a_device_that_does_not_exist_names_node_machine_and_choices():
    with pytest.raises(MgpuError) as info:
        resolve("cuda:7", "vae", None, TWO)
    msg = str(info.value)
    assert msg.startswith("MGPU Load VAE: device cuda:7 does not exist; this machine has cuda:0 simulated 24 GiB")
    assert "cpu simulated host 64 GiB" in msg
    assert msg.endswith("pick one of auto, cpu, cuda:0, cuda:1")  # no fsdp for a VAE
    with pytest.raises(MgpuError, match=r"^MGPU Load Diffusion Model: device cuda:2 .*pick one of .*cuda:1, fsdp$"):
        resolve("cuda:2", "dit", None, TWO)
    with pytest.raises(MgpuError, match="'gpu0' is not a device choice"):
        resolve("gpu0", "text_encoder", None, TWO)
    with pytest.raises(ValueError, match="unknown role"):
        resolve("cpu", "unet", None, TWO)


def test_fsdp_is_for_the_diffusion_model_only():
    with pytest.raises(MgpuError, match="MGPU Load Text Encoder: fsdp shards only the diffusion model"):
        resolve("fsdp", "text_encoder", None, TWO)


def test_auto_without_a_plan_follows_the_loaders_own_plan(wan14b):
    """No MGPU Plan: a plan for the loader's file alone, on the machine as it is, decides: the VAE where the decode
    has the most room, the 14B DiT sharded where it fits no GPU alone; no GPU: the cpu."""
    def auto(role, devices):
        return resolve("auto", role, plan_to_follow(role, wan14b[role].path, "auto", None, devices=devices), devices)

    assert auto("vae", with_free(TWO, cuda0=5, cuda1=20)).devices == ["cuda:1"]
    assert auto("vae", TWO).devices == ["cuda:0"]  # tie: lowest ordinal
    got = auto("text_encoder", CPU_ONLY)
    assert (got.strategy, got.devices) == ("cpu", ["cpu"])
    got = auto("dit", TWO)
    assert (got.strategy, got.devices, got.reason) == ("fsdp", ["cuda:0", "cuda:1"],
                                                       "auto: following a plan for this file alone (fsdp on cuda:0, "
                                                       "cuda:1)")
    with pytest.raises(ValueError, match="auto follows a plan that places the VAE"):
        resolve("auto", "vae", None, TWO)
    with pytest.raises(ValueError, match="fsdp follows a plan that shards the DiT"):
        resolve("fsdp", "dit", make(wan14b, "1x80GiB,cpu=64GiB"), TWO)


def test_an_explicit_device_needs_no_plan(wan14b, monkeypatch):
    monkeypatch.setattr(placement, "make_plan", None)   # never called
    plan = make(wan14b, "2x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    assert plan_to_follow("dit", wan14b["dit"].path, "cuda:1", plan) is plan
    assert plan_to_follow("vae", wan14b["vae"].path, "cpu", None) is None


def test_auto_follows_the_plan(wan14b):
    plan = make(wan14b, "2x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    dit = resolve("auto", "dit", plan, TWO)
    assert (dit.strategy, dit.devices, dit.weight_dtype) == ("fsdp", ["cuda:0", "cuda:1"], "fp8_e4m3fn")
    got, placed = resolve("auto", "text_encoder", plan, TWO), plan.placement("text_encoder")
    assert (got.strategy, got.devices, got.weight_dtype) == (placed.strategy, placed.devices, None)
    assert "following the plan" in got.reason
    # a plan without the role (no VAE planned): the loader's own plan, for the plan's workload
    partial = make_plan([Component("dit", wan14b["dit"], "fp8_e4m3fn")], parse_spec("2x24GiB,cpu=64GiB"),
                        Workload(1280, 720, 81, 1, True))
    machine = with_free(TWO, cuda1=30)
    own = plan_to_follow("vae", wan14b["vae"].path, "auto", partial, devices=machine)
    assert placement.is_own(own) and own.workload == partial.workload
    assert resolve("auto", "vae", own, machine).devices == ["cuda:1"]


def test_a_vae_whose_decode_the_plan_splits_loads_on_the_first_of_its_gpus(wan14b):
    """720p beside two fp8 shards on 20 GiB GPUs: the plan splits the decode over both GPUs (MGPU VAE Decode copies
    the VAE to the others), and MGPU Load VAE on auto loads it on the first; one device, as ComfyUI's VAE takes."""
    plan = make(wan14b, "2x20GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    assert (plan.placement("vae").strategy, plan.placement("vae").devices) == ("split", ["cuda:0", "cuda:1"])
    got = resolve("auto", "vae", plan, TWO)
    assert (got.strategy, got.devices, got.weight_dtype) == ("single", ["cuda:0"], None)
    assert got.reason == ("auto: following the plan (the VAE on cuda:0; MGPU VAE Decode splits its decode over "
                          "cuda:0, cuda:1)")
    with pytest.raises(MgpuError, match=r"^MGPU Load VAE: device cuda:0 does not exist \(the MGPU Plan loads the VAE "
                                        r"there: make the plan with devices 'auto'"):
        resolve("auto", "vae", plan, CPU_ONLY)
    one = make(wan14b, "1x80GiB,cpu=64GiB")   # an untiled decode on one GPU: the plan's one device, as it says
    got = resolve("auto", "vae", one, parse_spec("1x80GiB,cpu=64GiB"))
    assert (one.placement("vae").strategy, got.strategy, got.devices) == ("single", "single", ["cuda:0"])
    assert "following the plan (single on cuda:0)" in got.reason


def test_auto_keeps_stored_dtype_when_the_plan_does_not_recast(wan14b):
    plan = make(wan14b, "1x80GiB,cpu=64GiB")
    assert plan.placement("dit").weight_dtype == "bf16"
    assert resolve("auto", "dit", plan, parse_spec("1x80GiB,cpu=64GiB")).weight_dtype is None


def test_fsdp_uses_the_plans_group_else_every_gpu_else_cpu_ranks(wan14b):
    sharded = make(wan14b, "2x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn")
    four = parse_spec("4x24GiB,cpu=64GiB")
    assert resolve("fsdp", "dit", sharded, four).devices == ["cuda:0", "cuda:1"]
    path = wan14b["dit"].path

    def fsdp(plan, devices, ranks=0):
        return resolve("fsdp", "dit", plan_to_follow("dit", path, "fsdp", plan, fsdp_ranks=ranks, devices=devices),
                       devices)

    assert fsdp(sharded, four).devices == ["cuda:0", "cuda:1"]
    assert fsdp(sharded, four, ranks=1).devices == ["cuda:0"]
    single = make(wan14b, "1x80GiB,cpu=64GiB")
    assert single.placement("dit").strategy == "single"
    assert fsdp(single, four).devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert fsdp(None, TWO).devices == ["cuda:0", "cuda:1"]
    assert fsdp(None, TWO, ranks=1).devices == ["cuda:0"]
    cpu = fsdp(None, CPU_ONLY)
    assert (cpu.strategy, cpu.devices) == ("fsdp", ["cpu"] * placement.CPU_FSDP_RANKS)
    assert cpu.reason == "no GPU: fsdp over 2 CPU ranks (gloo; correct but slow)"
    assert fsdp(None, CPU_ONLY, ranks=3).devices == ["cpu"] * 3


def test_a_plan_for_other_devices_is_refused_with_the_way_out(wan14b):
    plan = make(wan14b, "4x24GiB,cpu=64GiB", dit_dtype="fp8_e4m3fn", prefer_speed=True)
    assert plan.placement("dit").devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(MgpuError) as info:
        resolve("auto", "dit", plan, TWO)
    msg = str(info.value)
    assert msg.startswith("MGPU Load Diffusion Model: devices cuda:2, cuda:3 do not exist")
    assert "make the plan with devices 'auto'" in msg
    with pytest.raises(MgpuError, match="the MGPU Plan shards the DiT over it"):
        resolve("fsdp", "dit", plan, TWO)
    # the same plan read back from the JSON the Plan node sends resolves the same way
    assert resolve("auto", "vae", Plan.from_json(plan.to_json()), parse_spec("4x24GiB")) == \
        resolve("auto", "vae", plan, parse_spec("4x24GiB"))


# --- the live machine ---------------------------------------------------------------------------------------------

def test_live_choices_come_from_the_inventory(monkeypatch):
    monkeypatch.setattr(placement, "inventory", lambda **_: parse_spec("3x8GiB,cpu=16GiB"))
    assert device_choices() == ["auto", "cpu", "cuda:0", "cuda:1", "cuda:2", "fsdp"]
    monkeypatch.setattr(placement, "inventory", lambda **_: parse_spec("1x8GiB,cpu=16GiB"))
    assert device_choices() == ["auto", "cpu", "cuda:0", "cuda:1", "cuda:2", "fsdp"]  # read once per process
    assert resolve("cuda:0", "vae").devices == ["cuda:0"]  # resolve reads the machine afresh
    with pytest.raises(MgpuError, match="cuda:2 does not exist"):
        resolve("cuda:2", "vae")


def test_without_gpus_the_driver_is_probed_once(monkeypatch):
    """The web page re-reads labels on every queue change; a GPU-less machine must not re-probe (and re-warn)."""
    probes = []

    def counting(spec=None, **_):
        probes.append(spec)
        return parse_spec(spec or "cpu=16GiB")

    monkeypatch.setattr(placement, "inventory", counting)
    for _ in range(3):
        assert [d.id for d in placement.live_devices()] == ["cpu"]
    assert probes == [None, "cpu", "cpu", "cpu"]


def test_a_broken_inventory_leaves_cpu_and_one_log_line(monkeypatch, caplog):
    def broken(**_):
        raise MgpuError("environment variable MGPU_DEVICES: bad device spec '2x'")

    monkeypatch.setattr(placement, "inventory", broken)
    with caplog.at_level(logging.WARNING, logger="mgpu"):
        assert device_choices() == ["auto", "cpu", "fsdp"]
        assert device_choices(include_fsdp=False) == ["auto", "cpu"]
    assert [r.getMessage() for r in caplog.records if "cannot list GPUs" in r.getMessage()] == \
        ["MGPU: cannot list GPUs (environment variable MGPU_DEVICES: bad device spec '2x'); device choices offer cpu only"]


def _fake_comfy(monkeypatch, listing):
    mm = types.ModuleType("comfy.model_management")
    mm.get_all_torch_devices = listing
    mm.get_total_memory = lambda dev: 48 * GiB
    mm.get_free_memory = lambda dev: 40 * GiB
    mm.get_torch_device_name = lambda dev: f"ComfyUI's {dev}"
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)


def test_comfyuis_device_list_wins_when_it_exists(monkeypatch):
    """ComfyUI 2026 lists its GPUs itself; NVML details are kept where it has them."""
    monkeypatch.setattr(placement, "inventory", lambda **_: parse_spec("1x24GiB,cpu=16GiB"))
    _fake_comfy(monkeypatch, lambda: [torch.device("cuda", 0), torch.device("cuda", 1)])
    devices = placement.live_devices()
    assert [d.id for d in devices] == ["cuda:0", "cuda:1", "cpu"]
    assert devices[0].name == "simulated 24 GiB"  # from the inventory
    assert (devices[1].name, devices[1].free_bytes) == ("ComfyUI's cuda:1", 40 * GiB)
    assert device_choices() == ["auto", "cpu", "cuda:0", "cuda:1", "fsdp"]


def test_a_failing_comfyui_device_list_falls_back(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(placement, "inventory", lambda **_: parse_spec("1x24GiB,cpu=16GiB"))
    _fake_comfy(monkeypatch, broken)
    with caplog.at_level(logging.WARNING, logger="mgpu"):
        assert [d.id for d in placement.live_devices()] == ["cuda:0", "cpu"]
    assert "get_all_torch_devices() failed (no CUDA)" in caplog.text


def test_a_plan_for_another_file_is_refused_by_the_loader_naming_both(wan14b, tmp_path):
    """A plan made for one DiT, connected to a loader of another file: following it would load a model nobody
    planned, with that file's devices and memory. The planned file (also through a link) passes."""
    plan = make(wan14b, "2x80GiB,cpu=64GiB")
    planned = plan.placement("dit").file
    placement.check_plan_file(plan, "dit", planned)
    link = tmp_path / "same_model.safetensors"
    link.symlink_to(planned)
    placement.check_plan_file(plan, "dit", str(link))
    placement.check_plan_file(None, "dit", "/elsewhere/other.safetensors")
    with pytest.raises(MgpuError) as info:
        placement.check_plan_file(plan, "dit", "/elsewhere/wan2.1_t2v_1.3B_bf16.safetensors")
    msg = str(info.value)
    assert msg.startswith("MGPU Load Diffusion Model: the connected MGPU Plan was made for "
                          "wan_14b.safetensors, and this loader loads wan2.1_t2v_1.3B_bf16.safetensors")
    assert "Pick the same file in MGPU Plan and here, or disconnect the plan" in msg
    with pytest.raises(MgpuError, match="^MGPU Load VAE: the connected MGPU Plan was made for vae.safetensors"):
        placement.check_plan_file(plan, "vae", "/elsewhere/other_vae.safetensors")


# --- one decision point: a loader without a plan makes the plan MGPU Plan would, and follows it -------------------

@pytest.mark.parametrize("choice, weight_dtype, spec", [
    ("auto", "default", "2x24GiB,cpu=64GiB"),       # 28.6 GB of bf16 fit no GPU alone: sharded over both
    ("auto", "default", "4x24GiB,cpu=64GiB"),       # over the fewest that fit, not every GPU
    ("auto", "fp8_e4m3fn", "1x24GiB,cpu=64GiB"),    # recast to fp8, it fits the one GPU
    ("auto", "default", "1x80GiB,cpu=64GiB"),
    ("auto", "default", "cpu=64GiB"),
    ("fsdp", "default", "2x24GiB,cpu=64GiB"),       # the plan shards it over every GPU anyway
    ("fsdp", "fp8_e4m3fn", "2x80GiB,cpu=64GiB"),    # the plan puts it on one GPU: fsdp makes a plan of its own
])
def test_a_loader_without_a_plan_decides_as_with_the_equivalent_plan_connected(wan14b, monkeypatch, choice,
                                                                                weight_dtype, spec):
    """MGPU Load Diffusion Model with no plan, and with MGPU Plan connected for the same file, default size and this
    machine: both get their plan from the same planner call with the same inputs, and ``resolve`` turns it into
    the same devices, weight dtype and gathered-weights decision. The one difference: without a plan the prompt's
    batch is a guess, so the ranks set up every sequence degree (a cfg-1 prompt still splits its tokens)."""
    from loaders import model_files as mf

    machine = parse_spec(spec)
    path = wan14b["dit"].path
    calls = []

    def spy(components, devices, workload, policy=None):
        calls.append((components, devices, workload, dataclasses.replace(policy, implicit=False, fsdp_devices=())))
        return make_plan(components, devices, workload, policy)

    monkeypatch.setattr(placement, "make_plan", spy)
    monkeypatch.setattr(mf, "make_plan", spy)

    def decide(plan):
        followed = plan_to_follow("dit", path, choice, plan, weight_dtype=weight_dtype, devices=machine)
        return resolve(choice, "dit", followed, machine), followed.placement("dit")

    own, own_placed = decide(None)
    request = mf.PlanRequest(dit=os.path.basename(path), dit_weight_dtype=weight_dtype)
    connected = mf.make_plan_for(request, lambda folder, name: path, live=lambda: machine)
    planned, planned_placed = decide(connected)
    assert calls[0] == calls[1]   # the same planner, the same file, workload, machine and policy
    assert [c.role for c in calls[0][0]] == ["dit"]
    assert dataclasses.replace(own, reason="", sp_degree=None) == \
        dataclasses.replace(planned, reason="", sp_degree=None)
    if own.strategy == "fsdp":   # 40 heads: every degree up to the ranks; the plan's CFG split sets up 1
        assert own.sp_degree == len(own.devices) and planned.sp_degree in (1, own.sp_degree)
        assert dataclasses.replace(own_placed.rank_need, process=0) == \
            dataclasses.replace(planned_placed.rank_need, process=0)   # process: the sequence groups' communicators
    assert own.reason.startswith("auto: following a plan for this file alone" if choice == "auto" else "fsdp over ")
