"""Device inventory: fake NVML/torch machines, CUDA_VISIBLE_DEVICES numbering, the spec grammar, JSON."""

import dataclasses
import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mgpu.planning import devices as dev
from mgpu.planning.devices import Device, format_bytes, format_spec, gpus, host, inventory, parse_bytes, parse_spec
from mgpu.errors import DeviceSpecError

GiB = 2**30


class NVMLError(Exception):
    pass


class FakeNVML:
    """Just the pynvml calls devices.py makes, over a described machine; ``fail`` names calls that raise."""

    def __init__(self, gpus, nvlink=(), p2p=(), nvlink_bridges=None, ancestors=None, migs=None, fail=(),
                 init_error=None, processes=None):
        self.gpus, self.migs = gpus, migs or {}
        self.processes = processes or {}         # physical index -> [(pid, used bytes or None)]
        self.nvlink = {frozenset(p) for p in nvlink}
        self.p2p = {frozenset(p) for p in p2p} | self.nvlink
        self.bridges = nvlink_bridges or {}      # physical index -> remote bus ids seen by nvmlDeviceGetNvLinkState
        self.ancestors = ancestors or {}         # (a, b) -> topology level
        self.fail, self.init_error, self.shutdowns, self.scanned = set(fail), init_error, 0, []
        self.NVMLError = NVMLError

    def _check(self, call, *key):
        if (call, *key) in self.fail:
            raise NVMLError(f"{call} {key} not supported")

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.migs:
            raise NVMLError("Not Found")
        return ("mig", uuid)

    def _info(self, h):
        return self.gpus[h[1]] if h[0] == "gpu" else self.migs[h[1]]

    def nvmlDeviceGetUUID(self, h):
        return self._info(h)["uuid"]

    def nvmlDeviceGetName(self, h):
        return self._info(h)["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        self._check("memory", h[1])
        info = self._info(h)
        return SimpleNamespace(total=info["total"], free=info["free"], used=info["total"] - info["free"])

    def nvmlDeviceGetCudaComputeCapability(self, h):
        self._check("capability", h[1])
        return self._info(h)["cc"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._info(h)["gen"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._info(h)["width"]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._info(h)["bus"])

    def nvmlDeviceGetP2PStatus(self, ha, hb, index):
        assert isinstance(index, int)            # pynvml's READ constant is a tuple; ctypes would reject it
        a, b = ha[1], hb[1]
        self._check("p2p", index, a, b)
        pairs = {0: self.p2p, 2: self.nvlink}[index]    # READ, NVLINK: the two capabilities worth asking
        return 0 if frozenset((a, b)) in pairs else 4

    def nvmlDeviceGetTopologyCommonAncestor(self, ha, hb):
        if (ha[1], hb[1]) not in self.ancestors:
            raise NVMLError("Not Supported")
        return self.ancestors[ha[1], hb[1]]

    def nvmlDeviceGetNvLinkState(self, h, link):
        self.scanned.append((h[1], link))
        if link >= len(self.bridges.get(h[1], ())):
            raise NVMLError("Invalid Argument")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self.bridges[h[1]][link])

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._check("processes", h[1])
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes.get(h[1], ())]


def gpu(name, gib, cc, bus, uuid, free_gib=None, gen=4, width=16):
    return dict(name=name, total=gib * GiB, free=(free_gib or gib) * GiB, cc=cc, bus=bus, uuid=uuid, gen=gen,
                width=width)


H100, RTX = "NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090"
UUIDS = ["GPU-aaaa0000-0000-0000-0000-000000000000", "GPU-bbbb0000-0000-0000-0000-000000000001",
         "GPU-cccc0000-0000-0000-0000-000000000002", "GPU-dddd0000-0000-0000-0000-000000000003"]


