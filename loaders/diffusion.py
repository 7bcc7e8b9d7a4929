"""The diffusion model as ComfyUI's own MODEL: on one chosen device, or sharded with FSDP over a rank pool.

FSDP, end to end: the ComfyUI process holds no weights. It builds ComfyUI's BaseModel on the meta device from the
checkpoint header (so model sampling, latent format, conds and previews are ComfyUI's own) and wraps it in a
weightless ModelPatcher. An object patch on that patcher replaces the network's ``_forward`` with a call to the
ranks: any sampler node works with the MODEL (KSampler, SamplerCustomAdvanced, MGPU FSDP Sampler), and
DIFFUSION_MODEL wrappers other nodes add (EasyCache, ...) run around the remote forward as around a local one. The
ranks build the same network with ComfyUI's own detection (``loaders.rank_factory``), shard it with FSDP2 and read
only their slices of the checkpoint.

``transformer_options`` travel with each step as ``loaders.transformer_options`` classifies them (host-only keys stay,
per-chunk ones are cut to each rank's rows). Weight patches (LoRA from stock loader nodes) travel as their adapter
tensors and each rank patches its own rows (``loaders.weight_patches``, ``mgpu.weights.lora``). What cannot travel: other
patches of the network itself (hook patches, ``patches`` / ``patches_replace``, object patches inside the network,
ControlNet) and options this pack does not know. Those raise a clear error instead of being ignored; supporting them
under FSDP is a later step.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import time

import comfy.cli_args
import comfy.model_management as mm
import comfy.model_patcher
import comfy.sd
import comfy.utils
import folder_paths
import torch

from mgpu.errors import CallCancelled, MgpuError, RankFailure
from mgpu.planning.devices import format_bytes
from mgpu.weights.gguf import is_gguf
from mgpu.weights.lora import PatchedModule
from mgpu.sharding.sharded import ModelSpec, ShardedModule, first_tensor
from mgpu.planning.sizing import read_header, size_component

from . import experts, pools
from . import transformer_options as remote_options
from . import weight_patches
from . import gguf_model
from .model_files import dit_path
from .plan_check import add_plan_check
from .placement import AUTO, FSDP, NODE_OF_ROLE, check_plan_file, plan_to_follow, resolve
from .rank_factory import (agree_dtype, detect, fp8_compute_summary, load_layers_on_meta, numeric_flags, quantized,
                           refuse_unknown_family)

log = logging.getLogger("mgpu")

NODE = NODE_OF_ROLE["dit"]
FACTORY = "loaders.rank_factory:diffusion_model"
PREPARE = "loaders.rank_factory:prepare"
REMOTE_FORWARD = "diffusion_model._forward"   # the object patch that sends the network's forward to the ranks
OPTIONS_KEY = "mgpu_fsdp"   # transformer_options[OPTIONS_KEY]: per-sampler settings of the remote forward (timeout_s)
# Node choice -> torch dtype name; "default" lets ComfyUI choose per device, as UNETLoader does.
WEIGHT_DTYPES = {"default": None, "fp8_e4m3fn": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "bf16": "bfloat16",
                 "fp16": "float16", "fp32": "float32"}
CACHED_INPUTS = ("context", "clip_fea")   # the same every step: sent to the ranks once
# sequence_parallel widget: "auto" follows the plan's degree, else splits each video's tokens over every rank (the
# ranks lower it to a degree that divides the heads; families without an adapter keep the batch split); "off": the
# batch (CFG) split only.
SEQUENCE_PARALLEL = ("auto", "off")
_handles = itertools.count()


def load(unet_name: str, weight_dtype: str, device: str, fsdp_ranks: int, plan=None, slot: tuple | None = None,
         sequence_parallel: str = "auto"):
    """The MODEL for MGPU Load Diffusion Model: on ``device``, or (auto, fsdp) where the plan it follows puts it,
    the connected MGPU Plan or its own for this file (``placement.plan_to_follow``). ``weight_dtype`` "default"
    follows the plan's recast, if any; ``slot`` names the loader node (``loader_slot``): its previous FSDP model
    leaves the GPUs first."""
    if sequence_parallel not in SEQUENCE_PARALLEL:
        raise MgpuError(f"{NODE}: sequence_parallel must be one of {', '.join(SEQUENCE_PARALLEL)}, "
                        f"got {sequence_parallel!r}")
    path = checked_file(unet_name)
    check_plan_file(plan, "dit", path)
    if device in (AUTO, FSDP):   # a plan of its own weighs the room once the model this loader replaces has left
        pools.release_garbage()
        pools.vacate(slot)
    followed = plan_to_follow("dit", path, device, plan, weight_dtype=weight_dtype, fsdp_ranks=fsdp_ranks)
    choice = resolve(device, "dit", followed)
    dtype = WEIGHT_DTYPES[weight_dtype] or WEIGHT_DTYPES.get(choice.weight_dtype or "default")
    if is_gguf(path):
        gguf_model.check_load(unet_name, NODE, choice.strategy, dtype)
    log.info("%s: %s (%s)", NODE, unet_name, choice.reason)
    if choice.strategy == "fsdp":
        sp = 1 if sequence_parallel == "off" else choice.sp_degree
        patcher = load_fsdp(path, unet_name, choice.devices, dtype, choice.reshard_after_forward, slot,
                            sp_degree=sp, plan=followed)
    else:
        patcher = load_single(path, torch.device(choice.devices[0]), dtype)   # "offload": ComfyUI's partial loading
    if plan is not None and plan.placement("dit") is not None:   # the prompt's size against the MGPU Plan's
        add_plan_check(patcher, size_component(path), plan, f"{NODE} ({unet_name})")
    return patcher


def checked_file(unet_name: str) -> str:
    """The path of ``unet_name``, checked as far as its header says (cheap: no weights read): it exists in
    ComfyUI's diffusion_models folders (ComfyUI-GGUF's for .gguf files), its header reads, and a safetensors file is
    a family ComfyUI builds (on one device too: ComfyUI would build it as another family). Raises MgpuError naming
    the file and what to do."""
    path = dit_path(unet_name)
    if path is None or not os.path.isfile(path):
        raise MgpuError(f"{NODE}: {unet_name!r} is not in ComfyUI's diffusion_models folder "
                        f"({', '.join(folder_paths.get_folder_paths('diffusion_models'))}); put the file there and "
                        "refresh (press r in the ComfyUI page), or pick another")
    if path.lower().endswith(".safetensors"):
        refuse_unknown_family(path, read_header(path).tensors)
    else:
        gguf_model.meta_state_dict(path)   # its header, and tensor types the ranks can dequantize
    return path


def queue_check(unet_name: str, device: str) -> str | None:
    """What ComfyUI's ``validate_inputs`` reports when the prompt is queued, before earlier nodes run: the file
    (``checked_file``) and the device choice on this machine. None when both are fine. What changes later (the
    memory free, a connected plan's decisions) is checked when the node runs."""
    try:
        checked_file(unet_name)
        if device not in (AUTO, FSDP):   # auto and fsdp depend on the plan, checked at run time
            resolve(device, "dit")
    except MgpuError as exc:
        return str(exc)
    return None


def loader_slot(node_id: str | None, extra_pnginfo: dict | None) -> tuple | None:
    """Which loader this is, across prompts: its node id within its workflow. Node ids repeat across workflows and
    browser tabs, so the workflow's id (the page sends it with every prompt) or else the client's id qualifies it.
    A collision only costs a reload (``pools.occupy``), never a wrong result."""
    if node_id is None:
        return None
    workflow = extra_pnginfo.get("workflow") if isinstance(extra_pnginfo, dict) else None
    owner = workflow.get("id") if isinstance(workflow, dict) else None
    if owner is None:
        try:
            from server import PromptServer   # ComfyUI's: the client that queued the running prompt
            owner = PromptServer.instance.client_id
        except (ImportError, AttributeError):
            owner = None   # an API call without either: the node id alone
    return (str(owner), str(node_id))


def load_single(path: str, device: torch.device, dtype: str | None):
    """ComfyUI's own loader, placed on ``device``.

    Newer ComfyUI honours ``model_options["load_device"]``; 0.3.64 loads for its main device, so there the patcher
    is moved afterwards (no global device function is patched) and its compute dtype recast for ``device``: the
    weights keep the dtype ComfyUI chose for its main device, the arithmetic is what ``device`` supports.
    """
    options: dict = {"load_device": device}
    if dtype is not None:
        options["dtype"] = getattr(torch, dtype)
    patcher = comfy.sd.load_diffusion_model(path, model_options=options)
    if patcher.load_device != device:
        patcher.load_device = device
        model = patcher.model
        cast = mm.unet_manual_cast(model.get_dtype(), device, model.model_config.supported_inference_dtypes)
        if cast != model.manual_cast_dtype:
            patcher.set_model_compute_dtype(cast)
    return patcher


class ShardedModelPatcher(comfy.model_patcher.ModelPatcher):
    """ModelPatcher of a model whose weights live on FSDP ranks.

    ComfyUI's model management sees a 0-byte model, so it neither moves nor counts weights (stock ``load`` would
    ``.to()`` the meta network and fail). Object patches (model sampling, ...) still apply, on the host's BaseModel;
    weight patches (LoRA) go to the ranks before the next step.
    """

    rank_devices: tuple[str, ...] = ()   # set by load_fsdp; clone() carries it

    def model_size(self) -> int:
        return 0

    @property
    def sharded(self) -> ShardedModule:
        """The sharded network this MODEL runs on its ranks (its forward's object patch holds it)."""
        return self.object_patches[REMOTE_FORWARD].sharded

    def clone(self, *args, **kwargs):
        """ComfyUI's clone builds a fresh instance (every sampler and patching node clones): carry our own state.
        Arguments pass through, whatever this ComfyUI's clone takes."""
        n = super().clone(*args, **kwargs)
        if isinstance(n, ShardedModelPatcher):
            n.rank_devices = self.rank_devices
        return n

    def deepclone_multigpu(self, *args, **kwargs):
        """ComfyUI 0.33's MultiGPU CFG Split asks every model for a full copy per extra GPU. A sharded model
        already splits CFG (and the tokens) over its ranks, and its host copy holds no weights to copy: refuse
        by name, with the way out, instead of ComfyUI's "use a core loader" or a copy that cannot compute."""
        raise MgpuError(f"MultiGPU CFG Split cannot copy a model that {NODE} sharded over "
                        f"{', '.join(self.rank_devices) or 'ranks'}: its ranks already split CFG's cond and uncond "
                        "(and each video's tokens) over those GPUs. Remove MultiGPU CFG Split from the graph, or "
                        "load the model on one device to use ComfyUI's own split instead")

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False) -> None:
        self._refuse_network_patches()
        self._want_weight_patches()
        free_rank_gpus(self.rank_devices)
        self.model.device = device_to
        self.model.model_loaded_weight_memory = 0
        self.model.current_weight_patches_uuid = self.patches_uuid

    def partially_unload(self, device_to, memory_to_free=0) -> int:
        return 0

    def unpatch_model(self, device_to=None, unpatch_weights=True) -> None:
        super().unpatch_model(None, unpatch_weights)   # never .to(): the host's network is on meta
        if device_to is not None:
            self.model.device = device_to

    def cleanup(self) -> None:
        """ComfyUI calls this when every sampling run ends (``CFGGuider.outer_sample``'s finally): the ranks give
        back the working memory their caching allocators kept, which the VAE decode (or the next prompt's text
        encoder) on the same GPUs needs and the plan counts as free after sampling. The next step reserves again."""
        super().cleanup()
        remote = self.object_patches.get(REMOTE_FORWARD)
        if isinstance(remote, RemoteForward):
            self._release_cached_memory(remote.sharded)

    def _release_cached_memory(self, sharded: ShardedModule) -> None:
        """``ShardedModule.release_cached_memory`` with this clone's step timeout, logged once for all ranks. It
        runs inside ComfyUI's cleanup (a ``finally``), so it never raises, which would hide the prompt's own
        outcome: a failure is logged instead."""
        label = os.path.basename(sharded.spec.checkpoint)   # "<file> sharded over N ranks" names its loads
        timeout = self.model_options.get("transformer_options", {}).get(OPTIONS_KEY, {}).get("timeout_s")
        try:
            released = sharded.release_cached_memory(timeout=timeout, cancelled=mm.processing_interrupted)
        except Exception as exc:   # noqa: BLE001 - see above; the next step finds a failed pool and says so
            log.warning("%s: the ranks' cached working memory was not released after sampling (%s); a VAE decode "
                        "on their GPUs may run short of memory (MGPU VAE Decode splits it; ComfyUI's Unload Models "
                        "frees it)", label, exc)
            return
        if not released:
            if not sharded.pool.alive:
                log.warning("%s: its ranks are gone, so no cached working memory was released after sampling; the "
                            "next run starts them again and reloads the model", label)
            return
        sizes = [(format_bytes(r["released_bytes"]), r["device"]) for r in released]
        log.info("%s: sampling ended: its ranks released %s of cached working memory on %s", label, sizes[0][0],
                 ", ".join([sizes[0][1], *(f"{b} on {d}" for b, d in sizes[1:])]))

    def _want_weight_patches(self) -> None:
        """ComfyUI calls ``load`` before sampling with the clone that samples: its weight patches (none: the base)
        become what the ranks hold from the next step on; they are sent only when they changed."""
        sharded = self.sharded
        shapes = {k: comfy.utils.get_attr(self.model, k).shape for k in self.patches}
        sharded.set_patches(weight_patches.patch_set(self.patches, self.patches_uuid, shapes, NODE))

    def _refuse_network_patches(self) -> None:
        found = [label for label, present in (
            ("hook weight patches", self.hook_patches),
            ("weight wrappers", self.weight_wrapper_patches),
            ("object patches of the network",
             [k for k in self.object_patches if k.startswith("diffusion_model") and k != REMOTE_FORWARD]),
        ) if present]
        if found:
            raise MgpuError(f"{NODE}: this FSDP model carries {', '.join(found)}, which would not reach the FSDP "
                            "ranks (only weight patches such as LoRA do). Remove the nodes that add them (hooks, "
                            "bypass LoRA, ...), or load the model on one device")


