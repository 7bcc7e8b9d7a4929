"""Checkpoint layouts for the tests: the supported families' real key layouts and their writers live in
``mgpu.planning.layouts`` (``python -m mgpu plan --example`` uses them too); here only the broken files users point
at by mistake, which no example needs."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from mgpu.planning.layouts import *  # noqa: F401,F403 - the tests read every layout as ckpt_layouts.<name>
from mgpu.planning.layouts import Layout, header_bytes, write_safetensors


# ------------------------------------------------------------------------------------------ bad files

def write_truncated(path: str | Path, layout: Layout, keep: float = 0.5) -> Path:
    """A valid file cut short inside its data section (an interrupted download)."""
    path = write_safetensors(path, layout, sparse=True)
    head, data_size = header_bytes(layout, None)
    with open(path, "r+b") as f:
        f.truncate(len(head) + int(data_size * keep))
    return path


def write_bad_header(path: str | Path, layout: Layout, defect: str) -> Path:
    """A file whose header lies. ``defect``: past_end, size_mismatch, overlap, unknown_dtype, bad_shape,
    not_json, header_past_end (length field larger than the file)."""
    head, data_size = header_bytes(layout, None)
    header = json.loads(head[8:])
    first, second = list(header)[:2]
    if defect == "past_end":
        header[first]["data_offsets"][1] += data_size  # also breaks the size check; move begin too
        header[first]["data_offsets"][0] += data_size
    elif defect == "size_mismatch":
        header[first]["data_offsets"][1] -= 2
    elif defect == "overlap":
        b0, e0 = header[first]["data_offsets"]
        b1, e1 = header[second]["data_offsets"]
        header[second]["data_offsets"] = [b0, b0 + (e1 - b1)]
    elif defect == "unknown_dtype":
        header[first]["dtype"] = "Q4_K"
    elif defect == "bad_shape":
        header[first]["shape"] = [-1, 4]
    raw = json.dumps(header).encode()
    if defect == "not_json":
        raw = raw[:-5] + b"!!!!!"
    raw += b" " * (-len(raw) % 8)
    length = len(raw) + (data_size + 1 if defect == "header_past_end" else 0)
    Path(path).write_bytes(length.to_bytes(8, "little") + raw)
    with open(path, "r+b") as f:
        f.truncate(8 + len(raw) + data_size)
    return Path(path)


def write_not_safetensors(path: str | Path, kind: str) -> Path:
    """Files users point at by mistake: zip (.ckpt/.pt), pickle, gguf, text, empty. Nothing here is a real pickle."""
    path = Path(path)
    if kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/data.pkl", b"not a pickle, just bytes")
            z.writestr("archive/version", b"3\n")
    else:
        path.write_bytes({"pickle": b"\x80\x04\x95" + b"\x00" * 64, "gguf": b"GGUF\x03\x00\x00\x00" + b"\x00" * 64,
                          "text": b"this is a README, not a model\n" * 4, "empty": b""}[kind])
    return path
