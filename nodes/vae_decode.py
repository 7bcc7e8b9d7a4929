"""MGPU VAE Decode: VAE Decode (Tiled) with its tiles decoded on several GPUs at once (loaders/parallel_decode.py)."""

from __future__ import annotations

from dataclasses import fields

import nodes as comfy_nodes   # ComfyUI's nodes.py: this pack's own package is not importable as "nodes"
from comfy_api.latest import io

from ..loaders import parallel_decode
from .plan import PlanType

_DEVICES_TIP = ("where the tiles are decoded, each device with its own copy of the VAE: auto (the MGPU Plan's "
                "choice when one is connected: its GPUs, or the whole video at once as VAE Decode does when the plan "
                "found room for that; else the VAE's GPU and every other GPU with room for a copy and one tile), or "
                "a list such as cuda:0,cuda:1")
# What an INT input of VAEDecodeTiled may say that io.Int.Input takes in both ComfyUI versions.
_INT_OPTIONS = ("default", "min", "max", "step", "tooltip")


def _tile_inputs() -> list[io.Int.Input]:
    """VAEDecodeTiled's tile inputs as this ComfyUI declares them: same names, defaults, limits and tooltips, so a
    workflow can switch between the two nodes and keep its settings."""
    required = comfy_nodes.VAEDecodeTiled.INPUT_TYPES()["required"]
    return [io.Int.Input(f.name, **{k: v for k, v in required[f.name][1].items() if k in _INT_OPTIONS})
            for f in fields(parallel_decode.TileSettings)]


class MgpuVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MgpuVAEDecode",
            display_name="MGPU VAE Decode",
            category="MGPU",
            description="VAE Decode (Tiled) spread over GPUs: the tiles of a long video go to the devices in "
                        "turn, each with its own copy of the VAE, and are blended as VAE Decode (Tiled) blends "
                        "them. No GPU holds the whole decode; with one device it is VAE Decode (Tiled).",
            inputs=[
                io.Latent.Input("samples"),
                io.Vae.Input("vae"),
                io.String.Input("devices", default="auto", tooltip=_DEVICES_TIP),
                *_tile_inputs(),
                # optional and last, so saved workflows and API prompts made before it still load unchanged
                PlanType.Input("plan", optional=True,
                               tooltip="an MGPU Plan: devices auto then decodes where the plan says"),
            ],
            outputs=[io.Image.Output()],
        )

    @classmethod
    def validate_inputs(cls, devices: str) -> bool | str:
        """A devices text that does not read, or names a GPU this machine lacks, refuses the prompt when it is
        queued, not after a whole sampling run."""
        return parallel_decode.queue_check(devices) or True

    @classmethod
    def execute(cls, samples: dict, vae, devices: str, plan=None, **tiles: int) -> io.NodeOutput:
        settings = parallel_decode.TileSettings(**tiles)
        return io.NodeOutput(parallel_decode.decode(vae, samples, devices, settings, plan=plan))