def four_gpu_box(**overrides):
    """GPUs 0-1 and 0-2 NVLinked (2's P2PStatus(NVLINK) is broken, so 2 -> 0 is found by scanning its links),
    1-2 PCIe P2P, the 4090 on another root: 3 -> 0 read from the PCIe tree, 3 -> 1 unknown; two broken fields."""
    machine = dict(
        gpus=[gpu(H100, 80, (9, 0), "00000000:18:00.0", UUIDS[0], free_gib=70, gen=5),
              gpu(H100, 80, (9, 0), "00000000:2A:00.0", UUIDS[1], gen=5),
              gpu(H100, 80, (9, 0), "00000000:3A:00.0", UUIDS[2], gen=5),
              gpu(RTX, 24, (8, 9), "00000000:AB:00.0", UUIDS[3], free_gib=20, width=8)],
        nvlink=[(0, 1), (0, 2)], p2p=[(1, 2)],
        nvlink_bridges={2: ["0000:18:00.0"]},
        ancestors={(3, 0): 10},
        fail={("p2p", 2, 2, 0), ("p2p", 2, 2, 1), ("p2p", 2, 2, 3), ("p2p", 0, 3, 0), ("p2p", 0, 3, 1),
              ("capability", 3), ("memory", 1)},
    )
    machine.update(overrides)
    return FakeNVML(**machine)


def fake_torch(available=False, initialized=False, uuids=(), gpus=(), peers=()):
    """A stand-in torch module: importing the real one costs seconds and would find real GPUs on a GPU box."""
    def props(i):
        if initialized:
            return SimpleNamespace(uuid=uuids[i])
        name, total, cc = gpus[i]
        return SimpleNamespace(name=name, total_memory=total, major=cc[0], minor=cc[1])

    cuda = SimpleNamespace(
        is_available=lambda: available, is_initialized=lambda: initialized,
        device_count=lambda: len(uuids) if initialized else len(gpus), get_device_properties=props,
        mem_get_info=lambda i: (gpus[i][1] // 2, gpus[i][1]),
        can_device_access_peer=lambda i, j: frozenset((i, j)) in {frozenset(p) for p in peers})
    return SimpleNamespace(cuda=cuda)


@pytest.fixture(autouse=True)
def clean_machine(monkeypatch):
    """No env overrides, no real torch; each test installs the NVML/torch it describes."""
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MGPU_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "torch", fake_torch())


def use_nvml(monkeypatch, nvml):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


def mgpu_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "mgpu"]


# --- live inventory through NVML ------------------------------------------------------------------------------------

def test_memory_our_processes_use_is_reclaimable(monkeypatch):
    """NVML's per-process memory of the PIDs named ours becomes reclaimable (what a plan may reuse); another
    process's memory, an unknown amount (None) and a GPU whose process list fails count as used."""
    box = four_gpu_box(fail={("processes", 3)}, processes={
        0: [(101, 6 * GiB), (999, 3 * GiB)], 1: [(102, 7 * GiB), (101, None)], 3: [(101, 1 * GiB)]})
    use_nvml(monkeypatch, box)
    ours = {d.id: d for d in inventory(own_pids=[101, 102])}
    assert [ours[f"cuda:{i}"].reclaimable_bytes for i in range(4)] == [6 * GiB, 0, 0, 0]   # GPU 1's memory is unknown
    assert ours["cuda:0"].available_bytes == 76 * GiB            # 70 GiB free + our 6 GiB; 999's 3 GiB stays used
    assert all(d.reclaimable_bytes == 0 for d in inventory())     # nobody named: nothing is ours
    box.gpus[1] = gpu(H100, 80, (9, 0), "00000000:2A:00.0", UUIDS[1], free_gib=60, gen=5)
    box.fail.discard(("memory", 1))
    assert {d.id: d for d in inventory(own_pids=[102])}["cuda:1"].reclaimable_bytes == 7 * GiB
    assert Device.from_dict(ours["cuda:0"].to_dict()) == ours["cuda:0"]


def test_reclaim_adds_and_removes_within_what_is_in_use():
    a, b = parse_spec("2x24GiB")
    a = dataclasses.replace(a, free_bytes=10 * GiB, reclaimable_bytes=4 * GiB)
    out = dev.reclaim([a, b], {"cuda:0": 20 * GiB, "cuda:1": 1 * GiB})
    assert out[0].reclaimable_bytes == 14 * GiB      # never more than the 14 GiB in use
    assert out[1] == b                               # all free already: nothing to reclaim
    assert dev.reclaim([a], {"cuda:0": -6 * GiB})[0].reclaimable_bytes == 0



