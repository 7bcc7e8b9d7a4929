"""Checks that run inside a ComfyUI interpreter on the CPU (tests/test_comfyui_host.py starts one per check).

Each ``check_*`` function returns JSON-able facts; the test asserts on them. They import ComfyUI, so they run in a
child process: importing comfy probes devices and parses global state that must not leak into pytest.
"""

from __future__ import annotations

import gc
import inspect
import re
import resource
import uuid
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch

WAN = "mgpu_host_wan.safetensors"


# ----------------------------------------------------------------------------------------------- helpers

class StubSharded:
    """Stands in for a ShardedModule when no rank is needed: records whether it was freed."""

    def __init__(self, devices: list[str]):
        self.pool = SimpleNamespace(config=SimpleNamespace(devices=list(devices)))
        self.handle = f"stub-{uuid.uuid4().hex[:6]}"
        self.spec = SimpleNamespace(checkpoint="stub.safetensors")
        self.freed = 0

    def free(self) -> None:
        self.freed += 1

    def set_patches(self, patch_set) -> None:
        """The sampling clone's weight patches (none here): a real one sends them before its next forward."""
        self.patches = patch_set


def meta_base(folder: str):
    """The host's BaseModel of a tiny Wan on meta, as load_fsdp builds it."""
    from comfy_checkpoints import write_tiny_wan21_t2v
    from loaders.rank_factory import detect

    path = write_tiny_wan21_t2v(Path(folder) / WAN)
    model_config, sd, _ = detect(str(path))
    model_config.set_inference_dtype(torch.float32, None)
    return model_config.get_model(sd, "", device="meta")


def sharded_patcher(folder: str, devices: list[str]):
    from loaders import diffusion

    return diffusion.sharded_patcher(meta_base(folder), StubSharded(devices), devices, "stub model")


class FakeGpuModels:
    """ComfyUI models 'loaded' on GPUs this machine does not have: real ModelPatchers and LoadedModels on a tiny
    module, entered in ``current_loaded_models`` the way load_models_gpu leaves them."""

    def __init__(self):
        import comfy.model_management as mm

        self.mm = mm
        self.patchers = {}

    def add(self, device: str) -> None:
        import comfy.model_patcher

        patcher = comfy.model_patcher.ModelPatcher(torch.nn.Linear(4, 4), load_device=torch.device(device),
                                                   offload_device=torch.device("cpu"))
        loaded = self.mm.LoadedModel(patcher)
        loaded.real_model = weakref.ref(patcher.model)
        loaded.model_finalizer = weakref.finalize(patcher.model, lambda: None)
        self.mm.current_loaded_models.insert(0, loaded)
        self.patchers[device] = patcher

    def devices(self) -> list[str]:
        return sorted(str(m.device) for m in self.mm.current_loaded_models if str(m.device).startswith("cuda"))


class DeviceCalls:
    """Records every model-management or torch.cuda call that names (or implies) a GPU; answers for GPUs that this
    CPU machine lacks as a GPU with memory to spare would."""

    CUDA = ("mem_get_info", "set_device", "synchronize", "empty_cache", "ipc_collect", "memory_stats",
            "memory_allocated", "memory_reserved", "get_device_properties", "current_device", "init", "device")

    def __init__(self):
        import comfy.model_management as mm

        self.calls: list[str] = []
        for name in ("get_total_memory", "get_free_memory"):
            setattr(mm, name, self._memory(name, getattr(mm, name)))
        mm.free_memory = self._recorded("free_memory", mm.free_memory)
        for name in self.CUDA:
            if hasattr(torch.cuda, name):
                setattr(torch.cuda, name, self._recorded(f"torch.cuda.{name}", getattr(torch.cuda, name)))

    def _recorded(self, name, fn):
        def call(*args, **kwargs):
            self.calls.append(f"{name}{tuple(str(a) for a in args)}")
            return fn(*args, **kwargs)
        return call

    def _memory(self, name, fn):
        def call(dev=None, torch_too=False, **kwargs):
            if dev is None or torch.device(dev).type != "cuda":
                return fn(dev, torch_too, **kwargs)
            self.calls.append(f"{name}('{dev}')")
            return (1 << 40, 1 << 40) if torch_too or any(kwargs.values()) else 1 << 40
        return call

    def gpus(self) -> list[str]:
        """The GPUs named in the calls so far."""
        return sorted({gpu for call in self.calls for gpu in re.findall(r"cuda(?::\d+)?", call)})


