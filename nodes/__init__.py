"""ComfyUI V3 nodes of comfy-mgpu (category MGPU). Thin: the logic lives in ``loaders/`` and ``mgpu/``."""

from comfy_api.latest import ComfyExtension, io

from mgpu.pool import clean_up_on_sigterm, sweep_stale_dirs

from .components import MgpuLoadTextEncoder, MgpuLoadVAE
from .diffusion import MgpuLoadDiffusionModel
from .plan import MgpuPlan
from .routes import register_routes
from .sampler import MgpuFSDPSampler


class MgpuExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [MgpuPlan, MgpuLoadDiffusionModel, MgpuLoadTextEncoder, MgpuLoadVAE, MgpuFSDPSampler]


register_routes()
sweep_stale_dirs()       # shared memory and logs of a ComfyUI that was killed (SIGKILL) while ranks ran
clean_up_on_sigterm()    # and none left behind when this one is stopped with SIGTERM
