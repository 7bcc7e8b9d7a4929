"""The VRAM-aware partitioner: where each component lives and whether the DiT must be sharded.

Memory model (every number is an estimate from `mgpu.planning.estimates`, and the plan says which):

* A run has three phases: ``encode`` (text encoder), ``sample`` (DiT), ``decode`` (VAE). A device's peak is the
  largest, over the phases, of the weights resident in that phase plus the working memory of what runs there.
* A single-device DiT or text encoder lives in ComfyUI's model management, which unloads models to make room,
  so with ``Policy.free_text_encoder_before_sampling`` the encoder's weights are gone before sampling starts. For an
  FSDP DiT ComfyUI cannot see the ranks' memory, so its loader unloads ComfyUI's models from the ranks' GPUs when
  sampling starts (``loaders.diffusion.ShardedModelPatcher``).
* An FSDP-sharded DiT lives in the rank processes for as long as the pool holds it, so its shard is resident in
  every phase. FSDP shards evenly: the smallest member of the rank group bounds every rank.
* A device's budget is its free memory minus ``Policy.reserve_bytes`` (other processes, allocator growth); the
  host's is its available RAM minus ``Policy.host_reserve_bytes``. No plan exceeds a budget.
* Working memory follows the budget rule of ``mgpu.planning.estimates``: where ComfyUI runs a component (single-device DiT,
  text encoder, untiled VAE decode) the larger of our calibrated estimate and ComfyUI's own reservation, since
  ComfyUI otherwise loads the weights only partly; on FSDP ranks our estimate plus FSDP2's all-gather buffers and
  NCCL's buffers (``fsdp_buffer_bytes``), since there ComfyUI reserves nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from mgpu.planning.devices import Device, format_bytes
from mgpu.errors import PlanError
from mgpu.planning.estimates import (
    GiB,
    Workload,
    dit_tokens,
    dit_working_bytes,
    fsdp_buffer_bytes,
    gathered_size,
    text_encoder_working_bytes,
    vae_decode_bytes,
    weight_bytes,
    weight_itemsize,
)
from mgpu.planning import parallel
from mgpu.planning.sizing import ComponentSize

ROLES = ("text_encoder", "dit", "vae")
PHASES = ("encode", "sample", "decode")
_PHASE_OF = {"text_encoder": "encode", "dit": "sample", "vae": "decode"}


@dataclass
class Component:
    """One model file to place, with the weight dtype it will run in (None: as stored)."""

    role: str
    size: ComponentSize
    weight_dtype: str | None = None


@dataclass
class Policy:
    reserve_bytes: int = 512 << 20  # other processes, allocator growth; the CUDA context is in the estimates
    host_reserve_bytes: int = 4 * GiB
    free_text_encoder_before_sampling: bool = True
    allow_offload: bool = False
    prefer_speed: bool = False
    text_encoder_tokens: int = 512
    sequence_parallel: bool = True   # split each video's tokens over the ranks where the family has an adapter
    # Gathered blocks an FSDP rank holds at once: the one computing plus the one prefetched.
    gathered_blocks: int = 2


@dataclass
class Placement:
    """Where one component lives and what it costs there."""

    role: str
    file: str
    family: str
    strategy: str  # "single" | "fsdp" | "offload" | "cpu" | "split" (text encoder: its layers over several GPUs)
    devices: list[str]
    weight_dtype: str
    weight_bytes: int
    resident_bytes: dict[str, int]  # weights held per device while resident
    working_bytes: dict[str, int]  # transient memory per device while this component runs
    tiled: bool = False  # VAE only: decode in tiles
    batch_per_rank: int | None = None  # FSDP only: DiT batch each rank computes (CFG split)
    cfg_degree: int = 1  # FSDP only: rank groups splitting the batch rows (mgpu.planning.parallel)
    sp_degree: int = 1  # FSDP only: ranks splitting each video's tokens (Ulysses)
    reshard_after_forward: bool = True  # FSDP only: False keeps the gathered weights between steps
    reasons: list[str] = field(default_factory=list)
    layers_by_device: dict[str, list[int]] = field(default_factory=dict)  # split only: [first, last] block per device


@dataclass
class DeviceUse:
    device: str
    budget_bytes: int
    peak_bytes: int
    by_phase: dict[str, int]
    holds: list[str]

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.peak_bytes


@dataclass
class Plan:
    placements: list[Placement]
    usage: list[DeviceUse]
    devices: list[dict]
    workload: dict
    policy: dict
    reasons: list[str]

    def placement(self, role: str) -> Placement | None:
        return next((p for p in self.placements if p.role == role), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        for u, use in zip(d["usage"], self.usage):
            u["headroom_bytes"] = use.headroom_bytes
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        usage = [DeviceUse(**{k: v for k, v in u.items() if k != "headroom_bytes"}) for u in d["usage"]]
        return cls(
            placements=[Placement(**p) for p in d["placements"]],
            usage=usage,
            devices=d["devices"],
            workload=d["workload"],
            policy=d["policy"],
            reasons=list(d["reasons"]),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def table(self) -> str:
        """A readable table: device, what it holds, peak bytes, budget, headroom; then the reasons."""
        rows = [("device", "holds", "peak", "budget", "headroom")]
        for u in self.usage:
            rows.append((u.device, ", ".join(u.holds) or "-", format_bytes(u.peak_bytes),
                         format_bytes(u.budget_bytes), format_bytes(u.headroom_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        for p in self.placements:
            lines.append(f"{p.role}: {p.strategy} on {', '.join(p.devices)} ({p.family}, {p.weight_dtype}, "
                         f"{format_bytes(p.weight_bytes)})")
            lines.extend(f"  - {r}" for r in p.reasons)
        lines.extend(f"- {r}" for r in self.reasons)
        return "\n".join(lines)


class _Ledger:
    """Per device and phase, the bytes committed so far; the partitioner only adds what fits."""

    def __init__(self, devices: list[Device], policy: Policy):
        self.budget: dict[str, int] = {}
        for d in devices:
            reserve = policy.host_reserve_bytes if d.kind == "cpu" else policy.reserve_bytes
            self.budget[d.id] = max(0, d.free_bytes - reserve)
        self.used = {d.id: dict.fromkeys(PHASES, 0) for d in devices}
        self.holds: dict[str, list[str]] = {d.id: [] for d in devices}

    def fits(self, need: dict[str, dict[str, int]]) -> bool:
        return all(self.used[dev][ph] + b <= self.budget[dev] for dev, phases in need.items() for ph, b in phases.items())

    def commit(self, need: dict[str, dict[str, int]], label: str) -> None:
        for dev, phases in need.items():
            for ph, b in phases.items():
                self.used[dev][ph] += b
            self.holds[dev].append(label)

    def free(self, dev: str) -> int:
        return self.budget[dev] - max(self.used[dev].values())


def phases_resident(role: str, strategy: str, policy: Policy) -> tuple[str, ...]:
    """The phases in which a component's weights occupy its device."""
    if role == "dit":
        # Rank processes and pinned host copies are outside ComfyUI's model management: they persist.
        return PHASES if strategy in ("fsdp", "offload") else ("sample", "decode")
    if role == "text_encoder":
        return ("encode",) if policy.free_text_encoder_before_sampling else PHASES
    return ("decode",)


