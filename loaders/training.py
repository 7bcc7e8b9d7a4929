"""MGPU Train LoRA, host side: ComfyUI's own Train LoRA loop, with the network and the optimizer on the FSDP ranks.

What stays ComfyUI's, so the result equals its Train LoRA for the same seed: the adapters' first values (its
``create_train`` per layer, in module order, drawing from the global generator right after ``manual_seed(seed)``:
the host makes them and sends them), and the whole loop, its ``TrainSampler`` run by its ``Guider_Basic``: the batch
(``randperm``), the noise (``Noise_RandomNoise(seed + 1000 i)``), the sigmas (``percent_to_sigma(rand)``), the
conditioning, ``model_sampling`` and the loss on the predicted x0. What moves: the network's forward is a
``RemoteNetwork`` node of the host's graph (``mgpu.training.run``), so ``loss.backward()`` reaches the ranks, and
the optimizer is ``RemoteOptimizer``, whose step sums the gradients over the ranks and updates their adapters.
The global generator is forked for the run: ComfyUI's own is left as it was.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace

import comfy.model_management as mm
import comfy.utils
import torch

from mgpu.errors import CallCancelled, MgpuError, RankFailure
from mgpu.planning.devices import format_bytes
from mgpu.training.run import TrainingRun

from . import pools
from .training_checkpoints import RunCheckpoints, newest
from .diffusion import REMOTE_FORWARD, RemoteForward, ShardedModelPatcher, raise_interrupted

log = logging.getLogger("mgpu")

NODE = "MGPU Train LoRA"
FACTORY = "loaders.train_adapters:build"
MODE = "loaders.train_adapters:training_mode"
NETWORK = "diffusion_model."   # the host BaseModel's prefix of the network the ranks hold
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LOSSES = {"MSE": torch.nn.MSELoss, "L1": torch.nn.L1Loss, "Huber": torch.nn.HuberLoss,
          "SmoothL1": torch.nn.SmoothL1Loss}   # ComfyUI's Train LoRA's choices
OPTIMIZERS = ("AdamW", "Adam", "SGD", "RMSprop")
ALGORITHMS = ("LoRA",)   # the others' first values depend on more than the weight's shape: not yet over FSDP
NO_LORA = "[None]"
# Networks whose ComfyUI code autograd cannot train through, by class name, and why: refused before any rank works.
NOT_TRAINABLE = {
    "LTXVModel": "its blocks add to their input in place (x += attn2(x, ...)) after layers kept that input for the "
                 "backward, so autograd refuses the backward (ComfyUI's own Train LoRA fails on it the same way)",
    "LTXAVModel": "its video blocks add to their input in place as LTX-Video's do, so autograd refuses the backward, "
                  "and it answers with two streams (video and audio)",
}


@dataclass
class TrainSettings:
    """Core Train LoRA's inputs, with its names and meanings."""

    batch_size: int = 1
    grad_accumulation_steps: int = 1
    steps: int = 16
    learning_rate: float = 0.0005
    rank: int = 8
    optimizer: str = "AdamW"
    loss_function: str = "MSE"
    seed: int = 0
    training_dtype: str = "bf16"
    lora_dtype: str = "bf16"
    algorithm: str = "LoRA"
    gradient_checkpointing: bool = True
    existing_lora: str = NO_LORA
    run_name: str = "mgpu_lora"      # names the run's checkpoint folder
    checkpoint_every: int = 0        # optimizer steps between checkpoints; 0: only at the end (and at a Cancel)
    keep_checkpoints: int = 3        # the newest checkpoints kept; 0: all
    resume: bool = False             # go on from the run's newest checkpoint
    timestep_start: float = 0.0      # the share of the noise schedule trained on, as ComfyUI's percents: 0 is the
    timestep_end: float = 1.0        # noisiest, 1 the cleanest (Wan 2.2: the high-noise expert 0..boundary)

    def fingerprint(self) -> dict:
        """What a resumed run must share with its checkpoint (the steps may grow; where checkpoints go may
        change)."""
        skip = {"steps", "run_name", "checkpoint_every", "keep_checkpoints", "resume",
                "gradient_checkpointing"}   # memory against compute: the same LoRA either way
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def check(self) -> None:
        """Refuse what this node cannot do, by name, before anything runs."""
        for name, value, allowed in (("training_dtype", self.training_dtype, DTYPES),
                                     ("lora_dtype", self.lora_dtype, DTYPES), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("loss_function", self.loss_function, LOSSES),
                                     ("algorithm", self.algorithm, ALGORITHMS)):
            if value not in allowed:
                raise MgpuError(f"{NODE}: {name} {value!r} is not supported over FSDP ranks; choose one of "
                                f"{', '.join(allowed)} (or ComfyUI's Train LoRA on a one-device model)")
        if not 0.0 <= self.timestep_start < self.timestep_end <= 1.0:
            raise MgpuError(f"{NODE}: timestep_start {self.timestep_start} and timestep_end {self.timestep_end} must "
                            "satisfy 0 <= start < end <= 1 (shares of the noise schedule, 0 the noisiest)")
        if self.existing_lora != NO_LORA and not self.existing_lora.lower().endswith(".safetensors"):
            raise MgpuError(f"{NODE}: existing_lora {self.existing_lora!r} is not a .safetensors file; this pack "
                            "never unpickles a file: convert it to safetensors first")