def free_rank_gpus(rank_devices: tuple[str, ...]) -> None:
    """Unload ComfyUI's own models (text encoder, VAE) from the ranks' GPUs before sampling.

    ComfyUI cannot see the ranks' memory, and the plan counts on the encoder being gone while the DiT computes;
    they come back by themselves when a later node needs them (the VAE for decoding). Only GPUs where ComfyUI holds
    a model are touched: asking ComfyUI about any other (free or total memory) would make this process open a
    CUDA context there, 0.3-0.5 GiB of the ranks' memory for nothing.
    """
    ranks = {torch.device(d) for d in rank_devices if torch.device(d).type != "cpu"}
    held = {m.device for m in mm.current_loaded_models if m.model is not None and m.device in ranks}
    for device in held:
        mm.free_memory(1e30, device)


def _no_host_memory(input_shape, cond_shapes=None) -> int:
    """BaseModel.memory_required of a sharded model: the host computes nothing, so ComfyUI always batches cond and
    uncond, which the ranks then split between them instead of running two half-idle calls."""
    return 0


class RemoteForward:
    """The host network's ``_forward`` (an object patch): runs it on the FSDP ranks; the meta network never runs.

    Being the network's own ``_forward``, it is what the innermost DIFFUSION_MODEL wrapper calls, so every wrapper
    stays outside it and sees the same tensors as with a local network.
    """

    def __init__(self, sharded: ShardedModule, label: str, signature: inspect.Signature):
        self.sharded = sharded
        self.label = label
        self.signature = signature

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        named, x, options = self.bind(args, kwargs)
        try:
            out = self.sharded(**named, timeout=(options or {}).get(OPTIONS_KEY, {}).get("timeout_s"),
                               cancelled=mm.processing_interrupted)
        except RankFailure as exc:
            raise pools.explain(exc, f"{self.label}: a denoising step") from exc
        except CallCancelled as exc:
            raise_interrupted(exc, self.label)
        return [o.to(x.device) for o in out] if isinstance(out, list) else out.to(x.device)

    def bind(self, args: tuple, kwargs: dict) -> tuple[dict, torch.Tensor, dict | None]:
        """The network's arguments by name, as the ranks take them (``transformer_options`` classified, what cannot
        travel refused by name), the latent input, and the options as ComfyUI passed them."""
        named = dict(self.signature.bind(*args, **kwargs).arguments)
        for p in self.signature.parameters.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                named.update(named.pop(p.name, {}))
        options = named.pop("transformer_options", None)
        odd = [k for k, v in named.items() if not remote_options.plain(v)]
        if odd:
            raise MgpuError(f"{self.label}: the network got {', '.join(odd)} (e.g. ControlNet), which cannot be sent "
                            "to the FSDP ranks yet; remove that node, or load the model on one device")
        x = first_tensor(list(named.values()))   # LTX-2 (0.33): x is its [video, audio] latents
        if options is not None:
            named["transformer_options"] = remote_options.for_ranks(options, x.shape[0], self.label)
        return named, x, options


