"""MGPU FSDP Sampler: KSampler, plus the pool's settings for a sharded model."""

from __future__ import annotations

import comfy.sample
import comfy.samplers
import comfy.utils
import latent_preview
from comfy_api.latest import io

from ..loaders import diffusion


class MgpuFSDPSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MgpuFSDPSampler",
            display_name="MGPU FSDP Sampler",
            category="MGPU",
            description="KSampler for a model sharded by MGPU Load Diffusion Model (any MODEL works): same "
                        "result, progress, previews and interrupt, plus a per-step timeout for the ranks.",
            inputs=[
                io.Model.Input("model"),
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True),
                io.Int.Input("steps", default=20, min=1, max=10000),
                io.Float.Input("cfg", default=8.0, min=0.0, max=100.0, step=0.1, round=0.01),
                io.Combo.Input("sampler_name", options=comfy.samplers.KSampler.SAMPLERS),
                io.Combo.Input("scheduler", options=comfy.samplers.KSampler.SCHEDULERS),
                io.Conditioning.Input("positive"),
                io.Conditioning.Input("negative"),
                io.Latent.Input("latent_image"),
                io.Float.Input("denoise", default=1.0, min=0.0, max=1.0, step=0.01),
                io.Float.Input("timeout_s", default=600.0, min=1.0, max=86400.0, step=1.0,
                               tooltip="a denoising step slower than this fails the node, stops the ranks and "
                                       "names the one that hung"),
            ],
            outputs=[io.Latent.Output()],
        )

    @classmethod
    def execute(cls, model, seed: int, steps: int, cfg: float, sampler_name: str, scheduler: str, positive,
                negative, latent_image: dict, denoise: float, timeout_s: float) -> io.NodeOutput:
        """Stock KSampler's path (comfy.sample + latent_preview): one progress update per step, which is also
        where a user interrupt lands, between two steps, so the ranks are never left mid-call."""
        model = diffusion.with_step_timeout(model, timeout_s)
        latent = comfy.sample.fix_empty_latent_channels(model, latent_image["samples"])
        noise = comfy.sample.prepare_noise(latent, seed, latent_image.get("batch_index"))
        samples = comfy.sample.sample(model, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                                      denoise=denoise, noise_mask=latent_image.get("noise_mask"),
                                      callback=latent_preview.prepare_callback(model, steps),
                                      disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED, seed=seed)
        return io.NodeOutput({**latent_image, "samples": samples})
