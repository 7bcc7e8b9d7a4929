"""Size a model component (DiT, text encoder, VAE) from its safetensors or GGUF headers alone.

Why headers only: planning must run before anything is loaded, on machines whose RAM is smaller than the
checkpoint. ``safetensors.safe_open`` maps the whole file (``Cannot allocate memory`` for a 28 GB file on a
24 GB host), so the 8-byte length and the JSON header are read with plain file reads and validated here. GGUF files
(city96's ComfyUI-GGUF quantizations) are read the same way, by our own parser: ``gguf.GGUFReader`` maps the whole
file and answers a truncated one with numpy errors. Their tensors keep their stored type ("Q8_0", "F32", ...) as
``TensorInfo.dtype`` and their stored bytes, so plans count what the ranks hold.
Nothing is ever unpickled: a ``.ckpt``/``.pt`` file is refused with a message saying so.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mgpu.errors import SizingError

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit; anything larger is not a safetensors header

# Bits per element of every dtype safetensors defines (sub-byte float formats included).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
                          "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"})

_CORRUPT = "the file is truncated or corrupt; re-download it"
_ONLY_SAFETENSORS = ("only .safetensors and .gguf files are accepted: download the .safetensors version of this "
                     "model (or convert it) and point at that")


# ----------------------------------------------------------------------------------------------- headers

@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. ``start``/``end`` are absolute file offsets, ready for positioned reads."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Header:
    path: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_offset: int  # absolute offset of the data section (8 + header length)
    file_size: int
    format: str = "safetensors"   # or "gguf"


def _sniff(head: bytes) -> str:
    """Name the format of a file that is not safetensors, so the message can say what it is."""
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive, e.g. a PyTorch .ckpt/.pt/.pth checkpoint"
    if head[:1] == b"\x80":
        return "it looks like a pickle file (.ckpt/.pt/.bin)"
    return "its first bytes are not a safetensors header"


def _not_safetensors(path: str, why: str) -> SizingError:
    return SizingError(f"{path} is not a safetensors file ({why}); {_ONLY_SAFETENSORS}.")


def _check_path(path: str) -> int:
    if not os.path.exists(path):
        raise SizingError(f"Model file not found: {path}; check the path / the model folder.")
    if not os.path.isfile(path):
        raise SizingError(f"{path} is a folder, not a file; point at the .safetensors file "
                          "(a sharded model folder is read with its *.safetensors.index.json).")
    return os.path.getsize(path)


def _tensor_info(path: str, name: str, entry: object, data_offset: int, data_size: int) -> TensorInfo:
    def bad(detail: str) -> SizingError:
        return SizingError(f"{path}: tensor '{name}' has a malformed header entry ({detail}); {_CORRUPT}.")

    if not isinstance(entry, dict):
        raise bad("not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise SizingError(f"{path}: tensor '{name}' has unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)}); "
                          "the file is corrupt or from a newer safetensors: re-download it or update comfy-mgpu.")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise SizingError(f"{path}: tensor '{name}' ({dtype} {shape}) needs {bits / 8:g} bytes but its data_offsets "
                          f"[{begin}, {end}] span {end - begin}; {_CORRUPT}.")
    if end > data_size:
        raise SizingError(f"{path}: tensor '{name}' ends at byte {end} of the data section but only {data_size} "
                          f"data bytes follow the header (file size {data_offset + data_size}); {_CORRUPT}.")
    return TensorInfo(name, dtype, tuple(shape), data_offset + begin, data_offset + end)


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate one safetensors (or GGUF) header with plain reads (no mmap, no tensor data)."""
    path = os.fspath(path)
    file_size = _check_path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if head.startswith(GGUF_MAGIC):
            return read_gguf_header(path)
        if len(head) < 8:
            raise SizingError(f"{path} is {file_size} bytes, too short for a safetensors file; {_CORRUPT}.")
        (header_len,) = struct.unpack("<Q", head)
        # safetensors headers start with "{" right after the length: anything else is another format
        if header_len > MAX_HEADER_BYTES or header_len < 2 or f.read(1) != b"{":
            raise _not_safetensors(path, _sniff(head))
        if header_len > file_size - 8:
            raise SizingError(f"{path}: its header says {header_len} header bytes follow but the file has only "
                              f"{file_size - 8}; {_CORRUPT}.")
        raw = b"{" + f.read(header_len - 1)
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SizingError(f"{path}: its header is not valid JSON ({e}); {_CORRUPT}.") from None
    if not isinstance(parsed, dict):
        raise _not_safetensors(path, "its header is not a JSON object")

    data_offset = 8 + header_len
    data_size = file_size - data_offset
    meta = parsed.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise SizingError(f"{path}: its __metadata__ is not a JSON object; {_CORRUPT}.")
    tensors = {name: _tensor_info(path, name, entry, data_offset, data_size) for name, entry in parsed.items()}
    _check_overlaps(path, tensors)
    return Header(path, tensors, {str(k): str(v) for k, v in meta.items()}, data_offset, file_size)


