"""The VRAM-aware partitioner: where each component lives and whether the DiT must be sharded.

Memory model (every number is an estimate from `mgpu.planning.estimates`, and the plan says which):

* A run has three phases: ``encode`` (text encoder), ``sample`` (DiT), ``decode`` (VAE). A device's peak is the
  largest, over the phases, of the weights resident in that phase plus the working memory of what runs there.
* A single-device DiT or text encoder lives in ComfyUI's model management, which unloads models to make room,
  so with ``Policy.free_text_encoder_before_sampling`` the encoder's weights are gone before sampling starts. For an
  FSDP DiT ComfyUI cannot see the ranks' memory, so its loader unloads ComfyUI's models from the ranks' GPUs when
  sampling starts (``loaders.diffusion.ShardedModelPatcher``).
* An FSDP-sharded DiT lives in the rank processes for as long as the pool holds it, so its shard is resident in
  every phase. FSDP shards evenly: the smallest member of the rank group bounds every rank. Its working memory
  counts in the sample phase only: when sampling ends the ranks give back what their caching allocators kept
  (``loaders.diffusion.ShardedModelPatcher.cleanup``), so the VAE decode and the next prompt's text encoder can use
  it (``PHASE_OF``). What the rank processes keep outside that allocator (CUDA context, libraries, one NCCL
  communicator per process group: ``estimates.rank_process_bytes``) counts in every phase (``process_bytes``).
* The VAE decodes on one GPU when the whole decode fits beside what that GPU holds at decode time (a short video);
  else its tiles are split over every GPU with room for a VAE copy and one tile (MGPU VAE Decode,
  ``estimates.vae_parallel_decode_bytes``: the same per GPU whatever the video's length); else tiled on one GPU;
  else on the host.
* A device's budget is its free memory, plus what this pack's ranks and ComfyUI's cached models hold there
  (``Device.reclaimable_bytes``: the planned models replace them), minus ``Policy.reserve_bytes`` (other processes,
  allocator growth) and, on the GPUs of ``Policy.host_context_gpus``, the ComfyUI process's own CUDA context, which
  it keeps in every phase; the host's is its available RAM minus ``Policy.host_reserve_bytes``. No plan exceeds a
  budget.
* A training plan (``Workload.train``: MGPU Train LoRA's step) places the DiT on FSDP ranks only, every GPU first,
  and takes the first of the step's ways that fits (``training.step_options``: without gradient checkpointing, then
  with it, then fewer rows per forward with more accumulation); its working memory is ``training``'s, its dataset
  sits in host RAM. A refusal names the most frames that fit.
* Working memory follows the budget rule of ``mgpu.planning.estimates``: where ComfyUI runs a component (single-device DiT,
  text encoder, untiled VAE decode) the larger of our calibrated estimate and ComfyUI's own reservation, since
  ComfyUI otherwise loads the weights only partly; on FSDP ranks our estimate plus FSDP2's all-gather buffers and
  NCCL's buffers (``fsdp_buffer_bytes``), since there ComfyUI reserves nothing.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from mgpu.planning.devices import Device, format_bytes
from mgpu.errors import PlanError
from mgpu.planning.estimates import (
    CUDA_CONTEXT_BYTES,
    CUDA_OVERHEAD_BYTES,
    GiB,
    Workload,
    dit_tokens,
    dit_working_bytes,
    fsdp_buffer_bytes,
    gathered_size,
    nccl_communicators,
    rank_process_bytes,
    text_encoder_working_bytes,
    vae_decode_bytes,
    vae_parallel_decode_bytes,
    weight_bytes,
    weight_itemsize,
)
from mgpu.planning import parallel
from mgpu.planning.sizing import ComponentSize, text_encoder_for
from mgpu.planning.training import (adapter_params, adapter_state_bytes, dataset_bytes, step_options,
                                    training_working_bytes)

ROLES = ("text_encoder", "dit", "dit_low_noise", "vae")
PHASES = ("encode", "sample", "decode")
# The phase each role runs in: its working memory occupies its devices then only. An FSDP DiT's ranks would keep
# what sampling used in their caching allocators; they give it back when sampling ends
# (``loaders.diffusion.ShardedModelPatcher.cleanup``).
PHASE_OF = {"text_encoder": "encode", "dit": "sample", "dit_low_noise": "sample", "vae": "decode"}
# A DiT in two experts (Wan 2.2 A14B): "dit" denoises the first steps (high noise), "dit_low_noise" the rest.
EXPERT_ROLES = ("dit", "dit_low_noise")
BOTH_RESIDENT, ONE_AT_A_TIME = "both_resident", "one_at_a_time"
# Assumed speeds for the cost of switching experts, stated in the plan's reasons: reading an expert's file from an
# NVMe SSD, and copying an expert ComfyUI moved to host RAM back to its GPU (pageable memory over PCIe 4.0).
DISK_BYTES_PER_S = 2e9
HOST_TO_GPU_BYTES_PER_S = 10e9
SWITCHES_PER_PROMPT = 2   # to the high-noise expert at the first step, to the low-noise one at the switch step


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
    # GPUs on which the ComfyUI process itself keeps a CUDA context for as long as it runs (its main GPU; every GPU
    # under ComfyUI 0.33's dynamic VRAM): less budget there in every phase. The loaders say which (mgpu/ stays
    # ComfyUI-free); a components ComfyUI runs there then adds only its libraries to its working memory.
    host_context_gpus: tuple[str, ...] = ()
    # A loader's own plan, made when no MGPU Plan tells it what to do (``loaders.placement.plan_to_follow``): its
    # workload is a guess, so the sequence degree the ranks set up covers any batch (``sequence_degree``), and it
    # refuses nothing: what fits nowhere by these estimates goes where it has the most room (``_last_resort``).
    implicit: bool = False
    # The DiT's FSDP ranks when its loader's device is fsdp: sharded over exactly these, one entry per rank ("cpu"
    # repeated: cpu ranks sharing the host's RAM), whatever the estimates say; the gathered weights kept if they fit.
    fsdp_devices: tuple[str, ...] = ()


@dataclass
class RankNeed:
    """Per rank bytes of a DiT sharded over ``ranks`` ranks (``rank_need``), as the plan counts them and the loaders
    weigh them (``fits_beside``)."""

    ranks: int
    shard: int     # in every phase: 1/N of the weights, plus what the root unit keeps gathered (outside the blocks)
    working: int   # while it samples: this rank's rows and tokens, and FSDP2's all-gather buffers
    kept: int      # the whole gathered model, held between steps when the gathered weights are kept
    process: int   # in every phase: the rank process's CUDA context, libraries and NCCL communicators (0 on cpu)

    def resident(self, keep: bool) -> int:
        """Weights held in every phase: the shard, and the gathered model when it is kept."""
        return self.shard + (self.kept if keep else 0)


@dataclass
class Placement:
    """Where one component lives and what it costs there."""

    role: str
    file: str
    family: str
    # "single" | "fsdp" | "offload" | "cpu" | "split": a text encoder's layers over several GPUs, or a VAE's decode
    # tiles over several GPUs (MGPU VAE Decode; the VAE loads on devices[0], the others decode with a copy)
    strategy: str
    devices: list[str]
    weight_dtype: str
    weight_bytes: int
    resident_bytes: dict[str, int]  # weights held per device while resident
    working_bytes: dict[str, int]  # transient memory per device while this component runs
    tiled: bool = False  # VAE only: decode in tiles
    batch_per_rank: int | None = None  # FSDP only: DiT batch each rank computes (CFG split)
    cfg_degree: int = 1  # FSDP only: rank groups splitting the batch rows (mgpu.planning.parallel)
    sp_degree: int = 1  # FSDP only: the largest sequence degree (Ulysses) the ranks set up (``sequence_degree``)
    reshard_after_forward: bool = True  # FSDP only: False keeps the gathered weights between steps
    reasons: list[str] = field(default_factory=list)
    layers_by_device: dict[str, list[int]] = field(default_factory=dict)  # split only: [first, last] block per device
    # Two DiT experts: BOTH_RESIDENT (both held, one computing at a time) or ONE_AT_A_TIME (the MGPU loaders free
    # one expert's shards before the other loads); None for a single DiT and every other component.
    experts: str | None = None
    switch_s: float | None = None  # ONE_AT_A_TIME: estimated seconds to load this expert at a switch
    # FSDP only: what each rank process keeps on its GPU in every phase outside PyTorch's allocator (CUDA context,
    # libraries, NCCL communicators); on the first expert of two, which share the ranks
    process_bytes: dict[str, int] = field(default_factory=dict)
    rank_need: RankNeed | None = None  # FSDP only: what one rank holds (``rank_need``), for a loader to weigh
    # A training plan's DiT only: what MGPU Train LoRA follows (gradient_checkpointing, batch_size,
    # grad_accumulation_steps) and the adapter's trained parameters
    training: dict | None = None


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

    def expert(self, file: str) -> Placement | None:
        """The placement of the DiT expert whose file is ``file`` in a two-expert plan; None otherwise (a plan of
        one DiT, or a file the plan does not name). A loader finds its own expert by its file."""
        return next((p for p in self.placements if p.experts and p.file == file), None)

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
            placements=[Placement(**{**p, "rank_need": p.get("rank_need") and RankNeed(**p["rank_need"])})
                        for p in d["placements"]],
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
        self.budget = {d.id: _budget(d, policy) for d in devices}
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


def host_context_bytes(device: Device, policy: Policy) -> int:
    """What the ComfyUI process itself keeps on ``device`` in every phase: its CUDA context on the GPUs the loaders
    name (``Policy.host_context_gpus``), else nothing."""
    return CUDA_CONTEXT_BYTES if device.kind == "cuda" and device.id in policy.host_context_gpus else 0


def _budget(device: Device, policy: Policy) -> int:
    """Free memory plus what is ours to reuse there, less the reserve and the host's own CUDA context."""
    reserve = policy.host_reserve_bytes if device.kind == "cpu" else policy.reserve_bytes
    return max(0, device.available_bytes - reserve - host_context_bytes(device, policy))


