"""Which devices the planner may use: live GPUs (NVML, else torch.cuda) plus host RAM, or simulated ones from a spec.

Simulated devices exist so plans can be made, shown and tested on machines that lack the GPUs (``--devices``,
``MGPU_DEVICES``). Live GPUs are numbered as torch numbers them: ``cuda:i`` is the i-th GPU visible through
``CUDA_VISIBLE_DEVICES``.

Ordinal assumption: NVML lists GPUs in PCI bus order, and so does CUDA under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. CUDA's
default, FASTEST_FIRST, can put a faster card first when the models differ, and torch's own NVML helpers ignore that
too. So when this process has already started CUDA (as ComfyUI has) the order is taken from torch's device UUIDs and
is exact; otherwise PCI order is assumed, with a warning when the visible GPUs are of different models and the order
is not PCI_BUS_ID. A MIG slice named by its MIG- UUID is listed with its own memory and no links; a GPU in MIG mode
that is not named that way is listed whole.

Spec grammar (case-insensitive, comma-separated parts; sizes as ``parse_bytes`` reads them):

    NxSIZE[:LINK]  N identical GPUs joined by LINK (nvlink | p2p | pcie; default pcie)   2x24GiB, 8x80GiB:nvlink
    cuda:I=SIZE    one GPU with ordinal I                                               cuda:0=80GiB,cuda:1=24GiB
    cpu[=SIZE]     the host: its real RAM, or a simulated amount                        2x24GiB,cpu=64GiB

GPUs in different parts reach each other over ``pcie``. Explicit ``cuda:I`` parts keep their ordinal; groups take the
lowest free ordinals in the order written; together they must number ``cuda:0..n-1`` without gaps, as torch does.
A spec replaces the live GPUs, so ``cpu`` alone means "no GPUs".
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from decimal import Decimal

from mgpu.errors import DeviceSpecError

log = logging.getLogger("mgpu")

LINK_KINDS = ("nvlink", "p2p", "pcie")
MAX_GPUS = 256  # bounds a typo such as 1000000x24GiB, whose pairwise links would not fit in memory

SIZE_FORMS = "24GiB, 24GB, 512MiB, 1.5TiB or plain bytes such as 1073741824 (GB = 10^9 bytes, GiB = 2^30)"
SPEC_FORMS = (
    "Accepted forms, comma-separated:\n"
    "  NxSIZE[:LINK]  N identical GPUs, e.g. 2x24GiB, 4x16GiB:pcie, 8x80GiB:nvlink\n"
    "                 (LINK joins the GPUs of the group: nvlink, p2p or pcie, the default)\n"
    "  cuda:I=SIZE    one GPU with ordinal I, e.g. cuda:0=80GiB,cuda:1=24GiB\n"
    "  cpu[=SIZE]     the host, its real RAM or a simulated amount, e.g. cpu or 2x24GiB,cpu=64GiB\n"
    f"SIZE: {SIZE_FORMS}."
)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.IGNORECASE | re.ASCII)
# Exact spellings for format_spec, largest first, so that a spec written back reads as the same bytes.
_EXACT_UNITS = (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9),
                ("MiB", 2**20), ("MB", 10**6), ("KiB", 2**10), ("KB", 10**3))

# C enum values (nvmlGpuP2PCapsIndex_t, nvmlGpuP2PStatus_t, nvmlGpuTopologyLevel_t), spelled out because
# nvidia-ml-py 13 defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,), which ctypes would reject.
_P2P_READ, _P2P_NVLINK, _P2P_OK = 0, 2, 0
_TOPOLOGY_HOSTBRIDGE = 30
_NO_GPU = ("no NVIDIA driver/GPU found (%s); planning continues with cpu only "
           "(simulate GPUs with --devices or MGPU_DEVICES, e.g. 2x24GiB)")


@dataclass(frozen=True)
class Device:
    """One device a plan can place work on; frozen so plans can share and hash it."""

    id: str                      # "cuda:0" or "cpu"
    kind: str                    # "cuda" | "cpu"
    index: int | None            # torch's GPU ordinal; None for cpu
    name: str
    total_bytes: int
    free_bytes: int
    capability: tuple[int, int] | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    links: tuple[tuple[int, str], ...] = ()   # (peer ordinal, "nvlink" | "p2p" | "pcie"); unknown peers left out
    simulated: bool = False
    source: str = "nvml"         # "nvml" | "torch" | "host" | "spec"
    # Of the memory in use, what this pack's rank processes and ComfyUI's cached models hold: the models a plan loads
    # replace it, so a plan counts it as available (``available_bytes``) instead of counting our own shards twice.
    reclaimable_bytes: int = 0

    @property
    def available_bytes(self) -> int:
        """Free memory plus what is ours to reuse: what a plan's budget starts from."""
        return self.free_bytes + self.reclaimable_bytes

    def link(self, peer: int) -> str | None:
        """How this GPU reaches GPU ``peer``: the partitioner prices collectives by it. None when unknown."""
        return next((kind for index, kind in self.links if index == peer), None)

    def to_dict(self) -> dict:
        """Plain JSON data (tuples as lists), so plans can be saved and shown in the UI."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["capability"] = list(self.capability) if self.capability else None
        d["links"] = [[peer, kind] for peer, kind in self.links]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Device:
        """Inverse of ``to_dict``; a damaged record raises DeviceSpecError naming what is wrong."""
        try:
            return cls(
                id=str(d["id"]), kind=str(d["kind"]), index=None if d["index"] is None else int(d["index"]),
                name=str(d["name"]), total_bytes=int(d["total_bytes"]), free_bytes=int(d["free_bytes"]),
                capability=tuple(int(c) for c in d["capability"]) if d.get("capability") else None,
                pcie_gen=d.get("pcie_gen"), pcie_width=d.get("pcie_width"),
                links=tuple((int(peer), str(kind)) for peer, kind in d.get("links", ())),
                simulated=bool(d.get("simulated", False)), source=str(d.get("source", "nvml")),
                reclaimable_bytes=int(d.get("reclaimable_bytes", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DeviceSpecError(f"device record {d!r} cannot be read ({type(exc).__name__}: {exc}); "
                                  "expected the keys Device.to_dict writes") from None


def gpus(devices: list[Device]) -> list[Device]:
    """The GPUs, by ordinal: what the partitioner spreads blocks over."""
    return sorted((d for d in devices if d.kind == "cuda"), key=lambda d: d.index)


def host(devices: list[Device]) -> Device | None:
    """The host RAM record, the place of last resort for offloaded weights; None when left out."""
    return next((d for d in devices if d.kind == "cpu"), None)


def reclaim(devices: list[Device], change: dict[str, int]) -> list[Device]:
    """``devices`` with ``change`` (device id -> bytes) added to their reclaimable bytes: what else the caller owns
    and replaces (ComfyUI's cached models), less what stays (other models on our ranks); kept within what is in use."""
    return [replace(d, reclaimable_bytes=min(max(0, d.reclaimable_bytes + change[d.id]),
                                             max(0, d.total_bytes - d.free_bytes)))
            if change.get(d.id) else d for d in devices]


def format_bytes(n: int) -> str:
    """Binary units, one decimal ("23.6 GiB", "24 GiB"), for tables and error messages."""
    sign, value = "-" if n < 0 else "", float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if round(value, 1) < 1024 or unit == "PiB":
            break
    return f"{sign}{value:.1f}".removesuffix(".0") + f" {unit}"


def parse_bytes(text: str | int) -> int:
    """Read a size; GB and GiB both accepted because vendors sell GB and tools print GiB."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    match = _SIZE_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    unit = _UNITS.get(match.group(2).lower() or "b") if match else None
    if unit is None:
        raise DeviceSpecError(f"cannot read size {text!r}: write {SIZE_FORMS}")
    return int((Decimal(match.group(1)) * unit).to_integral_value())


def parse_spec(spec: str) -> list[Device]:
    """Simulated devices from a spec (grammar in the module docstring): GPUs by ordinal, then the host if named."""
    if not isinstance(spec, str) or not spec.strip():
        raise _spec_error(spec, "it is empty")
    explicit: dict[int, int] = {}                  # ordinal -> bytes
    groups: list[tuple[int, int, str]] = []        # (count, bytes, link), in the order written
    cpu: list[Device] = []
    for part in (p.strip() for p in spec.split(",")):
        name, eq, value = part.partition("=")
        if not part:
            raise _spec_error(spec, "it has an empty part (a doubled or trailing comma)")
        if name.strip().lower() == "cpu":
            if cpu:
                raise _spec_error(spec, "cpu is listed twice")
            cpu.append(_simulated_host(_spec_size(spec, part, value)) if eq else _host())
        elif part.lower().startswith("cuda:"):
            index_text, eq, size_text = part[5:].partition("=")
            if not index_text.strip().isdecimal():
                raise _spec_error(spec, f"{part!r}: {index_text.strip()!r} is not a GPU ordinal (0, 1, ...)")
            if not eq:
                raise _spec_error(spec, f"{part!r} has no size; write e.g. {part.strip()}=24GiB")
            index = int(index_text)
            if index in explicit:
                raise _spec_error(spec, f"cuda:{index} is listed twice")
            explicit[index] = _spec_size(spec, part, size_text)
        elif match := re.fullmatch(r"(\d+)\s*x\s*(.*)", part, re.IGNORECASE | re.ASCII):
            count = int(match.group(1))
            size_text, colon, link = match.group(2).partition(":")
            link = link.strip().lower() if colon else "pcie"
            if count < 1:
                raise _spec_error(spec, f"{part!r} asks for {count} GPUs; give at least 1")
            if link not in LINK_KINDS:
                raise _spec_error(spec, f"{part!r}: unknown link {link!r}; use nvlink, p2p or pcie")
            groups.append((count, _spec_size(spec, part, size_text), link))
        else:
            raise _spec_error(spec, f"{part!r} is not a device")
    return _number_gpus(spec, explicit, groups) + cpu


def format_spec(devices: list[Device]) -> str:
    """The spec that rebuilds these devices: simulate a plan's machine elsewhere, or print an inventory compactly.

    Exact for specs this module parsed; for a live inventory it keeps sizes and links inside runs of equal GPUs
    and drops free memory and any other links (parts reach each other by pcie).
    """
    runs: list[tuple[list[Device], str | None]] = []
    listed = gpus(devices)
    for pos, gpu in enumerate(listed):
        members, kind = runs[-1] if runs else ([], None)
        if members and gpu.total_bytes == members[0].total_bytes:
            kind = kind or gpu.link(members[0].index)
            fits = kind in LINK_KINDS and all(gpu.link(m.index) == kind for m in members)
            if kind == "pcie":   # a pcie run must not swallow a GPU whose faster links to later GPUs would be lost
                fits = fits and all(gpu.link(later.index) in (None, "pcie") for later in listed[pos + 1:])
            if fits:
                runs[-1] = (members + [gpu], kind)
                continue
        runs.append(([gpu], None))
    parts = [f"{len(m)}x{_exact_size(m[0].total_bytes)}" + ("" if kind == "pcie" else f":{kind}")
             if len(m) > 1 else f"cuda:{m[0].index}={_exact_size(m[0].total_bytes)}" for m, kind in runs]
    cpu = host(devices)
    return ",".join(parts + ([f"cpu={_exact_size(cpu.total_bytes)}"] if cpu else []))


def inventory(spec: str | None = None, include_cpu: bool = True, own_pids: Collection[int] = ()) -> list[Device]:
    """Devices to plan for: ``spec``, else env MGPU_DEVICES, else the live GPUs; host RAM last when include_cpu.

    A blank spec counts as none, so an empty UI field means "this machine". Never raises because NVML or the
    driver is missing or broken: that leaves cpu only, said in one log line. ``own_pids``: processes whose GPU
    memory is ours to reuse (``live_gpus``).
    """
    if spec is not None and spec.strip():
        devices = parse_spec(spec)
    elif os.environ.get("MGPU_DEVICES", "").strip():
        try:
            devices = parse_spec(os.environ["MGPU_DEVICES"])
        except DeviceSpecError as exc:
            raise DeviceSpecError(f"environment variable MGPU_DEVICES: {exc}") from None
    else:
        devices = live_gpus(own_pids)
    if not include_cpu:
        return gpus(devices)
    return devices if host(devices) else devices + [_host()]


# --- spec helpers -------------------------------------------------------------------------------------------------

def _spec_error(spec: object, problem: str) -> DeviceSpecError:
    return DeviceSpecError(f"bad device spec {spec!r}: {problem}.\n{SPEC_FORMS}")


def _spec_size(spec: str, part: str, text: str) -> int:
    if not text.strip():
        raise _spec_error(spec, f"{part!r} has no size after it; write e.g. 2x24GiB, cuda:0=24GiB or cpu=64GiB")
    try:
        size = parse_bytes(text)
    except DeviceSpecError:
        raise _spec_error(spec, f"{part!r}: size {text.strip()!r} is not a size (a positive number with a unit)") from None
    if size <= 0:
        raise _spec_error(spec, f"{part!r}: size {text.strip()!r} must be more than 0 bytes")
    return size


def _number_gpus(spec: str, explicit: dict[int, int], groups: list[tuple[int, int, str]]) -> list[Device]:
    """Give groups the lowest free ordinals; links inside a group are its kind, pcie across parts."""
    n = len(explicit) + sum(count for count, _, _ in groups)
    if n > MAX_GPUS:
        raise _spec_error(spec, f"it lists {n} GPUs; at most {MAX_GPUS} are supported")
    if explicit and max(explicit) >= n:
        raise _spec_error(spec, f"cuda:{max(explicit)} is beyond the {n} GPU(s) listed; ordinals run "
                                f"cuda:0..cuda:{n - 1} without gaps, as torch numbers them")
    free = iter(i for i in range(n) if i not in explicit)
    size = dict(explicit)
    group_of: dict[int, tuple[int, str]] = {}
    for gid, (count, nbytes, link) in enumerate(groups):
        for _ in range(count):
            i = next(free)
            size[i], group_of[i] = nbytes, (gid, link)

    def kind(a: int, b: int) -> str:
        ga, gb = group_of.get(a), group_of.get(b)
        return ga[1] if ga is not None and ga == gb else "pcie"

    return [Device(id=f"cuda:{i}", kind="cuda", index=i, name=f"simulated {format_bytes(size[i])}",
                   total_bytes=size[i], free_bytes=size[i],
                   links=tuple((j, kind(i, j)) for j in range(n) if j != i), simulated=True, source="spec")
            for i in range(n)]


def _exact_size(n: int) -> str:
    return next((f"{n // unit}{name}" for name, unit in _EXACT_UNITS if n % unit == 0), str(n))


def _simulated_host(nbytes: int) -> Device:
    return Device(id="cpu", kind="cpu", index=None, name=f"simulated host {format_bytes(nbytes)}",
                  total_bytes=nbytes, free_bytes=nbytes, simulated=True, source="spec")


def _host() -> Device:
    """Host RAM; 'available' (not 'free') because page cache gives way to a model being loaded."""
    import psutil

    vm = psutil.virtual_memory()
    return Device(id="cpu", kind="cpu", index=None, name="host RAM", total_bytes=int(vm.total),
                  free_bytes=int(vm.available), source="host")


# --- live GPUs ----------------------------------------------------------------------------------------------------

def live_gpus(own_pids: Collection[int] = ()) -> list[Device]:
    """This machine's GPUs (never a simulated spec): NVML first (topology, PCIe, no CUDA context), torch.cuda when NVML is missing; [] when neither works.

    ``own_pids``: this pack's rank processes. What NVML says they use on a GPU becomes its ``reclaimable_bytes``
    (torch.cuda cannot tell processes apart: none there)."""
    try:
        import pynvml

        return _nvml_gpus(pynvml, frozenset(own_pids))
    except Exception as exc:  # library missing, driver/library mismatch, GPU lost: all mean "ask torch"
        nvml_why = _why(exc)
    try:
        found = _torch_gpus()
    except Exception as exc:
        log.warning(_NO_GPU, f"NVML: {nvml_why}; torch.cuda: {_why(exc)}")
        return []
    if found:
        log.info("NVML unavailable (%s); read %d GPU(s) through torch.cuda, without NVLink or PCIe details",
                 nvml_why, len(found))
    else:
        log.warning(_NO_GPU, f"NVML: {nvml_why}; torch.cuda: 0 devices")
    return found


def _torch_gpus() -> list[Device]:
    """Fallback without NVML (some containers and WSL setups): torch numbers the GPUs itself, but it cannot tell
    NVLink from PCIe P2P and creates a CUDA context per GPU to read free memory."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("not available")
    n = torch.cuda.device_count()
    found = []
    for i in range(n):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        links = tuple((j, "p2p" if torch.cuda.can_device_access_peer(i, j) else "pcie") for j in range(n) if j != i)
        found.append(Device(id=f"cuda:{i}", kind="cuda", index=i, name=str(props.name), total_bytes=int(total),
                            free_bytes=int(free), capability=(int(props.major), int(props.minor)), links=links,
                            source="torch"))
    return found


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _nvml_gpus(nv, own_pids: frozenset[int] = frozenset()) -> list[Device]:
    nv.nvmlInit()
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        if not handles:
            log.warning(_NO_GPU, "NVML: 0 GPUs")
            return []
        uuids = [_try(nv.nvmlDeviceGetUUID, h) or "" for h in handles]
        torch_order = _torch_uuid_tokens(uuids)
        visible = _visible(nv, handles, uuids, torch_order)   # [(handle, physical index, or None for a MIG slice)]
        if not visible:
            log.warning("CUDA_VISIBLE_DEVICES=%r hides all %d NVIDIA GPU(s); planning continues with cpu only",
                        os.environ.get("CUDA_VISIBLE_DEVICES"), len(handles))
            return []
        links = _nvml_links(nv, visible)
        records = [_nvml_record(nv, i, handle, links[i], own_pids) for i, (handle, _) in enumerate(visible)]
        if torch_order is None and len({d.name for d in records}) > 1 \
                and os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID":
            log.warning("GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may number the "
                        "fastest first, so cuda:i here (PCI bus order) may not be torch's cuda:i; "
                        "set CUDA_DEVICE_ORDER=PCI_BUS_ID")
        return records
    finally:
        _try(nv.nvmlShutdown)


def _try(fn, *args):
    """One NVML query, None when it fails: a GPU or binding that lacks one field should still be listed."""
    try:
        return fn(*args)
    except Exception:
        return None


def _own_bytes(nv, handle, own_pids: frozenset[int]) -> int:
    """Bytes NVML attributes to ``own_pids`` on this GPU; 0 when it cannot say (no per-process accounting, e.g.
    WDDM; or PIDs from another PID namespace, as in most containers: then our memory counts as used, erring safe)."""
    if not own_pids:
        return 0
    running = _try(nv.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return sum(int(p.usedGpuMemory or 0) for p in running if p.pid in own_pids)


def _nvml_record(nv, ordinal: int, handle, links: tuple[tuple[int, str], ...],
                 own_pids: frozenset[int] = frozenset()) -> Device:
    mem = _try(nv.nvmlDeviceGetMemoryInfo, handle)
    if mem is None:
        log.warning("cuda:%d: NVML could not read its memory; counting it as 0 bytes, so nothing is placed there",
                    ordinal)
    capability = _try(nv.nvmlDeviceGetCudaComputeCapability, handle)
    # Max, not current, link: an idle GPU drops to Gen1 to save power, but transfers run at the max.
    return Device(id=f"cuda:{ordinal}", kind="cuda", index=ordinal,
                  name=_try(nv.nvmlDeviceGetName, handle) or "unknown NVIDIA GPU",
                  total_bytes=int(mem.total) if mem else 0, free_bytes=int(mem.free) if mem else 0,
                  reclaimable_bytes=min(_own_bytes(nv, handle, own_pids), int(mem.total - mem.free)) if mem else 0,
                  capability=tuple(int(c) for c in capability) if capability else None,
                  pcie_gen=_try(nv.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                  pcie_width=_try(nv.nvmlDeviceGetMaxPcieLinkWidth, handle), links=links, source="nvml")


def _visible(nv, handles: list, uuids: list[str], tokens: list[str] | None) -> list[tuple[object, int | None]]:
    """NVML devices in torch's cuda:i order, read the way torch reads CUDA_VISIBLE_DEVICES (torch.cuda.
    _parse_visible_devices): integers or GPU-/MIG- UUIDs (GPU ones may be shortened while unique); the first
    entry that names no GPU ends the list; a GPU named twice leaves none. ``tokens`` (torch's own UUIDs) wins."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if tokens is None and env is None:
        return [(h, i) for i, h in enumerate(handles)]
    tokens = tokens if tokens is not None else [t.strip() for t in env.split(",")]
    prefix = next((p for p in ("GPU-", "MIG-") if tokens[0].startswith(p)), "")
    visible: list[tuple[object, int | None]] = []
    keys: list[str] = []
    for token in tokens:
        found = _resolve(nv, token, prefix, handles, uuids)
        if found is None:
            if token and not re.fullmatch(r"-\d+", token):   # "-1" is the usual way to hide every GPU
                log.warning("CUDA_VISIBLE_DEVICES entry %r names no GPU here; CUDA ignores it and the entries "
                            "after it", token)
            break
        if token in keys or (found[1] is not None and found[1] in [v[1] for v in visible]):
            log.warning("CUDA_VISIBLE_DEVICES names %r twice; CUDA then shows no GPU at all", token)
            return []
        visible.append(found)
        keys.append(token)
    return visible


def _resolve(nv, token: str, prefix: str, handles: list, uuids: list[str]) -> tuple[object, int | None] | None:
    if not prefix:
        match = re.match(r"[+-]?\d+", token)   # CUDA reads each entry like strtoul: "1gpu" is 1
        index = int(match.group()) if match else -1
        return (handles[index], index) if 0 <= index < len(handles) else None
    if not token.startswith(prefix):
        return None
    if prefix == "MIG-":
        handle = _try(nv.nvmlDeviceGetHandleByUUID, token)
        return None if handle is None else (handle, None)
    hits = [i for i, uuid in enumerate(uuids) if uuid.startswith(token)]
    return (handles[hits[0]], hits[0]) if len(hits) == 1 else None


def _torch_uuid_tokens(uuids: list[str]) -> list[str] | None:
    """torch's cuda:i -> UUID, but only when this process has already started CUDA: then the order is exact under
    any CUDA_DEVICE_ORDER, and asking costs nothing. Never starts CUDA itself (a context per GPU)."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        found = [_hex(str(torch.cuda.get_device_properties(i).uuid)) for i in range(torch.cuda.device_count())]
    except Exception:
        return None
    physical = {_hex(u): u for u in uuids}
    return [physical.get(h) or "MIG-" + "-".join((h[:8], h[8:12], h[12:16], h[16:20], h[20:])) for h in found] or None


def _hex(uuid: str) -> str:
    return re.sub(r"[^0-9a-f]", "", uuid.lower().removeprefix("gpu-").removeprefix("mig-"))


def _nvml_links(nv, visible: list[tuple[object, int | None]]) -> list[tuple[tuple[int, str], ...]]:
    """Per visible GPU, how it reaches each other visible GPU; MIG slices and hidden GPUs have no links."""
    bus = [_try(lambda h: nv.nvmlDeviceGetPciInfo(h).busId, h) for h, _ in visible]
    out = []
    for a, (ha, pa) in enumerate(visible):
        scan = functools.cache(functools.partial(_nvlink_scan, nv, ha))   # only if P2PStatus(NVLINK) fails
        row = []
        for b, (hb, pb) in enumerate(visible):
            if a != b and pa is not None and pb is not None:
                kind = _pair_link(nv, ha, hb, scan, bus[b])
                if kind:
                    row.append((b, kind))
        out.append(tuple(row))
    return out


def _pair_link(nv, ha, hb, scan, bus_b: str | None) -> str | None:
    """Best path a -> b: nvlink, else p2p (direct PCIe reads), else pcie (staged through the host); None if unknown."""
    nvlink = _try(nv.nvmlDeviceGetP2PStatus, ha, hb, _P2P_NVLINK)
    if nvlink == _P2P_OK or (nvlink is None and bus_b is not None and _bus_key(bus_b) in scan()):
        return "nvlink"
    read = _try(nv.nvmlDeviceGetP2PStatus, ha, hb, _P2P_READ)
    if read is not None:
        return "p2p" if read == _P2P_OK else "pcie"
    # Old drivers: guess from the PCIe tree. Behind one host bridge P2P usually works; across CPUs it usually does not.
    level = _try(nv.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
    return None if level is None else "p2p" if level <= _TOPOLOGY_HOSTBRIDGE else "pcie"


def _nvlink_scan(nv, handle) -> set[str]:
    """PCI bus ids at the far end of this GPU's active NVLinks (direct bridges; NVSwitch peers need P2PStatus)."""
    peers: set[str] = set()
    for link in range(64):   # NVML numbers links from 0; the first error is past the last link or no NVLink
        try:
            if nv.nvmlDeviceGetNvLinkState(handle, link):
                peers.add(_bus_key(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        except Exception:
            break
    return peers


def _bus_key(bus_id: str) -> str:
    """"00000000:3B:00.0" and "0000:3b:00.0" name the same slot: compare without domain width or case."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return f"{int(domain, 16):x}:{rest}"
