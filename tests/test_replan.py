"""What the plan counts beside the components: what this pack and ComfyUI already hold on a live machine (faked
NVML), what the rank processes keep in every phase, and the ComfyUI process's own CUDA contexts. No ComfyUI, no GPU."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

import ckpt_layouts as L
from loaders import model_files as mf
from loaders import placement, pools
from mgpu.errors import PlanError
from mgpu.planning.devices import parse_spec
from mgpu.planning.estimates import CUDA_CONTEXT_BYTES, CUDA_OVERHEAD_BYTES, Workload
from mgpu.planning.partition import Component, Policy, make_plan
from mgpu.planning.sizing import size_component
from test_devices import FakeNVML, gpu

GiB = 1 << 30
HD_81 = Workload(width=1280, height=720, frames=81, batch=1, cfg=True)
RANK_PIDS = [4242, 4243]
HOST_PID, OTHER_PID = 100, 777
UUIDS = ["GPU-aaaa0000-0000-0000-0000-000000000000", "GPU-bbbb0000-0000-0000-0000-000000000001"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    for name, layout in (("wan14b.safetensors", L.wan21_t2v_14b()), ("umt5.safetensors", L.umt5_xxl()),
                         ("vae.safetensors", L.wan_vae())):
        L.write_safetensors(d / name, layout, sparse=True)
    return d


@dataclass(eq=False)
class FakeSharded:
    """A model loaded on the ranks, as pools sees one: its pool's devices and the bytes each rank reported."""
    checkpoint: str
    local_bytes: int
    devices: list[str] = field(default_factory=lambda: ["cuda:0", "cuda:1"])
    loaded: bool = True
    freed: int = 0
    handle: str = "dit-test"

    @property
    def pool(self):
        return SimpleNamespace(config=SimpleNamespace(devices=self.devices))

    @property
    def spec(self):
        return SimpleNamespace(checkpoint=self.checkpoint, reshard_after_forward=True)

    @property
    def load_replies(self):
        return [{"local_param_bytes": self.local_bytes, "gathered_bytes_per_forward": 0} for _ in self.devices]

    def free(self) -> None:
        self.freed += 1
        self.loaded = False


class _Model:
    """Stands for the host's BaseModel, which ``pools.release_with`` watches (weakly)."""


def _comfy(monkeypatch, loaded=(), main: str | None = "cuda:0", aimdo: bool = False) -> None:
    """Just what placement reads of ComfyUI: its loaded models, its main device, whether dynamic VRAM is on."""
    mm = types.ModuleType("comfy.model_management")
    mm.current_loaded_models = [SimpleNamespace(device=torch.device(dev), model=object(),
                                                model_loaded_memory=lambda n=n: n) for dev, n in loaded]
    mm.get_torch_device = lambda: torch.device(main or "cpu")
    memory = types.ModuleType("comfy.memory_management")
    memory.aimdo_enabled = aimdo
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.memory_management", memory)


@pytest.fixture
def machine(monkeypatch):
    """Two 24 GiB GPUs seen through a fake NVML; ``machine(used)`` sets what each process uses on each GPU."""
    monkeypatch.setattr(pools, "_live", set())
    monkeypatch.setattr(pools, "_slots", {})
    monkeypatch.setattr(pools, "rank_pids", lambda: RANK_PIDS)
    for name in ("CUDA_VISIBLE_DEVICES", "MGPU_DEVICES"):
        monkeypatch.delenv(name, raising=False)

    def install(used: dict[int, dict[int, int]]) -> None:
        gib = {i: sum(per.values()) / GiB for i, per in used.items()}
        box = FakeNVML([gpu("NVIDIA GeForce RTX 4090", 24, (8, 9), f"00000000:0{i + 1}:00.0", UUIDS[i],
                            free_gib=24 - gib.get(i, 0)) for i in range(2)],
                       p2p=[(0, 1)], processes={i: list(per.items()) for i, per in used.items()})
        monkeypatch.setitem(sys.modules, "pynvml", box)
        placement._live_gpu_ids.cache_clear()

    yield install
    placement._live_gpu_ids.cache_clear()


def _plan(files, **request):
    req = mf.PlanRequest(dit="wan14b.safetensors", text_encoder="umt5.safetensors", vae="vae.safetensors",
                         width=1280, height=720, dit_weight_dtype="fp8_e4m3fn", **request)
    return mf.make_plan_for(req, lambda folder, name: str(files / name))


def _gpu_view(plan) -> tuple:
    return (plan.placements, [(u.device, u.budget_bytes, u.by_phase) for u in plan.usage if u.device != "cpu"])


