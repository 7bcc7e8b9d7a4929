"""NCCL between GPUs that cannot reach each other peer to peer.

Consumer GPUs (two RTX 4090s, most PCIe boards without a P2P-capable switch) report no P2P access; NCCL then hangs or
fails at its first collective unless P2P is switched off, the most common complaint in raylight's tracker. NVML
(``mgpu.planning.devices``) already records how each GPU reaches each other one, so the pool decides before the ranks
start: NCCL cannot switch P2P off per pair, so the closest it offers is used:

- every pair of rank GPUs with P2P (NVLink or PCIe P2P): nothing changes;
- some pairs without P2P, and every pair that has it joined by NVLink: ``NCCL_P2P_LEVEL=NVL`` (P2P over NVLink only);
- otherwise: ``NCCL_P2P_DISABLE=1`` (every transfer goes through host memory: slower, never hung).

A setting of either variable in the environment or the pool's ``env`` is the user's and wins.

NVML can report P2P that does not work (PCIe ACS or an IOMMU between the GPUs, some consumer drivers): NCCL then
hangs or returns garbage at its first transfer. The ranks check one all-reduce at start-up (``mgpu.ranks.rank``);
``after_failed_probe`` decides whether the pool restarts once with P2P off. With P2P off (or limited to NVLink) NCCL
moves data through /dev/shm, which Docker limits to 64 MB unless told otherwise: ``shm_warning`` says so with numbers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from mgpu.planning.devices import Device

USER_VARS = ("NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL")
OFF = {"NCCL_P2P_DISABLE": "1"}
SHM_PATH = "/dev/shm"
# One NCCL shared-memory connection is a segment of ~9.2 MiB with NCCL's default buffers (9637888 bytes in NCCL's own
# "Error while creating shared memory segment /dev/shm/nccl-* (size 9637888)" reports); each rank opens at least one
# per channel to its ring neighbour and one for the tree, over at least 2 channels. An estimate of the floor, not a
# measurement: NCCL opens more channels on some machines.
SHM_SEGMENT_BYTES = 9637888
SHM_SEGMENTS_PER_RANK = 4


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


def after_failed_probe(user_env: Mapping[str, str], rank_env: Mapping[str, str]) -> P2pDecision:
    """After the start-up all-reduce failed or timed out on NCCL: ``env`` to restart the ranks with once (P2P off),
    or none (the P2P setting is the user's, or P2P is already off), with the sentence that says which."""
    mine = {var: user_env[var] for var in USER_VARS if var in user_env}
    if mine:
        settings = ", ".join(f"{k}={v}" for k, v in mine.items())
        hint = "" if mine.get("NCCL_P2P_DISABLE") == "1" else "; try NCCL_P2P_DISABLE=1"
        return P2pDecision({}, f"the ranks ran with your {settings}, which the pool does not override{hint}")
    if rank_env.get("NCCL_P2P_DISABLE") == "1":
        return P2pDecision({}, "P2P was already off (NCCL_P2P_DISABLE=1), so the fault is not peer-to-peer")
    return P2pDecision(dict(OFF), "NVML reports peer-to-peer access between these GPUs, but NCCL's first transfer "
                                  "failed: restarting the ranks once with NCCL_P2P_DISABLE=1 (transfers through host "
                                  "memory: slower, never hung); set NCCL_P2P_DISABLE yourself to choose")


def uses_shm(env: Mapping[str, str]) -> bool:
    """Whether NCCL may move data between these ranks' GPUs through /dev/shm: P2P off, or limited to NVLink / none."""
    return env.get("NCCL_P2P_DISABLE") == "1" or env.get("NCCL_P2P_LEVEL", "").upper() in ("LOC", "NVL", "0", "1")


def shm_space(path: str = SHM_PATH) -> tuple[int, int] | None:
    """(free, size) bytes of the shared-memory file system, None where it does not exist."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def shm_warning(space: tuple[int, int] | None, world_size: int) -> str | None:
    """The warning when /dev/shm has less room than NCCL's shared-memory transport needs for ``world_size`` ranks."""
    need = world_size * SHM_SEGMENTS_PER_RANK * SHM_SEGMENT_BYTES
    if space is None or space[0] >= need:
        return None
    free, size = space
    return (f"{SHM_PATH} has {free / 2**20:.0f} MiB free of {size / 2**20:.0f} MiB, and NCCL without P2P needs at "
            f"least ~{need / 2**20:.0f} MiB there for {world_size} ranks (it fails or hangs when the room runs out); "
            "in Docker start the container with --shm-size=1g (or --ipc=host), elsewhere enlarge /dev/shm "
            "(mount -o remount,size=1G /dev/shm)")
