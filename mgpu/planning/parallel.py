"""How an FSDP group of N ranks shares one sampling step: CFG/batch degree x sequence-parallel (Ulysses) degree.

FSDP makes a model fit; only the work split makes a step faster. The ranks form a ``cfg x sp`` mesh with
``cfg * sp == N``: ``cfg`` splits the batch rows (cond / uncond, videos of a batch), ``sp`` splits each video's
tokens (Ulysses: two all-to-alls around every self-attention, heads divided over the ``sp`` ranks). The choice:

``best_split`` picks, for each forward, the split with the least work on the busiest rank, the most cfg groups on
a tie (splitting rows costs no communication); ``sp`` must divide the family's heads, and a family without a
sequence-parallel adapter has only ``sp`` = 1. The ranks take the same decision per forward (``mgpu.families``),
so the plan shows what will run. Ranks without rows still join the all-gathers, idle, which the plan says.

The time model below only decides whether to warn: per step, compute (2 x params x tokens x rows for the matmuls
plus 4 x tokens^2 x hidden x rows x layers for attention) at ``gpu_flops``, plus the bytes each rank moves (the
FSDP all-gather when the gathered weights are not kept, the SP all-to-alls) at the slowest link of the group. No
overlap is assumed, so the estimate errs towards warning. A LoRA training step counts its backward and, with
gradient checkpointing, its recompute (``TRAINING_PASSES``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from mgpu.planning.devices import Device

# Families with a sequence-parallel adapter (mgpu/families): the family names mgpu.planning.sizing gives, by prefix,
# except the Wan variants whose network has none (mgpu.families.wan: S2V, HuMo, Animate group tokens by frame).
SP_FAMILIES = ("wan", "ltxv", "ltx2")
NO_SP_VARIANTS = ("-s2v", "-humo", "-animate")
# Effective bytes/s a rank moves per direction in a collective over the group's slowest link (NVLink4 ~450 GB/s
# peak, PCIe4 x16 ~32 GB/s peak with P2P, about half of that through host memory without it).
LINK_BYTES_PER_S = {"nvlink": 300e9, "p2p": 20e9, "pcie": 10e9}
# Sustained dense bf16 FLOP/s in a DiT forward (~half of the tensor-core peak), by CUDA compute capability.
GPU_FLOPS = {(7, 0): 50e12, (7, 5): 30e12, (8, 0): 150e12, (8, 6): 40e12, (8, 9): 90e12, (9, 0): 400e12,
             (10, 0): 900e12, (12, 0): 110e12}
DEFAULT_GPU_FLOPS = 100e12
ALL_TO_ALLS_PER_LAYER = 4   # q, k, v to (all tokens, local heads), the attention output back


@dataclass
class Degrees:
    """The split of one step over the group, and why (``warnings``: numbers saying N ranks may be slower)."""

    ranks: int
    cfg: int = 1
    sp: int = 1
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    step_seconds: float | None = None     # estimated, this split
    single_seconds: float | None = None   # estimated, the same step on one of these GPUs

    def busy_ranks(self, rows: int) -> int:
        return min(self.cfg, rows) * self.sp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def has_sp_adapter(family: str) -> bool:
    return family.startswith(SP_FAMILIES) and not any(variant in family for variant in NO_SP_VARIANTS)


def best_split(ranks: int, rows: int, degrees: list[int]) -> tuple[int, int]:
    """(cfg groups, sequence degree) for a forward over ``rows`` batch rows on ``ranks`` ranks, ``cfg x sp ==
    ranks``, ``sp`` one of ``degrees`` (those the model's heads allow; 1 always is).

    The split with the least work on the busiest rank (``ceil(rows / cfg) / sp`` rows' worth of tokens); on a tie
    the most cfg groups, since splitting rows costs no communication. CFG (2 rows) on 2 ranks: 2 x 1; on 4 ranks:
    2 x 2; cfg 1 (1 row) on 4 ranks: 1 x 4."""
    options = [(ranks // sp, sp) for sp in degrees if ranks % sp == 0]
    return min(options, key=lambda o: (-(-rows // o[0]) / o[1], -o[0]))


def choose(ranks: int, rows: int, heads: int | None, family: str, sequence_parallel: bool = True) -> Degrees:
    """The cfg x sp degrees for ``rows`` batch rows per step (2 per video with CFG) on ``ranks`` ranks: the split
    the ranks will take for such a forward (``best_split``, as ``mgpu.families.Layouts`` does), and why."""
    sp_ok = sequence_parallel and bool(heads) and has_sp_adapter(family)
    degrees = [d for d in _divisors(ranks) if sp_ok and heads % d == 0] or [1]
    cfg, sp = best_split(ranks, rows, degrees)
    chosen = Degrees(ranks=ranks, cfg=cfg, sp=sp)
    if cfg > 1:
        chosen.reasons.append(f"CFG/batch split: {cfg} groups of ranks, each computing {math.ceil(rows / cfg)} of the "
                              f"{rows} batch row{'s' if rows != 1 else ''} per step (no communication)")
    if sp > 1:
        chosen.reasons.append(f"Ulysses sequence parallel over {sp} ranks: each computes 1/{sp} of the tokens, "
                              f"{heads // sp} of the {heads} heads in attention (two all-to-alls per self-attention)")
    idle = ranks - min(cfg, rows) * sp
    if idle:
        why = ("sequence parallelism is off" if not sequence_parallel
               else f"{family} has no sequence-parallel adapter yet" if not (heads and has_sp_adapter(family))
               else f"sequence degrees must divide the {heads} attention heads "
                    f"({', '.join(str(d) for d in _divisors(heads) if 1 < d <= 8)})")
        chosen.reasons.append(f"{idle} of the {ranks} ranks get no rows ({why}): they hold their share of the "
                              "weights but add no speed")
    return chosen


def group_link(group: list[Device]) -> str | None:
    """The slowest link between any two GPUs of the group (None: unknown or a single GPU)."""
    order = ["pcie", "p2p", "nvlink"]
    kinds = [a.link(b.index) for i, a in enumerate(group) for b in group[i + 1:] if b.index is not None]
    if not kinds or None in kinds:
        return None
    return min(kinds, key=order.index)


def nvls_likely(group: list[Device]) -> bool:
    """Whether NCCL sets up NVLS (NVLink SHARP) buffers for the group's communicators: Hopper or later GPUs behind an
    NVSwitch, which NVML shows as each one NVLinked to every other and to more than one peer (a bridge joins pairs
    only). NVLS is on by default there; the ranks inherit a user's ``NCCL_NVLS_ENABLE=0``."""
    if len(group) < 2 or os.environ.get("NCCL_NVLS_ENABLE", "").strip() == "0":
        return False
    switched = all(sum(kind == "nvlink" for _, kind in d.links) >= 2 for d in group)
    return switched and group_link(group) == "nvlink" and all(tuple(d.capability or (0, 0)) >= (9, 0) for d in group)


def gpu_flops(device: Device) -> float:
    return GPU_FLOPS.get(tuple(device.capability or ()), DEFAULT_GPU_FLOPS)


def step_flops(params: int, tokens: int, rows: int, hidden: int, layers: int) -> float:
    """FLOPs of one step's forward: the matmuls over every token, and self-attention's two token x token products."""
    return 2.0 * params * tokens * rows + 4.0 * tokens * tokens * hidden * rows * layers


# A training step in forward passes' worth (``estimate``'s ``training``): compute (the backward costs two forwards;
# checkpointing recomputes the forward), FSDP all-gathers (again in the backward) and sequence exchanges (their
# backward, and the recompute's).
TRAINING_PASSES = {"off": {"compute": 3, "gather": 2, "exchange": 2}, "on": {"compute": 4, "gather": 2, "exchange": 3}}


def estimate(degrees: Degrees, group: list[Device], *, params: int, weight_bytes: int, tokens: int, rows: int,
             hidden: int, layers: int, act_bytes: int = 2, resharding: bool = True,
             kv_gather_width: int = 0, training: str | None = None) -> Degrees:
    """Fill the step-time estimates of ``degrees`` on ``group`` and warn when N GPUs are likely slower than one.
    ``kv_gather_width``: a stream that attends to every token of a split one all-gathers their keys and values in
    each layer, at this width (LTX-2's audio queries on the video tokens: its audio width). ``training``: a LoRA
    training step with gradient checkpointing "on" or "off" (``TRAINING_PASSES``) instead of a sampling step."""
    link = group_link(group)
    if link is None or not group:
        return degrees
    passes = TRAINING_PASSES[training] if training else {"compute": 1, "gather": 1, "exchange": 1}
    flops = step_flops(params, tokens, rows, hidden, layers) * passes["compute"]
    speed = min(gpu_flops(d) for d in group)
    n = degrees.ranks
    compute = flops / degrees.busy_ranks(rows) / speed
    gather = weight_bytes * (n - 1) / n * passes["gather"] if resharding else 0.0
    local_rows = math.ceil(rows / degrees.cfg)
    a2a = (ALL_TO_ALLS_PER_LAYER * layers * local_rows * math.ceil(tokens / degrees.sp) * hidden * act_bytes
           * (degrees.sp - 1) / degrees.sp) * passes["exchange"]
    kv = 2 * layers * local_rows * tokens * kv_gather_width * act_bytes * (degrees.sp - 1) / degrees.sp
    kv *= passes["exchange"]
    moved = gather + a2a + kv
    degrees.step_seconds = compute + moved / LINK_BYTES_PER_S[link]
    degrees.single_seconds = flops / speed
    ratio = degrees.single_seconds / degrees.step_seconds
    detail = (f"{_gb(moved)} GB moved per rank per step over {link} (~{LINK_BYTES_PER_S[link] / 1e9:.0f} GB/s: "
              f"{moved / LINK_BYTES_PER_S[link]:.2f} s) vs {compute:.2f} s of compute per rank")
    if ratio < 1.0:
        degrees.warnings.append(f"likely slower than one GPU: estimated {degrees.step_seconds:.2f} s per step on "
                                f"{n} GPUs vs {degrees.single_seconds:.2f} s on one ({detail})")
    elif ratio < 0.7 * degrees.busy_ranks(rows):
        degrees.reasons.append(f"estimated {ratio:.1f}x one GPU on {n} GPUs ({detail})")
    else:
        degrees.reasons.append(f"estimated {ratio:.1f}x one GPU on {n} GPUs")
    return degrees


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"