def test_a_replan_while_our_ranks_hold_a_shard_equals_the_plan_on_the_empty_machine(machine, monkeypatch, files):
    """The user changes the frame count and the plan is made again while the ranks still hold the DiT's shards (and
    their contexts and communicators: 9 GiB per GPU) and ComfyUI still caches the text encoder on cuda:0: what is
    ours counts as available, so the plan is the one the machine gets with none of it loaded. Only the ComfyUI
    process's own context (cuda:0, its main GPU) is held in both."""
    _comfy(monkeypatch)
    machine({0: {HOST_PID: CUDA_CONTEXT_BYTES}})
    empty = _plan(files)
    assert empty.placement("dit").strategy == "fsdp"
    te = size_component(str(files / "umt5.safetensors")).total_bytes
    _comfy(monkeypatch, loaded=[("cuda:0", te)])
    machine({0: {HOST_PID: CUDA_CONTEXT_BYTES + te, RANK_PIDS[0]: 9 * GiB},
             1: {RANK_PIDS[1]: 9 * GiB, OTHER_PID: 0}})
    again = _plan(files)
    assert _gpu_view(again) == _gpu_view(empty)
    assert "counted as available: cuda:0 20.1 GiB, cuda:1 9 GiB in use now by this pack's rank processes" in \
        "\n".join(again.reasons)
    # another process's memory is not ours: 9 GiB of it on each GPU and the fp8 DiT no longer fits beside it
    _comfy(monkeypatch)
    machine({0: {HOST_PID: CUDA_CONTEXT_BYTES, OTHER_PID: 9 * GiB}, 1: {OTHER_PID: 9 * GiB}})
    with pytest.raises(PlanError, match="cannot place the dit"):
        _plan(files)


def test_a_model_of_another_file_on_our_ranks_stays_counted_as_used(machine, monkeypatch, files):
    """Only the loaded copies of the plan's own DiT files are replaced by its loads; a model of another checkpoint
    that another workflow keeps on the same ranks stays where it is."""
    _comfy(monkeypatch, main=None)   # a CPU ComfyUI: no context of its own on the GPUs
    machine({i: {RANK_PIDS[i]: 9 * GiB} for i in range(2)})
    dit = str(files / "wan14b.safetensors")
    other, models = FakeSharded("/models/other.safetensors", 3 * GiB), [_Model(), _Model()]
    pools.release_with(models[0], other)   # registered as loaded, as a load does
    ours = {d.id: d.reclaimable_bytes for d in placement.available_devices([dit])}
    assert ours == {"cuda:0": 6 * GiB, "cuda:1": 6 * GiB, "cpu": 0}
    same_file = FakeSharded(dit, 5 * GiB)
    pools.release_with(models[1], same_file)
    assert placement.available_devices([dit])[0].reclaimable_bytes == 6 * GiB   # its 5 GiB: replaced by the plan
    assert placement.available_devices()[0].reclaimable_bytes == 1 * GiB       # a load of a third file keeps both


def test_a_loader_run_again_frees_its_previous_model_before_the_room_is_weighed(monkeypatch):
    """``vacate``: the MGPU loader without a plan makes its own plan (``placement.plan_to_follow``) on what the ranks
    hold once its previous model left them, not with the old shards still there."""
    monkeypatch.setattr(pools, "_slots", {})
    previous = FakeSharded("/models/wan.safetensors", 7 * GiB)
    pools.occupy(("workflow", "12"), previous)
    pools.vacate(("workflow", "13"))
    assert previous.loaded
    pools.vacate(("workflow", "12"))
    assert (previous.loaded, previous.freed) == (False, 1)
    pools.occupy(("workflow", "12"), FakeSharded("/models/wan.safetensors", 7 * GiB))   # frees nothing twice
    assert previous.freed == 1


# --- what stays on a rank GPU between phases --------------------------------------------------------------------

@pytest.fixture(scope="module")
def sizes(files):
    return {role: size_component(str(files / name)) for role, name in
            (("dit", "wan14b.safetensors"), ("text_encoder", "umt5.safetensors"), ("vae", "vae.safetensors"))}


def _components(sizes):
    return [Component("dit", sizes["dit"], "fp8_e4m3fn"), Component("text_encoder", sizes["text_encoder"]),
            Component("vae", sizes["vae"])]


