"""The pack's example workflows in ComfyUI's template browser: only those this ComfyUI has every node for.

ComfyUI lists every ``custom_nodes/*/example_workflows/*.json`` in ``GET /workflow_templates`` (also under
/api), a plain glob in ``app/custom_node_manager.py`` (0.3.64 and 0.33.0 alike) that no pack can filter. The
LTX-2 example needs ComfyUI's LTX-2 nodes (0.33 and newer): on 0.3.64 the browser would offer a card that opens
into "Some Nodes Are Missing". A middleware on ComfyUI's server takes the pack's examples whose node types this
ComfyUI lacks out of that listing, and logs once which and why; the files stay where they are (and readable at
their URL), other packs' entries are untouched.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from aiohttp import web

log = logging.getLogger("mgpu")

PACK_DIR = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = PACK_DIR / "example_workflows"
LISTING_PATHS = ("/workflow_templates", "/api/workflow_templates")
# Node types only the frontend knows (the examples' notes): never in ComfyUI's node list.
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
_logged: set[str] = set()


def node_types(workflow: dict) -> set[str]:
    """The node types a UI workflow names, its subgraphs' included."""
    graphs = [workflow, *workflow.get("definitions", {}).get("subgraphs", [])]
    return {n["type"] for g in graphs for n in g.get("nodes", [])} - FRONTEND_ONLY


def unrunnable(known: set[str] | None = None) -> dict[str, list[str]]:
    """Example name (the file stem, as the listing names it) -> the node types this ComfyUI lacks, for the examples
    it cannot run. ``known``: the registered node types (default: ComfyUI's NODE_CLASS_MAPPINGS)."""
    if known is None:
        import nodes

        known = set(nodes.NODE_CLASS_MAPPINGS)
    lacking = {}
    for path in sorted(EXAMPLES_DIR.glob("*.json")):
        try:
            missing = sorted(node_types(json.loads(path.read_text(encoding="utf-8"))) - known)
        except (OSError, ValueError, AttributeError, KeyError, TypeError) as exc:
            log.warning("MGPU: example workflow %s does not read (%s); ComfyUI lists it as it is", path.name, exc)
            continue
        if missing:
            lacking[path.stem] = missing
    return lacking


def _our_entries(listing: dict) -> list[str]:
    """The keys of the listing (custom_nodes folder names, links included) that are this pack."""
    import folder_paths

    ours = []
    for name in listing:
        for root in folder_paths.get_folder_paths("custom_nodes"):
            candidate = os.path.join(root, name)
            if os.path.isdir(candidate) and Path(candidate).resolve() == PACK_DIR:
                ours.append(name)
                break
    return ours


def filter_listing(listing: dict, lacking: dict[str, list[str]]) -> dict:
    """``listing`` (ComfyUI's {pack folder: [example names]}) without this pack's examples in ``lacking``."""
    if not lacking:
        return listing
    for name in _our_entries(listing):
        listing[name] = [e for e in listing[name] if e not in lacking]
        if not listing[name]:
            del listing[name]
    for example, missing in lacking.items():
        if example not in _logged:
            _logged.add(example)
            log.info("MGPU: the example workflow %r is not offered in the template browser: this ComfyUI lacks its "
                     "nodes %s (a newer ComfyUI has them)", example, ", ".join(missing))
    return listing


@web.middleware
async def hide_unrunnable_templates(request: web.Request, handler):
    response = await handler(request)
    if (request.method != "GET" or request.path not in LISTING_PATHS or response.status != 200
            or not isinstance(response, web.Response) or response.content_type != "application/json"):
        return response
    try:
        listing = json.loads(response.body)
    except (TypeError, ValueError):
        return response
    if not isinstance(listing, dict):
        return response
    return web.json_response(filter_listing(listing, unrunnable()))


def register_template_filter() -> None:
    """Add the middleware to ComfyUI's server once (before it starts: custom nodes load before that); without a
    server, or one already started, do nothing."""
    try:
        from server import PromptServer

        app = PromptServer.instance.app
    except (ImportError, AttributeError) as exc:
        log.info("MGPU: no ComfyUI server (%s); example workflows listed unfiltered", exc)
        return
    if hide_unrunnable_templates in app.middlewares:
        return
    try:
        app.middlewares.append(hide_unrunnable_templates)
    except RuntimeError:   # frozen: the server started before this pack was imported
        log.warning("MGPU: ComfyUI's server already started; example workflows listed unfiltered")
