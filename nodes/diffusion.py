"""MGPU Load Diffusion Model: ComfyUI's MODEL on a device you pick, or sharded with FSDP over several."""

from __future__ import annotations

from comfy_api.latest import io

from ..loaders import diffusion, model_files, placement
from .plan import PlanType


class MgpuLoadDiffusionModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MgpuLoadDiffusionModel",
            display_name="MGPU Load Diffusion Model",
            category="MGPU",
            description="ComfyUI's diffusion model loader with a device. fsdp shards the model over several GPUs "
                        "(rank processes hold the weights, this process none); the MODEL works with any sampler.",
            inputs=[
                io.Combo.Input("unet_name", options=model_files.dit_names(),
                               tooltip="models/diffusion_models; .gguf files (ComfyUI-GGUF's) shard with fsdp"),
                io.Combo.Input("weight_dtype", options=list(diffusion.WEIGHT_DTYPES), default="default",
                               tooltip="default: what ComfyUI picks for the device (or the plan's fp8). fp8 halves "
                                       "the weights and, under fsdp, what the ranks exchange"),
                io.Combo.Input("device", options=placement.device_choices(), default=placement.AUTO,
                               tooltip="auto: where the connected MGPU Plan puts it, else where a plan for this "
                                       "file alone (default size) puts it. fsdp: shard over the plan's GPUs, else "
                                       "all of them"),
                io.Int.Input("fsdp_ranks", default=0, min=0, max=64,
                             tooltip="fsdp only: 0 = the planned GPUs (all without a plan); N = the first N. "
                                     "Without a GPU, N CPU ranks (slow; for trying workflows)"),
                PlanType.Input("plan", optional=True),
                io.Combo.Input("sequence_parallel", options=list(diffusion.SEQUENCE_PARALLEL), default="auto",
                               optional=True,
                               tooltip="fsdp only. auto: split each video's tokens over the ranks (Ulysses; the "
                                       "plan's degree when a plan is connected), so N GPUs speed up one video even "
                                       "at cfg 1. off: split only the CFG/batch rows"),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id, io.Hidden.extra_pnginfo],
        )

    @classmethod
    def validate_inputs(cls, unet_name: str, device: str) -> bool | str:
        """Checked when the prompt is queued, before the nodes before it run: a missing or unreadable file, or a
        GPU this machine lacks, refuses the prompt with a message that names it and what there is (instead of
        ComfyUI's bare "Value not in list", or an error after a long text encode)."""
        return diffusion.queue_check(unet_name, device) or True

    @classmethod
    def execute(cls, unet_name: str, weight_dtype: str, device: str, fsdp_ranks: int, plan=None,
                sequence_parallel: str = "auto") -> io.NodeOutput:
        slot = diffusion.loader_slot(cls.hidden.unique_id, cls.hidden.extra_pnginfo)
        return io.NodeOutput(diffusion.load(unet_name, weight_dtype, device, fsdp_ranks, plan, slot,
                                            sequence_parallel))