def follow_plan(plan, model, settings: TrainSettings, run: dict | None = None) -> TrainSettings:
    """``settings`` as a connected MGPU Plan made for training decides them: gradient checkpointing and the rows per
    forward (its batch_size and grad_accumulation_steps keep the rows per optimizer step it was asked for). A plan
    made for sampling is refused; one sized for another LoRA, dtype or ranks than the node's is followed with a
    warning naming the difference. ``run``: the settings a resumed run was trained with (its checkpoint's
    fingerprint): its rows per forward and accumulation are kept, whatever the plan made of today's free memory."""
    if plan is None:
        return settings
    if not plan.workload.get("train"):
        raise MgpuError(f"{NODE}: the connected MGPU Plan was made for sampling: turn its train input on (with this "
                        "node's LoRA rank and optimizer), or disconnect it")
    placed = plan.expert(model.sharded.spec.checkpoint) or plan.placement("dit")   # Wan 2.2: this expert's
    if placed is None or placed.training is None:
        raise MgpuError(f"{NODE}: the connected MGPU Plan has no training step for a DiT: make it again with a dit "
                        "and train on")
    asked = plan.workload["train"]
    planned = {"rank": asked["lora_rank"], "optimizer": asked["optimizer"],
               "training_dtype": asked["training_dtype"], "lora_dtype": asked["lora_dtype"]}
    if differ := {k: v for k, v in planned.items() if getattr(settings, k) != v}:
        log.warning("%s: the MGPU Plan was sized for %s; this node trains with %s: its memory estimate does not hold "
                    "(set the plan's lora_rank and optimizer to this node's; it plans bf16)", NODE,
                    ", ".join(f"{k} {v}" for k, v in differ.items()),
                    ", ".join(f"{k} {getattr(settings, k)}" for k in differ))
    if model.rank_devices and list(model.rank_devices) != list(placed.devices):
        log.warning("%s: the MGPU Plan shards the DiT over %s, but this MODEL's ranks are %s: connect the plan to "
                    "MGPU Load Diffusion Model (device auto) too", NODE, ", ".join(placed.devices),
                    ", ".join(model.rank_devices))
    chosen = {"gradient_checkpointing": placed.training["gradient_checkpointing"],
              "batch_size": placed.training["batch_size"],
              "grad_accumulation_steps": placed.training["grad_accumulation_steps"]}
    for k in ("batch_size", "grad_accumulation_steps"):
        if run is not None and k in run and run[k] != chosen[k]:
            log.info("%s: resume: the run was trained with %s %s; kept over the plan's %s", NODE, k, run[k], chosen[k])
            chosen[k] = run[k]
    log.info("%s: following the MGPU Plan: %s (asked on this node: %s)", NODE,
             ", ".join(f"{k} {v}" for k, v in chosen.items()),
             ", ".join(f"{k} {getattr(settings, k)}" for k in chosen))
    return replace(settings, **chosen)


