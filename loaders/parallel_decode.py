"""MGPU VAE Decode: ComfyUI's tiled VAE decode with its tiles decoded on several devices at once.

ComfyUI's own tiled decode (``VAEDecodeTiled`` → ``VAE.decode_tiled`` → ``comfy.utils.tiled_scale_multidim``) runs
twice on a stand-in of the VAE whose decoder is not a network:

1. record: the decoder keeps each tile's latent and answers with an empty tensor of the decoded tile's shape on
   ``meta``, so ComfyUI lays out its tiles and masks without computing or allocating anything;
2. the recorded tiles are decoded on the devices, round-robin, one thread and one copy of the VAE per device;
3. replay: the decoder hands back the decoded tiles in the order ComfyUI asks for them again.

So the tile grid, the overlap masks and the blend are ComfyUI's own, on either ComfyUI version. A tile is what
ComfyUI decodes in one call: a spatial tile of one temporal chunk. Each call starts afresh (a causal VAE such as
Wan's starts its feature cache over), which is why ComfyUI's chunks are independent and may go to different devices;
a chunk is never split further. Each decoded tile moves to ComfyUI's intermediate device (host RAM) at once, so a
device holds its VAE copy and one tile, whatever the length of the video.

The parsing of the ``devices`` text and the choice of devices do not import ComfyUI.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mgpu.errors import MgpuError
from mgpu.planning.devices import Device, format_bytes, gpus
from mgpu.planning.estimates import CUDA_OVERHEAD_BYTES

from .placement import AUTO, CPU

log = logging.getLogger("mgpu")

NODE = "MGPU VAE Decode"
FORMS = "auto, or devices separated by commas such as cuda:0,cuda:1 (cpu may be listed, also more than once)"
# How often the waiting host looks at ComfyUI's Cancel while the devices decode.
POLL_S = 0.1
# ComfyUI's per-device load state of a layer or model (dynamic VRAM, 0.33+): tied to the original's device and
# allocator, so a copy starts without it and computes with its own weights.
_DEVICE_STATE = ("_v", "_v_signature", "_pin_state", "_prefetch", "dynamic_vbars", "dynamic_pins",
                 "dynamic_patchers")


# --- which devices ------------------------------------------------------------------------------------------------

def parse_devices(text: str, known: list[str]) -> list[str] | None:
    """The devices listed in the node's ``devices`` text, in order; None for "auto".

    Each entry must be one of ``known`` (this machine's device ids) or "cpu". A GPU may be listed once (one VAE
    copy per GPU); "cpu" more than once, each entry a thread with its own copy. Raises MgpuError saying what is
    wrong and what this machine has.
    """
    entries = [e.strip().lower() for e in str(text).split(",")]
    if entries == [AUTO]:
        return None
    if not any(entries):
        raise MgpuError(f"{NODE}: devices is empty; write {FORMS}")
    choices = ", ".join(dict.fromkeys([*known, CPU]))
    for entry in entries:
        if entry == AUTO:
            raise MgpuError(f"{NODE}: auto cannot be combined with other devices in {text!r}; write {FORMS}")
        if entry == "cuda" or entry == "gpu":
            raise MgpuError(f"{NODE}: {entry!r} in devices {text!r} names no GPU; write cuda:0, cuda:1, ... "
                            f"(this machine has {choices})")
        if entry != CPU and entry not in known:
            why = "is empty" if not entry else "does not exist on this machine"
            raise MgpuError(f"{NODE}: device {entry!r} in devices {text!r} {why}; this machine has {choices}; "
                            f"write {FORMS}")
    twice = sorted({e for e in entries if e != CPU and entries.count(e) > 1})
    if twice:
        raise MgpuError(f"{NODE}: {', '.join(twice)} listed twice in devices {text!r}; a GPU decodes with one copy "
                        "of the VAE, list each once")
    return entries


def pick_auto(devices: list[Device], need: int, home: str) -> tuple[list[str], str]:
    """For "auto": the VAE's own device ``home`` when it is a GPU (ComfyUI makes room there), then every other GPU
    with ``need`` bytes free; without any, ``home`` alone. Returns the ids and why, for the log."""
    gpu_list = gpus(devices)
    chosen = [d.id for d in gpu_list if d.id == home or d.free_bytes >= need]
    chosen.sort(key=lambda i: i != home)
    short = [f"{d.id} ({format_bytes(d.free_bytes)} free)" for d in gpu_list if d.id not in chosen]
    if not chosen:
        return [home], (f"auto: no GPU has the {format_bytes(need)} a VAE copy and one tile need, so the VAE's "
                        f"device {home} alone" if gpu_list else f"auto: no GPU, so the VAE's device {home}")
    why = f"auto: {', '.join(chosen)} (each needs {format_bytes(need)}: a VAE copy and one tile)"
    return chosen, why + (f"; left out {', '.join(short)}" if short else "")


def planned(plan, known: list[str], home: str) -> tuple[list[str], str] | None:
    """For "auto" with an MGPU Plan connected: the GPUs the plan splits the decode over (the VAE's device ``home``
    first when it is one of them), or ``home`` alone when the plan decodes on one device; None when the plan has no
    VAE. Raises MgpuError when a planned GPU is not one of ``known`` (a plan made for another machine)."""
    placed = plan.placement("vae") if plan is not None else None
    if placed is None:
        return None
    if placed.strategy != "split":
        return [home], f"auto: the MGPU Plan decodes on one device, so the VAE's device {home} alone"
    missing = [d for d in placed.devices if d != CPU and d not in known]
    if missing:
        raise MgpuError(f"{NODE}: the MGPU Plan splits the decode over {', '.join(placed.devices)}, but "
                        f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on this machine (it has "
                        f"{', '.join(dict.fromkeys([*known, CPU]))}); make the plan with devices 'auto' for this "
                        f"machine, or write the devices here; {FORMS}")
    chosen = sorted(placed.devices, key=lambda d: d != home)
    each = max(placed.resident_bytes.get(d, 0) + placed.working_bytes.get(d, 0) for d in chosen)
    return chosen, (f"auto: the MGPU Plan's split over {', '.join(chosen)} ({format_bytes(each)} each: a VAE copy "
                    "and one tile of VAE Decode (Tiled)'s default size)")


def labels(devices: list[str]) -> list[str]:
    """How errors and logs name each entry: the device id, numbered where an id is listed more than once."""
    seen: dict[str, int] = {}
    out = []
    for d in devices:
        seen[d] = seen.get(d, 0) + 1
        out.append(d if devices.count(d) == 1 else f"{d} #{seen[d]}")
    return out


def round_robin(tiles: int, workers: int) -> list[list[int]]:
    """Tile indices per worker: tile i goes to worker i mod ``workers``."""
    return [list(range(w, tiles, workers)) for w in range(workers)]


# --- the decode ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TileSettings:
    """VAEDecodeTiled's inputs, by its names: pixels and frames, mapped to latent tiles by ComfyUI itself."""
    tile_size: int = 512
    overlap: int = 64
    temporal_size: int = 64
    temporal_overlap: int = 8


