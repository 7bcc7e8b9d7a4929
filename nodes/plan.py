"""MGPU Plan: where the text encoder, DiT and VAE will live, decided from safetensors headers before loading."""

from __future__ import annotations

from comfy_api.latest import io

from mgpu.errors import PlanError, SizingError

from ..loaders import model_files as mf

# The plan travels in-process between nodes; loaders with device "auto" follow it.
PlanType = io.Custom("MGPU_PLAN")


def _with_none(folder: str) -> list[str]:
    return [mf.NONE, *mf.folder_names(folder)]   # checkpoints' files too (all-in-one files: LTX-2)


def _int(name: str, step: int, tooltip: str, optional: bool = False) -> io.Int.Input:
    low, high, default = mf.INT_LIMITS[name]
    return io.Int.Input(name, default=default, min=low, max=high, step=step, tooltip=tooltip, optional=optional)


# The workload the plan was made for, as INT outputs for ComfyUI's own latent nodes (EmptyHunyuanLatentVideo,
# EmptyLTXVLatentVideo, LTXVEmptyLatentAudio, ...): the size is typed once, in the plan.
SIZE_OUTPUTS = (
    ("width", "the plan's width: wire it into the latent node's width"),
    ("height", "the plan's height: wire it into the latent node's height"),
    ("frames", "the plan's frames: wire it into the latent node's length (frames_number for LTX-2's audio)"),
    ("batch", "the plan's batch: wire it into the latent node's batch_size"),
)