def _host_run(working: int, dev: str, policy: Policy) -> int:
    """``working`` (with ``CUDA_OVERHEAD_BYTES``) of a component ComfyUI runs on ``dev``, less the host's context
    where the budget counts it already in every phase."""
    return working - (CUDA_CONTEXT_BYTES if dev in policy.host_context_gpus else 0)


def phases_resident(role: str, strategy: str, policy: Policy) -> tuple[str, ...]:
    """The phases in which a component's weights occupy its device."""
    if role in EXPERT_ROLES:
        # Rank processes and pinned host copies are outside ComfyUI's model management: they persist.
        return PHASES if strategy in ("fsdp", "offload") else ("sample", "decode")
    if role == "text_encoder":
        return ("encode",) if policy.free_text_encoder_before_sampling else PHASES
    return ("decode",)


def _need(role: str, strategy: str, policy: Policy, resident: dict[str, int], working: dict[str, int]) -> dict:
    need: dict[str, dict[str, int]] = {}
    for dev in set(resident) | set(working):
        need[dev] = {ph: resident.get(dev, 0) for ph in phases_resident(role, strategy, policy)}
        run = PHASE_OF[role]
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


def sequence_degree(comp: Component, wl: Workload, ranks: int, policy: Policy) -> int:
    """The sequence degree the load sets up (the ranks pick each step's split among the degrees up to it): the
    split of the plan's workload; in a loader's own plan (``Policy.implicit``), whose workload is a guess, the largest
    the ranks and the heads allow, so a prompt at cfg 1 still splits its tokens over every rank."""
    rows = 1 if policy.implicit else wl.dit_batch
    return parallel.choose(ranks, rows, comp.size.dims.get("heads"), comp.size.family, policy.sequence_parallel).sp


def rank_need(comp: Component, group: list[Device], wl: Workload, policy: Policy | None = None) -> RankNeed:
    """What each rank holds of a DiT sharded over ``group`` (one Device per rank), the one place the plan and the
    loaders get these numbers from.

    Shard: 1/N of the weights (dim-0 shards, rounded up) plus the bytes outside the blocks, which the root FSDP unit
    keeps gathered for the whole forward. Working: the activations of this rank's rows (CFG/batch split) and tokens
    (sequence split) for ``wl``, with no ComfyUI reservation (ComfyUI cannot see the ranks), plus FSDP2's all-gather
    buffers in the storage dtype (NCCL gathers fp8 as fp8); for a training step (``wl.train``, its checkpointing
    decided) its forward and backward and the adapter state (``training.training_working_bytes``). Kept: the whole
    model gathered (GGUF dequantized, ``estimates.gathered_size``). Process: the rank process's own memory for the
    sequence degrees the load sets up (``sequence_degree``), with NVLS buffers on an NVSwitch machine; cpu ranks
    (gloo) keep none of it.
    """
    policy = policy or Policy()
    size, ranks = comp.size, len(group)
    degrees = _degrees(comp, wl, ranks, policy)
    wbytes = weight_bytes(size, comp.weight_dtype)
    scale = wbytes / size.total_bytes if size.total_bytes else 1.0
    shard = math.ceil(wbytes / ranks) + int(size.bytes_outside_blocks * scale)
    buffers = fsdp_buffer_bytes(size, gather_itemsize=weight_itemsize(size, comp.weight_dtype),
                                gathered_blocks=policy.gathered_blocks)
    rows = math.ceil(wl.dit_batch / degrees.cfg)
    if wl.train is not None:
        working = training_working_bytes(size, wl, rows=rows, sp=degrees.sp) + buffers
    else:
        working = dit_working_bytes(size, wl, batch=rows, comfyui=False, sp=degrees.sp) + buffers
    process = 0
    if group and group[0].kind == "cuda":
        process = rank_process_bytes(ranks, size.dims.get("heads"), sequence_degree(comp, wl, ranks, policy),
                                     nvls=parallel.nvls_likely(group))
    return RankNeed(ranks=ranks, shard=shard, working=working,
                    kept=weight_bytes(gathered_size(size), comp.weight_dtype), process=process)


def _process_reason(comp: Component, group: list[Device], sp_degree: int, per_rank: int) -> str:
    comms = nccl_communicators(len(group), comp.size.dims.get("heads"), sp_degree)
    nvls = " with NVLS buffers (NVSwitch)" if parallel.nvls_likely(group) else ""
    return (f"each rank process keeps {format_bytes(per_rank)} on its GPU in every phase, outside what it releases "
            f"after sampling: its CUDA context and libraries ({format_bytes(CUDA_OVERHEAD_BYTES)}) and "
            f"{len(comms)} NCCL communicator(s){nvls} (groups of {', '.join(map(str, comms)) or 'none'} ranks); "
            "unmeasured guesses (estimates.GPU_PROCESS_GUESSES)")


def _per_device(group: list[Device], per_rank: int) -> dict[str, int]:
    """``per_rank`` bytes on every rank of ``group``, per device: cpu ranks share the host, so it holds them all."""
    return {dev: n * per_rank for dev, n in Counter(d.id for d in group).items()}