# Methods of the network that ComfyUI calls on the host outside its forward: they run on the ranks, which hold the
# weights (LTX-2's text connectors, from LTXAV.extra_conds and LTXVDurationPredictor, ComfyUI 0.33).
RANK_METHODS = ("preprocess_text_embeds",)


class RemoteMethod:
    """One of ``RANK_METHODS`` on the host's meta network: runs on the ranks (``ShardedModule.call``)."""

    def __init__(self, sharded: ShardedModule, method: str, label: str):
        self.sharded, self.method, self.label = sharded, method, label

    def __call__(self, *args, **kwargs):
        try:
            out = self.sharded.call(self.method, *args, cancelled=mm.processing_interrupted, **kwargs)
        except RankFailure as exc:
            raise pools.explain(exc, f"{self.label}: {self.method}") from exc
        except CallCancelled as exc:
            raise_interrupted(exc, self.label)
        inputs = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        return out.to(inputs[0].device) if inputs and isinstance(out, torch.Tensor) else out


def raise_interrupted(exc: CallCancelled, label: str):
    """ComfyUI's Cancel reached the ranks: end the prompt as ComfyUI's own interrupt does (and clear its flag)."""
    log.info("%s: %s", label, exc)
    mm.throw_exception_if_processing_interrupted()
    raise mm.InterruptProcessingException() from exc   # the flag was cleared meanwhile: still an interrupt


