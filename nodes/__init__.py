"""ComfyUI V3 nodes of comfy-mgpu (category MGPU). Thin: the logic lives in ``loaders/`` and ``mgpu/``."""

from comfy_api.latest import ComfyExtension, io

from mgpu.ranks.pool import clean_up_on_sigterm, sweep_stale_dirs

from ..loaders import pools, text_encoder_split

from .components import MgpuLoadTextEncoder, MgpuLoadVAE
from .diffusion import MgpuLoadDiffusionModel
from .plan import MgpuPlan
from .routes import register_routes
from .sampler import MgpuFSDPSampler
from .train import MgpuTrainLoRA
from .templates import register_template_filter
from .vae_decode import MgpuVAEDecode


class MgpuExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [MgpuPlan, MgpuLoadDiffusionModel, MgpuLoadTextEncoder, MgpuLoadVAE, MgpuFSDPSampler, MgpuVAEDecode,
                MgpuTrainLoRA]




def _follow_unload_all_models() -> None:
    """ComfyUI's "Unload models" and ``POST /free`` call ``comfy.model_management.unload_all_models``, which only
    unloads what ComfyUI placed on its own devices: the shards on the ranks are invisible to it. Run it, then free
    them too (``pools.unload_all``)."""
    import comfy.model_management as mm

    original = mm.unload_all_models
    if getattr(original, "mgpu_follows", False):
        return

    def unload_all_models(*args, **kwargs):
        result = original(*args, **kwargs)
        text_encoder_split.release_all()   # ComfyUI 0.3.x frees only its main device
        pools.unload_all()
        return result

    unload_all_models.mgpu_follows = True
    mm.unload_all_models = unload_all_models


register_routes()
register_template_filter()   # the LTX-2 example only where ComfyUI has LTX-2's nodes
_follow_unload_all_models()
sweep_stale_dirs()       # shared memory and logs of a ComfyUI that was killed (SIGKILL) while ranks ran
clean_up_on_sigterm()    # and none left behind when this one is stopped with SIGTERM