def _check_overlaps(path: str, tensors: dict[str, TensorInfo]) -> None:
    """Two tensors sharing bytes means a lying header: sizes would be counted twice."""
    spans = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.start)
    for a, b in zip(spans, spans[1:]):
        if b.start < a.end:
            raise SizingError(f"{path}: tensors '{a.name}' [{a.start}, {a.end}) and '{b.name}' [{b.start}, {b.end}) "
                              f"overlap; {_CORRUPT}.")


def _read_index(index: str) -> list[Header]:
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise SizingError(f"{index} is not a readable safetensors index ({e}); re-download it.") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SizingError(f"{index} has no valid 'weight_map' (tensor name -> shard file); re-download it.")
    folder = os.path.dirname(index)
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
    if missing:
        raise SizingError(f"{index} lists {len(shards)} shard files but {len(missing)} are missing from {folder}: "
                          f"{', '.join(missing[:5])}; download every shard into that folder.")
    headers = [read_header(os.path.join(folder, s)) for s in shards]
    by_name = {s: h for s, h in zip(shards, headers)}
    for name, shard in weight_map.items():
        if name not in by_name[shard].tensors:
            raise SizingError(f"{index} says tensor '{name}' is in {shard} but that shard does not hold it; "
                              "the download is incomplete or mixed: re-download the model.")
    return headers


def read_headers(path: str | os.PathLike) -> list[Header]:
    """Headers of a single file, of a HF-sharded folder (via its index), or of the index file itself."""
    path = os.fspath(path)
    if path.endswith(".index.json"):
        _check_path(path)
        return _read_index(path)
    if os.path.isdir(path):
        indexes = sorted(Path(path).glob("*.safetensors.index.json"))
        if len(indexes) == 1:
            return _read_index(str(indexes[0]))
        files = sorted(Path(path).glob("*.safetensors"))
        if not indexes and len(files) == 1:
            return [read_header(files[0])]
        raise SizingError(f"{path} is a folder with {len(indexes)} *.safetensors.index.json and {len(files)} "
                          "*.safetensors files; point at one .safetensors file or one index file.")
    return [read_header(path)]


# ----------------------------------------------------------------------------------------------- GGUF

GGUF_MAGIC = b"GGUF"
GGUF_ORIG_SHAPE = "comfy.gguf.orig_shape."   # ComfyUI-GGUF's key for a tensor stored reshaped
_GGUF_ALIGNMENT_KEY = "general.alignment"
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_DIMS = 8
_GGUF_MAX_NAME = 1 << 16