class _ComfyShardedModule(PatchedModule):
    """Each (re)load first takes its loader's slot (``pools.occupy``) and frees the models it takes turns with
    (``pools.make_room``, Wan 2.2's experts one at a time: logged with the seconds it took), then runs ``prepare`` on
    the ranks: it imports ComfyUI there outside the meta-device build and agrees on the dtype. The first load fixes
    the dtype; reloads (after a rank failure, or an eviction) keep it, since the host's BaseModel was built for it."""

    def __init__(self, pool, spec: ModelSpec, handle: str, unet_dtype: str | None, slot: tuple | None = None):
        super().__init__(pool, spec, handle)
        self.unet_dtype = unet_dtype
        self.manual_cast: str | None = None
        self.slot = slot

    def load(self, timeout: float | None = None, cancelled=None) -> list[dict]:
        pools.occupy(self.slot, self)
        freed, began = pools.make_room(self), time.perf_counter()
        kwargs = self.spec.factory_kwargs
        replies = self.pool.call(PREPARE, {"checkpoint": self.spec.checkpoint, "flags": kwargs["flags"],
                                           "unet_dtype": self.unet_dtype}, timeout=timeout, cancelled=cancelled)
        self.unet_dtype, self.manual_cast = agree_dtype([r.payload for r in replies], kwargs["devices"])
        if fp8_line := fp8_compute_summary([r.payload for r in replies]):
            log.info("%s: %s", NODE, fp8_line)
        kwargs["unet_dtype"] = self.unet_dtype
        replies = super().load(timeout, cancelled)
        if freed:
            log.info("%s: freed %s to load %s: %.1f s", NODE, ", ".join(map(os.path.basename, freed)),
                     os.path.basename(self.spec.checkpoint), time.perf_counter() - began)
        return replies