def _need(role: str, strategy: str, policy: Policy, resident: dict[str, int], working: dict[str, int]) -> dict:
    phases = phases_resident(role, strategy, policy)
    run = _PHASE_OF[role]
    need: dict[str, dict[str, int]] = {}
    for dev in set(resident) | set(working):
        need[dev] = {ph: resident.get(dev, 0) for ph in phases}
        need[dev][run] = need[dev].get(run, 0) + working.get(dev, 0)
    return need


def _dtype_name(size: ComponentSize, dtype: str | None) -> str:
    if dtype:
        return dtype
    if not size.bytes_by_dtype:
        return "unknown"
    return max(size.bytes_by_dtype.items(), key=lambda kv: kv[1])[0].lower()


def _largest_block(size: ComponentSize, wbytes: int) -> int:
    """Bytes of the largest repeated block after recasting (scaled with the dtype change)."""
    if not size.blocks:
        return 0
    scale = wbytes / size.total_bytes if size.total_bytes else 1.0
    return int(max(max(g.bytes_per_block) for g in size.blocks if g.bytes_per_block) * scale)


def _degrees(comp: Component, wl: Workload, ranks: int, policy: Policy) -> parallel.Degrees:
    return parallel.choose(ranks, wl.dit_batch, comp.size.dims.get("heads"), comp.size.family,
                           policy.sequence_parallel)