def gguf_types() -> dict[int, tuple[str, int, int]]:
    """GGML tensor type id -> (name, elements per block, bytes per block), from gguf-py's own table."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


class _Cursor:
    """Sequential little-endian reads of a GGUF header; running past the end of the file is a SizingError."""

    def __init__(self, f, path: str, file_size: int):
        self.f, self.path, self.file_size, self.pos = f, path, file_size, 0

    def bad(self, detail: str) -> SizingError:
        return SizingError(f"{self.path}: {detail} (GGUF header, byte {self.pos}); {_CORRUPT}.")

    def take(self, n: int, what: str) -> bytes:
        if n > self.file_size - self.pos:
            raise self.bad(f"the file ends inside {what}: {n} bytes needed, {self.file_size - self.pos} left")
        data = self.f.read(n)
        if len(data) != n:
            raise self.bad(f"the file ends inside {what}")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n > self.file_size - self.pos:
            raise self.bad(f"the file ends inside {what}")
        self.pos += n
        self.f.seek(self.pos)

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("<Q", what)
        if limit is not None and n > limit:
            raise self.bad(f"{what} is {n} bytes long (at most {limit})")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"{what} is not UTF-8") from None

    def value(self, vtype: int, what: str):
        """A scalar or string; arrays of numbers come back as lists, arrays of strings are skipped (None)."""
        if vtype in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[vtype], what)
        if vtype == _GGUF_STRING:
            return self.string(what)
        if vtype != _GGUF_ARRAY:
            raise self.bad(f"{what} has unknown value type {vtype}")
        etype, count = self.unpack("<I", what), self.unpack("<Q", what)
        if etype in _GGUF_SCALARS:
            size = struct.calcsize(_GGUF_SCALARS[etype])
            if count * size > self.file_size - self.pos:
                raise self.bad(f"the file ends inside {what} ({count} items)")
            if count > 64:   # e.g. a tokenizer's scores: not needed for sizing
                self.skip(count * size, what)
                return None
            return list(struct.unpack(f"<{count}{_GGUF_SCALARS[etype][1]}", self.take(count * size, what)))
        if etype == _GGUF_STRING:
            if count > (self.file_size - self.pos) // 8:
                raise self.bad(f"{what} claims {count} strings, more than the file can hold")
            for _ in range(count):
                self.skip(self.unpack("<Q", what), what)
            return None
        raise self.bad(f"{what} is an array of unknown value type {etype}")


def read_gguf_header(path: str | os.PathLike) -> Header:
    """Read and validate a GGUF header (version 2 or 3, little-endian) with plain reads; no tensor data is read.

    Shapes are torch's order (GGUF stores them reversed), or ComfyUI-GGUF's ``comfy.gguf.orig_shape.<name>`` when
    the tensor was stored reshaped; ``dtype`` is the GGML type name; ``start``/``end`` are absolute file offsets.
    ``metadata`` holds the scalar and string entries (``general.architecture`` names the family).
    """
    path = os.fspath(path)
    file_size = _check_path(path)
    with open(path, "rb") as f:
        cur = _Cursor(f, path, file_size)
        if cur.take(4, "the magic number") != GGUF_MAGIC:
            raise cur.bad("it does not start with GGUF")
        version = cur.unpack("<I", "the version")
        if version not in (2, 3):
            endian = " (a big-endian file: convert it on a little-endian machine)" \
                if struct.unpack(">I", struct.pack("<I", version))[0] in (2, 3) else ""
            raise SizingError(f"{path}: GGUF version {version} is not supported (2 and 3 are){endian}; "
                              "re-download or re-convert the file.")
        n_tensors, n_kv = cur.unpack("<Q", "the tensor count"), cur.unpack("<Q", "the metadata count")
        if n_tensors > file_size // 24 or n_kv > file_size // 12:   # each entry takes at least that many bytes
            raise cur.bad(f"it claims {n_tensors} tensors and {n_kv} metadata entries, more than the file can hold")
        metadata: dict[str, object] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}", _GGUF_MAX_NAME)
            metadata[key] = cur.value(cur.unpack("<I", f"the type of {key!r}"), f"metadata {key!r}")
        infos = [_gguf_tensor_entry(cur) for _ in range(n_tensors)]
        alignment = metadata.get(_GGUF_ALIGNMENT_KEY, 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise cur.bad(f"{_GGUF_ALIGNMENT_KEY} is {alignment!r}, not a positive multiple of 8")
        data_offset = -(-cur.pos // alignment) * alignment
    tensors = _gguf_tensors(path, infos, metadata, data_offset, alignment, file_size)
    _check_overlaps(path, tensors)
    plain = {k: str(v) for k, v in metadata.items() if isinstance(v, (str, int, float)) and not k.startswith(
        GGUF_ORIG_SHAPE)}
    return Header(path, tensors, plain, data_offset, file_size, format="gguf")


def _gguf_tensor_entry(cur: _Cursor) -> tuple[str, list[int], int, int]:
    name = cur.string("a tensor name", _GGUF_MAX_NAME)
    n_dims = cur.unpack("<I", f"the rank of tensor {name!r}")
    if n_dims > _GGUF_MAX_DIMS:
        raise cur.bad(f"tensor {name!r} claims {n_dims} dimensions")
    dims = [cur.unpack("<Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
    return name, dims, cur.unpack("<I", f"the type of tensor {name!r}"), cur.unpack("<Q", f"the offset of {name!r}")


def _gguf_tensors(path: str, infos: list, metadata: dict, data_offset: int, alignment: int,
                  file_size: int) -> dict[str, TensorInfo]:
    types = gguf_types()
    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in infos:
        def bad(detail: str) -> SizingError:
            return SizingError(f"{path}: tensor '{name}' {detail}; {_CORRUPT}.")

        if type_id not in types:
            raise SizingError(f"{path}: tensor '{name}' has GGML type {type_id}, which this gguf package "
                              "does not know; update gguf (pip install -U gguf) or re-convert the file.")
        type_name, block, block_bytes = types[type_id]
        numel = math.prod(dims)
        if dims and dims[0] % block:
            raise bad(f"({type_name}) has rows of {dims[0]} elements, not whole blocks of {block}")
        if name in tensors:
            raise bad("appears twice")
        if offset % alignment:
            raise bad(f"starts at data offset {offset}, not a multiple of the alignment {alignment}")
        start = data_offset + offset
        end = start + numel // block * block_bytes
        if end > file_size:
            raise SizingError(f"{path}: tensor '{name}' ({type_name} {list(reversed(dims))}) ends at byte {end} but "
                              f"the file has {file_size}; {_CORRUPT}.")
        shape = tuple(reversed(dims))
        orig = metadata.get(GGUF_ORIG_SHAPE + name)
        if orig is not None:
            if not isinstance(orig, list) or not all(type(d) is int and d >= 0 for d in orig) \
                    or math.prod(orig) != numel:
                raise bad(f"has {GGUF_ORIG_SHAPE}{name} = {orig!r}, not a shape of its {numel} elements")
            shape = tuple(orig)
        tensors[name] = TensorInfo(name, type_name, shape, start, end)
    return tensors


# ------------------------------------------------------------------------------------------ components

@dataclass
class BlockGroup:
    """A run of repeated blocks (``blocks.N.``): the unit the partitioner shards and places."""
    prefix: str
    count: int
    bytes_per_block: list[int]


@dataclass
class ComponentSize:
    path: str
    kind: str  # "dit" | "text_encoder" | "vae" | "unknown"
    family: str
    total_bytes: int
    params: int
    bytes_by_dtype: dict[str, int]
    blocks: list[BlockGroup]  # main group (most bytes) first
    bytes_outside_blocks: int  # total_bytes minus the main group
    dims: dict[str, int]
    key_prefix: str
    warnings: list[str] = field(default_factory=list)
    # Floating tensors with >= 2 dims: what a dtype recast (fp8/bf16 weights) changes; norms and biases keep theirs.
    matrix_params: int = 0
    matrix_bytes: int = 0
    # Of bytes_outside_blocks, those ComfyUI's module registers after the blocks (LTX-2's text projection): a layer
    # split puts them with the last layers.
    bytes_after_blocks: int = 0
    # What ComfyUI's LTX-2 text encoder loads from this file besides the component (an LTX-2 checkpoint's text
    # projection, ``ltx2_text_encoder_parts``), sized on its own; ``text_encoder_for`` adds it to the encoder.
    text_encoder_parts: ComponentSize | None = None
    # What ComfyUI's Train LoRA trains on it (``mgpu.planning.training.adapter_params``): out + in summed over the
    # weight matrices (a LoRA of rank r has r x that), and the elements of the 1-D weights and biases (trained whole).
    adapter_sides: int = 0
    adapter_vectors: int = 0

    @property
    def gguf(self) -> bool:
        """A GGUF file: its weights stay quantized blocks, and only MGPU's FSDP loader loads it."""
        return self.path.lower().endswith(".gguf")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ComponentSize:
        d = dict(d)
        d["blocks"] = [BlockGroup(**b) for b in d.get("blocks", [])]
        if d.get("text_encoder_parts") is not None:
            d["text_encoder_parts"] = cls.from_dict(d["text_encoder_parts"])
        return cls(**d)


