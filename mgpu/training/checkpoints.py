"""Training checkpoints on the host side: where they live, what the host keeps in them, and the signature that lets a
later prompt trust one (no ComfyUI here).

A checkpoint is one folder per saved optimizer step, ``<root>/<run>/step_<N>``: the ranks' part is a
``torch.distributed.checkpoint`` (every rank writes its own shard of the adapters and optimizer state, in parallel;
``mgpu.training.ops.save_state``), the host's part ``host.json`` (the step, the random generator's state, the losses
so far, and the fingerprint of the settings and data, so a resume with other settings is refused by name). DCP's
reader unpickles the folder's ``.metadata``, so a folder is read only if it carries this pack's signature: an HMAC
of every file in it under a key that stays beside ComfyUI's user data (``signing_key``); anything else is refused
before a byte of it is unpickled.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mgpu.errors import MgpuError

HOST_FILE = "host.json"
SIGNATURE_FILE = "signature.json"
KEY_FILE = "checkpoint-signing.key"
FORMAT = 1
LORA_PREFIX = "lora/"     # the adapters' tensors in the ranks' part, under their network-relative LoRA keys
OPTIM_PREFIX = "optim/"   # the optimizer's state: optim/<LoRA key>/<state name>
_STEP = re.compile(r"^step_(\d{6,})$")


class CheckpointRefused(MgpuError):
    """A checkpoint folder that this pack did not write (or that changed since), or one of another run."""


@dataclass
class HostState:
    """What the host needs to go on exactly where a run stopped."""

    run: str
    optimizer_steps: int              # optimizer steps finished
    micro_steps: int                  # network steps finished (optimizer steps x gradient accumulation)
    rng: str                          # torch.get_rng_state() at the step boundary, base64
    losses: list[float]
    fingerprint: dict                 # settings and data digest a resume must match
    keys: list[str]                   # the LoRA's keys as core names them, in its order
    prefix: str                       # what those keys have that the ranks' (network-relative) keys lack
    world_size: int                   # ranks that wrote it (a resume may use another count)
    format: int = FORMAT

    def rng_state(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(self.rng)), dtype=torch.uint8)

    @staticmethod
    def encode_rng(state: torch.Tensor) -> str:
        return base64.b64encode(state.numpy().tobytes()).decode()


def signing_key(folder: str | os.PathLike) -> bytes:
    """The key this machine signs checkpoints with: 32 random bytes in ``folder/KEY_FILE`` (made on first use,
    readable by its owner only). Kept outside the checkpoints, so a folder copied from elsewhere does not verify."""
    path = Path(folder) / KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    key = path.read_bytes()
    if len(key) != 32:
        raise MgpuError(f"the checkpoint signing key {path} is not 32 bytes: delete it (checkpoints signed with it "
                        "can then not be resumed) and run again")
    return key


def _digest(folder: Path, key: bytes) -> tuple[str, list[str]]:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != SIGNATURE_FILE)
    for name in names:
        mac.update(name.encode() + b"\0")
        with open(folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                mac.update(chunk)
        mac.update(b"\0")
    return mac.hexdigest(), names


def sign(folder: str | os.PathLike, key: bytes) -> None:
    """Sign every file of a checkpoint folder the ranks and the host have finished writing."""
    digest, names = _digest(Path(folder), key)
    (Path(folder) / SIGNATURE_FILE).write_text(json.dumps({"format": FORMAT, "hmac_sha256": digest, "files": names}))


def verify(folder: str | os.PathLike, key: bytes) -> HostState:
    """The host state of a checkpoint folder this pack wrote and signed on this machine, unchanged since; refused
    by name otherwise, before anything in it is unpickled."""
    folder = Path(folder)
    why = "it has no signature from this pack"
    signature = folder / SIGNATURE_FILE
    if signature.is_file():
        try:
            want = json.loads(signature.read_text())["hmac_sha256"]
        except (ValueError, KeyError, TypeError):
            want = None
        got, _ = _digest(folder, key)
        if want is not None and hmac.compare_digest(str(want), got):
            return read_host_state(folder)
        why = "its files do not match the signature (changed after it was written, or signed with another key)"
    raise CheckpointRefused(f"checkpoint {folder}: {why}; this pack reads only checkpoints it wrote on this machine "
                            "(torch.distributed.checkpoint's metadata is a pickle, which could run any code)")


def write_host_state(folder: str | os.PathLike, state: HostState) -> None:
    (Path(folder) / HOST_FILE).write_text(json.dumps(asdict(state)))


def read_host_state(folder: str | os.PathLike) -> HostState:
    data = json.loads((Path(folder) / HOST_FILE).read_text())
    if data.get("format") != FORMAT:
        raise CheckpointRefused(f"checkpoint {folder}: format {data.get('format')}, this pack reads {FORMAT}")
    return HostState(**data)


def run_folder(root: str | os.PathLike, run: str) -> Path:
    """``root/run``; a run name is a plain folder name."""
    if not run or run in (".", "..") or not re.fullmatch(r"[\w.\- ]+", run):
        raise MgpuError(f"run name {run!r}: use letters, digits, spaces, '.', '-' and '_' (it names a folder)")
    return Path(root) / run


def step_folder(root: str | os.PathLike, run: str, optimizer_steps: int) -> Path:
    return run_folder(root, run) / f"step_{optimizer_steps:06d}"


def saved_steps(root: str | os.PathLike, run: str) -> list[Path]:
    """The run's checkpoint folders, oldest first (whatever they hold: ``verify`` decides whether one is read)."""
    folder = run_folder(root, run)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and _STEP.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP.match(p.name).group(1)))


def prune(root: str | os.PathLike, run: str, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` signed checkpoints of the run (keep <= 0: keep all); returns those
    removed. Unsigned folders (a save that died half-way) go too, unless they are the newest."""
    folders = saved_steps(root, run)
    signed = [p for p in folders if (p / SIGNATURE_FILE).is_file()]
    kept = set(signed[-keep:]) if keep > 0 else set(signed)
    removed = [p for p in folders if p not in kept and (p in signed or p != folders[-1])]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def data_digest(*tensors: torch.Tensor) -> str:
    """A digest of the training data's values (latents, conditionings), for the resume check."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def mismatches(saved: dict, wanted: dict) -> list[str]:
    """The settings a resume changes against the checkpoint's, as 'name: saved -> now'. Only what this version
    fingerprints counts: a setting a checkpoint recorded that no longer changes the LoRA (gradient checkpointing,
    recorded before 2026-12-04) does not refuse it."""
    return [f"{k}: {saved.get(k)!r} in the checkpoint, {wanted.get(k)!r} now"
            for k in sorted(wanted) if saved.get(k) != wanted.get(k)]


def export_lora(folder: str | os.PathLike, key: bytes, out: str | os.PathLike) -> list[str]:
    """Write a checkpoint's LoRA as one safetensors file in ComfyUI's LoRA format (core's keys and order), loadable
    by stock LoraLoaderModelOnly; read in this process, no ranks. Returns the keys written."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    host = verify(folder, key)
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    found = {name: torch.empty(meta.size, dtype=meta.properties.dtype)
             for name, meta in metadata.state_dict_metadata.items() if name.startswith(LORA_PREFIX)}
    with warnings.catch_warnings():   # no process group here by design: DCP warns that it assumes one process
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(found, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    lora = {k: found[LORA_PREFIX + k[len(host.prefix):]].contiguous() for k in host.keys}
    save_file(lora, str(out))
    return list(lora)

