"""NCCL between GPUs that cannot reach each other peer to peer.

Consumer GPUs (two RTX 4090s, most PCIe boards without a P2P-capable switch) report no P2P access; NCCL then hangs or
fails at its first collective unless P2P is switched off, the most common complaint in raylight's tracker. NVML
(``mgpu.planning.devices``) already records how each GPU reaches each other one, so the pool decides before the ranks
start: NCCL cannot switch P2P off per pair, so the closest it offers is used:

- every pair of rank GPUs with P2P (NVLink or PCIe P2P): nothing changes;
- some pairs without P2P, and every pair that has it joined by NVLink: ``NCCL_P2P_LEVEL=NVL`` (P2P over NVLink only);
- otherwise: ``NCCL_P2P_DISABLE=1`` (every transfer goes through host memory: slower, never hung).

A setting of either variable in the environment or the pool's ``env`` is the user's and wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mgpu.planning.devices import Device

USER_VARS = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL")


@dataclass(frozen=True)
class P2pDecision:
    """What the ranks' environment gets, and the sentence that says why (None when nothing changes)."""

    env: dict[str, str] = field(default_factory=dict)
    reason: str | None = None


def rank_pairs(gpus: list[Device], rank_devices: list[str]) -> dict[str, list[tuple[str, str]]]:
    """The pairs of rank GPUs by link kind ("nvlink" | "p2p" | "pcie" = no P2P | "unknown")."""
    by_id = {d.id: d for d in gpus}
    ranks = [by_id.get(r) for r in dict.fromkeys(rank_devices)]
    pairs: dict[str, list[tuple[str, str]]] = {}
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            if a is None or b is None or b.index is None:
                continue
            pairs.setdefault(a.link(b.index) or "unknown", []).append((a.id, b.id))
    return pairs


def decide(gpus: list[Device], rank_devices: list[str], env: Mapping[str, str]) -> P2pDecision:
    """The NCCL P2P setting for ranks on ``rank_devices`` (``gpus``: the live inventory's GPU records)."""
    if any(var in env for var in USER_VARS):
        return P2pDecision()
    pairs = rank_pairs(gpus, rank_devices)
    without = pairs.get("pcie", [])
    if not without:
        return P2pDecision()
    named = ", ".join(f"{a}-{b}" for a, b in without)
    if not pairs.get("p2p"):
        kept = "; the NVLink pairs keep P2P" if pairs.get("nvlink") else ""
        return P2pDecision({"NCCL_P2P_LEVEL": "NVL"},
                           f"GPUs {named} have no peer-to-peer access (NVML): the ranks start with "
                           f"NCCL_P2P_LEVEL=NVL, so NCCL sends between them through host memory instead of hanging"
                           f"{kept}; set NCCL_P2P_LEVEL yourself to override")
    return P2pDecision({"NCCL_P2P_DISABLE": "1"},
                       f"GPUs {named} have no peer-to-peer access (NVML) while other rank GPUs use PCIe P2P: the "
                       "ranks start with NCCL_P2P_DISABLE=1 (NCCL cannot switch P2P off per pair), so every transfer "
                       "goes through host memory; set NCCL_P2P_DISABLE=0 to override, or use GPUs that all have P2P")