# Prefixes ComfyUI strips before detection (comfy/model_detection.py unet_prefix_from_state_dict,
# supported_models*.py vae_key_prefix / text_encoder_key_prefix, sd.py CLIP loading).
_PREFIXES = [re.compile(p) for p in (
    r"model\.diffusion_model\.", r"diffusion_model\.", r"first_stage_model\.", r"vae\.",
    r"text_encoders\.[^.]+\.transformer\.", r"text_encoders\.[^.]+\.", r"cond_stage_model\.transformer\.",
    r"conditioner\.embedders\.\d+\.transformer\.",
)]
_BLOCK_KEY = re.compile(r"^(.+?)\.(\d+)(?:\.|$)")


def _known_prefix(name: str) -> str | None:
    return next((m.group(0) for pattern in _PREFIXES if (m := pattern.match(name))), None)


def _strip(tensors: dict[str, TensorInfo], prefix: str) -> dict[str, TensorInfo]:
    return {k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)}


def _choose_prefix(tensors: dict[str, TensorInfo]) -> str:
    """The component is whatever holds most bytes: a known prefix, the raw keys, or (AuraFlow-style) ``model.``."""
    found: Counter = Counter()
    for name, t in tensors.items():
        found[_known_prefix(name) or ""] += t.nbytes
    prefix, _ = max(found.items(), key=lambda kv: (kv[1], len(kv[0])))
    if prefix or _detect(tensors) is not None:
        return prefix
    stripped = _strip(tensors, "model.")
    return "model." if stripped and _detect(stripped) is not None else ""


def _block_groups(tensors: dict[str, TensorInfo]) -> list[BlockGroup]:
    """Groups of keys ``PREFIX.N.rest`` with N = 0..count-1 whose members mostly share one structure."""
    members: dict[str, dict[int, dict[str, int]]] = {}
    for name, t in tensors.items():
        m = _BLOCK_KEY.match(name)
        if m:
            rest = name[m.end():]
            members.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[rest] = t.nbytes
    groups = []
    for prefix, by_index in members.items():
        count = len(by_index)
        if count < 2 or set(by_index) != set(range(count)):
            continue  # nn.Sequential indices such as text_embedding.0 / .2 are not repeated blocks
        structures = Counter(frozenset(v) for v in by_index.values())
        if 2 * structures.most_common(1)[0][1] < count:
            continue
        groups.append(BlockGroup(prefix, count, [sum(by_index[i].values()) for i in range(count)]))
    return sorted(groups, key=lambda g: -sum(g.bytes_per_block))


# ------------------------------------------------------------------------------------------- detection

@dataclass
class _Detection:
    kind: str
    family: str
    dims: dict[str, int]
    warnings: list[str] = field(default_factory=list)