def load_fsdp(path: str, name: str, devices: list[str], dtype: str | None, reshard_after_forward: bool,
              slot: tuple | None, sp_degree: int, plan):
    """A weightless MODEL whose network is sharded over ``devices``; the ranks load it now, so errors show here.
    ``sp_degree``: ranks that split each video's tokens (lowered on the ranks to one the heads allow). Beside other
    models on these ranks it stays, or takes turns with them, as ``plan`` (the one ``load`` follows) or the ranks'
    free memory says (``loaders.experts``)."""
    pools.release_garbage()   # a model this one replaces leaves the GPUs first
    model_config, sd, prefix = detect(path)
    handle = f"dit-{next(_handles)}"
    comfy_root = os.path.dirname(os.path.abspath(folder_paths.__file__))   # the ComfyUI checkout
    pool = pools.acquire(devices, handle, [comfy_root])
    spec = ModelSpec(factory=FACTORY, checkpoint=path, key_prefix=prefix, cached_inputs=CACHED_INPUTS,
                     reshard_after_forward=reshard_after_forward, sp_degree=sp_degree,
                     factory_kwargs={"checkpoint": path, "devices": devices,
                                     "flags": numeric_flags(comfy.cli_args.args)})
    sharded = _ComfyShardedModule(pool, spec, handle, dtype, slot)
    label = f"{name} sharded over {len(devices)} ranks ({', '.join(devices)})"
    began = time.perf_counter()
    try:
        pools.occupy(slot, sharded)   # this loader's previous model is not one to share the ranks with
        experts.share_ranks(sharded, plan, NODE)
        sharded.load(cancelled=mm.processing_interrupted)
        degrees = sharded.load_replies[0].get("layout", {}).get("degrees", [1])
        log.info("%s: %s loaded in %.1f s (%s, compute %s; sequence-parallel degrees %s, chosen per step after the "
                 "CFG/batch split)", NODE, label, time.perf_counter() - began, sharded.unet_dtype,
                 sharded.manual_cast or sharded.unet_dtype, ", ".join(map(str, degrees)))
        model_config.set_inference_dtype(getattr(torch, sharded.unet_dtype),
                                         sharded.manual_cast and getattr(torch, sharded.manual_cast))
        base = model_config.get_model(sd, "", device="meta")
        if quantized(model_config):   # ComfyUI's quantized layers get their (meta) weights as stock's have them
            load_layers_on_meta(base.diffusion_model, sd)
    except BaseException as exc:
        pools.release(sharded)
        if isinstance(exc, RankFailure):
            raise pools.explain(exc, f"{NODE}: loading {label}") from exc
        if isinstance(exc, CallCancelled):
            raise_interrupted(exc, f"{NODE}: loading {label}")
        raise
    return sharded_patcher(base, sharded, devices, label)