def dataset(latents: list[dict], positive: list) -> tuple[torch.Tensor, list, int]:
    """The latents as one batch and one conditioning per latent, by ComfyUI's Train LoRA's rules: several LATENT
    inputs are split into single latents and joined, one conditioning serves every latent, else one each."""
    if len(latents) == 1:
        samples = latents[0]["samples"]
    else:
        parts = [s[None] for latent in latents for s in latent["samples"]]
        if len({p.shape for p in parts}) > 1:
            raise MgpuError(f"{NODE}: the latents have different sizes ({sorted({tuple(p.shape) for p in parts})}); "
                            "training several resolutions at once is not supported over FSDP ranks yet: give one "
                            "size (e.g. resize the images before VAE Encode)")
        samples = torch.cat(parts)
    count = samples.shape[0]
    flat = positive[0] if len(positive) == 1 else [c for group in positive for c in
                                                    (group if isinstance(group, list) else [group])]
    if len(flat) == 1 and count > 1:
        flat = flat * count
    elif len(flat) != count:
        raise MgpuError(f"{NODE}: {len(flat)} conditionings for {count} latents; give one conditioning for all "
                        "latents, or one per latent")
    return samples, flat, count


def existing(name: str) -> tuple[dict[str, torch.Tensor], int]:
    """An existing LoRA to go on training (safetensors only) and the steps its name records, as core reads them
    (``<prefix>_<steps>_steps_<date>``)."""
    if name == NO_LORA:
        return {}, 0
    import folder_paths

    path = folder_paths.get_full_path_or_raise("loras", name)
    try:
        steps = int(name.split("_steps_")[0].split("_")[-1])
    except ValueError:
        steps = 0
    return comfy.utils.load_torch_file(path, safe_load=True), steps


def first_adapters(base, settings: TrainSettings, existing_weights: dict[str, torch.Tensor]
                   ) -> tuple[list[dict], dict[str, torch.Tensor], list[str]]:
    """ComfyUI's Train LoRA's adapters for ``base`` (the host's BaseModel, on meta), made as it makes them: every
    layer with a ``weight_function`` in module order, an existing adapter from ``existing_weights`` or a new one of
    ``settings.algorithm`` (``create_train``, drawing from the global generator: the caller seeds it), a zero
    difference for 1-D weights and biases. Returns the ranks' specs (network-relative keys), the first values (LoRA
    keys, network-relative) and the LoRA keys as core names them, in its order."""
    from comfy.weight_adapter import adapter_maps, adapters

    dtype = DTYPES[settings.lora_dtype]
    specs: list[dict] = []
    first: dict[str, torch.Tensor] = {}
    order: list[str] = []
    for name, module in base.named_modules():
        if not hasattr(module, "weight_function"):
            continue
        if not name.startswith(NETWORK):
            raise MgpuError(f"{NODE}: layer {name} is outside the diffusion network the ranks hold")
        local = name[len(NETWORK):]
        weight = getattr(module, "weight", None)
        if weight is not None:
            if weight.ndim >= 2:
                key = f"{name}.weight"
                alpha = float(existing_weights.get(f"{key}.alpha", 1.0))
                loaded = next((a for a in (cls.load(name, existing_weights, alpha, existing_weights.get(
                    f"{key}.dora_scale")) for cls in adapters) if a is not None), None)
                if loaded is not None:
                    adapter = loaded.to_train().to(dtype)
                    _check_fits(adapter, name, weight.shape, settings.existing_lora)
                else:   # the shape and device are all create_train reads of the weight: no weight memory here
                    standin = SimpleNamespace(shape=weight.shape, device=torch.device("cpu"), dtype=weight.dtype)
                    adapter = adapter_maps[settings.algorithm].create_train(standin, rank=settings.rank,
                                                                            alpha=1.0).to(dtype)
                specs.append({"key": f"{local}.weight", "kind": "adapter"})
                for pname, param in adapter.named_parameters():
                    first[f"{local}.{pname}"] = param.detach()
                    order.append(f"{name}.{pname}")
            else:
                specs.append({"key": f"{local}.weight", "kind": "diff"})
                first[f"{local}.diff"] = torch.zeros(weight.shape, dtype=dtype)
                order.append(f"{name}.diff")
        if getattr(module, "bias", None) is not None:
            specs.append({"key": f"{local}.bias", "kind": "diff"})
            first[f"{local}.diff_b"] = torch.zeros(module.bias.shape, dtype=dtype)
            order.append(f"{name}.diff_b")
    if not specs:
        raise MgpuError(f"{NODE}: the model has no ComfyUI layer to train an adapter on")
    return specs, first, order