# ----------------------------------------------------------------------------------------------- checks

def check_clone_frees_rank_gpus(folder: str) -> dict:
    """A sharded MODEL as samplers get it (cloned, then patched by ModelSamplingSD3), loaded by ComfyUI's model
    management with a model of ComfyUI's on one rank GPU and one on another GPU."""
    import comfy.model_management as mm
    import comfy_extras.nodes_model_advanced as advanced

    patcher = sharded_patcher(folder, ["cuda:1", "cuda:2"])
    node = advanced.ModelSamplingSD3
    shifted = node().patch(patcher.clone(), 5.0)[0] if hasattr(node, "patch") else node.execute(patcher, 5.0)[0]
    gpus = FakeGpuModels()
    gpus.add("cuda:2")
    gpus.add("cuda:0")
    DeviceCalls()
    mm.load_models_gpu([shifted])
    return {"rank_devices": list(shifted.rank_devices), "left": gpus.devices(),
            "patched": "model_sampling" in shifted.object_patches}


def check_only_gpus_holding_models_are_touched(folder: str) -> dict:
    """Rank GPUs cuda:0 and cuda:1: first ComfyUI holds nothing on them, then a model on cuda:1 (and on cuda:3,
    not a rank GPU)."""
    patcher = sharded_patcher(folder, ["cuda:0", "cuda:1"])
    gpus = FakeGpuModels()
    gpus.add("cuda:3")
    calls = DeviceCalls()
    patcher.load(torch.device("cpu"))
    nothing_held = calls.gpus()
    gpus.add("cuda:1")
    patcher.load(torch.device("cpu"))
    return {"nothing_held": nothing_held, "one_held": calls.gpus(), "left": gpus.devices(),
            "cuda1_detached": gpus.patchers["cuda:1"].model.device == torch.device("cpu")}


def _sample(model, seed: int = 1, cfg: float = 3.0) -> torch.Tensor:
    """One Euler step of Wan on a tiny latent, cond and uncond batched, as KSampler runs it."""
    import comfy.sample

    latent = torch.zeros(1, 16, 1, 8, 8)
    g = torch.Generator().manual_seed(seed)
    pos = [[torch.randn(1, 8, 4096, generator=g), {}]]
    neg = [[torch.zeros(1, 8, 4096), {}]]
    noise = comfy.sample.prepare_noise(latent, seed)
    return comfy.sample.sample(model, noise, 1, cfg, "euler", "simple", pos, neg, latent, seed=seed,
                               disable_pbar=True)


def check_transformer_options_of_real_sampling(folder: str) -> dict:
    """Every transformer_options key a stock sampling step hands Wan and LTX-Video networks (cond and uncond
    batched, and one at a time), recorded by a DIFFUSION_MODEL wrapper like other nodes add."""
    import comfy.patcher_extension
    import comfy.sample
    import comfy.sd
    from comfy_checkpoints import LTXVDiTConfig, WanDiTConfig, write_tiny_ltxv, write_tiny_wan21_t2v

    seen: dict[str, list[str]] = {}
    files = {"wan": write_tiny_wan21_t2v(Path(folder) / "wan.safetensors", WanDiTConfig()),
             "ltxv": write_tiny_ltxv(Path(folder) / "ltxv.safetensors", LTXVDiTConfig())}
    for family, path in files.items():
        model = comfy.sd.load_diffusion_model(str(path))

        def record(executor, *args, **kwargs):
            named = inspect.signature(executor.class_obj._forward).bind(*args, **kwargs).arguments
            for key in named.get("transformer_options") or {}:
                seen.setdefault(key, []).append(family)
            return executor(*args, **kwargs)

        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "mgpu_test", record)
        latent = torch.zeros(1, 16, 1, 8, 8) if family == "wan" else torch.zeros(1, 128, 1, 4, 4)
        g = torch.Generator().manual_seed(0)
        pos = [[torch.randn(1, 8, 4096, generator=g), {"attention_mask": torch.ones(1, 8, dtype=torch.long)}]]
        neg = [[torch.zeros(1, 40, 4096), {"attention_mask": torch.ones(1, 40, dtype=torch.long)}]]
        for negative in (pos, neg):   # same length: one batch; different lengths: one call each
            comfy.sample.sample(model, torch.randn_like(latent), 1, 3.0, "euler", "simple", pos, negative, latent,
                                seed=0, disable_pbar=True)
    return {k: sorted(set(v)) for k, v in seen.items()}


