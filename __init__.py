"""ComfyUI entry point of comfy-mgpu.

ComfyUI imports a custom node pack under its folder path as the module name, so the runtime package
is registered here as the top-level module ``mgpu`` (rank processes import it by that name too,
whatever folder the pack was cloned into). The pack folder itself is never put on ``sys.path``:
its ``nodes/`` would shadow ComfyUI's own ``nodes`` module.
"""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _register_runtime() -> None:
    existing = sys.modules.get("mgpu")
    if existing is not None and os.path.dirname(os.path.abspath(existing.__file__ or "")) == os.path.join(_HERE, "mgpu"):
        return
    spec = importlib.util.spec_from_file_location(
        "mgpu", os.path.join(_HERE, "mgpu", "__init__.py"), submodule_search_locations=[os.path.join(_HERE, "mgpu")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["mgpu"] = module
    spec.loader.exec_module(module)


_register_runtime()

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """ComfyUI's V3 entry point. ComfyUI is imported here, not at module level, so the pack imports without it."""
    from .nodes import MgpuExtension

    return MgpuExtension()