def _check_fits(adapter, layer: str, shape: torch.Size, file: str) -> None:
    """An existing LoRA made for another model: refused by name here, before the ranks get shapes that fail inside
    the first forward."""
    up, down = getattr(adapter, "lora_up", None), getattr(adapter, "lora_down", None)
    if up is None or down is None:
        return
    if up.weight.shape[0] != shape[0] or down.weight[0].numel() != shape[1:].numel():
        raise MgpuError(f"{NODE}: existing_lora {file!r} does not fit this model: its {layer} is "
                        f"{tuple(up.weight.shape[:1])} x {tuple(down.weight.shape[1:])}, the layer's weight is "
                        f"{tuple(shape)}. Pick a LoRA trained for this model, or [None]")


class TrainingForward(RemoteForward):
    """The network's ``_forward`` during a run: the ranks' forward as a node of the host's graph."""

    def __init__(self, remote: RemoteForward, run: TrainingRun):
        super().__init__(remote.sharded, remote.label, remote.signature)
        self.run = run

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        named, x, _ = self.bind(args, kwargs)
        return self.run.network(**named).to(x.device)


class SigmaRange(torch.nn.Module):
    """The model's ``model_sampling`` with ``percent_to_sigma`` confined to ``[start, end]``: core's loop draws each
    row's sigma as ``percent_to_sigma(rand())``, so the same draws land in that share of the schedule (a Wan 2.2
    expert's). Everything else is the model's own."""

    def __init__(self, inner: torch.nn.Module, start: float, end: float):
        super().__init__()
        self.inner, self.start, self.end = inner, start, end

    def percent_to_sigma(self, percent: float):
        return self.inner.percent_to_sigma(self.start + (self.end - self.start) * percent)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class RemoteOptimizer:
    """What ComfyUI's TrainSampler sees as its optimizer: the adapters live on the ranks (no parameter here),
    ``step`` runs there; one progress update per optimizer step, with the loss; a checkpoint when one is due."""

    param_groups: list = []

    def __init__(self, run: TrainingRun, steps: int, losses: list[float], node_id: str | None,
                 checkpoints: RunCheckpoints, done: int = 0):
        self.run, self.losses, self.node_id, self.checkpoints = run, losses, node_id, checkpoints
        self.bar = comfy.utils.ProgressBar(steps)
        self.bar.update(done)
        self.done = done
        checkpoints.mark_boundary(done)

    def step(self) -> None:
        self.run.step()
        self.done += 1
        self.checkpoints.mark_boundary(self.done)
        loss = self.losses[-1] if self.losses else float("nan")
        log.info("%s: step %d of %d, loss %.5f", NODE, self.done, self.bar.total, loss)
        _progress_text(f"step {self.done}/{self.bar.total}  loss {loss:.4f}", self.node_id)
        if self.checkpoints.due(self.done, self.bar.total):
            self.checkpoints.save(self.run, self.losses)
        self.bar.update(1)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The ranks clear their gradients after their step."""


def _progress_text(text: str, node_id: str | None) -> None:
    try:
        from server import PromptServer

        send = getattr(PromptServer.instance, "send_progress_text", None)   # ComfyUI 0.33
        if send is not None and node_id is not None:
            send(text, node_id)
    except (ImportError, AttributeError):
        pass


def train(model, latents: list[dict], positive: list, settings: TrainSettings,
          node_id: str | None = None, plan=None) -> tuple[dict[str, torch.Tensor], dict, int]:
    """Train a LoRA on the ranks of ``model`` (MGPU Load Diffusion Model on fsdp); returns core's outputs:
    ``LORA_MODEL`` (keys as core names them), ``LOSS_MAP``, the steps. A connected training ``plan`` decides
    checkpointing and the rows per forward (``follow_plan``)."""
    settings.check()
    if not isinstance(model, ShardedModelPatcher):
        raise MgpuError(f"{NODE}: this MODEL is not sharded over FSDP ranks: load it with MGPU Load Diffusion "
                        "Model on device fsdp, or train it on one device with ComfyUI's Train LoRA")
    network = type(model.model.diffusion_model).__name__
    if network in NOT_TRAINABLE:
        raise MgpuError(f"{NODE}: this MODEL's network is ComfyUI's {network}, which cannot be trained: "
                        f"{NOT_TRAINABLE[network]}. Train a Wan 2.1 / 2.2 model")
    trained = newest(NODE, settings.run_name) if settings.resume and plan is not None else None
    settings = follow_plan(plan, model, settings, trained.host.fingerprint if trained else None)
    samples, conds, count = dataset(latents, positive)
    existing_weights, existing_steps = existing(settings.existing_lora)
    checkpoints = RunCheckpoints(NODE, settings.run_name, settings.checkpoint_every, settings.keep_checkpoints,
                                 {**settings.fingerprint(), "data": _data_digest(samples, conds)}, [], NETWORK,
                                 settings.grad_accumulation_steps)
    resumed = checkpoints.find() if settings.resume else None
    if settings.resume and resumed is None:
        log.info("%s: resume: run %r has no checkpoint yet; training from the start", NODE, settings.run_name)
    done = resumed.host.optimizer_steps if resumed else 0
    if done > settings.steps:
        raise MgpuError(f"{NODE}: resume: run {settings.run_name!r} has trained {done} optimizer steps "
                        f"({resumed.folder}), more than steps {settings.steps}: raise steps, or give another run_name")
    import comfy_extras.nodes_custom_sampler as custom_sampler
    from comfy_extras.nodes_train import TrainSampler

    dtype = DTYPES[settings.training_dtype]
    with torch.inference_mode(False), torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        specs, first, order = first_adapters(model.model, settings, existing_weights)
        checkpoints.keys = order
        mp = model.clone()
        mp.set_model_compute_dtype(dtype)
        if (settings.timestep_start, settings.timestep_end) != (0.0, 1.0):
            mp.add_object_patch("model_sampling", SigmaRange(mp.get_model_object("model_sampling"),
                                                             settings.timestep_start, settings.timestep_end))
        remote = mp.object_patches[REMOTE_FORWARD]
        run = TrainingRun(remote.sharded, cancelled=mm.processing_interrupted)
        mp.add_object_patch(REMOTE_FORWARD, TrainingForward(remote, run))
        losses: list[float] = list(resumed.host.losses) if resumed else []
        optimizer = RemoteOptimizer(run, settings.steps, losses, node_id, checkpoints, done)
        micro = done * settings.grad_accumulation_steps   # core's loop index where this run goes on
        kwargs = {"loss_callback": losses.append, "batch_size": settings.batch_size,
                  "grad_acc": settings.grad_accumulation_steps,
                  "total_steps": settings.steps * settings.grad_accumulation_steps - micro,
                  "seed": settings.seed + 1000 * micro,   # its step i draws noise from seed + 1000 i
                  "training_dtype": dtype}
        accepted = inspect.signature(TrainSampler.__init__).parameters
        sampler = TrainSampler(LOSSES[settings.loss_function](), optimizer,
                               **{k: v for k, v in kwargs.items() if k in accepted})
        if resumed:
            _start_where_stopped(sampler, resumed.host.rng_state())
        guider = custom_sampler.Guider_Basic(mp)
        guider.set_conds(conds)
        label = remote.label
        try:
            started = run.start(specs, first, factory=FACTORY, mode=MODE, optimizer=settings.optimizer,
                                learning_rate=settings.learning_rate, training_dtype=settings.training_dtype,
                                lora_dtype=settings.lora_dtype, gradient_checkpointing=settings.gradient_checkpointing)
            log.info("%s: %d adapters (%s trainable, rank %d) on every rank of %s; gradient checkpointing %s",
                     NODE, started["adapters"], format_bytes(started["adapter_bytes"]), settings.rank, label,
                     f"on ({started['checkpointed_units']} units)" if settings.gradient_checkpointing else "off")
            if not settings.gradient_checkpointing:
                log.warning("%s: gradient checkpointing is off: every layer keeps the weight it computed with (the "
                            "gathered weight plus its adapter, a copy per layer) until the backward, so each rank "
                            "holds about the whole model in the compute dtype beside the activations; turn it on "
                            "for a large model", NODE)
            if resumed:
                run.load(str(resumed.folder))
                log.info("%s: resumed run %r at optimizer step %d of %d from %s (written by %d ranks)", NODE,
                         settings.run_name, done, settings.steps, resumed.folder, resumed.host.world_size)
            if done < settings.steps:
                samples = samples.to(dtype)
                noise = custom_sampler.Noise_RandomNoise(settings.seed)
                guider.sample(noise.generate_noise({"samples": samples}), samples, sampler,
                              torch.tensor(range(count)), seed=noise.seed)
            trained = run.adapters()
        except RankFailure as exc:
            raise pools.explain(exc, f"{NODE}: training on {label}; {checkpoints.where()}") from exc
        except CallCancelled as exc:
            kept = _keep_so_far(run, order, settings, optimizer.done, checkpoints, losses)
            raise_interrupted(exc, f"{NODE} (training on {label}; {kept})")
        except mm.InterruptProcessingException:   # Cancel seen between two steps, by ComfyUI's progress hook
            log.info("%s: cancelled; %s", NODE, _keep_so_far(run, order, settings, optimizer.done, checkpoints,
                                                               losses))
            raise
        finally:
            _stop(run, label)
    log.info("%s: %d optimizer steps; bytes per run: outputs %s, their gradients %s, adapter gradients summed %s "
             "per rank", NODE, optimizer.done, *(format_bytes(run.bytes[k]) for k in
                                                  ("outputs", "output_grads", "adapter_reduce")))
    lora = {key: trained[key[len(NETWORK):]].to(DTYPES[settings.lora_dtype]) for key in order}
    return lora, {"loss": losses}, settings.steps + existing_steps


def _keep_so_far(run: TrainingRun, order: list[str], settings: TrainSettings, steps: int,
                 checkpoints: RunCheckpoints, losses: list[float]) -> str:
    """A cancelled run keeps what its finished optimizer steps trained: the ranks' adapters (they change only at a
    step) saved as a LoRA in ComfyUI's output folder (``loras/``, core's keys and naming, so Load LoRA and
    existing_lora take it), and a checkpoint of that step to resume from (unless it was just saved). Returns what was
    kept, for the message; never raises over the cancel."""
    if steps == 0:
        return f"no optimizer step had finished: nothing to keep; {checkpoints.where()}"
    try:
        import time

        import folder_paths
        from safetensors.torch import save_file

        run.cancelled = None   # ComfyUI's interrupt flag may still be up: these calls must not be cancelled too
        if checkpoints.last is None or checkpoints.last.name != f"step_{steps:06d}":
            checkpoints.save(run, losses)
        trained = run.adapters()
        lora = {key: trained[key[len(NETWORK):]].to(DTYPES[settings.lora_dtype]).contiguous() for key in order}
        folder = os.path.join(folder_paths.get_output_directory(), "loras")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"mgpu_cancelled_lora_{steps}_steps_{time.strftime('%Y%m%d_%H%M%S')}"
                                    ".safetensors")
        save_file(lora, path)
    except Exception as exc:   # noqa: BLE001 - the cancel is what the user must see
        log.warning("%s: the LoRA of the %d finished steps could not be kept (%s)", NODE, steps, exc)
        return f"the LoRA of its {steps} finished steps could not be kept: {exc}; {checkpoints.where()}"
    return f"the LoRA of its {steps} finished steps is kept in {path}; {checkpoints.where()}"


def _start_where_stopped(sampler, rng: torch.Tensor) -> None:
    """A resumed run's TrainSampler starts its loop with the global generator where the checkpointed step left it
    (the batch order and the sigmas come from it; the noise from its own seed, already offset)."""
    loop = sampler.sample

    def sample(*args, **kwargs):
        torch.set_rng_state(rng)
        return loop(*args, **kwargs)

    sampler.sample = sample


def _data_digest(samples: torch.Tensor, conds: list) -> str:
    """The training data's digest for the resume check: the latents and every tensor of the conditionings."""
    from mgpu.training.checkpoints import data_digest

    tensors = [samples]
    for cond in conds:
        tensors.append(cond[0])
        tensors.extend(v for _, v in sorted(cond[1].items()) if isinstance(v, torch.Tensor))
    return data_digest(*tensors)


def _stop(run: TrainingRun, label: str) -> None:
    """End the run on the ranks, whatever ended the loop; the model samples as before. Never raises: the loop's
    own outcome is what the user must see."""
    try:
        run.stop()
    except Exception as exc:   # noqa: BLE001 - a dead pool is rebuilt (and the model reloaded) by its next use
        log.warning("%s: the ranks of %s did not end the training run cleanly (%s); the next use of the model "
                    "restarts them", NODE, label, exc)