def test_nvml_records_links_and_broken_calls(monkeypatch, caplog):
    nvml = use_nvml(monkeypatch, four_gpu_box())
    caplog.set_level(logging.INFO, logger="mgpu")
    found = inventory(include_cpu=False)
    assert [d.id for d in found] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    d0, d1, d2, d3 = found
    assert (d0.name, d0.total_bytes, d0.free_bytes, d0.capability) == (H100, 80 * GiB, 70 * GiB, (9, 0))
    assert (d0.pcie_gen, d0.pcie_width, d0.source, d0.simulated) == (5, 16, "nvml", False)
    assert (d3.name, d3.capability, d3.pcie_gen, d3.pcie_width) == (RTX, None, 4, 8)   # capability call broken
    assert (d1.total_bytes, d1.free_bytes) == (0, 0)                                   # memory call broken
    assert d0.links == ((1, "nvlink"), (2, "nvlink"), (3, "pcie"))
    assert d1.links == ((0, "nvlink"), (2, "p2p"), (3, "pcie"))
    assert d2.links == ((0, "nvlink"), (1, "p2p"), (3, "pcie"))    # 2 -> 0 found by the NVLink scan
    assert d3.links == ((0, "p2p"), (2, "pcie"))                   # 3 -> 0 from the PCIe tree; 3 -> 1 unknown
    assert d2.link(0) == "nvlink" and d3.link(1) is None
    assert nvml.shutdowns == 1
    assert nvml.scanned == [(2, 0), (2, 1)]                        # GPU 2's links read once, up to the first error
    lines = mgpu_lines(caplog)
    assert any("cuda:1" in line and "memory" in line for line in lines)
    assert any("CUDA_DEVICE_ORDER" in line for line in lines)      # mixed models, order not pinned


def test_no_order_warning_under_pci_bus_id(monkeypatch, caplog):
    use_nvml(monkeypatch, four_gpu_box(fail=()))
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    caplog.set_level(logging.INFO, logger="mgpu")
    assert len(inventory(include_cpu=False)) == 4
    assert mgpu_lines(caplog) == []


def test_host_appended_last(monkeypatch):
    use_nvml(monkeypatch, four_gpu_box())
    found = inventory()
    assert [d.id for d in found][-1] == "cpu" and host(found) is found[-1]
    assert found[-1].source == "host" and 0 < found[-1].free_bytes <= found[-1].total_bytes


