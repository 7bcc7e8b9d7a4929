"""HTTP routes for the web extension: GET /mgpu/devices (device labels) and POST /mgpu/plan (a plan, read-only).

Both are also served under /api by ComfyUI. Request checking lives in loaders/model_files.py.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from mgpu.errors import MgpuError, PlanError

from ..loaders import model_files as mf
from ..loaders import placement

log = logging.getLogger("mgpu")


def _error(status: int, message: str, **extra) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


async def devices(request: web.Request) -> web.Response:
    """This machine's devices (fresh free memory), the combo values and their labels."""
    found = await asyncio.to_thread(placement.live_devices)
    return web.json_response({
        "devices": [d.to_dict() for d in found],
        "choices": placement.device_choices(),
        "labels": placement.choice_labels(devices=found),
    })


async def plan(request: web.Request) -> web.Response:
    """400: the request must change (JSON error naming the field). 422: valid, but the files cannot be sized
    or nothing fits (``needs`` lists each device's need and budget)."""
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body must be JSON")
    list_files, full_path = mf.comfy_folders()
    try:
        req = mf.parse_plan_request(body, list_files)
        result = await asyncio.to_thread(mf.make_plan_for, req, full_path)
    except mf.BadRequest as exc:
        return _error(400, str(exc))
    except PlanError as exc:
        return _error(422, str(exc), needs=exc.needs)
    except MgpuError as exc:
        return _error(422, str(exc))
    return web.json_response({"plan": result.to_dict(), "table": result.table(), "chart": mf.chart(result)})


def register_routes() -> None:
    """Add the routes to ComfyUI's server once; without a server (e.g. nodes imported by a script) do nothing."""
    try:
        from server import PromptServer

        routes = PromptServer.instance.routes
    except (ImportError, AttributeError) as exc:
        log.info("MGPU: no ComfyUI server (%s); /mgpu routes not registered", exc)
        return
    if any(getattr(r, "path", None) == "/mgpu/devices" for r in routes):
        return
    routes.get("/mgpu/devices")(devices)
    routes.post("/mgpu/plan")(plan)