def _fsdp_need(comp: Component, wbytes: int, wl: Workload, degrees: parallel.Degrees,
               policy: Policy) -> tuple[int, int, int]:
    """(resident per rank, working per rank, batch per rank) for a DiT sharded over ``degrees.ranks`` ranks.

    Resident: 1/N of the weights (dim-0 shards, rounded up) plus the bytes outside the blocks, which the root
    FSDP unit keeps gathered for the whole forward. Working: the activations of this rank's rows (CFG/batch split)
    and tokens (sequence split), with no ComfyUI reservation (ComfyUI cannot see the ranks), plus FSDP2's
    all-gather buffers in the storage dtype (NCCL gathers fp8 as fp8) and NCCL's buffers.
    """
    size, ranks = comp.size, degrees.ranks
    batch = math.ceil(wl.dit_batch / degrees.cfg)
    scale = wbytes / size.total_bytes if size.total_bytes else 1.0
    outside = int(size.bytes_outside_blocks * scale)
    resident = math.ceil(wbytes / ranks) + outside
    buffers = fsdp_buffer_bytes(size, ranks, gather_itemsize=weight_itemsize(size, comp.weight_dtype),
                                gathered_blocks=policy.gathered_blocks)
    working = dit_working_bytes(size, wl, batch=batch, comfyui=False, sp=degrees.sp) + buffers
    return resident, working, batch


def keep_gathered(comp: Component, ranks: list[Device], wl: Workload, policy: Policy | None = None) -> tuple[bool, str]:
    """Whether a DiT sharded over exactly ``ranks`` can keep its gathered weights between steps, and why: the call
    a plan makes, for a loader set to fsdp with no MGPU Plan connected. Resharding after every step all-gathers the
    whole model each step (on CPU ranks a Wan 1.3B step went from ~1 s to ~50 s), so it is kept whenever it fits.

    ``ranks``: one Device per rank, as the inventory reports them now; cpu ranks share the host's RAM, so there the
    whole group's need is held against that one budget."""
    policy = policy or Policy()
    wbytes = weight_bytes(comp.size, comp.weight_dtype)
    resident, working, _ = _fsdp_need(comp, wbytes, wl, _degrees(comp, wl, len(ranks), policy), policy)
    kept = weight_bytes(gathered_size(comp.size), comp.weight_dtype)
    per_rank = resident + kept + working
    budgets: dict[str, tuple[int, int]] = {}   # device -> (need, budget)
    for d in ranks:
        reserve = policy.host_reserve_bytes if d.kind == "cpu" else policy.reserve_bytes
        need, _ = budgets.get(d.id, (0, 0))
        budgets[d.id] = (need + per_rank, max(0, d.free_bytes - reserve))
    short = [f"{dev} needs {format_bytes(need)}, has {format_bytes(budget)}"
             for dev, (need, budget) in budgets.items() if need > budget]
    if short:
        return False, ("the gathered weights are freed after every step (each step all-gathers the model again): "
                       "keeping them does not fit (" + "; ".join(short) + ")")
    return True, (f"the gathered weights stay between steps ({format_bytes(kept)} per rank; "
                  + "; ".join(f"{dev} needs {format_bytes(n)} of {format_bytes(b)}" for dev, (n, b) in budgets.items())
                  + ")")


