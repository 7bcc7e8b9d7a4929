"""MGPU Train LoRA's checkpoints in ComfyUI: saved every N optimizer steps (and at the end, and at a Cancel) under
ComfyUI's output folder (``mgpu_training/<run>/step_<N>``), pruned to the newest few, resumed by a later prompt of the
same run with the same settings and data. The folders outlive the rank pool (they are not its private files); the
signing key stays in ComfyUI's user folder (``comfy-mgpu/``). Host-independent parts: ``mgpu.training.checkpoints``.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mgpu.errors import MgpuError
from mgpu.training import checkpoints as ck
from mgpu.training.run import TrainingRun

log = logging.getLogger("mgpu")
FOLDER = "mgpu_training"   # under ComfyUI's output folder


def root() -> Path:
    import folder_paths

    return Path(folder_paths.get_output_directory()) / FOLDER


def key() -> bytes:
    import folder_paths

    return ck.signing_key(Path(folder_paths.get_user_directory()) / "comfy-mgpu")


@dataclass
class Resumed:
    """Where a resumed run goes on from."""

    folder: Path
    host: ck.HostState


def newest(node: str, run: str) -> Resumed | None:
    """The newest checkpoint of ``run`` whose signature verifies (a folder whose save did not finish is skipped; one
    that no longer verifies is refused by name); None when the run has none."""
    signing = key()
    for folder in reversed(ck.saved_steps(root(), run)):
        if not (folder / ck.SIGNATURE_FILE).is_file():
            log.warning("%s: %s has no signature (its save did not finish): skipped", node, folder)
            continue
        return Resumed(folder, ck.verify(folder, signing))
    return None


@dataclass
class RunCheckpoints:
    """One run's checkpoints: ``every`` optimizer steps (0: only at the end), the newest ``keep`` kept."""

    node: str
    run: str
    every: int
    keep: int
    fingerprint: dict
    keys: list[str]
    prefix: str
    grad_acc: int
    last: Path | None = None                       # the newest checkpoint of this run, saved or resumed from
    boundary: tuple[int, torch.Tensor] | None = field(default=None, repr=False)   # (optimizer steps, RNG state)

    def __post_init__(self) -> None:
        ck.run_folder(root(), self.run)   # a bad run name is refused before anything runs

    def find(self) -> Resumed | None:
        """The newest checkpoint of this run that verifies, checked against this prompt's settings and data; None
        when the run has none yet. A signed folder that no longer verifies, or other settings, are refused by name."""
        resumed = newest(self.node, self.run)
        if resumed is None:
            return None
        changed = ck.mismatches(resumed.host.fingerprint, self.fingerprint)
        if changed:
            raise MgpuError(f"{self.node}: resume: the newest checkpoint of run {self.run!r} ({resumed.folder}) was "
                            f"trained with other settings or data: {'; '.join(changed)}. Queue it with the "
                            "checkpoint's settings, or give this run another run_name")
        self.last = resumed.folder
        return resumed

    def mark_boundary(self, optimizer_steps: int) -> None:
        """After each optimizer step: the global generator is where the next step draws from (core's loop draws
        nothing between the optimizer step and the next batch)."""
        self.boundary = (optimizer_steps, torch.get_rng_state())

    def due(self, optimizer_steps: int, total: int) -> bool:
        return optimizer_steps == total or (self.every > 0 and optimizer_steps % self.every == 0)

    def save(self, run: TrainingRun, losses: list[float]) -> Path:
        """The run at the last optimizer step boundary: the ranks' shards, the host state, the signature; then the
        older checkpoints beyond ``keep`` go."""
        steps, rng = self.boundary
        folder = ck.step_folder(root(), self.run, steps)
        if folder.exists():   # a run queued again over the same steps: its own state replaces the old one
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        run.save(str(folder))
        micro = steps * self.grad_acc
        ck.write_host_state(folder, ck.HostState(
            run=self.run, optimizer_steps=steps, micro_steps=micro, rng=ck.HostState.encode_rng(rng),
            losses=list(losses[:micro]), fingerprint=self.fingerprint, keys=self.keys, prefix=self.prefix,
            world_size=run.sharded.pool.world_size))
        ck.sign(folder, key())
        self.last = folder
        for old in ck.prune(root(), self.run, self.keep):
            log.info("%s: removed the older checkpoint %s (keep_checkpoints %d)", self.node, old, self.keep)
        log.info("%s: checkpoint of step %d saved in %s", self.node, steps, folder)
        return folder

    def where(self) -> str:
        """For a message: the newest checkpoint, and how to go on from it."""
        if self.last is None:
            return "no checkpoint of this run was saved yet"
        return f"the last checkpoint is {self.last} (queue again with resume on to continue from it)"
