"""Parallelism beyond FSDP for the diffusion networks that support it, one adapter module per family.

The registry is keyed by the network's class name (ComfyUI's ``WanModel``, ``LTXVModel``, ``LTXAVModel``; diffusers'
``WanTransformer3DModel``); adapters hook the model's own modules on the rank, never import ComfyUI, never copy
its code. ``parallelize`` views the ranks as a 2-D grid
("cfg" x "sp"): the cfg groups split the batch (CFG cond/uncond rows), the ranks of one group split each sample's
tokens (Ulysses sequence parallelism) and exchange them over a process group of their own (``sequence_groups``).
The split is chosen per forward from its batch rows (``Layouts``), among the degrees the model's heads allow. FSDP
still shards the parameters over all the ranks. A family without an adapter keeps FSDP + batch split, and says so.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mgpu.families.sequence import SpDegree, choose_sp_degree
from mgpu.planning.parallel import best_split

log = logging.getLogger(__name__)

# Network class -> adapter module (imported on first use). A subclass differs in its forward and needs its own entry:
# Wan's S2V, HuMo, Animate (tokens grouped by frame), Animate 2 and the causal model have none.
ADAPTERS = {"WanModel": "mgpu.families.wan", "WanTransformer3DModel": "mgpu.families.wan_diffusers",
            "VaceWanModel": "mgpu.families.wan", "CameraWanModel": "mgpu.families.wan",
            "SCAILWanModel": "mgpu.families.wan", "SCAIL2WanModel": "mgpu.families.wan",
            "LTXVModel": "mgpu.families.ltxv", "LTXAVModel": "mgpu.families.ltxav"}   # LTXAV: LTX-2, audio + video


@dataclass(frozen=True)
class Family:
    """What an adapter module exports as ``FAMILY``."""

    heads: Callable[[nn.Module], int]   # attention heads: a degree must divide them
    # installs the SP hooks for each degree's sequence group (torchtitan style); returns the switch: select(degree)
    parallelize: Callable[[nn.Module, dict[int, dist.ProcessGroup]], Callable[[int], None]]


@dataclass(frozen=True)
class Layout:
    """How the ranks split one forward: ``cfg`` groups of ``sp`` ranks; rank r is group r // sp, position r % sp."""

    cfg: int
    sp: int
    note: str | None = None    # why sp differs from what was asked (None when it does not)

    def coords(self, rank: int) -> tuple[int, int]:
        """(cfg group, position in the group) of ``rank``."""
        return divmod(rank, self.sp)


def family_of(model: nn.Module) -> Family | None:
    """The adapter for ``model``'s exact class (before FSDP renames it), or None."""
    path = ADAPTERS.get(type(model).__name__)
    return None if path is None else importlib.import_module(path).FAMILY


def plan_sp_degree(model: nn.Module, wanted: int, ranks: int) -> SpDegree:
    """The degree ``parallelize`` will use for ``model`` on ``ranks`` ranks when ``wanted`` is asked for."""
    if wanted <= 1:
        return SpDegree(1)
    name = type(model).__name__
    family = family_of(model)
    if family is None:
        return SpDegree(1, f"{name} has no sequence-parallel adapter (mgpu.families: {', '.join(ADAPTERS)}): "
                           f"FSDP + batch split over the {ranks} ranks instead of degree {wanted}")
    return choose_sp_degree(family.heads(model), wanted, ranks, name)


_groups: dict[int, dist.ProcessGroup] = {}


def sequence_groups(degrees: list[int], timeout: timedelta | None = None) -> dict[int, dist.ProcessGroup]:
    """This rank's sequence-parallel group of each degree > 1 in ``degrees``: ranks ``[g * d, (g + 1) * d)`` for
    cfg group g. Collective: every rank calls it with the same degrees (``new_group`` is collective over WORLD, so
    every group of a degree is made, in rank order, on every rank).

    Groups of their own, never the default group that FSDP's 1-D mesh all-gathers on: ``DeviceMesh`` hands out the
    default group for a dimension that spans every rank (a 1 x N split, torch 2.11 and 2.13), and on NCCL one group
    is one stream, so the self-attention all-to-alls would queue behind the next block's prefetched all-gather. Made
    once per degree (each is an NCCL communicator on every member rank, which costs GPU memory) and kept: a rank
    process outlives its models. Nothing communicates over the cfg groups (each computes its own rows), so none
    is made for them. ``timeout``: the ranks' collective timeout (the pool's, shorter than the host's on NCCL so the
    flight recorder dumps first); without it NCCL's groups would wait torch's default 10 minutes."""
    ranks = dist.get_world_size()
    for degree in sorted(d for d in degrees if d > 1 and d not in _groups):
        for first in range(0, ranks, degree):
            group = dist.new_group(list(range(first, first + degree)), timeout=timeout)
            if first <= dist.get_rank() < first + degree:
                _groups[degree] = group
    return {d: _groups[d] for d in degrees if d > 1}


class Layouts:
    """The splits a loaded model can run; each forward takes the best for its batch rows (``best_split``): CFG's
    2 rows go to 2 cfg groups, a cfg-1 forward splits its tokens over every rank, with the same loaded shards."""

    def __init__(self, ranks: int, degrees: list[int], note: str | None = None,
                 select: Callable[[int], None] | None = None):
        self.ranks, self.degrees, self.note, self._select = ranks, degrees, note, select

    def for_rows(self, rows: int) -> Layout:
        cfg, sp = best_split(self.ranks, rows, self.degrees)
        return Layout(cfg, sp, self.note)

    def use(self, layout: Layout) -> None:
        """Point the model's hooks at ``layout``'s sequence groups before a forward (sp 1: hooks idle)."""
        if self._select is not None:
            self._select(layout.sp)

    def describe(self) -> dict:
        widest = max(self.degrees)
        return {"cfg": self.ranks // widest, "sp": widest, "degrees": list(self.degrees), "note": self.note}


def parallelize(model: nn.Module, mesh: DeviceMesh, sp_degree: int, timeout: timedelta | None = None) -> Layouts:
    """Install ``model``'s sequence parallelism over ``mesh``'s ranks for every degree up to ``sp_degree`` that its
    heads and the ranks allow (collective: every rank calls it, before FSDP shards the model)."""
    ranks = mesh.size()
    chosen = plan_sp_degree(model, sp_degree, ranks)
    if chosen.note:
        log.warning("%s", chosen.note)
    if chosen.degree == 1:
        return Layouts(ranks, [1], chosen.note)
    family = family_of(model)
    heads = family.heads(model)
    degrees = [d for d in range(1, chosen.degree + 1) if ranks % d == 0 and heads % d == 0]
    return Layouts(ranks, degrees, chosen.note, family.parallelize(model, sequence_groups(degrees, timeout)))