def _rank_handles(sharded) -> list[str]:
    return sharded.pool.call("stats")[0].payload["handles"]


def check_model_lifetimes(folder: str) -> dict:
    """Four loads of one file on 2 CPU ranks by loader node "4" of tabs A, B, C and B again: what the ranks hold
    when each load starts (after its loader's previous model left), and whether models still held still sample."""
    import folder_paths

    import mgpu.sharding.sharded
    from comfy_checkpoints import WanDiTConfig, write_tiny_wan21_t2v
    from loaders import diffusion

    write_tiny_wan21_t2v(Path(folder) / WAN, WanDiTConfig())
    folder_paths.add_model_folder_path("diffusion_models", folder)
    at_load_start: list[list[str]] = []
    real_load = mgpu.sharding.sharded.ShardedModule.load

    def load(self, *args, **kwargs):
        if self.pool.alive:
            at_load_start.append(_rank_handles(self))
        return real_load(self, *args, **kwargs)

    mgpu.sharding.sharded.ShardedModule.load = load

    def loader(tab: str):
        return diffusion.load(WAN, "default", "fsdp", 2, slot=(tab, "4"))

    def handle(model) -> str:
        return model.object_patches[diffusion.REMOTE_FORWARD].sharded.handle

    a = loader("A")
    b = loader("B")                      # the same node id in another tab: A's model stays
    same_ab = torch.equal(_sample(a), _sample(b))
    held = [a]
    held.append(held)                    # ComfyUI's caches hold outputs in structures only the collector frees
    del a, held                          # tab A's MODEL is garbage now
    c = loader("C")                      # A's shards leave before C loads
    d = loader("B")                      # B's loader again, B's old MODEL still cached: it leaves the GPUs first
    on_ranks_after_d = _rank_handles(b.object_patches[diffusion.REMOTE_FORWARD].sharded)
    same_bd = torch.equal(_sample(b), _sample(d))   # the evicted one still samples (reloads, evicting d, then d back)
    return {"at_load_start": at_load_start, "after_d": on_ranks_after_d, "same": [same_ab, same_bd],
            "handles": [handle(m) for m in (b, c, d)]}


def check_vae_reads_only_its_tensors(folder: str, dit_gib: float) -> dict:
    """MGPU Load VAE on an all-in-one file (VAE under vae., a DiT of ``dit_gib`` GiB of holes beside it), against
    ComfyUI's own VAE loading on the VAE alone: peak RSS growth and the decoded frames. Under ComfyUI's
    --disable-mmap (network drives, Windows), where every tensor read is a copy in RAM."""
    import comfy.cli_args

    comfy.cli_args.args.disable_mmap = True
    import comfy.sd
    import comfy.utils
    import folder_paths

    comfy.utils.DISABLE_MMAP = True
    import ckpt_layouts as L
    from comfy_checkpoints import random_state_dict, save_checkpoint, wan21_vae_shapes
    from loaders import components
    from mgpu.planning.sizing import read_header

    vae_sd = random_state_dict(wan21_vae_shapes(), seed=5)
    pure = save_checkpoint(Path(folder) / "pure_vae.safetensors", vae_sd)
    dit_elems = int(dit_gib * (1 << 30)) // 2
    layout = {**{f"vae.{k}": (tuple(v.shape), "BF16") for k, v in vae_sd.items()},
              "model.diffusion_model.blob": ((dit_elems,), "BF16")}
    combined = L.write_safetensors(Path(folder) / "all_in_one.safetensors", layout, sparse=True,
                                   metadata={"mgpu_test": "kept"})
    header = read_header(combined)
    with open(combined, "r+b") as f:   # the VAE's bytes for real; the DiT stays a hole
        for k, v in vae_sd.items():
            f.seek(header.tensors[f"vae.{k}"].start)
            f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
    del vae_sd
    gc.collect()
    folder_paths.add_model_folder_path("vae", folder)
    latent = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(3))

    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ours = components.load_vae(combined.name, "cpu")
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak_before
    ours_frames = ours.decode(latent)
    del ours
    stock = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(pure)))
    _, metadata = components.vae_state_dict(str(combined))
    return {"rss_growth": growth, "dit_bytes": dit_elems * 2, "same": torch.equal(ours_frames, stock.decode(latent)),
            "metadata": metadata}