def queue_check(devices: str) -> str | None:
    """What ComfyUI's ``validate_inputs`` reports when the prompt is queued, before the sampler runs: the devices
    text read against this machine's devices (``parse_devices``). None when it reads."""
    from . import placement

    try:
        parse_devices(devices, [d.id for d in gpus(placement.live_devices())])
    except MgpuError as exc:
        return str(exc)
    return None


def decode(vae, samples: dict, devices: str, tiles: TileSettings = TileSettings(),
           machine: Callable[[], list[Device]] | None = None, plan=None) -> torch.Tensor:
    """IMAGE of ``samples`` (a LATENT) decoded as ComfyUI's VAEDecodeTiled with ``tiles`` would, its tiles spread
    over ``devices`` (the node's text; "auto" follows ``plan``, an MGPU Plan, when one is connected). ``machine``
    lists this machine's devices (tests); default: the live ones."""
    from . import placement

    vae.throw_exception_if_invalid()
    machine = machine or placement.live_devices
    known = [d.id for d in gpus(machine())]
    wanted = parse_devices(devices, known)   # before anything is loaded or decoded
    home = _device_id(vae.device)
    if wanted is None and (chosen := planned(plan, known, home)) is not None:
        wanted, why = chosen
        if _planned_whole(plan):
            log.info("%s: auto: the MGPU Plan decodes the whole video at once on %s, as VAE Decode does", NODE, home)
            return _whole_decode(vae, samples)
        log.info("%s: %s", NODE, why)
    if not _comfyui_tiles(vae):
        if wanted is not None and wanted != [home]:
            log.warning("%s: this VAE (%s) tiles its own decode; decoding on its device %s only", NODE,
                        type(vae.first_stage_model).__name__, home)
        return _tiled_decode(vae, samples, tiles)
    recorder = _Recorder(vae)
    _tiled_decode(_stand_in(vae, recorder, torch.device("meta")), samples, tiles)
    need = _need(vae, recorder.tiles)
    if wanted is None:
        wanted, why = pick_auto(machine(), need, home)
        log.info("%s: %s", NODE, why)
    wanted = wanted[:len(recorder.tiles)]        # no copy for a device that would get no tile
    decoded = _decode_all(vae, recorder.tiles, wanted, need)
    return _tiled_decode(_stand_in(vae, _Replayer(recorder.tiles, decoded), vae.output_device), samples, tiles)