def _place_dit(comp: Component, gpus: list[Device], host: Device | None, wl: Workload, policy: Policy,
               ledger: _Ledger, attempts: list[str]) -> Placement:
    size = comp.size
    wbytes = weight_bytes(size, comp.weight_dtype)
    base = dict(role="dit", file=size.path, family=size.family, weight_dtype=_dtype_name(size, comp.weight_dtype),
                weight_bytes=wbytes)
    by_budget = sorted(gpus, key=lambda d: (-ledger.free(d.id), d.index))

    def fsdp(group: list[Device], why: str) -> Placement | None:
        degrees = _degrees(comp, wl, len(group), policy)
        resident, working, batch = _fsdp_need(comp, wbytes, wl, degrees, policy)
        work = {d.id: working for d in group}
        # Keeping every block gathered between steps saves one all-gather of the whole model per step; it costs
        # the full weights on every rank, so it is chosen only when that fits too.
        keep = {d.id: resident + weight_bytes(gathered_size(size), comp.weight_dtype) for d in group}
        need = _need("dit", "fsdp", policy, keep, work)
        reshard = not ledger.fits(need)
        res = {d.id: resident for d in group} if reshard else keep
        need = _need("dit", "fsdp", policy, res, work)
        if not ledger.fits(need):
            attempts.append(f"DiT sharded over {len(group)} GPUs needs {format_bytes(resident + working)} per rank "
                            f"({format_bytes(resident)} shard + {format_bytes(working)} working, batch {batch} per rank"
                            + (f", 1/{degrees.sp} of the tokens" if degrees.sp > 1 else "")
                            + f"); smallest budget is {format_bytes(min(ledger.free(d.id) for d in group))}")
            return None
        ledger.commit(need, "DiT shard")
        if size.dims.get("hidden") and size.dims.get("layers"):
            parallel.estimate(degrees, group, params=size.params, weight_bytes=wbytes, tokens=dit_tokens(size, wl),
                              rows=wl.dit_batch, hidden=size.dims["hidden"], layers=size.dims["layers"],
                              resharding=reshard)
        reasons = [why, f"each rank holds 1/{len(group)} of the weights ({format_bytes(math.ceil(wbytes / len(group)))}) "
                        f"plus {policy.gathered_blocks} gathered blocks, an all-gather buffer and NCCL's buffers "
                        "while computing",
                   f"split of each step: {degrees.cfg} (CFG/batch) x {degrees.sp} (sequence) over {len(group)} ranks",
                   *degrees.reasons, *(f"warning: {w}" for w in degrees.warnings)]
        if len({d.free_bytes for d in group}) > 1:
            reasons.append("GPUs differ in size: FSDP shards evenly, so the smallest member bounds every shard")
        if not reshard:
            reasons.append("memory allows keeping the gathered weights between steps: no all-gather after the "
                           "first step")
        return Placement(**base, strategy="fsdp", devices=[d.id for d in group], resident_bytes=res,
                         working_bytes=work, batch_per_rank=batch, cfg_degree=degrees.cfg, sp_degree=degrees.sp,
                         reshard_after_forward=reshard, reasons=reasons)

    if policy.prefer_speed and len(gpus) >= 2:
        group = sorted(gpus, key=lambda d: d.index)
        placed = fsdp(group, f"speed asked for: sharded over all {len(group)} GPUs")
        if placed:
            return placed

    working1 = dit_working_bytes(size, wl, batch=1)
    for d in by_budget:
        need = _need("dit", "single", policy, {d.id: wbytes}, {d.id: working1})
        if ledger.fits(need):
            ledger.commit(need, "DiT")
            return Placement(**base, strategy="single", devices=[d.id], resident_bytes={d.id: wbytes},
                             working_bytes={d.id: working1},
                             reasons=[f"fits on {d.id} with {format_bytes(ledger.free(d.id))} to spare; CFG runs "
                                      f"cond and uncond as ComfyUI does on one device"])
    if by_budget:
        best = by_budget[0]
        attempts.append(f"DiT on one GPU needs {format_bytes(wbytes + working1)} ({format_bytes(wbytes)} weights + "
                        f"{format_bytes(working1)} working); largest budget is {format_bytes(ledger.free(best.id))} on {best.id}")

    for k in range(2, len(gpus) + 1):
        # The k GPUs with the largest budgets: adding a smaller one can only lower the shared bound.
        group = sorted(by_budget[:k], key=lambda d: d.index)
        placed = fsdp(group, f"too large for one GPU: sharded over the fewest GPUs that fit ({k})")
        if placed:
            return placed

    if host is not None and policy.allow_offload and by_budget:
        compute = by_budget[0]
        stream = policy.gathered_blocks * _largest_block(size, wbytes)
        need = _need("dit", "offload", policy, {host.id: wbytes}, {compute.id: working1 + stream})
        if ledger.fits(need):
            ledger.commit(need, "DiT (offload)")
            return Placement(**base, strategy="offload", devices=[compute.id, host.id],
                             resident_bytes={host.id: wbytes}, working_bytes={compute.id: working1 + stream},
                             reasons=[f"weights stay in host RAM and are streamed block by block to {compute.id}: "
                                      f"works, but every step moves {format_bytes(wbytes)} over the bus"])
        attempts.append(f"offload needs {format_bytes(working1 + stream)} on {compute.id} and "
                        f"{format_bytes(wbytes)} of host RAM; host budget is {format_bytes(ledger.free(host.id))}")

    if not gpus and host is not None:
        working1 = dit_working_bytes(size, wl, batch=1, comfyui=False)   # no reservation in host RAM
        need = _need("dit", "cpu", policy, {host.id: wbytes}, {host.id: working1})
        if ledger.fits(need):
            ledger.commit(need, "DiT")
            return Placement(**base, strategy="cpu", devices=[host.id], resident_bytes={host.id: wbytes},
                             working_bytes={host.id: working1},
                             reasons=["no GPU: the DiT runs on the CPU (correct, very slow)"])
        attempts.append(f"DiT on the CPU needs {format_bytes(wbytes + working1)} of host RAM; budget is "
                        f"{format_bytes(ledger.free(host.id))}")
    return None  # type: ignore[return-value]


