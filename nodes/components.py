"""MGPU Load Text Encoder / MGPU Load VAE: ComfyUI's CLIP and VAE, on a device you pick or the plan picks."""

from __future__ import annotations

from comfy_api.latest import io

from ..loaders import components, placement
from ..loaders.model_files import FOLDERS, NONE, folder_names
from .plan import PlanType

_DEVICE_TIP = ("auto: where the connected MGPU Plan puts it, else where a plan for this file alone (default size) "
               "puts it. The web page labels each device with its free memory.")
_SPLIT_DEVICES_TIP = ("For an encoder too big for one GPU: the devices to split its layers over, in order "
                      "(e.g. cuda:0,cuda:1), or auto (the MGPU Plan's split, else every GPU). When set it replaces "
                      "device; empty: the device above (whose auto also splits when the MGPU Plan does).")


# Files and devices are checked when the prompt is queued (``validate_inputs``), with the loader's own message naming
# the file or device and the choices, so a missing file is not found only after the slow nodes before it ran; and again
# when the loader runs (the file may go, a plan decides auto). As for stock loaders, ComfyUI still runs the output
# nodes that do not depend on a refused node (MGPU Plan is one) and lists the refusal in the response's node_errors.
# (A ``validate_inputs`` that names an input also turns off ComfyUI's own "Value not in list" check of it.)


def _device_input() -> io.Combo.Input:
    return io.Combo.Input("device", options=placement.device_choices(include_fsdp=False), default=placement.AUTO,
                          tooltip=_DEVICE_TIP)


class MgpuLoadTextEncoder(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        names = folder_names(FOLDERS["text_encoder"])   # checkpoints' too: LTX-2's text projection is there
        return io.Schema(
            node_id="MgpuLoadTextEncoder",
            display_name="MGPU Load Text Encoder",
            category="MGPU",
            description="ComfyUI's text encoder loader with a device: put the encoder on another GPU than the "
                        "diffusion model, or on the cpu, or split its layers over several GPUs. Its outputs are "
                        "cached by prompt, so a prompt queued again does not load the encoder.",
            inputs=[
                io.Combo.Input("clip_name", options=names),
                io.Combo.Input("type", options=components.clip_types(), default="wan",
                               tooltip="the model family, as in ComfyUI's Load CLIP (wan: umt5 xxl, ltxv: t5 xxl)"),
                _device_input(),
                io.Combo.Input("clip_name2", options=[NONE, *names], default=NONE,
                               tooltip="second file for dual encoders (e.g. hunyuan_video, flux)"),
                PlanType.Input("plan", optional=True),
                # last and optional: workflows saved before it load with its default (empty: no split)
                io.String.Input("split_devices", default="", optional=True, tooltip=_SPLIT_DEVICES_TIP),
            ],
            outputs=[io.Clip.Output()],
        )

    @classmethod
    def validate_inputs(cls, clip_name: str, clip_name2: str, device: str) -> bool | str:
        """Checked when the prompt is queued (see above)."""
        names = [clip_name] + ([] if clip_name2 == NONE else [clip_name2])
        return components.queue_check("text_encoder", "text_encoders", names, device) or True

    @classmethod
    def execute(cls, clip_name: str, type: str, device: str, clip_name2: str = NONE, plan=None,
                split_devices: str = "") -> io.NodeOutput:
        names = [clip_name] + ([] if clip_name2 == NONE else [clip_name2])
        return io.NodeOutput(components.load_text_encoder(names, type, device, plan, split_devices))


class MgpuLoadVAE(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="MgpuLoadVAE",
            display_name="MGPU Load VAE",
            category="MGPU",
            description="ComfyUI's VAE loader with a device: decode on a GPU the diffusion model leaves free.",
            inputs=[
                io.Combo.Input("vae_name", options=folder_names(FOLDERS["vae"])),   # and checkpoints' (all-in-one)
                _device_input(),
                PlanType.Input("plan", optional=True),
            ],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def validate_inputs(cls, vae_name: str, device: str) -> bool | str:
        """Checked when the prompt is queued (see above)."""
        return components.queue_check("vae", "vae", [vae_name], device) or True

    @classmethod
    def execute(cls, vae_name: str, device: str, plan=None) -> io.NodeOutput:
        return io.NodeOutput(components.load_vae(vae_name, device, plan))