def _planned_whole(plan) -> bool:
    """The plan sized an untiled decode on one device (a short video): decode it as VAE Decode does, not in tiles."""
    placed = plan.placement("vae")
    return placed.strategy != "split" and not placed.tiled


def _whole_decode(vae, samples: dict) -> torch.Tensor:
    import nodes   # ComfyUI's VAE Decode: its own fallback to tiles if the device runs out of memory after all

    return nodes.VAEDecode().decode(vae, samples)[0]


def _device_id(device) -> str:
    """ "cuda:N" or "cpu", as ``devices`` names it; a bare "cuda" is torch's current GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _comfyui_tiles(vae) -> bool:
    """Whether ComfyUI tiles this VAE's decode through ``tiled_scale_multidim`` (images and videos); not when the
    VAE tiles itself (``handles_tiling``, ComfyUI 0.33+) or decodes audio (1-D)."""
    return (not getattr(vae, "handles_tiling", False) and getattr(vae, "extra_1d_channel", None) is None
            and getattr(vae, "latent_dim", 2) in (2, 3))


def _tiled_decode(vae, samples: dict, tiles: TileSettings) -> torch.Tensor:
    import nodes   # ComfyUI's, as every custom node reaches it

    return nodes.VAEDecodeTiled().decode(vae, samples, tiles.tile_size, tiles.overlap, tiles.temporal_size,
                                         tiles.temporal_overlap)[0]


def _stand_in(vae, decoder, output_device):
    """The VAE with ``decoder`` in place of its network; tiles reach the decoder where the latent is."""
    shadow = copy.copy(vae)
    shadow.first_stage_model = decoder
    shadow.device = torch.device(CPU)
    shadow.output_device = output_device
    return shadow


def decoded_shape(vae, shape: torch.Size) -> list[int]:
    """Shape ComfyUI sizes a decoded tile of latent ``shape`` by (its ``upscale_ratio`` per axis)."""
    dims = len(shape) - 2
    ratios = vae.upscale_ratio if isinstance(vae.upscale_ratio, (tuple, list)) else [vae.upscale_ratio] * dims
    return [shape[0], vae.output_channels, *(round(r(n) if callable(r) else r * n) for r, n in zip(ratios, shape[2:]))]


class _Recorder:
    """First pass: keeps each tile's latent, answers with an empty decoded tile on meta."""

    def __init__(self, vae):
        self.vae = vae
        self.tiles: list[torch.Tensor] = []

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        self.tiles.append(latent)
        return torch.empty(decoded_shape(self.vae, latent.shape), dtype=latent.dtype, device="meta")


class _Replayer:
    """Last pass: hands back the decoded tiles in the order they were recorded."""

    def __init__(self, recorded: list[torch.Tensor], decoded: list[torch.Tensor]):
        self.recorded, self.decoded, self.next = recorded, decoded, 0

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        i = self.next
        if i >= len(self.decoded) or latent.shape != self.recorded[i].shape:
            raise MgpuError(f"{NODE}: ComfyUI asked for tile {i + 1} ({tuple(latent.shape)}) where "
                            f"{len(self.decoded)} tiles were recorded; its tiling changed between two passes. "
                            "Please report this with your ComfyUI version; VAE Decode (Tiled) works meanwhile")
        self.next += 1
        return self.decoded[i]


def _module_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _need(vae, tiles: list[torch.Tensor]) -> int:
    """Bytes a device needs: a VAE copy, ComfyUI's own figure for its largest tile, and the CUDA overhead."""
    largest = max(tiles, key=lambda t: t.numel()).shape
    tile = int(vae.memory_used_decode(largest, vae.vae_dtype))
    return _module_bytes(vae.first_stage_model) + tile + CUDA_OVERHEAD_BYTES