def check_multigpu_cfg_split_is_refused(folder: str) -> dict:
    """ComfyUI 0.33's MultiGPU CFG Split on a sharded MODEL, on a machine that (as faked here) has two GPUs: the
    node asks the model for a full copy on the second. ComfyUI 0.3.x has no such node."""
    try:
        import comfy_extras.nodes_multigpu as multigpu
    except ImportError:
        return {"node": False}
    import comfy.model_management as mm

    from mgpu.errors import MgpuError

    patcher = sharded_patcher(folder, ["cuda:0", "cuda:1"])
    mm.get_all_torch_devices = lambda exclude_current=False: [torch.device("cuda:0"), torch.device("cuda:1")]
    try:
        multigpu.MultiGPUCFGSplitNode.execute(patcher, 2)
        return {"node": True, "raised": None}
    except MgpuError as exc:
        return {"node": True, "raised": "MgpuError", "message": str(exc)}
    except Exception as exc:   # noqa: BLE001 - reported for the assertion
        return {"node": True, "raised": type(exc).__name__, "message": str(exc)}


def check_loader_decides_alike_with_and_without_a_plan(folder: str) -> dict:
    """MGPU Load Diffusion Model's ``load`` on a (simulated) 2 x 24 GiB machine for a 14B Wan DiT (a header-only
    file), with no plan and with MGPU Plan connected for the same file at its default size: what it would load
    (``load_fsdp`` / ``load_single`` recorded, not run), the plan each ``resolve`` got, and what it logged."""
    import logging

    import folder_paths

    import ckpt_layouts as L
    from loaders import diffusion, placement
    from loaders import model_files as mf
    from mgpu.planning.devices import parse_spec

    models = Path(folder) / "diffusion_models"
    models.mkdir()
    L.write_safetensors(models / "wan14b.safetensors", L.wan21_t2v_14b(), sparse=True)
    folder_paths.add_model_folder_path("diffusion_models", str(models), is_default=True)
    machine = parse_spec("2x24GiB,cpu=64GiB")
    placement.available_devices = lambda replacing=(): machine
    placement.live_devices = lambda: machine
    loads, resolved, lines = [], [], []

    def load_fsdp(path, name, devices, dtype, reshard_after_forward, slot, sp_degree, plan):
        loads.append({"fsdp": devices, "dtype": dtype, "reshard": reshard_after_forward, "sp": sp_degree})

    def load_single(path, device, dtype):
        loads.append({"single": str(device), "dtype": dtype})

    def resolve(choice, role, plan=None, devices=None):
        resolved.append(None if plan is None else "own" if placement.is_own(plan) else "MGPU Plan")
        return real_resolve(choice, role, plan, devices)

    real_resolve = diffusion.resolve
    diffusion.load_fsdp, diffusion.load_single, diffusion.resolve = load_fsdp, load_single, resolve
    diffusion.add_plan_check = lambda *args: None
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("mgpu").addHandler(handler)
    logging.getLogger("mgpu").setLevel(logging.INFO)
    facts = []
    for device, dtype in (("auto", "default"), ("auto", "fp8_e4m3fn"), ("fsdp", "default")):
        request = mf.PlanRequest(dit="wan14b.safetensors", dit_weight_dtype=dtype)
        plan = mf.make_plan_for(request, mf.comfy_folders()[1], live=lambda: machine)
        for connected in (None, plan):
            del loads[:], resolved[:], lines[:]
            diffusion.load("wan14b.safetensors", dtype, device, 0, connected)
            facts.append({"device": device, "dtype": dtype, "connected": connected is not None, "loads": list(loads),
                          "resolved": list(resolved), "log": list(lines)})
    return facts