def fits_beside(need: RankNeed, ranks: list[Device], *, keep: bool, held: int = 0,
                policy: Policy | None = None) -> tuple[bool, str]:
    """Whether a DiT whose ranks hold ``need`` fits beside the models already loaded on them, and why: what a
    loader weighs when its ranks hold another model that no plan placed with it (Wan 2.2's other expert). If not,
    the two take turns.

    ``ranks``: one Device per rank with the free memory the ranks report now, so the shards already loaded, and the
    rank processes' own memory, are taken; ``held``: per rank bytes those models take later when they run (their
    kept gathered weights); ``keep``: this model keeps its own gathered weights."""
    policy = policy or Policy()
    per_rank = need.resident(keep) + need.working + held
    by_id = {d.id: d for d in ranks}
    budgets = {dev: (n, _budget(by_id[dev], policy)) for dev, n in _per_device(ranks, per_rank).items()}
    parts = [f"{format_bytes(need.shard)} shard", f"{format_bytes(need.working)} working"]
    parts += [f"{format_bytes(need.kept)} kept gathered"] if keep else []
    parts += [f"{format_bytes(held)} the other models keep gathered"] if held else []
    text = "; ".join(f"{dev} needs {format_bytes(n)}, has {format_bytes(b)}" for dev, (n, b) in budgets.items())
    return (all(n <= b for n, b in budgets.values()),
            f"{format_bytes(per_rank)} per rank ({' + '.join(parts)}) beside them: {text}")


def _switch_s(size: ComponentSize) -> float:
    """Seconds to load an expert again at a switch: every rank reads its 1/N of the file at once, all from the
    same disk, so the whole file passes through the disk once."""
    return size.total_bytes / DISK_BYTES_PER_S


def _expert_reasons(experts: list[Component], mode: str, group: list[Device], shards: list[int], working: int,
                    kept: int, process: int, budget: int, host: Device | None, ledger: _Ledger) -> list[str]:
    """The two-expert decision of an FSDP group with its numbers: both resident, or one at a time and its cost.
    ``kept``: per rank bytes of the gathered weights the plan keeps between steps (0 when it reshards); ``process``:
    the rank process's own memory, shared by the experts."""
    n, both = len(group), sum(shards) + working + kept + process
    split = " + ".join(format_bytes(b) for b in shards) + (f" + {format_bytes(kept)} kept gathered" if kept else "")
    split += " of shards" + (f" + {format_bytes(process)} rank process" if process else "")
    if mode == BOTH_RESIDENT:
        return [f"two experts (high noise, then low noise from the switch step) on the same {n} ranks, both "
                f"resident: {split} + {format_bytes(working)} working for one expert at a time = "
                f"{format_bytes(both)} per rank of {format_bytes(budget)}; switching experts reloads nothing"]
    files = [c.size.total_bytes for c in experts]
    switch = [_switch_s(c.size) for c in experts]
    reasons = [f"both experts resident would need {format_bytes(both)} per rank ({split} + "
               f"{format_bytes(working)} working), over the {format_bytes(budget)} budget: one expert at a time "
               f"({format_bytes(max(shards) + working + kept + process)} per rank). The MGPU loaders free one "
               "expert's shards before the other loads, so both are never resident together",
               f"each switch reads 1/{n} of the next expert's file on every rank ("
               + ", ".join(f"{format_bytes(math.ceil(f / n))} per rank, {format_bytes(f)} from the disk in all"
                           for f in dict.fromkeys(files))
               + f"): ~{max(switch):.1f} s at an assumed {DISK_BYTES_PER_S / 1e9:g} GB/s (NVMe); "
               f"{SWITCHES_PER_PROMPT} switches per prompt (the high-noise expert at the first step, the low-noise "
               f"one at the switch step): ~{sum(switch):.1f} s per prompt"]
    if host is not None and ledger.free(host.id) >= sum(files):
        reasons.append(f"host RAM ({format_bytes(ledger.free(host.id))} free) can hold both files "
                       f"({format_bytes(sum(files))}): after the first prompt the kernel's page cache usually serves "
                       "these reads, faster than the disk")
    return reasons


# MGPU Load Diffusion Model shards a GGUF file and loads it no other way (ComfyUI-GGUF's loader keeps one on one device
# quantized): a plan for one places it only where that loader can follow, on one GPU too (one rank).
GGUF_SHARDED = ("a GGUF file: sharded with its quantized blocks kept (MGPU Load Diffusion Model loads GGUF files only "
                "this way), over the fewest ranks that fit ({k})")


def _place_dit(experts: list[Component], gpus: list[Device], host: Device | None, wl: Workload, policy: Policy,
               ledger: _Ledger, attempts: list[str]) -> list[Placement] | None:
    """The DiT, or the two experts of a two-expert DiT (``EXPERT_ROLES``) on the same devices with the same
    strategy. Two experts are tried both resident on every GPU rung first, then one at a time: a plan that reloads
    an expert twice per prompt is worse than one on more GPUs that reloads nothing, and better than streaming the
    weights from host RAM every step (offload, or the CPU: both experts in host RAM), the last resorts."""
    modes = (BOTH_RESIDENT, ONE_AT_A_TIME) if len(experts) > 1 else (None,)
    for mode in modes:
        placed = _dit_ladder(experts, mode, gpus, host, wl, policy, ledger, attempts, on_gpus=True)
        if placed:
            return placed
    return _dit_ladder(experts, modes[0], gpus, host, wl, policy, ledger, attempts, on_gpus=False)