def _decode_all(vae, tiles: list[torch.Tensor], devices: list[str], need: int) -> list[torch.Tensor]:
    """Every tile decoded, tile i on device i mod len(devices), in a thread per device; the host waits, reports
    progress and passes ComfyUI's Cancel on between tiles."""
    import comfy.model_management as mm
    import comfy.utils

    home = _device_id(vae.device)
    own = devices.index(home) if home in devices else None
    workers = [_Worker(label, torch.device(d), vae.first_stage_model, i == own)
               for i, (label, d) in enumerate(zip(labels(devices), devices))]
    for w in workers:
        if not w.own and w.device.type != CPU:
            mm.free_memory(need - CUDA_OVERHEAD_BYTES, w.device)   # ComfyUI's models there make room first
    log.info("%s: %d tiles over %s", NODE, len(tiles), ", ".join(w.label for w in workers))
    results: queue.Queue = queue.Queue()
    stop = threading.Event()
    threads = [threading.Thread(target=w.run, args=(tiles, indices, vae.output_device, results, stop),
                                name=f"mgpu-vae-{w.label}", daemon=True)
               for w, indices in zip(workers, round_robin(len(tiles), len(workers)))]
    decoded: list[torch.Tensor | None] = [None] * len(tiles)
    pbar = comfy.utils.ProgressBar(len(tiles))
    try:
        for t in threads:
            t.start()
        done = 0
        while done < len(tiles):
            mm.throw_exception_if_processing_interrupted()
            try:
                index, out, error = results.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if error is not None:
                raise error
            decoded[index] = out
            done += 1
            pbar.update_absolute(done, len(tiles))
    finally:
        stop.set()
        for t in threads:
            t.join()
        if any(w.device.type == "cuda" and not w.own for w in workers):
            torch.cuda.empty_cache()   # the copies' memory back to the other processes (and FSDP ranks)
    return decoded


@dataclass
class _Worker:
    """One entry of ``devices``: decodes its tiles with the VAE's own network (``own``: it is on this device) or
    with a copy of it placed there."""
    label: str
    device: torch.device
    source: torch.nn.Module
    own: bool

    def run(self, tiles: list[torch.Tensor], indices: list[int], host: torch.device, results: queue.Queue,
            stop: threading.Event) -> None:
        """Decode ``indices`` one by one, each result to ``host`` and into ``results``; stop between tiles when
        ``stop`` is set or ComfyUI's Cancel was pressed. A failure goes to ``results`` naming this device; Cancel
        seen inside a layer (ComfyUI 0.33+) goes there as it is, for the host to raise."""
        import comfy.model_management as mm

        index = None
        try:
            with torch.inference_mode(), _on(self.device):
                network = self.source if self.own else self._copy()
                for index in indices:
                    if stop.is_set() or mm.processing_interrupted():
                        return
                    out = network.decode(tiles[index].to(self.device)).to(host)
                    results.put((index, out, None))
        except mm.InterruptProcessingException as exc:   # ComfyUI 0.33+ checks Cancel in every layer
            results.put((index, None, exc))
        except BaseException as exc:   # noqa: BLE001 - the host thread re-raises it, naming the device
            results.put((index, None, self._error(exc, index, len(tiles))))

    def _copy(self) -> torch.nn.Module:
        """The network with its weights placed on this device, straight from where they are; ComfyUI's load state
        of the original (``_DEVICE_STATE``) is left behind. Each parameter keeps the dtype ComfyUI computes in."""
        memo: dict[int, object] = {}
        for module in self.source.modules():
            for name, p in module.named_parameters(recurse=False):
                if p.is_meta:
                    raise MgpuError(f"the weights of {type(self.source).__name__} are not in memory (ComfyUI keeps "
                                    "them on disk): decode on the VAE's own device only")
                dtype = getattr(module, f"{name}_comfy_model_dtype", p.dtype)
                memo[id(p)] = torch.nn.Parameter(p.detach().to(self.device, dtype, copy=True), requires_grad=False)
            for b in module.buffers(recurse=False):
                memo[id(b)] = b.detach().to(self.device, copy=True)
            for attr in _DEVICE_STATE:
                if attr in module.__dict__:
                    memo[id(module.__dict__[attr])] = None
        network = copy.deepcopy(self.source, memo)
        for module in network.modules():
            for attr in _DEVICE_STATE:
                module.__dict__.pop(attr, None)
        return network

    def _error(self, exc: BaseException, index: int | None, total: int) -> MgpuError:
        where = "placing its copy of the VAE" if index is None else f"decoding tile {index + 1} of {total}"
        hint = ("lower tile_size or temporal_size, or leave it out of devices" if _out_of_memory(exc)
                else "leave it out of devices, or decode with VAE Decode (Tiled)")
        err = MgpuError(f"{NODE}: {self.label} failed {where}: {type(exc).__name__}: {exc}; {hint}")
        err.__cause__ = exc
        return err


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _on(device: torch.device):
    """The thread's current CUDA device while it decodes there (cuDNN handles, custom kernels); no-op on the cpu."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