def sharded_patcher(base, sharded: ShardedModule, devices: list[str], label: str) -> ShardedModelPatcher:
    """The MODEL around the host's meta ``base``: its network's forward runs on ``sharded``, whose shards are
    freed once ComfyUI drops the last clone of it."""
    pools.release_with(base, sharded)
    cpu = torch.device("cpu")   # the host only does the sampler's arithmetic on the latent
    base.device = cpu
    patcher = ShardedModelPatcher(base, load_device=cpu, offload_device=cpu)
    patcher.rank_devices = tuple(devices)
    signature = inspect.signature(base.diffusion_model._forward)
    patcher.add_object_patch(REMOTE_FORWARD, RemoteForward(sharded, label, signature))
    for method in RANK_METHODS:   # the network's own attribute, not an object patch: also outside sampling
        if hasattr(base.diffusion_model, method):
            setattr(base.diffusion_model, method, RemoteMethod(sharded, method, label))
    patcher.add_object_patch("memory_required", _no_host_memory)
    return patcher


def with_step_timeout(model, timeout_s: float):
    """A clone of ``model`` whose FSDP steps fail after ``timeout_s`` instead of the pool's default."""
    model = model.clone()
    model.model_options["transformer_options"][OPTIONS_KEY] = {"timeout_s": timeout_s}
    return model