@pytest.mark.parametrize("visible, physical", [
    ("2,0", [2, 0]),
    (" 3 , 1 ", [3, 1]),
    ("1gpu,0", [1, 0]),                                   # CUDA reads entries like strtoul
    ("GPU-dddd,GPU-aaaa0000-0000-0000-0000-000000000000", [3, 0]),   # shortened while unique
    ("0,-1,1", [0]),                                      # a negative entry ends the list
])
def test_cuda_visible_devices_numbers_like_torch(monkeypatch, visible, physical):
    use_nvml(monkeypatch, four_gpu_box(fail=()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = inventory(include_cpu=False)
    assert [d.index for d in found] == list(range(len(physical)))
    assert [d.free_bytes for d in found] == [four_gpu_box().gpus[p]["free"] for p in physical]
    for d in found:                                       # links only to visible GPUs, by their new ordinals
        assert {peer for peer, _ in d.links} <= set(range(len(physical))) - {d.index}


def test_cuda_visible_devices_remaps_links(monkeypatch):
    use_nvml(monkeypatch, four_gpu_box())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    d0, d1 = inventory(include_cpu=False)
    assert (d0.links, d1.links) == (((1, "nvlink"),), ((0, "nvlink"),))


@pytest.mark.parametrize("visible, physical, warned", [
    ("0,7,1", [0], "'7'"),
    ("GPU-bbbb,GPU-zzzz,GPU-aaaa", [1], "'GPU-zzzz'"),
    ("GPU-bbbb,0", [1], "'0'"),                           # a UUID list takes only UUIDs
    ("GPU-,1", [], "'GPU-'"),                             # ambiguous prefix names no one GPU
])
def test_cuda_visible_devices_stops_at_unknown_entry(monkeypatch, caplog, visible, physical, warned):
    use_nvml(monkeypatch, four_gpu_box(fail=()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    found = inventory(include_cpu=False)
    assert [d.name for d in found] == [four_gpu_box().gpus[p]["name"] for p in physical]
    assert any(warned in line and "ignores" in line for line in mgpu_lines(caplog))


@pytest.mark.parametrize("visible", ["", "-1", "1,1", "GPU-aaaa,GPU-aaaa"])
def test_cuda_visible_devices_hiding_everything(monkeypatch, caplog, visible):
    use_nvml(monkeypatch, four_gpu_box(fail=()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = inventory()
    assert [d.id for d in found] == ["cpu"]
    lines = mgpu_lines(caplog)
    assert "hides all 4 NVIDIA GPU(s)" in lines[-1] and "cpu only" in lines[-1]
    assert len(lines) == (2 if "," in visible else 1)     # a duplicate also says why


def test_mig_slice_by_uuid(monkeypatch):
    mig = "MIG-1234abcd-0000-0000-0000-000000000000"
    migs = {mig: dict(name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", total=10 * GiB, free=9 * GiB, uuid=mig, cc=None,
                      bus="00000000:18:00.0", gen=5, width=16)}
    use_nvml(monkeypatch, four_gpu_box(fail=(("capability", mig),), migs=migs))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{mig},MIG-ffff")
    (only,) = inventory(include_cpu=False)
    assert (only.id, only.name, only.total_bytes, only.free_bytes, only.links) == (
        "cuda:0", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", 10 * GiB, 9 * GiB, ())


def test_order_from_torch_when_cuda_already_started(monkeypatch, caplog):
    """FASTEST_FIRST may put the 4090 first; a process that started CUDA knows, and its UUIDs win over env parsing."""
    use_nvml(monkeypatch, four_gpu_box(fail=()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setitem(sys.modules, "torch", fake_torch(initialized=True, uuids=[
        "dddd0000-0000-0000-0000-000000000003", "bbbb0000-0000-0000-0000-000000000001"]))
    d0, d1 = inventory(include_cpu=False)
    assert (d0.name, d1.name) == (RTX, H100)
    assert d0.links == ((1, "pcie"),) and d1.links == ((0, "pcie"),)
    assert not any("CUDA_DEVICE_ORDER" in line for line in mgpu_lines(caplog))


# --- fallbacks -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nvml", [
    FakeNVML([], init_error=NVMLError("Driver Not Loaded")),
    None,                                                  # pynvml not installed: import fails
])
def test_no_driver_leaves_cpu_with_one_line(monkeypatch, caplog, nvml):
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    caplog.set_level(logging.DEBUG, logger="mgpu")
    found = inventory()
    assert [d.id for d in found] == ["cpu"] and found[0].source == "host"
    (line,) = mgpu_lines(caplog)
    assert "no NVIDIA driver/GPU found" in line and "cpu only" in line and "--devices" in line
    assert "torch.cuda: not available" in line
    assert inventory(include_cpu=False) == []


def test_nvml_without_gpus_is_one_line(monkeypatch, caplog):
    use_nvml(monkeypatch, FakeNVML([]))
    assert [d.id for d in inventory()] == ["cpu"]
    (line,) = mgpu_lines(caplog)
    assert "NVML: 0 GPUs" in line


def test_torch_missing_too(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert [d.id for d in inventory()] == ["cpu"]
    assert len(mgpu_lines(caplog)) == 1


def test_torch_fallback_when_nvml_broken(monkeypatch, caplog):
    use_nvml(monkeypatch, FakeNVML([], init_error=NVMLError("Driver/library version mismatch")))
    monkeypatch.setitem(sys.modules, "torch", fake_torch(
        available=True, gpus=[("NVIDIA A10", 24 * GiB, (8, 6)), ("NVIDIA A10", 24 * GiB, (8, 6))], peers=[(0, 1)]))
    caplog.set_level(logging.INFO, logger="mgpu")
    d0, d1 = inventory(include_cpu=False)
    assert (d0.id, d0.name, d0.total_bytes, d0.free_bytes, d0.capability) == (
        "cuda:0", "NVIDIA A10", 24 * GiB, 12 * GiB, (8, 6))
    assert d0.source == "torch" and d0.links == ((1, "p2p"),) and d1.links == ((0, "p2p"),)
    (line,) = mgpu_lines(caplog)
    assert "version mismatch" in line and "torch.cuda" in line


def test_import_needs_neither_torch_nor_nvml_nor_comfy():
    code = ("import sys, mgpu.planning.devices; bad = {'torch', 'pynvml', 'comfy', 'psutil'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# --- simulated devices -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, sizes, links", [
    ("2x24GiB", [24 * GiB] * 2, {(0, 1): "pcie"}),
    ("cuda:0=80GiB,cuda:1=24GiB", [80 * GiB, 24 * GiB], {(0, 1): "pcie"}),
    ("cuda:1=24GiB, CUDA:0 = 80gib", [80 * GiB, 24 * GiB], {(0, 1): "pcie"}),
    ("4x16GiB:pcie", [16 * GiB] * 4, {(0, 3): "pcie"}),
    ("8x80GiB:nvlink", [80 * GiB] * 8, {(0, 7): "nvlink", (6, 7): "nvlink"}),
    ("2X24GB:P2P", [24 * 10**9] * 2, {(0, 1): "p2p"}),
    ("2x24GiB:nvlink,cuda:2=16GiB", [24 * GiB] * 2 + [16 * GiB], {(0, 1): "nvlink", (1, 2): "pcie"}),
    ("cuda:0=80GiB,2x24GiB:nvlink", [80 * GiB] + [24 * GiB] * 2, {(1, 2): "nvlink", (0, 1): "pcie"}),
    ("2x48GiB:nvlink,2x48GiB:nvlink", [48 * GiB] * 4, {(0, 1): "nvlink", (2, 3): "nvlink", (1, 2): "pcie"}),
])
def test_spec_forms(spec, sizes, links):
    found = parse_spec(spec)
    assert [d.id for d in found] == [f"cuda:{i}" for i in range(len(sizes))]
    assert [d.total_bytes for d in found] == [d.free_bytes for d in found] == sizes
    assert all(d.simulated and d.source == "spec" and d.kind == "cuda" for d in found)
    assert found[0].name == f"simulated {format_bytes(sizes[0])}"
    for (a, b), kind in links.items():
        assert found[a].link(b) == found[b].link(a) == kind
    assert all(len(d.links) == len(found) - 1 for d in found)


def test_spec_cpu_forms():
    *two, cpu = parse_spec("CPU = 64GiB,2x24GiB")
    assert [d.id for d in two] == ["cuda:0", "cuda:1"]
    assert (cpu.id, cpu.total_bytes, cpu.free_bytes, cpu.simulated, cpu.source) == ("cpu", 64 * GiB, 64 * GiB,
                                                                                     True, "spec")
    (real,) = parse_spec("cpu")
    assert real.source == "host" and not real.simulated


def test_inventory_uses_spec_then_env(monkeypatch):
    use_nvml(monkeypatch, four_gpu_box())
    monkeypatch.setenv("MGPU_DEVICES", "3x16GiB")
    from_env = inventory()
    assert [d.id for d in from_env] == ["cuda:0", "cuda:1", "cuda:2", "cpu"] and from_env[0].simulated
    assert from_env[-1].source == "host"
    assert [d.total_bytes for d in inventory("cuda:0=80GiB")][:1] == [80 * GiB]        # spec beats env
    assert len(inventory("  ", include_cpu=False)) == 3                                   # blank spec: env
    assert [d.id for d in inventory("cpu")] == ["cpu"]                                   # cpu alone: no GPUs
    assert inventory("1x1GiB,cpu=2GiB")[-1].total_bytes == 2 * GiB                        # spec's host kept
    assert [d.kind for d in inventory("1x1GiB,cpu=2GiB", include_cpu=False)] == ["cuda"]
    monkeypatch.setenv("MGPU_DEVICES", "2x")
    with pytest.raises(DeviceSpecError, match="MGPU_DEVICES.*'2x'"):
        inventory()
    monkeypatch.setenv("MGPU_DEVICES", "")
    assert [d.source for d in inventory()] == ["nvml"] * 4 + ["host"]                    # empty env: live


@pytest.mark.parametrize("spec, problem", [
    ("3x", "'3x' has no size"),
    ("cuda:x=1GiB", "'x' is not a GPU ordinal"),
    ("2x-5GiB", "size '-5GiB' is not a size"),
    ("2x0GiB", "must be more than 0 bytes"),
    ("0x24GiB", "asks for 0 GPUs"),
    ("cuda:0=80GiB,cuda:0=24GiB", "cuda:0 is listed twice"),
    ("cpu,cpu=1GiB", "cpu is listed twice"),
    ("cpu=", "'cpu=' has no size"),
    ("", "it is empty"),
    ("   ", "it is empty"),
    ("foo", "'foo' is not a device"),
    ("24GiB", "'24GiB' is not a device"),
    ("2x24GiB:infiniband", "unknown link 'infiniband'"),
    ("2x24GiB:", "unknown link ''"),
    ("2x24GiB,", "empty part"),
    ("cuda:0", "'cuda:0' has no size"),
    ("cuda:0=80GiB,cuda:2=24GiB", "cuda:2 is beyond the 2 GPU(s)"),
    ("2x24G", "size '24G' is not a size"),
    ("1000x1GiB", "at most 256"),
])
def test_malformed_specs(spec, problem):
    with pytest.raises(DeviceSpecError) as info:
        parse_spec(spec)
    message = str(info.value)
    assert problem in message
    assert f"bad device spec {spec!r}" in message
    for example in ("2x24GiB", "8x80GiB:nvlink", "cuda:0=80GiB,cuda:1=24GiB", "cpu=64GiB", "nvlink, p2p or pcie",
                    "GiB = 2^30"):
        assert example in message
    assert isinstance(info.value, ValueError)


sizes = st.one_of(st.integers(1, 2**44), st.integers(1, 4096).map(lambda n: n * GiB),
                  st.integers(1, 999).map(lambda n: n * 10**9))
groups = st.lists(st.tuples(st.integers(1, 8), sizes, st.sampled_from(["", ":nvlink", ":p2p", ":pcie"])),
                  min_size=1, max_size=5)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(groups, st.none() | sizes)
def test_spec_round_trip(parts, cpu_bytes):
    spec = ",".join(f"{count}x{nbytes}{link}" for count, nbytes, link in parts)
    spec += f",cpu={cpu_bytes}B" if cpu_bytes else ""
    found = parse_spec(spec)
    listed = gpus(found)
    assert [d.total_bytes for d in listed] == [nbytes for count, nbytes, _ in parts for _ in range(count)]
    assert (host(found).total_bytes if host(found) else None) == cpu_bytes
    written = format_spec(found)
    assert parse_spec(written) == found
    assert format_spec(parse_spec(written)) == written


def test_format_spec_of_live_inventory(monkeypatch):
    use_nvml(monkeypatch, four_gpu_box(fail=()))
    live = inventory()
    written = format_spec(live)
    assert written.startswith("2x80GiB:nvlink,cuda:2=80GiB,cuda:3=24GiB,cpu=")   # 2 -> 0 NVLink dropped
    assert [d.total_bytes for d in parse_spec(written)] == [d.total_bytes for d in live]


# --- sizes -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("24 gib", 24 * 2**30), ("512MiB", 512 * 2**20),
    ("512MB", 512 * 10**6), ("1.5TiB", 3 * 2**39), ("2TB", 2 * 10**12), ("0.5GiB", 2**29), (".5KiB", 512),
    ("1073741824", 2**30), ("100B", 100), ("8kb", 8000), ("0", 0), (4096, 4096),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "24G", "24 GiBs", "-1GiB", "1e9", "1,5GiB", "twelve", None, True, -3])
def test_parse_bytes_rejects(text):
    with pytest.raises(DeviceSpecError, match=r"cannot read size .*24GiB, 24GB, 512MiB, 1\.5TiB .*GB = 10\^9"):
        parse_bytes(text)


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (int(23.6 * GiB), "23.6 GiB"), (24 * GiB, "24 GiB"),
    (80 * 10**9, "74.5 GiB"), (2**40 - 1, "1 TiB"), (-3 * 2**20, "-3 MiB"), (5 * 2**50, "5 PiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


# --- records ---------------------------------------------------------------------------------------------------------

def test_json_round_trip(monkeypatch):
    use_nvml(monkeypatch, four_gpu_box())
    found = inventory() + parse_spec("2x24GiB:nvlink")
    data = json.loads(json.dumps([d.to_dict() for d in found]))
    assert data[0]["links"][0] == [1, "nvlink"] and data[0]["capability"] == [9, 0]
    assert [Device.from_dict(d) for d in data] == found


def test_from_dict_rejects_damaged_record():
    record = parse_spec("1x1GiB")[0].to_dict()
    del record["total_bytes"]
    with pytest.raises(DeviceSpecError, match="total_bytes"):
        Device.from_dict(record)


def test_gpus_and_host_helpers():
    *two, cpu = parse_spec("2x1GiB,cpu=1GiB")
    assert gpus([cpu, two[1], two[0]]) == two
    assert host([cpu, *two]) is cpu and host(two) is None
    assert dev.Device.__dataclass_params__.frozen