def _place_simple(comp: Component, candidates: list[Device], wl: Workload, policy: Policy, ledger: _Ledger,
                  attempts: list[str]) -> Placement | None:
    """Text encoder or VAE on one device: the first candidate with room (VAE: untiled, else tiled)."""
    size = comp.size
    wbytes = weight_bytes(size, comp.weight_dtype)
    label = "text encoder" if comp.role == "text_encoder" else "VAE"
    options: list[tuple[int, bool]]
    if comp.role == "text_encoder":
        options = [(text_encoder_working_bytes(size, tokens=policy.text_encoder_tokens,
                                               batch=2 if wl.cfg else 1), False)]
    else:
        options = [(vae_decode_bytes(size, wl, tiled=False), False), (vae_decode_bytes(size, wl, tiled=True), True)]
    # GPUs before the host; on GPUs, untiled anywhere before tiled anywhere.
    gpus = [d for d in candidates if d.kind != "cpu"]
    hosts = [d for d in candidates if d.kind == "cpu"]
    tiers = [(gpus, o) for o in options] + [(hosts, o) for o in options]
    for devices, (working, tiled) in tiers:
        for d in devices:
            strategy = "cpu" if d.kind == "cpu" else "single"
            need = _need(comp.role, strategy, policy, {d.id: wbytes}, {d.id: working})
            if not ledger.fits(need):
                continue
            ledger.commit(need, label + (" (tiled)" if tiled else ""))
            reasons = [f"{format_bytes(wbytes)} weights + {format_bytes(working)} working fit on {d.id}"]
            if comp.role == "text_encoder" and policy.free_text_encoder_before_sampling and d.kind != "cpu":
                reasons.append("freed before sampling, so its memory is reused by the DiT")
            if tiled:
                reasons.append("untiled decode does not fit: decode in tiles")
            if d.kind == "cpu":
                reasons.append(f"no GPU has room left: runs on the CPU ({'once per prompt' if comp.role == 'text_encoder' else 'slow'})")
            return Placement(role=comp.role, file=size.path, family=size.family, strategy=strategy, devices=[d.id],
                             weight_dtype=_dtype_name(size, comp.weight_dtype), weight_bytes=wbytes,
                             resident_bytes={d.id: wbytes}, working_bytes={d.id: working}, tiled=tiled,
                             reasons=reasons)
    attempts.append(f"{label} needs {format_bytes(wbytes + options[-1][0])} on one device; largest budget left is "
                    f"{format_bytes(max((ledger.free(d.id) for d in candidates), default=0))}")
    return None


def split_in_order(sizes: list[int], capacities: list[int]) -> list[int] | None:
    """The device index of each unit for units placed in order over devices in order: contiguous runs, each
    device's share of the bytes proportional to its capacity (units go where the boundary falls nearest), none over
    its capacity (else first fit in order). None when the units do not fit. Shared by the planner (blocks from the
    header) and the loader (``mgpu.sharding.layer_split``, the module's units)."""
    n = len(capacities)
    if not n or sum(sizes) > sum(capacities):
        return None
    targets = [sum(sizes) * c / sum(capacities) for c in capacities] if sum(capacities) else [0.0] * n
    index, used, dev = [], [0] * n, 0
    for size in sizes:
        if used[dev] and used[dev] + size / 2 > targets[dev] and dev < n - 1:
            dev += 1
        index.append(dev)
        used[dev] += size
    if all(u <= c for u, c in zip(used, capacities)):
        return index
    index, used, dev = [], [0] * n, 0
    for size in sizes:
        while used[dev] + size > capacities[dev]:
            dev += 1
            if dev == n:
                return None
        index.append(dev)
        used[dev] += size
    return index