class MgpuPlan(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MgpuPlan",
            display_name="MGPU Plan",
            category="MGPU",
            description="Decides, from the model files' headers (no weights loaded), which device holds the text "
                        "encoder, the DiT (one GPU, sharded with FSDP, or offloaded) and the VAE (one GPU, or a long "
                        "video's decode split over GPUs: connect the plan to MGPU VAE Decode) for this video "
                        "size, and shows each device's peak memory and headroom. Loaders set to auto follow it. "
                        "With a second expert (Wan 2.2 A14B: dit is the high-noise one, dit_low_noise the other) "
                        "both experts share the devices: both resident when memory allows, else one at a time, "
                        "with the cost of each switch. Wire its width, height, frames and batch outputs into the "
                        "latent node, so the size the plan is made for is the size sampled. With train on it plans a "
                        "LoRA training step instead (MGPU Train LoRA, its plan input connected): per GPU the shard, "
                        "the activations and the adapter's state, the ranks, gradient checkpointing and the rows per "
                        "forward, or the frames that fit.",
            is_output_node=True,
            inputs=[
                io.Combo.Input("dit", options=mf.dit_names(),
                               tooltip="diffusion model (models/diffusion_models, .gguf included)"),
                io.Combo.Input("text_encoder", options=_with_none(mf.FOLDERS["text_encoder"]), default=mf.NONE),
                io.Combo.Input("vae", options=_with_none(mf.FOLDERS["vae"]), default=mf.NONE),
                _int("width", 16, "output width in pixels"),
                _int("height", 16, "output height in pixels"),
                _int("frames", 1, "video length in frames (1 for an image)"),
                _int("batch", 1, "videos per prompt"),
                io.Boolean.Input("cfg", default=True,
                                 tooltip="CFG > 1 runs cond and uncond each step (twice the DiT batch)"),
                io.Combo.Input("dit_weight_dtype", options=list(mf.DIT_DTYPES), default="default",
                               tooltip="the weight dtype the DiT loader will use; fp8 halves the DiT's weights"),
                io.String.Input("devices", default=mf.AUTO_DEVICES,
                                tooltip="auto: this machine's GPUs and RAM. Or simulate others: 2x24GiB, "
                                        "cuda:0=80GiB,cuda:1=24GiB, 4x16GiB:pcie, 2x24GiB,cpu=64GiB"),
                io.Boolean.Input("allow_offload", default=False,
                                 tooltip="if nothing else fits, stream DiT weights from host RAM (slow)"),
                io.Boolean.Input("prefer_speed", default=False,
                                 tooltip="shard over all GPUs even when fewer would fit"),
                # optional and last, so saved workflows and API prompts made before it still load unchanged
                io.Combo.Input("dit_low_noise", options=[mf.NONE, *mf.dit_names()], default=mf.NONE,
                               optional=True,
                               tooltip="Wan 2.2 A14B: the low-noise expert (dit is then the high-noise one). Both "
                                       "MGPU loaders connected to this plan follow its decision: both resident, "
                                       "or one at a time"),
                # training (MGPU Train LoRA): optional and after the rest, for the same reason
                io.Boolean.Input("train", default=False, optional=True,
                                 tooltip="plan a LoRA training step (MGPU Train LoRA, connected to this plan) instead "
                                         "of sampling: width, height and frames are one dataset item's, batch the "
                                         "rows per step; cfg does not apply"),
                _int("lora_rank", 1, "training: the LoRA's rank", optional=True),
                io.Combo.Input("optimizer", options=list(mf.CHOICES["optimizer"][0]),
                               default=mf.CHOICES["optimizer"][1], optional=True,
                               tooltip="training: the optimizer (its state is held on every rank)"),
                io.Combo.Input("gradient_checkpointing", options=list(mf.CHOICES["gradient_checkpointing"][0]),
                               default=mf.CHOICES["gradient_checkpointing"][1], optional=True,
                               tooltip="training: auto turns it off when the step fits without it (faster), else on"),
                _int("grad_accumulation", 1, "training: forwards per optimizer step", optional=True),
                _int("dataset", 1, "training: latents in the dataset (held in host RAM)", optional=True),
            ],
            # plan first and the sizes after it, so saved workflows wired to the plan still connect; wire the sizes
            # into the latent node (width, height, length or frames_number, batch_size) to type them only here
            outputs=[PlanType.Output(display_name="plan"),
                     # ids apart from the inputs' (ComfyUI 0.3.64 refuses a shared id); shown as the inputs' names
                     *(io.Int.Output(f"{name}_out", display_name=name, tooltip=tip) for name, tip in SIZE_OUTPUTS)],
        )

    @classmethod
    def validate_inputs(cls, devices: str | None) -> bool | str:
        """A device spec typo is reported when the prompt is queued, not after the graph starts (a linked value
        is None here and is checked when the node runs)."""
        if devices is None:
            return True
        try:
            mf.check_devices(devices)
        except mf.BadRequest as exc:
            return f"MGPU Plan: {exc}"
        return True

    @classmethod
    def execute(cls, dit: str, text_encoder: str, vae: str, width: int, height: int, frames: int, batch: int,
                cfg: bool, dit_weight_dtype: str, devices: str, allow_offload: bool,
                prefer_speed: bool, dit_low_noise: str = mf.NONE, train: bool = False, lora_rank: int = 8,
                optimizer: str = "AdamW", gradient_checkpointing: str = "auto", grad_accumulation: int = 1,
                dataset: int = 1) -> io.NodeOutput:
        request = mf.PlanRequest(
            dit=dit, dit_low_noise=None if dit_low_noise in (None, mf.NONE) else dit_low_noise,
            text_encoder=None if text_encoder == mf.NONE else text_encoder,
            vae=None if vae == mf.NONE else vae, width=width, height=height, frames=frames, batch=batch, cfg=cfg,
            dit_weight_dtype=dit_weight_dtype, devices=mf.check_devices(devices), allow_offload=allow_offload,
            prefer_speed=prefer_speed, train=train, lora_rank=lora_rank, optimizer=optimizer,
            gradient_checkpointing=gradient_checkpointing, grad_accumulation=grad_accumulation, dataset=dataset)
        try:
            plan = mf.make_plan_for(request, mf.comfy_folders()[1])
        except PlanError as exc:
            raise PlanError(f"MGPU Plan: no placement fits.\n{exc}", needs=exc.needs) from None
        except SizingError as exc:
            raise SizingError(f"MGPU Plan: {exc}") from None
        # The web extension shows "text" in the node and draws "mgpu_chart"; "mgpu_plan" is the whole plan.
        # the sizes as typed: the latent node wired to them samples the video this plan was made for
        return io.NodeOutput(plan, width, height, frames, batch,
                             ui={"text": [plan.table()], "mgpu_plan": [plan.to_dict()], "mgpu_chart": [mf.chart(plan)]})