def test_the_rank_processes_count_in_the_decode_and_encode_phases_too(sizes):
    """Wan 14B fp8 on 2 x 24 GiB: after sampling the ranks empty their caching allocators, but their CUDA context,
    libraries and NCCL communicator stay: the decode (and the next prompt's encode) phase counts them."""
    p = make_plan(_components(sizes), parse_spec("2x24GiB,cpu=64GiB"), HD_81)
    dit = p.placement("dit")
    process = dit.process_bytes["cuda:1"]
    assert process > CUDA_OVERHEAD_BYTES   # context and libraries, plus the WORLD communicator
    cuda1 = p.usage[1]   # cuda:1 holds the DiT shard only
    assert cuda1.by_phase["decode"] == cuda1.by_phase["encode"] == dit.resident_bytes["cuda:1"] + process
    assert cuda1.by_phase["sample"] == dit.resident_bytes["cuda:1"] + process + dit.working_bytes["cuda:1"]
    assert any("keeps 1.5 GiB on its GPU in every phase" in r for r in dit.reasons)


def test_eight_ranks_count_more_communicators_than_two(sizes):
    """Each rank joins WORLD and one NCCL group per sequence degree the load sets up: on 8 ranks (40 heads) cfg 2 x
    sp 4 sets up 2 and 4, three communicators of more than two ranks; on 2 ranks (cfg 2 x sp 1) WORLD alone."""
    dit = [Component("dit", sizes["dit"])]
    two = make_plan(dit, parse_spec("2x80GiB,cpu=64GiB"), HD_81, Policy(prefer_speed=True)).placement("dit")
    eight = make_plan(dit, parse_spec("8x80GiB:pcie,cpu=64GiB"), HD_81, Policy(prefer_speed=True)).placement("dit")
    assert (two.sp_degree, eight.cfg_degree, eight.sp_degree) == (1, 2, 4)
    assert eight.process_bytes["cuda:0"] > two.process_bytes["cuda:0"] + 1 * GiB
    assert any("3 NCCL communicator(s) (groups of 8, 2, 4 ranks)" in r for r in eight.reasons)
    nvswitch = make_plan(dit, parse_spec("8x80GiB:nvlink,cpu=64GiB"), HD_81, Policy(prefer_speed=True))
    assert nvswitch.placement("dit").process_bytes["cuda:0"] == eight.process_bytes["cuda:0"]   # no capability: no NVLS


# --- the ComfyUI process's own CUDA contexts (ComfyUI 0.33's dynamic VRAM) --------------------------------------

def test_the_hosts_context_on_every_gpu_lowers_each_budget_and_the_plan_says_so(sizes):
    spec = parse_spec("2x24GiB,cpu=64GiB")
    without = make_plan(_components(sizes), spec, HD_81)
    with_host = make_plan(_components(sizes), spec, HD_81, Policy(host_context_gpus=("cuda:0", "cuda:1")))
    for a, b in zip(without.usage[:2], with_host.usage[:2]):
        assert a.budget_bytes - b.budget_bytes == CUDA_CONTEXT_BYTES
    text = with_host.table()
    assert ("the ComfyUI process itself holds, in every phase, on cuda:0: its CUDA context (512 MiB); cuda:1: its "
            "CUDA context (512 MiB)") in text
    assert "ComfyUI process" not in without.table()
    # the encoder and the VAE ComfyUI runs on cuda:0 do not count that context a second time
    te = with_host.placement("text_encoder")
    assert te.working_bytes["cuda:0"] == without.placement("text_encoder").working_bytes["cuda:0"] - CUDA_CONTEXT_BYTES


@pytest.mark.parametrize("aimdo, main, held", [(True, "cuda:0", ("cuda:0", "cuda:1")), (False, "cuda:1", ("cuda:1",)),
                                               (False, None, ())])
def test_the_loaders_say_where_the_host_holds_a_context(monkeypatch, files, aimdo, main, held):
    """Dynamic VRAM on (comfy-aimdo's init_devices over every GPU): all of them; else ComfyUI's main GPU; a CPU
    ComfyUI: none. The MGPU Plan node's plan carries it, for a simulated machine too."""
    _comfy(monkeypatch, main=main, aimdo=aimdo)
    assert placement.host_context_gpus(parse_spec("2x24GiB")) == held
    plan = _plan(files, devices="2x24GiB,cpu=64GiB")
    assert tuple(plan.policy["host_context_gpus"]) == held
    assert ("the ComfyUI process itself holds" in "\n".join(plan.reasons)) == bool(held)


def test_outside_comfyui_the_host_holds_nothing_and_caches_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    assert placement.host_context_gpus(parse_spec("2x24GiB")) == ()
    assert placement.comfyui_held() == {}