def _dit_ladder(experts: list[Component], mode: str | None, gpus: list[Device], host: Device | None, wl: Workload,
                policy: Policy, ledger: _Ledger, attempts: list[str], on_gpus: bool) -> list[Placement] | None:
    """One DiT (``mode`` None) or two experts held ``mode``. ``on_gpus``: speed first if asked, then one GPU, then
    the fewest GPUs sharded; else offload, then the CPU."""
    comp, size = experts[0], experts[0].size
    gguf = size.gguf
    wbytes = [weight_bytes(c.size, c.weight_dtype) for c in experts]
    bases = [dict(role=role, file=c.size.path, family=c.size.family, weight_dtype=_dtype_name(c.size, c.weight_dtype),
                  weight_bytes=w) for role, c, w in zip(EXPERT_ROLES, experts, wbytes)]
    by_budget = sorted(gpus, key=lambda d: (-ledger.free(d.id), d.index))
    noun = {None: "DiT", BOTH_RESIDENT: "both DiT experts (resident together)",
            ONE_AT_A_TIME: "one DiT expert at a time"}[mode]

    def held(per_expert: list[int]) -> int:
        """Bytes the experts take at once on a device: one expert's, or both."""
        return max(per_expert) if mode == ONE_AT_A_TIME else sum(per_expert)

    def placements(strategy: str, devices: list[str], resident: list[dict[str, int]], working: list[dict[str, int]],
                   reasons: list[str], **fsdp) -> list[Placement]:
        out = [Placement(**base, strategy=strategy, devices=list(devices), resident_bytes=res, working_bytes=work,
                         reasons=reasons, experts=mode, **fsdp)
               for base, res, work in zip(bases, resident, working)]
        for p in out[1:]:
            p.reasons = [f"the low-noise expert: {strategy} on the same devices as the high-noise one "
                         f"({mode.replace('_', ' ')}; see dit)"]
        if mode == ONE_AT_A_TIME and strategy == "fsdp":
            for p, c in zip(out, experts):
                p.switch_s = round(_switch_s(c.size), 2)
        return out

    def fsdp(group: list[Device], why: str, forced: bool = False) -> list[Placement] | None:
        """Sharded over ``group`` (one Device per rank), committed if it fits; ``forced`` (the loader's device
        fsdp, ``Policy.fsdp_devices``): committed even when it does not, and said. A training step takes the first
        of its ways (``training.step_options``: checkpointing, rows per forward) that fits."""
        options = step_options(wl) if wl.train is not None else [wl]
        tried: list[tuple[Workload, int, int]] = []   # the ways that did not fit: rows per rank, bytes per rank
        for run in options:
            degrees = _degrees(comp, run, len(group), policy)   # two experts share one architecture
            needs = [rank_need(c, group, run, policy) for c in experts]
            working, batch = max(n.working for n in needs), math.ceil(run.dit_batch / degrees.cfg)
            process = needs[0].process   # once: the experts share the rank processes
            work = _per_device(group, working)

            def per_expert(keep: bool) -> list[int]:
                return [n.resident(keep) for n in needs]

            # Keeping every block gathered between steps saves one all-gather of the whole model per step (on cpu
            # ranks a Wan 1.3B step took ~50 s with it, ~1 s without); it costs the full weights on every rank (of
            # each resident expert), so it is chosen only when that fits too.
            reshard = not ledger.fits(_need("dit", "fsdp", policy,
                                            _per_device(group, held(per_expert(True)) + process), work))
            resident = held(per_expert(not reshard))
            need = _need("dit", "fsdp", policy, _per_device(group, resident + process), work)
            if fits := ledger.fits(need):
                break
            tried.append((run, batch, resident + process + working))
        sp_setup = sequence_degree(comp, run, len(group), policy)
        budget = min(ledger.free(dev) // k for dev, k in Counter(d.id for d in group).items())
        if not fits:
            shard = ("shard" if mode is None else "of shards")
            what = ("GPU" if group[0].kind == "cuda" else "cpu rank") + ("s" if len(group) > 1 else "")
            short = (f"{noun} sharded over {len(group)} {what} needs "
                     f"{format_bytes(resident + process + working)} per rank ({format_bytes(resident)} {shard} "
                     f"+ {format_bytes(process)} rank process + {format_bytes(working)} working, "
                     + (_train_short(run, batch) if run.train else f"batch {batch} per rank")
                     + (f", 1/{degrees.sp} of the tokens" if degrees.sp > 1 else "")
                     + f"); smallest budget is {format_bytes(budget)}")
            if not forced:
                attempts.append(short)
                return None
        ledger.commit(need, {None: "DiT shard", BOTH_RESIDENT: "DiT shards (2 experts)",
                             ONE_AT_A_TIME: "DiT shard (1 expert at a time)"}[mode])
        if size.dims.get("hidden") and size.dims.get("layers"):
            parallel.estimate(degrees, group, params=size.params, weight_bytes=wbytes[0],
                              tokens=dit_tokens(size, run), rows=run.dit_batch, hidden=size.dims["hidden"],
                              layers=size.dims["layers"], resharding=reshard,
                              kv_gather_width=size.dims.get("audio_hidden", 0),   # LTX-2's audio queries
                              training=run.train.checkpointing if run.train else None)
        n = len(group)
        whose = "each expert's" if mode else "the"
        reasons = [why, *([] if fits else [f"warning: {short}, by these estimates: sharded over them all the "
                                            "same, as the loader's device fsdp asks"]),
                   f"each rank holds 1/{n} of {whose} weights "
                   f"({format_bytes(math.ceil(wbytes[0] / n))}) "
                   f"plus {policy.gathered_blocks} gathered blocks and an all-gather buffer while computing",
                   _process_reason(comp, group, sp_setup, process),
                   f"split of each step: {degrees.cfg} ({'batch' if run.train else 'CFG/batch'}) x {degrees.sp} "
                   f"(sequence) over {n} ranks",
                   *degrees.reasons, *(f"warning: {w}" for w in degrees.warnings)]
        if run.train is not None:
            reasons += _train_reasons(size, wl, run, tried if fits else tried[:-1], batch)
        if sp_setup != degrees.sp:
            reasons.append(f"sequence degrees up to {sp_setup} set up on the ranks, which pick each step's split for "
                           "its rows: this plan's workload is a guess")
        if len({d.available_bytes for d in group}) > 1:
            reasons.append("GPUs differ in size: FSDP shards evenly, so the smallest member bounds every shard")
        kept = [n.kept for n in needs]
        reasons.append(f"the gathered weights are freed after every step (each step all-gathers the model again): "
                       f"keeping them ({format_bytes(held(kept))} per rank) does not fit" if reshard else
                       f"the gathered weights stay between steps ({format_bytes(held(kept))} per rank): memory "
                       "allows it, so no all-gather after the first step")
        if mode is not None:
            kept_now = 0 if reshard else held(kept)
            reasons += _expert_reasons(experts, mode, group, per_expert(False), working, kept_now, process, budget,
                                       host, ledger)
        placed = placements("fsdp", [d.id for d in group], [_per_device(group, r) for r in per_expert(not reshard)],
                            [_per_device(group, nd.working) for nd in needs], reasons, batch_per_rank=batch,
                            cfg_degree=degrees.cfg, sp_degree=sp_setup, reshard_after_forward=reshard)
        placed[0].process_bytes = _per_device(group, process)
        for p, nd in zip(placed, needs):
            p.rank_need = nd
            if run.train is not None:
                p.training = {"gradient_checkpointing": run.train.checkpointing == "on", "batch_size": run.batch,
                              "grad_accumulation_steps": run.train.grad_accumulation,
                              "adapter_params": adapter_params(size, run.train.lora_rank)}
        return placed

    if policy.fsdp_devices:   # the loader's device fsdp: exactly these ranks
        by_id = {d.id: d for d in (*gpus, *([host] if host else []))}
        if missing := [i for i in policy.fsdp_devices if i not in by_id]:
            raise ValueError(f"Policy.fsdp_devices names {', '.join(missing)}, which the devices lack")
        group = [by_id[i] for i in policy.fsdp_devices]
        return fsdp(group, f"device fsdp on the loader: sharded over {', '.join(policy.fsdp_devices)}"
                    if group[0].kind == "cuda" else f"no GPU: sharded over {len(group)} cpu ranks (gloo; correct but "
                    "slow)", forced=True)
    if wl.train is not None:   # MGPU Train LoRA trains a sharded MODEL: FSDP ranks only
        return _train_ladder(gpus, host, by_budget, on_gpus, fsdp)
    if not on_gpus and gguf:   # no offload or one-process CPU run of a GGUF file: our cpu ranks shard it
        return fsdp([host], GGUF_SHARDED.format(k="cpu")) if host is not None and not gpus else None
    if not on_gpus:
        return _dit_on_host(experts, mode, gpus, host, by_budget, wbytes, wl, policy, ledger, attempts, placements)
    if policy.prefer_speed and len(gpus) >= 2:
        group = sorted(gpus, key=lambda d: d.index)
        placed = fsdp(group, f"speed asked for: sharded over all {len(group)} GPUs")
        if placed:
            return placed

    for d in ([] if gguf else by_budget):   # one device unsharded is ComfyUI-GGUF's loader, not ours
        working1 = _host_run(max(dit_working_bytes(c.size, wl, batch=1) for c in experts), d.id, policy)
        # one at a time on one GPU: ComfyUI's model management moves the idle expert to host RAM and back
        resident = {d.id: held(wbytes), **({host.id: max(wbytes)} if mode == ONE_AT_A_TIME and host else {})}
        need = _need("dit", "single", policy, resident, {d.id: working1})
        if (mode != ONE_AT_A_TIME or host) and ledger.fits(need):
            ledger.commit(need, {None: "DiT", BOTH_RESIDENT: "DiT (2 experts)",
                                 ONE_AT_A_TIME: "DiT (1 expert at a time)"}[mode])
            spare = format_bytes(ledger.free(d.id))
            reasons = {None: [f"fits on {d.id} with {spare} to spare; CFG runs cond and uncond as ComfyUI does "
                              "on one device"],
                       BOTH_RESIDENT: [f"both experts fit on {d.id} ({' + '.join(map(format_bytes, wbytes))} "
                                       f"weights + {format_bytes(working1)} working) with {spare} to spare; "
                                       "switching experts moves no weights"],
                       ONE_AT_A_TIME: [f"both experts do not fit on {d.id}: ComfyUI's model management keeps one "
                                       f"there and moves the other to host RAM ({format_bytes(max(wbytes))}); each "
                                       f"switch copies it back: ~{max(wbytes) / HOST_TO_GPU_BYTES_PER_S:.1f} s at "
                                       f"an assumed {HOST_TO_GPU_BYTES_PER_S / 1e9:g} GB/s, {SWITCHES_PER_PROMPT} "
                                       "switches per prompt"]}[mode]
            keep_host = [{host.id: w} if mode == ONE_AT_A_TIME and host else {} for w in wbytes]
            return placements("single", [d.id], [{d.id: w, **h} for w, h in zip(wbytes, keep_host)],
                              [{d.id: working1} for _ in experts], reasons)
    if by_budget and not gguf:
        best = by_budget[0]
        working1 = _host_run(max(dit_working_bytes(c.size, wl, batch=1) for c in experts), best.id, policy)
        attempts.append(f"{noun} on one GPU needs {format_bytes(held(wbytes) + working1)} "
                        f"({format_bytes(held(wbytes))} weights + {format_bytes(working1)} working); largest budget "
                        f"is {format_bytes(ledger.free(best.id))} on {best.id}")

    for k in range(1 if gguf else 2, len(gpus) + 1):
        # The k GPUs with the largest budgets: adding a smaller one can only lower the shared bound.
        group = sorted(by_budget[:k], key=lambda d: d.index)
        placed = fsdp(group, GGUF_SHARDED.format(k=k) if gguf else
                      f"too large for one GPU: sharded over the fewest GPUs that fit ({k})")
        if placed:
            return placed
    return None


def _train_ladder(gpus: list[Device], host: Device | None, by_budget: list[Device], on_gpus: bool,
                  fsdp) -> list[Placement] | None:
    """A training step's ranks: every GPU first (each rank trains on its share of the rows or tokens, so every GPU
    adds speed), then fewer, those with the most room (the smallest member of a group bounds every shard); with no
    GPU, one cpu rank."""
    if not on_gpus:
        return fsdp([host], "no GPU: trained over one cpu rank (gloo; correct but slow)") if host and not gpus else None
    if not gpus:
        return None
    placed = fsdp(sorted(gpus, key=lambda d: d.index),
                  f"training: sharded over all {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} (every rank trains on its "
                  "share of each step's rows, or of its tokens)")
    for k in range(len(gpus) - 1, 0, -1):
        if placed:
            break
        placed = fsdp(sorted(by_budget[:k], key=lambda d: d.index),
                      f"training: sharded over the {k} GPUs with the most room (on all {len(gpus)}, the smallest "
                      "bounds every shard and it does not fit)")
    return placed


def _train_short(run: Workload, batch: int) -> str:
    return (f"{run.batch} row{'s' if run.batch > 1 else ''} per forward ({batch} per rank), gradient checkpointing "
            f"{run.train.checkpointing}")


def _train_reasons(size: ComponentSize, asked: Workload, run: Workload, tried: list[tuple[Workload, int, int]],
                   batch: int) -> list[str]:
    """The training step the plan chose and why: what did not fit first, the adapter state on every rank."""
    train = run.train
    total = asked.batch * asked.train.grad_accumulation
    reasons = [f"training step: {run.batch} row{'s' if run.batch > 1 else ''} per forward ({batch} per rank), "
               f"gradient checkpointing {train.checkpointing}, {train.grad_accumulation} forward"
               f"{'s' if train.grad_accumulation > 1 else ''} per optimizer step ({total} row{'s' if total > 1 else ''}"
               ", as asked)"]
    reasons += [f"tried first: {_train_short(w, rows)}, {format_bytes(n)} per rank: does not fit"
                for w, rows, n in tried]
    if train.checkpointing == "on":
        reasons.append("gradient checkpointing: each block keeps only its input and is recomputed in the backward "
                       "(gathered again: about a third more compute per step)")
    elif asked.train.checkpointing == "auto":
        reasons.append("no gradient checkpointing: every block's activations fit until the backward, so nothing "
                       "is recomputed")
    params = adapter_params(size, train.lora_rank)
    reasons.append(f"LoRA rank {train.lora_rank}: {params:,} trained parameters, whole on every rank with their "
                   f"gradients and the {train.optimizer} state ({format_bytes(adapter_state_bytes(size, train))} per "
                   "rank); only their gradients travel, summed once per optimizer step")
    return reasons


def _dit_on_host(experts: list[Component], mode: str | None, gpus: list[Device], host: Device | None,
                 by_budget: list[Device], wbytes: list[int], wl: Workload, policy: Policy, ledger: _Ledger,
                 attempts: list[str], placements) -> list[Placement] | None:
    """The last resorts, every expert's weights in host RAM: streamed to a GPU block by block, or computed on the
    CPU when there is no GPU."""
    size = experts[0].size
    working1 = max(dit_working_bytes(c.size, wl, batch=1) for c in experts)
    noun = "DiT" if mode is None else "both DiT experts"
    if host is not None and policy.allow_offload and by_budget:
        compute = by_budget[0]
        working1 = _host_run(working1, compute.id, policy)
        stream = policy.gathered_blocks * _largest_block(size, wbytes[0])
        need = _need("dit", "offload", policy, {host.id: sum(wbytes)}, {compute.id: working1 + stream})
        if ledger.fits(need):
            ledger.commit(need, "DiT (offload)")
            return placements("offload", [compute.id, host.id], [{host.id: w} for w in wbytes],
                              [{compute.id: working1 + stream} for _ in experts],
                              [f"weights stay in host RAM and are streamed block by block to {compute.id}: works, "
                               f"but every step moves {format_bytes(wbytes[0])} over the bus"])
        attempts.append(f"offload needs {format_bytes(working1 + stream)} on {compute.id} and "
                        f"{format_bytes(sum(wbytes))} of host RAM; {_host_room(host, ledger)}")

    if not gpus and host is not None:
        working1 = max(dit_working_bytes(c.size, wl, batch=1, comfyui=False) for c in experts)   # no reservation
        need = _need("dit", "cpu", policy, {host.id: sum(wbytes)}, {host.id: working1})
        if ledger.fits(need):
            ledger.commit(need, "DiT")
            return placements("cpu", [host.id], [{host.id: w} for w in wbytes], [{host.id: working1} for _ in experts],
                              ["no GPU: the DiT runs on the CPU (correct, very slow)"])
        attempts.append(f"{noun} on the CPU needs {format_bytes(sum(wbytes) + working1)} of host RAM; "
                        f"{_host_room(host, ledger)}")
    return None


def _host_room(host: Device, ledger: _Ledger) -> str:
    """What host RAM this plan can still use, said as what it is: the memory free now (the OS's available figure,
    less what this plan already put there), and what other processes hold of the total, which is where a
    "0 B" on a machine with plenty of RAM comes from."""
    others = host.total_bytes - host.available_bytes
    held = f", {format_bytes(others)} of it held by other processes" if others > 0 else ""
    return f"host RAM free now for this plan: {format_bytes(ledger.free(host.id))} of {format_bytes(host.total_bytes)}{held}"


# While ComfyUI loads a text encoder into host RAM it holds the file's tensors and the built encoder at once; measured
# with ComfyUI 0.3.64 on the CPU, UMT5-XXL fp8 (a 5.7 GB file): a 12.3 GB high-water mark, where weights + working
# alone planned 7.5 GiB. Weights twice + working covers it.
TEXT_ENCODER_HOST_LOAD = ("loading it into host RAM holds the file's tensors and the built encoder at once: its "
                          "weights are counted twice while it loads and encodes")


def _single(comp: Component, d: Device, working: int, tiled: bool, policy: Policy, ledger: _Ledger,
            reasons: list[str], force: bool = False) -> Placement | None:
    """``comp`` on ``d`` alone with ``working`` bytes beside its weights: committed and returned if it fits (or
    ``force``: in any case)."""
    size = comp.size
    wbytes = weight_bytes(size, comp.weight_dtype)
    strategy = "cpu" if d.kind == "cpu" else "single"
    working = _host_run(working, d.id, policy)
    if comp.role == "text_encoder" and strategy == "cpu":   # the file's tensors and the built encoder, at once
        working += wbytes
        reasons = [*reasons, TEXT_ENCODER_HOST_LOAD]
    need = _need(comp.role, strategy, policy, {d.id: wbytes}, {d.id: working})
    fits = ledger.fits(need)
    if not (fits or force):
        return None
    ledger.commit(need, _LABELS[comp.role] + (" (tiled)" if tiled else ""))
    return Placement(role=comp.role, file=size.path, family=size.family, strategy=strategy, devices=[d.id],
                     weight_dtype=_dtype_name(size, comp.weight_dtype), weight_bytes=wbytes,
                     resident_bytes={d.id: wbytes}, working_bytes={d.id: working}, tiled=tiled,
                     reasons=[f"{format_bytes(wbytes)} weights + {format_bytes(working)} working "
                              f"{'fit' if fits else 'do not fit'} on {d.id}", *reasons])


_LABELS = {"dit": "DiT", "text_encoder": "text encoder", "vae": "VAE"}


def _last_resort(comp: Component, gpus: list[Device], host: Device | None, wl: Workload, policy: Policy,
                 ledger: _Ledger, attempts: list[str]) -> Placement | None:
    """What fits nowhere by these estimates, in a loader's own plan (``Policy.implicit``), which refuses nothing: on
    the GPU with the most room, else the host, as the loaders did before plans; ComfyUI loads what fits there and
    offloads the rest. Not a GGUF DiT, which only shards: a plan that cannot shard it refuses it."""
    d = min(gpus, key=lambda d: (-ledger.free(d.id), d.index), default=host)
    if d is None or (comp.role == "dit" and comp.size.gguf):
        return None
    if comp.role == "dit":
        working = dit_working_bytes(comp.size, wl, batch=1, comfyui=d.kind == "cuda")
    elif comp.role == "text_encoder":
        working = text_encoder_working_bytes(comp.size, tokens=policy.text_encoder_tokens, batch=2 if wl.cfg else 1)
    else:
        working = vae_decode_bytes(comp.size, wl, tiled=True)
    why = (f"warning: nothing fits by these estimates ({'; '.join(attempts)}): on {d.id}, where it has the most room, "
           "since a loader's own plan refuses nothing; ComfyUI loads what fits there and offloads the rest")
    return _single(comp, d, working, comp.role == "vae", policy, ledger, [why], force=True)


def _place_simple(comp: Component, candidates: list[Device], wl: Workload, policy: Policy, ledger: _Ledger,
                  attempts: list[str]) -> Placement | None:
    """A text encoder on one device: the first candidate with room, GPUs before the host."""
    wbytes = weight_bytes(comp.size, comp.weight_dtype)
    working = text_encoder_working_bytes(comp.size, tokens=policy.text_encoder_tokens, batch=2 if wl.cfg else 1)
    gpu_here = any(d.kind == "cuda" for d in candidates)
    for d in sorted(candidates, key=lambda d: d.kind == "cpu"):
        reasons = ([f"{'no GPU has room left' if gpu_here else 'no GPU on this machine'}: runs on the CPU (once "
                    "per prompt)"] if d.kind == "cpu"
                   else ["freed before sampling, so its memory is reused by the DiT"]
                   if policy.free_text_encoder_before_sampling else [])
        if placed := _single(comp, d, working, False, policy, ledger, reasons):
            return placed
    attempts.append(f"text encoder needs {format_bytes(wbytes + working)} on one device; largest budget left is "
                    f"{format_bytes(max((ledger.free(d.id) for d in candidates), default=0))}")
    return None


def _decode_room(dev: str, ledger: _Ledger) -> int:
    """Bytes ``dev`` has while the VAE decodes: its budget less what the decode phase already holds there."""
    return ledger.budget[dev] - ledger.used[dev]["decode"]


def _held_at_decode(dev: str, placements: list[Placement], policy: Policy) -> list[str]:
    """What takes ``dev``'s memory while the VAE decodes, as the ledger counts it: the weights resident then (of two
    experts one at a time, the larger)."""
    dits = [p for p in placements if p.role in EXPERT_ROLES]
    weights = [p.resident_bytes.get(dev, 0) for p in dits if "decode" in phases_resident(p.role, p.strategy, policy)]
    held = max(weights, default=0) if dits and dits[0].experts == ONE_AT_A_TIME else sum(weights)
    parts = [f"DiT {'shard' if dits[0].strategy == 'fsdp' else 'weights'} {format_bytes(held)}"] if held else []
    parts += [f"FSDP rank process {format_bytes(p.process_bytes[dev])}" for p in dits if p.process_bytes.get(dev)]
    parts += [f"text encoder {format_bytes(p.resident_bytes[dev])}" for p in placements
              if p.role == "text_encoder" and dev in p.resident_bytes
              and "decode" in phases_resident(p.role, p.strategy, policy)]
    return parts


def _rooms(devices: list[Device], ledger: _Ledger, placements: list[Placement], policy: Policy) -> str:
    """ "cuda:0 6 GiB (beside DiT shard 6.9 GiB + ...)": each device's room at decode and what holds the rest."""
    out = []
    for d in devices:
        held = _held_at_decode(d.id, placements, policy)
        out.append(f"{d.id} {format_bytes(max(0, _decode_room(d.id, ledger)))}"
                   + (f" (beside {' + '.join(held)})" if held else ""))
    return ", ".join(out)


def _split_vae(comp: Component, by_room: list[Device], wl: Workload, policy: Policy, ledger: _Ledger,
               tried: list[str]) -> Placement | None:
    """The VAE's decode tiles split over every GPU with room for a VAE copy and one tile at decode time (MGPU VAE
    Decode), at least two: the one with the most room first (the VAE loads there), the others in order. The need
    per GPU does not grow with the video, so a long video that no one GPU decodes whole still fits."""
    size = comp.size
    wbytes = weight_bytes(size, comp.weight_dtype)
    each = vae_parallel_decode_bytes(size, wl, weight_dtype=comp.weight_dtype)
    what = (f"{format_bytes(each)} on each GPU ({format_bytes(wbytes)} VAE copy + "
            f"{format_bytes(each - wbytes - CUDA_OVERHEAD_BYTES)} one tile of 512 px x 64 frames + "
            f"{format_bytes(CUDA_OVERHEAD_BYTES)} CUDA context and libraries)")
    working = {d.id: _host_run(each - wbytes, d.id, policy) for d in by_room}
    fit = [d for d in by_room if _decode_room(d.id, ledger) >= wbytes + working[d.id]]
    if len(fit) < 2:
        tried.append(f"split over GPUs by MGPU VAE Decode needs {what} on at least 2 GPUs; "
                     + (f"only {fit[0].id} has that room" if fit else "no GPU has that room"))
        return None
    group = [fit[0], *sorted(fit[1:], key=lambda d: d.index)]
    need = _need("vae", "split", policy, {d.id: wbytes for d in group}, {d.id: working[d.id] for d in group})
    if not ledger.fits(need):
        return None
    ledger.commit(need, "VAE (split decode)")
    reasons = [*tried,
               f"decoded in tiles split over {len(group)} GPUs by MGPU VAE Decode (devices auto, this plan "
               f"connected): {what}, whatever the video's length",
               f"{group[0].id} loads the VAE (MGPU Load VAE on auto) and decodes with it, "
               f"{', '.join(d.id for d in group[1:])} with a copy; VAE Decode would need the whole decode on one "
               "GPU"]
    if left := [d for d in by_room if d not in fit]:
        reasons.append("left out: " + ", ".join(f"{d.id} ({format_bytes(max(0, _decode_room(d.id, ledger)))} free "
                                                 "at decode)" for d in left))
    return Placement(role="vae", file=size.path, family=size.family, strategy="split", devices=[d.id for d in group],
                     weight_dtype=_dtype_name(size, comp.weight_dtype), weight_bytes=wbytes,
                     resident_bytes={d.id: wbytes for d in group}, working_bytes={d.id: working[d.id] for d in group},
                     tiled=True, reasons=reasons)


def _place_vae(comp: Component, gpus: list[Device], host: Device | None, wl: Workload, policy: Policy,
               ledger: _Ledger, placements: list[Placement], attempts: list[str]) -> Placement | None:
    """The VAE against each device's room at decode time (beside what the plan keeps there then): untiled on one GPU
    (a short video), else split over the GPUs (``_split_vae``), else tiled on one GPU, else the host."""
    size = comp.size
    wbytes = weight_bytes(size, comp.weight_dtype)
    untiled, tiled = vae_decode_bytes(size, wl, tiled=False), vae_decode_bytes(size, wl, tiled=True)
    by_room = sorted(gpus, key=lambda d: (-_decode_room(d.id, ledger), d.index))
    for d in by_room:
        if placed := _single(comp, d, untiled, False, policy, ledger, []):
            return placed
    tried: list[str] = []
    if by_room:
        tried.append(f"untiled on one GPU needs {format_bytes(wbytes + untiled)} ({format_bytes(wbytes)} weights + "
                     f"{format_bytes(untiled)} working, the whole video at once); free at decode: "
                     f"{_rooms(by_room, ledger, placements, policy)}")
        if placed := _split_vae(comp, by_room, wl, policy, ledger, tried):
            return placed
        for d in by_room:
            if placed := _single(comp, d, tiled, True, policy, ledger, [*tried, "decode in tiles on it"]):
                return placed
        tried.append(f"tiled on one GPU needs {format_bytes(wbytes + tiled)}")
    if host is not None:
        why = [*tried, "no GPU has room left: decodes on the CPU (slow)"] if by_room else ["no GPU: decodes on the CPU"]
        for working, is_tiled in ((untiled, False), (tiled, True)):
            if placed := _single(comp, host, working, is_tiled, policy, ledger,
                                 why + (["decode in tiles"] if is_tiled else [])):
                return placed
        tried.append(f"on the CPU needs {format_bytes(wbytes + tiled)} of host RAM (tiled); budget left is "
                     f"{format_bytes(_decode_room(host.id, ledger))}")
    attempts.extend(f"VAE {t}" for t in tried)
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
    after = int(size.bytes_after_blocks * scale)   # LTX-2's text projection: after the last block, as loaded
    units = [wbytes - sum(blocks) - after, *blocks, *([after] if after else [])]   # embeddings, norms: with the first
    working = text_encoder_working_bytes(size, tokens=policy.text_encoder_tokens, batch=2 if wl.cfg else 1)
    for k in range(2, len(by_room) + 1):
        group = sorted(by_room[:k], key=lambda d: d.index)
        work = {d.id: _host_run(working, d.id, policy) for d in group}
        index = split_in_order(units, [max(0, _encoder_room(d.id, work[d.id], policy, ledger)) for d in group])
        if index is None:
            continue
        resident = {d.id: sum(u for u, i in zip(units, index) if i == j) for j, d in enumerate(group)}
        need = _need("text_encoder", "split", policy, resident, work)
        if not ledger.fits(need):
            continue
        ledger.commit(need, "text encoder (split)")
        layers = {d.id: [min(ks), max(ks)] for j, d in enumerate(group)
                  if (ks := [b for b, i in enumerate(index[1:len(blocks) + 1]) if i == j])}
        parts = ", ".join(f"{dev} {format_bytes(resident[dev])} (blocks {a}-{b})" for dev, (a, b) in layers.items())
        reasons = [f"{format_bytes(wbytes)} of weights fit on no one GPU beside what the plan put there: layers split "
                   f"in order over {k} GPUs: {parts}",
                   f"each GPU computes its own layers ({format_bytes(working)} working memory on each); the "
                   f"activations return to {group[0].id} between layers"]
        if policy.free_text_encoder_before_sampling:
            reasons.append("freed before sampling on every GPU, so its memory is reused by the DiT")
        return Placement(role="text_encoder", file=size.path, family=size.family, strategy="split",
                         devices=[d.id for d in group], weight_dtype=_dtype_name(size, comp.weight_dtype),
                         weight_bytes=wbytes, resident_bytes=resident, working_bytes=work,
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


def _ways_out(components: list[Component], gpus: list[Device], policy: Policy, wl: Workload,
              role: str = "dit", fit_frames: int | None = None) -> list[str]:
    dit = next((c for c in components if c.role == "dit"), None)
    low_bit = dit is not None and (dit.size.gguf or weight_itemsize(dit.size, dit.weight_dtype) == 1)
    if wl.train is not None and role == "dit":
        train = wl.train
        frames = (f"train on fewer frames (the DiT's step fits these devices as they are up to {fit_frames} at "
                  f"{wl.width}x{wl.height}) or a smaller size" if fit_frames else
                  f"train at a smaller size than {wl.width}x{wl.height} (not even one frame of it fits these "
                  "devices as they are)" if fit_frames == 0 else
                  f"train on fewer frames or a smaller size than {wl.frames} x {wl.width}x{wl.height}")
        return [*(["turn gradient checkpointing on"] if train.checkpointing == "off" else []),
                frames,
                *([f"a smaller LoRA rank than {train.lora_rank}"] if train.lora_rank > 4 else []),
                *([] if low_bit else ["an fp8 base (weight dtype fp8_e4m3fn) or a GGUF file (Q8_0, Q4_K: sharded "
                                      "as stored)"]),
                "use more GPUs" if gpus else "use a machine with a GPU"]
    ways = []
    if dit is not None and (dit.weight_dtype or "").lower() not in ("fp8_e4m3fn", "fp8_e5m2"):
        ways.append("load the DiT in fp8 (weight dtype fp8_e4m3fn) to halve its weights")
    ways.append("use more GPUs" if gpus else "use a machine with a GPU")
    if role == "vae":   # the VAE's last resort is the host, not DiT offload
        ways.append("give the host more free RAM (the VAE then decodes on the CPU, slowly)")
    elif not policy.allow_offload:
        ways.append("allow CPU offload (slow: weights stream from host RAM every step)")
    ways.append(f"generate fewer frames or a smaller size than {wl.frames} x {wl.width}x{wl.height}")
    return ways


def _place_dataset(dit: Component | None, host: Device | None, workload: Workload, ledger: _Ledger) -> int:
    """A training step's dataset (latents and conditioning) in host RAM, committed before any model: its bytes, 0
    when there is none to hold; PlanError with the ways out when the host cannot hold it."""
    if dit is None or host is None or workload.train is None:
        return 0
    data = dataset_bytes(dit.size, workload)
    if not ledger.fits({host.id: {"sample": data}}):
        raise PlanError(f"the training dataset's {workload.train.dataset} latent(s) of {workload.frames} x "
                        f"{workload.width}x{workload.height} and their conditioning need {format_bytes(data)} of "
                        f"host RAM; {_host_room(host, ledger)}. Ways out: fewer latents in the dataset, a smaller "
                        "size, or more free host RAM",
                        needs=[{"device": host.id, "budget_bytes": ledger.budget[host.id], "committed_bytes": 0}])
    ledger.commit({host.id: {"sample": data}}, "training dataset")
    return data


def _frames_that_fit(dits: list[Component], devices: list[Device], workload: Workload, policy: Policy) -> int | None:
    """The most frames below the workload's (1 + a whole number of the VAE's frame steps) whose training step fits
    the DiT on these devices, by bisection (the step's memory grows with the frames); 0 if not even one frame fits,
    None if the workload is one frame already."""
    step = dits[0].size.dims.get("vae_t", 1)

    def fits(k: int) -> bool:
        try:
            make_plan(dits, devices, replace(workload, frames=1 + step * k), policy, suggest=False)
            return True
        except PlanError:
            return False

    high = (workload.frames - 2) // step   # the largest k with 1 + step * k below the workload's frames
    if high < 0:
        return None
    if not fits(0):
        return 0
    low = 0   # fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return 1 + step * low


def _plan_error(role: str, components: list[Component], devices: list[Device], workload: Workload, policy: Policy,
                gpus: list[Device], ledger: _Ledger, attempts: list[str], fit_frames: int | None = None) -> PlanError:
    """What could not be placed, every attempt with its numbers, each device's budget, and the ways out."""
    needs = [{"device": d.id, "budget_bytes": ledger.budget[d.id], "committed_bytes": max(ledger.used[d.id].values())}
             for d in devices]
    roles = EXPERT_ROLES if role == "dit" else (role,)
    what = " and ".join(f"{c.size.path}, {format_bytes(c.size.total_bytes)}" for c in components if c.role in roles)
    label = "DiT experts" if sum(c.role in EXPERT_ROLES for c in components) > 1 and role == "dit" else role
    lines = [f"cannot place the {label.replace('_', ' ')} ({what}) "
             f"for {workload.frames} frames at {workload.width}x{workload.height}, batch {workload.batch}, "
             f"CFG {'on' if workload.cfg else 'off'}:"]
    lines += [f"  - {a}" for a in attempts]
    lines += [f"  - {n['device']}: budget {format_bytes(n['budget_bytes'])}, already committed "
              f"{format_bytes(n['committed_bytes'])}" for n in needs]
    lines.append("ways out: " + "; ".join(_ways_out(components, gpus, policy, workload, role, fit_frames)))
    return PlanError("\n".join(lines), needs=needs)


def _machine_reasons(gpus: list[Device], policy: Policy) -> list[str]:
    """What the budgets hold besides the plan's components: the ComfyUI process's own memory on each GPU (when the
    loaders said where it keeps a context), and what is in use by us now but counted as available."""
    reasons = []
    if policy.host_context_gpus:
        held = [f"{d.id}: {f'its CUDA context ({format_bytes(c)})' if (c := host_context_bytes(d, policy)) else 'nothing'}"
                for d in gpus]
        reasons.append("the ComfyUI process itself holds, in every phase, on " + "; ".join(held)
                       + " (an unmeasured guess, taken out of those budgets)")
    if ours := [d for d in gpus if d.reclaimable_bytes]:
        reasons.append("counted as available: " + ", ".join(f"{d.id} {format_bytes(d.reclaimable_bytes)}" for d in ours)
                       + " in use now by this pack's rank processes and by ComfyUI (its cached models, and its "
                       "context where counted above), which the models this plan loads replace")
    return reasons


def make_plan(components: list[Component], devices: list[Device], workload: Workload,
              policy: Policy | None = None, *, suggest: bool = True) -> Plan:
    """Place the components: DiT first (it decides sharding), then the text encoder, then the VAE. A
    ``dit_low_noise`` component makes the DiT two experts (Wan 2.2 A14B) on the same devices: both resident when
    memory allows, else one at a time with the cost of each switch in the reasons.

    Deterministic for the same input. Raises PlanError naming each device's need and budget, and the ways out
    (``suggest``: for a training step, also the most frames that fit).
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
    if "text_encoder" in by_role and "dit" in by_role:   # LTX-2's encoder also loads parts of the DiT's checkpoint
        te = by_role["text_encoder"]
        by_role["text_encoder"] = replace(te, size=text_encoder_for(te.size, by_role["dit"].size))
    placements: list[Placement] = []
    attempts: list[str] = []
    gguf_notes = {}
    for role in EXPERT_ROLES:   # a GGUF file keeps its blocks: no weight dtype recasts it (the loader agrees)
        comp = by_role.get(role)
        if comp is not None and comp.size.gguf and comp.weight_dtype:
            gguf_notes[role] = (f"weight dtype {comp.weight_dtype} does not apply to a GGUF file: its weights stay "
                                "as their quantized blocks (sized as stored); MGPU Load Diffusion Model following "
                                "this plan loads it with its default dtype")
            by_role[role] = replace(comp, weight_dtype=None)

    if "dit_low_noise" in by_role and "dit" not in by_role:
        raise ValueError("dit_low_noise is the second expert of a two-expert DiT: give the first (high-noise) "
                         "expert as dit")

    dataset = _place_dataset(by_role.get("dit"), host, workload, ledger)   # a training step's, first: it must fit
    for role in ("dit", "text_encoder", "vae"):
        comp = by_role.get(role)
        if comp is None:
            continue
        if role == "dit":
            placed = _place_dit([by_role[r] for r in EXPERT_ROLES if r in by_role], gpus, host, workload, policy,
                                ledger, attempts)
            if placed is not None:
                from mgpu.weights.quant import fp8_plan_line   # imports torch, which planning otherwise needs not

                if line := fp8_plan_line(placed[0].weight_dtype, [(d.id, d.capability) for d in devices
                                                                  if d.id in placed[0].devices]):
                    placed[0].reasons.append(line)
            if placed is not None and dataset:
                for p in placed:
                    p.training["dataset_bytes"] = {host.id: dataset}
                placed[0].reasons.append(f"the dataset's {workload.train.dataset} latent(s) and their conditioning "
                                         f"stay in host RAM: {format_bytes(dataset)}")
        elif role == "text_encoder":
            placed = _place_text_encoder(comp, gpus, host, workload, policy, ledger, attempts)
        else:
            placed = _place_vae(comp, gpus, host, workload, policy, ledger, placements, attempts)
        if placed is None and policy.implicit:
            placed = _last_resort(comp, gpus, host, workload, policy, ledger, attempts)
            placed = [placed] if role == "dit" and placed is not None else placed
        if placed is None:
            frames = (_frames_that_fit([c for c in components if c.role in EXPERT_ROLES], devices, workload, policy)
                      if role == "dit" and workload.train is not None and suggest else None)
            raise _plan_error(role, components, devices, workload, policy, gpus, ledger, attempts, frames)
        for p in placed if isinstance(placed, list) else [placed]:
            if p.role in gguf_notes:
                p.reasons.append(gguf_notes[p.role])
        placements.extend(placed if isinstance(placed, list) else [placed])

    usage = [DeviceUse(device=d.id, budget_bytes=ledger.budget[d.id], peak_bytes=max(ledger.used[d.id].values()),
                       by_phase=dict(ledger.used[d.id]), holds=list(ledger.holds[d.id])) for d in devices]
    reasons = _machine_reasons(gpus, policy)
    if len(gpus) and all(not u.holds for u in usage if u.device != (host.id if host else None)):
        reasons.append("no component uses a GPU")
    return Plan(placements=placements, usage=usage, devices=[d.to_dict() for d in devices],
                workload=asdict(workload), reasons=reasons,
                policy={**asdict(policy), "host_context_gpus": list(policy.host_context_gpus),
                        "fsdp_devices": list(policy.fsdp_devices)})   # as JSON reads it