def _count(tensors: dict[str, TensorInfo], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return len({m.group(1) for k in tensors if (m := pattern.match(k))})


_WAN_SIZES = {1536: "1.3b", 3072: "5b", 5120: "14b"}
_WAN_ADDONS = {"control_adapter.conv.weight": ("wan2.2", "camera"),
               "casual_audio_encoder.encoder.final_linear.weight": ("wan2.2", "s2v"),
               "audio_proj.audio_proj_glob_1.layer.bias": ("wan2.1", "humo"),
               "face_adapter.fuser_blocks.0.k_norm.weight": ("wan2.2", "animate")}


def _detect_diffusers_wan(t: dict[str, TensorInfo]) -> _Detection | None:
    """Wan DiT in diffusers' layout (WanTransformer3DModel): same sizes, other names; heads assume head_dim 128."""
    pe, ff = t.get("patch_embedding.weight"), t.get("blocks.0.ffn.net.0.proj.weight")
    if "condition_embedder.time_embedder.linear_1.weight" not in t or pe is None or len(pe.shape) != 5 or ff is None:
        return None
    dim, in_ch, pt, ph, pw = pe.shape
    out_ch = t["proj_out.weight"].shape[0] // (pt * ph * pw) if "proj_out.weight" in t else in_ch
    text = t.get("condition_embedder.text_embedder.linear_1.weight")
    has_img = "condition_embedder.image_embedder.ff.net.0.proj.weight" in t
    variant = "i2v" if has_img else ("ti2v" if in_ch == 48 else "t2v")
    size = _WAN_SIZES.get(dim)
    dims = dict(hidden=dim, ffn=ff.shape[0], heads=max(1, dim // 128), head_dim=min(128, dim),
                layers=_count(t, "blocks."),
                in_channels=in_ch, out_channels=out_ch, text_dim=text.shape[1] if text else 4096,
                text_len=512 + (257 if has_img else 0), patch_t=pt, patch_h=ph, patch_w=pw, z_channels=out_ch,
                vae_t=4, vae_s=16 if out_ch == 48 else 8)
    return _Detection("dit", f"wan-{variant}" + (f"-{size}" if size else "") + "-diffusers", dims, [])


def _detect_wan(t: dict[str, TensorInfo]) -> _Detection | None:
    """Wan 2.1/2.2 DiT (comfy/ldm/wan/model.py; detection mirrors comfy/model_detection.py)."""
    if "head.modulation" not in t or "patch_embedding.weight" not in t or len(t["patch_embedding.weight"].shape) != 5:
        return None
    dim, in_ch, pt, ph, pw = t["patch_embedding.weight"].shape
    out_ch = t["head.head.weight"].shape[0] // (pt * ph * pw) if "head.head.weight" in t else in_ch
    ffn = t["blocks.0.ffn.0.weight"].shape[0] if "blocks.0.ffn.0.weight" in t else 4 * dim
    text_dim = t["text_embedding.0.weight"].shape[1] if "text_embedding.0.weight" in t else 4096
    has_img = "img_emb.proj.0.bias" in t
    version, variant = "wan2.1", "t2v"
    addon = next((v for k, v in _WAN_ADDONS.items() if k in t), None)
    if addon:
        version, variant = addon
    elif "vace_patch_embedding.weight" in t:
        variant = "vace"
    elif "img_emb.emb_pos" in t:
        variant = "flf2v"
    elif has_img:
        variant = "i2v"
    elif in_ch == 48:
        version, variant = "wan2.2", "ti2v"
    elif in_ch == 36:
        version, variant = "wan2.2", "i2v"
    warnings = [] if in_ch in (16, 36, 48) or addon or variant == "vace" else [
        f"Wan DiT with {in_ch} input channels is not a known variant; sized as a generic Wan {variant} model."]
    size = _WAN_SIZES.get(dim)
    family = f"{version}-{variant}" + (f"-{size}" if size else "")
    wan22_vae = out_ch == 48
    dims = dict(hidden=dim, ffn=ffn, heads=max(1, dim // 128), head_dim=128, layers=_count(t, "blocks."),
                in_channels=in_ch, out_channels=out_ch, text_dim=text_dim, text_len=512 + (257 if has_img else 0),
                patch_t=pt, patch_h=ph, patch_w=pw, z_channels=out_ch, vae_t=4, vae_s=16 if wan22_vae else 8)
    return _Detection("dit", family, dims, warnings)


def _detect_ltxv(t: dict[str, TensorInfo]) -> _Detection | None:
    """LTX-Video DiT (comfy/ldm/lightricks/model.py). PixArt shares adaln_single but has pos_embed."""
    if "adaln_single.emb.timestep_embedder.linear_1.bias" not in t or "pos_embed.proj.bias" in t:
        return None
    if "patchify_proj.weight" not in t:
        return None
    hidden, in_ch = t["patchify_proj.weight"].shape
    to_k = t.get("transformer_blocks.0.attn2.to_k.weight")
    ff = t.get("transformer_blocks.0.ff.net.0.proj.weight")
    caption = t.get("caption_projection.linear_1.weight")
    heads = 32  # ComfyUI hard-codes 32 heads and derives the head size from attn2.to_k
    dims = dict(hidden=hidden, ffn=ff.shape[0] if ff else 4 * hidden, heads=heads,
                head_dim=(to_k.shape[0] if to_k else hidden) // heads, layers=_count(t, "transformer_blocks."),
                in_channels=in_ch, out_channels=t["proj_out.weight"].shape[0] if "proj_out.weight" in t else in_ch,
                text_dim=caption.shape[1] if caption else 4096, cross_dim=to_k.shape[1] if to_k else hidden,
                text_len=128, patch_t=1, patch_h=1, patch_w=1, z_channels=in_ch, vae_t=8, vae_s=32)
    return _Detection("dit", "ltxv", dims)


def _detect_ltx2(t: dict[str, TensorInfo]) -> _Detection | None:
    """LTX-2 DiT (ComfyUI 0.33's LTXAV, comfy/ldm/lightricks/av_model.py): an LTX-Video-shaped video stream beside an
    audio stream in every block, plus the two text connectors. ComfyUI tells it from LTX-Video by the audio AdaLN.

    Its own family name: LTX-Video's sequence-parallel adapter and memory rules (``ltxv``) do not apply. The video
    stream sizes the activations (the audio stream's ~25 tokens a second are a rounding error beside the video's);
    heads are ComfyUI's default of 32 (files that differ say so in their metadata, not their shapes). The processed
    text context is the connectors' 1024 tokens (they pad with learnt registers)."""
    if "audio_adaln_single.linear.weight" not in t or "patchify_proj.weight" not in t:
        return None
    hidden, in_ch = t["patchify_proj.weight"].shape
    audio, audio_in = t["audio_patchify_proj.weight"].shape if "audio_patchify_proj.weight" in t else (0, 0)
    ff = t.get("transformer_blocks.0.ff.net.0.proj.weight")
    audio_ff = t.get("transformer_blocks.0.audio_ff.net.0.proj.weight")
    to_k = t.get("transformer_blocks.0.attn2.to_k.weight")
    registers = t.get("video_embeddings_connector.learnable_registers")
    heads = 32
    dims = dict(hidden=hidden, ffn=ff.shape[0] if ff else 4 * hidden, heads=heads, head_dim=hidden // heads,
                layers=_count(t, "transformer_blocks."), in_channels=in_ch,
                out_channels=t["proj_out.weight"].shape[0] if "proj_out.weight" in t else in_ch,
                audio_hidden=audio, audio_ffn=audio_ff.shape[0] if audio_ff else 4 * audio, audio_channels=audio_in,
                text_dim=registers.shape[1] if registers else 3840, cross_dim=to_k.shape[1] if to_k else hidden,
                text_len=max(1024, registers.shape[0] if registers else 0), patch_t=1, patch_h=1, patch_w=1,
                z_channels=in_ch, vae_t=8, vae_s=32)
    return _Detection("dit", "ltx2-av", dims)


def _detect_t5(t: dict[str, TensorInfo]) -> _Detection | None:
    """T5 / UMT5 encoders in ComfyUI's layout (comfy/text_encoders/t5.py): encoder.block.N + shared."""
    q = t.get("encoder.block.0.layer.0.SelfAttention.q.weight")
    if q is None or "shared.weight" not in t:
        return None
    vocab, d_model = t["shared.weight"].shape
    layers = _count(t, "encoder.block.")
    bias = "encoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
    umt5 = layers > 1 and bias.format(1) in t  # UMT5 has a relative-attention bias in every block
    heads = t[bias.format(0)].shape[1] if bias.format(0) in t else 64
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in t
    wi = t.get("encoder.block.0.layer.1.DenseReluDense.wi_0.weight" if gated
               else "encoder.block.0.layer.1.DenseReluDense.wi.weight")
    name = "umt5" if umt5 else "t5"
    size = {4096: "xxl", 2048: "xl", 1024: "large", 768: "base", 512: "small"}.get(d_model)
    dims = dict(hidden=d_model, ffn=wi.shape[0] if wi else 4 * d_model, heads=heads, head_dim=q.shape[0] // heads,
                layers=layers, vocab=vocab, gated_ffn=int(gated))
    return _Detection("text_encoder", f"{name}-{size}" if size else name, dims)


_GEMMA_LAYERS = ("model.language_model.layers.", "language_model.model.layers.", "model.layers.")
_GEMMA3_SIZES = {1152: "1b", 2560: "4b", 3840: "12b", 5376: "27b"}


def _detect_gemma(t: dict[str, TensorInfo]) -> _Detection | None:
    """Gemma 2/3 text encoders: HF layouts (old and new transformers naming) and ComfyUI's (model.layers.N)."""
    base = next((p for p in _GEMMA_LAYERS if p + "0.post_feedforward_layernorm.weight" in t), None)
    if base is None:
        return None
    root = base[: -len("layers.")]
    q = t[base + "0.self_attn.q_proj.weight"]
    k = t[base + "0.self_attn.k_proj.weight"]
    gemma3 = base + "0.self_attn.q_norm.weight" in t
    head_dim = t[base + "0.self_attn.q_norm.weight"].shape[0] if gemma3 else 256
    vocab, hidden = t[root + "embed_tokens.weight"].shape if root + "embed_tokens.weight" in t else (0, q.shape[1])
    dims = dict(hidden=hidden, ffn=t[base + "0.mlp.gate_proj.weight"].shape[0], heads=q.shape[0] // head_dim,
                kv_heads=k.shape[0] // head_dim, head_dim=head_dim, layers=_count(t, base), vocab=vocab, gated_ffn=1)
    size = _GEMMA3_SIZES.get(hidden) if gemma3 else {2304: "2b"}.get(hidden)
    name = "gemma3" if gemma3 else "gemma2"
    return _Detection("text_encoder", f"{name}-{size}" if size else name, dims)


def _detect_wan_vae(t: dict[str, TensorInfo]) -> _Detection | None:
    """Wan 2.1 (z 16, 4x8x8) and 2.2 (z 48, 4x16x16, 2x2 output patches) VAEs (comfy/ldm/wan/vae*.py)."""
    if "decoder.middle.0.residual.0.gamma" not in t or "decoder.head.2.weight" not in t:
        return None
    wan22 = "decoder.upsamples.0.upsamples.0.residual.2.weight" in t
    head = t["decoder.head.2.weight"].shape  # [3 * p * p, C_last, 3, 3, 3]
    dims = dict(z_channels=t["decoder.conv1.weight"].shape[1], vae_t=4, vae_s=16 if wan22 else 8,
                dec_channels=head[1], out_patch=math.isqrt(head[0] // 3), causal=1)
    return _Detection("vae", "wan2.2-vae" if wan22 else "wan-vae", dims)


def _detect_ltxv_vae(t: dict[str, TensorInfo]) -> _Detection | None:
    """LTX-Video causal VAE (comfy/ldm/lightricks/vae/): 128 latent channels, 8x32x32, 4x4 output patches."""
    if "decoder.up_blocks.0.res_blocks.0.conv1.conv.weight" not in t or "decoder.conv_out.conv.weight" not in t:
        return None
    out = t["decoder.conv_out.conv.weight"].shape
    dims = dict(z_channels=t["decoder.conv_in.conv.weight"].shape[1], vae_t=8, vae_s=32, dec_channels=out[1],
                out_patch=math.isqrt(out[0] // 3), causal=0)
    return _Detection("vae", "ltxv-vae", dims)


_DETECTORS = (_detect_wan, _detect_diffusers_wan, _detect_ltx2, _detect_ltxv, _detect_t5, _detect_gemma,
              _detect_wan_vae, _detect_ltxv_vae)   # LTX-2 before LTX-Video: it has LTX-Video's keys too


def _detect(tensors: dict[str, TensorInfo]) -> _Detection | None:
    return next((d for d in (f(tensors) for f in _DETECTORS) if d is not None), None)


# ---------------------------------------------------------------------------------------------- sizing

def _merge(headers: list[Header]) -> dict[str, TensorInfo]:
    merged: dict[str, TensorInfo] = {}
    origin: dict[str, str] = {}
    for h in headers:
        for name, t in h.tensors.items():
            if name in merged:
                raise SizingError(f"tensor '{name}' is in both {origin[name]} and {h.path}; the sharded model is "
                                  "mixed up: re-download it.")
            merged[name], origin[name] = t, h.path
    return merged


def _other_parts(path: str, everything: dict[str, TensorInfo], prefix: str) -> list[str]:
    """Name what a combined checkpoint holds besides the sized component, so nothing is silently dropped."""
    others: Counter = Counter()
    for k, t in everything.items():
        if not k.startswith(prefix):
            others[_known_prefix(k) or k.split(".")[0] + "."] += t.nbytes
    if not others:
        return []
    parts = ", ".join(f"{p!r}: {n} bytes" for p, n in others.most_common())
    return [f"{path} also holds tensors outside {prefix!r} ({parts}); they are not counted here. "
            "Size them with size_component(path, prefix=...)."]


def size_component(path: str | os.PathLike, prefix: str | None = None) -> ComponentSize:
    """Size, classify and find the repeated blocks of one component, reading headers only.

    ``prefix`` picks a part of a combined checkpoint (e.g. ``"vae."``); by default the prefix holding most
    bytes is the component and the other parts are reported in ``warnings``.
    """
    path = os.fspath(path)
    headers = read_headers(path)
    everything = _merge(headers)
    if not everything:
        raise SizingError(f"{path} holds no tensors; {_CORRUPT}.")
    if prefix is None:
        prefix = _choose_prefix(everything)
    tensors = _strip(everything, prefix)
    if not tensors:
        raise SizingError(f"{path} has no tensor whose name starts with {prefix!r}; check the prefix "
                          f"(found e.g. {', '.join(list(everything)[:3])}).")

    detection = _detect(tensors)
    warnings: list[str] = []
    if detection is None:
        sample = ", ".join(sorted(tensors)[:4])
        arch = headers[0].metadata.get("general.architecture") if headers[0].format == "gguf" else None
        named = f", GGUF architecture {arch!r}" if arch else ""
        warnings.append(f"{path}: not a recognised model family ({len(tensors)} tensors{named}, e.g. {sample}); "
                        "sized generically, memory estimates will be rough.")
        detection = _Detection("unknown", "unknown", {})
    parts = ltx2_text_encoder_parts(everything)
    # an LTX-2 checkpoint's projection is counted with the text encoder that loads it: not among "not counted"
    counted_elsewhere = parts if detection.kind != "text_encoder" else {}
    warnings += detection.warnings + _other_parts(
        path, {k: t for k, t in everything.items() if k not in counted_elsewhere}, prefix)
    size = _sized(path, tensors, detection, prefix, warnings)
    if detection.kind == "text_encoder":   # a Gemma file that holds LTX-2's projection too: it comes last
        return replace(size, bytes_after_blocks=sum(t.nbytes for k, t in tensors.items() if prefix + k in parts))
    if parts:
        size.text_encoder_parts = _sized(path, parts, _Detection("text_encoder_part", "ltx2-text-projection", {}),
                                         LTX2_TEXT_PROJECTION, [])
    return size


def _sized(path: str, tensors: dict[str, TensorInfo], detection: _Detection, prefix: str,
           warnings: list[str]) -> ComponentSize:
    total = sum(t.nbytes for t in tensors.values())
    by_dtype: Counter = Counter()
    for t in tensors.values():
        by_dtype[t.dtype] += t.nbytes
    matrices = [t for t in tensors.values() if t.dtype in FLOAT_DTYPES and len(t.shape) >= 2]
    groups = _block_groups(tensors)
    layer_weights = [t for k, t in tensors.items() if k.endswith((".weight", ".bias"))]
    return ComponentSize(
        path=path, kind=detection.kind, family=detection.family, total_bytes=total,
        params=sum(t.numel for t in tensors.values()), bytes_by_dtype=dict(by_dtype), blocks=groups,
        bytes_outside_blocks=total - (sum(groups[0].bytes_per_block) if groups else 0), dims=detection.dims,
        key_prefix=prefix, warnings=warnings, matrix_params=sum(t.numel for t in matrices),
        matrix_bytes=sum(t.nbytes for t in matrices),
        adapter_sides=sum(t.shape[0] + math.prod(t.shape[1:]) for t in layer_weights
                          if len(t.shape) >= 2 and t.name.endswith(".weight")),
        adapter_vectors=sum(t.numel for t in layer_weights if len(t.shape) == 1))


# ComfyUI 0.33's LTX-2 text encoder (comfy/text_encoders/lt.py, LTXAVTEModel.load_sd) is Gemma plus what it loads
# from the LTX-2 checkpoint given beside the Gemma file (LTXAVTextEncoderLoader's ckpt_name, MGPU Load Text Encoder's
# clip_name2): the text projection (``text_embedding_projection.aggregate_embed.weight``, 1.4 GB in LTX-2 19B;
# LTX-2.3's ``video_``/``audio_aggregate_embed``), and, in its compatibility mode (an audio connector 3840 wide
# without a third block: LTX-2 19B's), both text connectors too, a second copy beside the DiT's (1.4 GB more).
LTX2_TEXT_PROJECTION = "text_embedding_projection."
LTX2_CONNECTORS = ("model.diffusion_model.video_embeddings_connector.",
                   "model.diffusion_model.audio_embeddings_connector.")
_COMPAT_PROBE = "model.diffusion_model.audio_embeddings_connector.transformer_1d_blocks.{}.attn1.to_q.bias"


def ltx2_text_encoder_parts(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The tensors of a file (full key names) that ComfyUI's LTX-2 text encoder loads from it; none without a text
    projection (a file without one is no LTX-2 checkpoint to load the encoder with)."""
    parts = {k: t for k, t in tensors.items() if k.startswith(LTX2_TEXT_PROJECTION)}
    probe = tensors.get(_COMPAT_PROBE.format(0))
    if parts and probe is not None and probe.shape[0] == 3840 and _COMPAT_PROBE.format(2) not in tensors:
        parts.update({k: t for k, t in tensors.items() if k.startswith(LTX2_CONNECTORS)})
    return parts


def text_encoder_for(encoder: ComponentSize, dit: ComponentSize) -> ComponentSize:
    """The text encoder as ComfyUI loads it for this DiT: for LTX-2, with the parts it loads from the DiT's
    checkpoint (``ltx2_text_encoder_parts``), registered after Gemma's layers. Unchanged otherwise, and when the
    encoder's own file holds them already."""
    parts = dit.text_encoder_parts if dit.family.startswith("ltx2") else None
    if parts is None or encoder.kind != "text_encoder" or encoder.bytes_after_blocks:
        return encoder
    by_dtype = Counter(encoder.bytes_by_dtype)
    by_dtype.update(parts.bytes_by_dtype)
    return replace(encoder, total_bytes=encoder.total_bytes + parts.total_bytes, params=encoder.params + parts.params,
                   bytes_by_dtype=dict(by_dtype), bytes_outside_blocks=encoder.bytes_outside_blocks + parts.total_bytes,
                   bytes_after_blocks=parts.total_bytes, matrix_params=encoder.matrix_params + parts.matrix_params,
                   matrix_bytes=encoder.matrix_bytes + parts.matrix_bytes)


def size_from_bytes(kind: str, family: str, total_bytes: int, dims: dict[str, int] | None = None,
                    layers: int = 0, bytes_outside_blocks: int = 0, itemsize: int = 2) -> ComponentSize:
    """A ComponentSize without a file ("sizes only" planning): blocks split the non-outside bytes evenly.

    Everything is assumed to be floating weight matrices of ``itemsize`` bytes, so ``weight_bytes`` can recast.
    """
    if total_bytes <= 0 or bytes_outside_blocks < 0 or bytes_outside_blocks > total_bytes:
        raise SizingError(f"size_from_bytes: need 0 <= bytes_outside_blocks ({bytes_outside_blocks}) <= "
                          f"total_bytes ({total_bytes}) and total_bytes > 0.")
    in_blocks = total_bytes - bytes_outside_blocks if layers else 0
    per_block = [in_blocks // layers + (i < in_blocks % layers) for i in range(layers)] if layers else []
    return ComponentSize(
        path="", kind=kind, family=family, total_bytes=total_bytes, params=total_bytes // itemsize,
        bytes_by_dtype={}, blocks=[BlockGroup("blocks", layers, per_block)] if layers else [],
        bytes_outside_blocks=total_bytes - in_blocks, dims=dict(dims or {}), key_prefix="",
        warnings=[], matrix_params=total_bytes // itemsize, matrix_bytes=total_bytes)