def _encoder_room(dev: str, working: int, policy: Policy, ledger: _Ledger) -> int:
    """Bytes of encoder weights ``dev`` can still take: its budget less what each phase the weights stay in already
    holds, and less the working memory in the encode phase."""
    phases = phases_resident("text_encoder", "split", policy)
    return min(ledger.budget[dev] - ledger.used[dev][ph] - (working if ph == "encode" else 0) for ph in phases)


def _split_text_encoder(comp: Component, by_room: list[Device], wl: Workload, policy: Policy, ledger: _Ledger,
                        attempts: list[str]) -> Placement | None:
    """A text encoder too big for any one GPU: its layers in order over the fewest GPUs that hold them, each GPU's
    share of the weights proportional to its room. Each GPU computes its own layers (ComfyUI keeps its reservation
    on each, as it loads the encoder's part there), and the encoder is freed before sampling like a one-GPU one."""
    size = comp.size
    wbytes = weight_bytes(size, comp.weight_dtype)
    scale = wbytes / size.total_bytes if size.total_bytes else 1.0
    blocks = [int(b * scale) for b in size.blocks[0].bytes_per_block] if size.blocks else []
    if len(blocks) < 2 or len(by_room) < 2:
        return None
    units = [wbytes - sum(blocks), *blocks]   # embeddings, norms, projections: with the first block
    working = text_encoder_working_bytes(size, tokens=policy.text_encoder_tokens, batch=2 if wl.cfg else 1)
    for k in range(2, len(by_room) + 1):
        group = sorted(by_room[:k], key=lambda d: d.index)
        index = split_in_order(units, [max(0, _encoder_room(d.id, working, policy, ledger)) for d in group])
        if index is None:
            continue
        resident = {d.id: sum(u for u, i in zip(units, index) if i == j) for j, d in enumerate(group)}
        need = _need("text_encoder", "split", policy, resident, {d.id: working for d in group})
        if not ledger.fits(need):
            continue
        ledger.commit(need, "text encoder (split)")
        layers = {d.id: [min(ks), max(ks)] for j, d in enumerate(group)
                  if (ks := [b for b, i in enumerate(index[1:]) if i == j])}
        parts = ", ".join(f"{dev} {format_bytes(resident[dev])} (blocks {a}-{b})" for dev, (a, b) in layers.items())
        reasons = [f"{format_bytes(wbytes)} of weights fit on no one GPU beside what the plan put there: layers split "
                   f"in order over {k} GPUs: {parts}",
                   f"each GPU computes its own layers ({format_bytes(working)} working memory on each); the "
                   f"activations return to {group[0].id} between layers"]
        if policy.free_text_encoder_before_sampling:
            reasons.append("freed before sampling on every GPU, so its memory is reused by the DiT")
        return Placement(role="text_encoder", file=size.path, family=size.family, strategy="split",
                         devices=[d.id for d in group], weight_dtype=_dtype_name(size, comp.weight_dtype),
                         weight_bytes=wbytes, resident_bytes=resident, working_bytes={d.id: working for d in group},
                         reasons=reasons, layers_by_device=layers)
    rooms = ", ".join(f"{d.id} {format_bytes(max(0, _encoder_room(d.id, working, policy, ledger)))}" for d in by_room)
    attempts.append(f"text encoder split over up to {len(by_room)} GPUs needs {format_bytes(wbytes)} of weights in "
                    f"all and {format_bytes(working)} working on each; room for weights: {rooms}")
    return None


def _place_text_encoder(comp: Component, gpus: list[Device], host: Device | None, wl: Workload, policy: Policy,
                        ledger: _Ledger, attempts: list[str]) -> Placement | None:
    """One GPU (most room first) if one holds it, else its layers split over the fewest GPUs that hold them, else
    the host: a split on GPUs encodes far faster than the CPU."""
    by_room = sorted(gpus, key=lambda d: (-ledger.free(d.id), d.index))
    return (_place_simple(comp, by_room, wl, policy, ledger, attempts)
            or _split_text_encoder(comp, by_room, wl, policy, ledger, attempts)
            or (_place_simple(comp, [host], wl, policy, ledger, attempts) if host else None))


