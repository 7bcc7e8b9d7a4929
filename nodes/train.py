"""MGPU Train LoRA: ComfyUI's Train LoRA over the FSDP ranks of a sharded MODEL (inputs and outputs are core's)."""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from ..loaders import training
from .plan import PlanType


class MgpuTrainLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MgpuTrainLoRA",
            display_name="MGPU Train LoRA",
            category="MGPU",
            description="ComfyUI's Train LoRA on a model that MGPU Load Diffusion Model sharded (device fsdp): the "
                        "base stays sharded as stored, each rank trains on its rows of the batch, only the "
                        "adapters' gradients travel. Same seed and settings give core's LoRA.",
            is_experimental=True,
            is_input_list=True,
            inputs=[
                io.Model.Input("model", tooltip="from MGPU Load Diffusion Model with device fsdp"),
                io.Latent.Input("latents", tooltip="the dataset: one latent per image or video"),
                io.Conditioning.Input("positive", tooltip="one conditioning for all latents, or one per latent"),
                io.Int.Input("batch_size", default=1, min=1, max=10000,
                             tooltip="rows per step, split over the ranks"),
                io.Int.Input("grad_accumulation_steps", default=1, min=1, max=1024),
                io.Int.Input("steps", default=16, min=1, max=100000, tooltip="optimizer steps"),
                io.Float.Input("learning_rate", default=0.0005, min=0.0000001, max=1.0, step=0.0000001),
                io.Int.Input("rank", default=8, min=1, max=128, tooltip="the LoRA's rank"),
                io.Combo.Input("optimizer", options=list(training.OPTIMIZERS), default="AdamW"),
                io.Combo.Input("loss_function", options=list(training.LOSSES), default="MSE"),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF,
                             tooltip="the adapters' first values, the batches, the noise and the sigmas"),
                io.Combo.Input("training_dtype", options=list(training.DTYPES), default="bf16"),
                io.Combo.Input("lora_dtype", options=list(training.DTYPES), default="bf16"),
                io.Combo.Input("algorithm", options=list(training.ALGORITHMS), default="LoRA"),
                io.Boolean.Input("gradient_checkpointing", default=True,
                                 tooltip="recompute each block in the backward (the ranks gather it again) "
                                         "instead of keeping its activations"),
                io.Combo.Input("existing_lora", options=[*folder_paths.get_filename_list("loras"), training.NO_LORA],
                               default=training.NO_LORA, tooltip="a LoRA (safetensors) to go on training"),
                io.String.Input("run_name", default=training.TrainSettings.run_name, optional=True,
                                tooltip="names the run's checkpoints: output/mgpu_training/<run_name>/step_<N>"),
                io.Int.Input("checkpoint_every", default=0, min=0, max=100000, optional=True,
                             tooltip="optimizer steps between checkpoints (adapters, optimizer state, random "
                                     "generators, data position); 0: only at the end and at a Cancel"),
                io.Int.Input("keep_checkpoints", default=3, min=0, max=1000, optional=True,
                             tooltip="the newest checkpoints kept; 0: keep all"),
                io.Boolean.Input("resume", default=False, optional=True,
                                 tooltip="go on from this run's newest checkpoint (same settings and data; the "
                                         "steps may grow); ends with the LoRA of an uninterrupted run"),
                io.Float.Input("timestep_start", default=0.0, min=0.0, max=1.0, step=0.001, optional=True,
                               tooltip="train on this share of the noise schedule only, from (0: the noisiest) ..."),
                io.Float.Input("timestep_end", default=1.0, min=0.0, max=1.0, step=0.001, optional=True,
                               tooltip="... to (1: the cleanest); Wan 2.2 A14B: the high-noise expert 0 to its "
                                       "boundary, the low-noise expert from there to 1"),
                PlanType.Input("plan", optional=True,
                               tooltip="an MGPU Plan made with train on: its gradient checkpointing and rows per "
                                       "forward replace batch_size, grad_accumulation_steps and "
                                       "gradient_checkpointing here (the rows per optimizer step it was asked for)"),
            ],
            outputs=[
                io.Custom("LORA_MODEL").Output(display_name="lora"),
                io.Custom("LOSS_MAP").Output(display_name="loss_map"),
                io.Int.Output(display_name="steps"),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, latents, positive, batch_size, grad_accumulation_steps, steps, learning_rate, rank,
                optimizer, loss_function, seed, training_dtype, lora_dtype, algorithm, gradient_checkpointing,
                existing_lora, run_name=None, checkpoint_every=None, keep_checkpoints=None, resume=None,
                timestep_start=None, timestep_end=None, plan=None) -> io.NodeOutput:
        defaults = training.TrainSettings
        settings = training.TrainSettings(
            batch_size=batch_size[0], grad_accumulation_steps=grad_accumulation_steps[0], steps=steps[0],
            learning_rate=learning_rate[0], rank=rank[0], optimizer=optimizer[0], loss_function=loss_function[0],
            seed=seed[0], training_dtype=training_dtype[0], lora_dtype=lora_dtype[0], algorithm=algorithm[0],
            gradient_checkpointing=gradient_checkpointing[0], existing_lora=existing_lora[0],
            run_name=(run_name or [defaults.run_name])[0],
            checkpoint_every=(checkpoint_every or [defaults.checkpoint_every])[0],
            keep_checkpoints=(keep_checkpoints or [defaults.keep_checkpoints])[0], resume=(resume or [False])[0],
            timestep_start=(timestep_start or [0.0])[0], timestep_end=(timestep_end or [1.0])[0])
        lora, loss_map, total = training.train(model[0], latents, positive, settings, node_id=cls.hidden.unique_id,
                                               plan=(plan or [None])[0])
        return io.NodeOutput(lora, loss_map, total)