def _ways_out(components: list[Component], gpus: list[Device], policy: Policy, wl: Workload) -> list[str]:
    ways = []
    dit = next((c for c in components if c.role == "dit"), None)
    if dit is not None and (dit.weight_dtype or "").lower() not in ("fp8_e4m3fn", "fp8_e5m2"):
        ways.append("load the DiT in fp8 (weight dtype fp8_e4m3fn) to halve its weights")
    ways.append("use more GPUs" if gpus else "use a machine with a GPU")
    if not policy.allow_offload:
        ways.append("allow CPU offload (slow: weights stream from host RAM every step)")
    ways.append(f"generate fewer frames or a smaller size than {wl.frames} x {wl.width}x{wl.height}")
    return ways


def make_plan(components: list[Component], devices: list[Device], workload: Workload,
              policy: Policy | None = None) -> Plan:
    """Place the components: DiT first (it decides sharding), then the text encoder, then the VAE.

    Deterministic for the same input. Raises PlanError naming each device's need and budget, and the ways out.
    """
    policy = policy or Policy()
    roles = [c.role for c in components]
    if bad := [r for r in roles if r not in ROLES]:
        raise ValueError(f"unknown component role(s) {bad}; expected one of {ROLES}")
    if len(set(roles)) != len(roles):
        raise ValueError(f"each role may appear once, got {roles}")
    gpus = sorted((d for d in devices if d.kind == "cuda"), key=lambda d: d.index)
    host = next((d for d in devices if d.kind == "cpu"), None)
    ledger = _Ledger(devices, policy)
    by_role = {c.role: c for c in components}
    placements: list[Placement] = []
    attempts: list[str] = []

    for role in ("dit", "text_encoder", "vae"):
        comp = by_role.get(role)
        if comp is None:
            continue
        if role == "dit":
            placed = _place_dit(comp, gpus, host, workload, policy, ledger, attempts)
            if placed is not None:
                from mgpu.weights.quant import fp8_plan_line   # imports torch, which planning otherwise needs not

                if line := fp8_plan_line(placed.weight_dtype, [(d.id, d.capability) for d in devices
                                                               if d.id in placed.devices]):
                    placed.reasons.append(line)
        elif role == "text_encoder":
            placed = _place_text_encoder(comp, gpus, host, workload, policy, ledger, attempts)
        else:
            # GPUs with the most room left first, then the host.
            order = sorted(gpus, key=lambda d: (-ledger.free(d.id), d.index)) + ([host] if host else [])
            placed = _place_simple(comp, order, workload, policy, ledger, attempts)
        if placed is None:
            needs = [{"device": d.id, "budget_bytes": ledger.budget[d.id], "committed_bytes": max(ledger.used[d.id].values())}
                     for d in devices]
            lines = [f"cannot place the {role.replace('_', ' ')} ({comp.size.path}, {format_bytes(comp.size.total_bytes)}) "
                     f"for {workload.frames} frames at {workload.width}x{workload.height}, batch {workload.batch}, "
                     f"CFG {'on' if workload.cfg else 'off'}:"]
            lines += [f"  - {a}" for a in attempts]
            lines += [f"  - {n['device']}: budget {format_bytes(n['budget_bytes'])}, already committed "
                      f"{format_bytes(n['committed_bytes'])}" for n in needs]
            lines.append("ways out: " + "; ".join(_ways_out(components, gpus, policy, workload)))
            raise PlanError("\n".join(lines), needs=needs)
        placements.append(placed)

    usage = [DeviceUse(device=d.id, budget_bytes=ledger.budget[d.id], peak_bytes=max(ledger.used[d.id].values()),
                       by_phase=dict(ledger.used[d.id]), holds=list(ledger.holds[d.id])) for d in devices]
    reasons = []
    if len(gpus) and all(not u.holds for u in usage if u.device != (host.id if host else None)):
        reasons.append("no component uses a GPU")
    return Plan(placements=placements, usage=usage, devices=[d.to_dict() for d in devices],
                workload=asdict(workload), policy=asdict(policy), reasons=reasons)
