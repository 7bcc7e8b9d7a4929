"""The example workflows as a user meets them: ComfyUI's template browser, in a real browser (Debian's chromium
driven by Playwright, on the frontend the ComfyUI under test pins: 1.27 for 0.3.64, 1.49 for 0.33).

With empty model folders, the template browser's category for the pack shows each example under its readable title
with its thumbnail; clicking it opens the workflow and ComfyUI warns about every model file the workflow names, each
with a Download button that asks huggingface.co for the official file (frontend 1.27: the Missing Models dialog;
1.49: the error overlay, then the Errors tab of the side panel). huggingface.co is answered locally.

An example whose stock nodes this ComfyUI lacks (LTX-2 on 0.3.64) is not offered: its card is absent.

A screenshot of each warning is kept in test-artifacts/. ``MGPU_UPDATE_THUMBNAILS=1`` first renders each example
on the canvas and writes example_workflows/<title>.jpg: run it with ComfyUI 0.33.0, which has every example's
nodes (0.3.64 would open LTX-2 under "Some Nodes Are Missing", and writes only the others). Empty placeholder
files stand in for the model files and the training clip while it renders (frontend 1.49 outlines the loaders of
absent files in red, and reports a Load Video without its file),
and a thumbnail is refused if a dialog is open (test_example_workflows.py checks the files for one too). Needs
what tests/test_web.py needs; skips with the reason otherwise.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from comfyui_env import MODEL_FOLDERS, PACK_LINK_NAME, ComfyServer
from example_files import EXAMPLES, declared_models, input_files, load, thumbnail_path
from test_web import ARTIFACTS, CHROMIUM, LAUNCH_ARGS, MGPU_TYPES, _missing

FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}

pytestmark = pytest.mark.comfyui

UPDATE_THUMBNAILS = os.environ.get("MGPU_UPDATE_THUMBNAILS") == "1"
THUMBNAIL_SIZE = 640  # px, the longer side
VIEWPORT = {"width": 1600, "height": 1000}
SETTINGS = {"Comfy.TutorialCompleted": True,            # no template browser over the canvas at start
            "Comfy.Workflow.ShowMissingModelsWarning": True, "Comfy.RightSidePanel.ShowErrorsTab": True}
CLEAN_CANVAS = {"Comfy.Minimap.Visible": False, "Comfy.Graph.CanvasMenu": False, "Comfy.Graph.CanvasInfo": False}


def _example_files(server: ComfyServer) -> list[Path]:
    """The examples' model files as they would lie in this server's model folders (the test folders, else ComfyUI's
    own under --base-directory: checkpoints, where LTX-2's audio VAE loader looks)."""
    def folder(name: str) -> Path:
        return server.models_dir / name if name in MODEL_FOLDERS else server.base_dir / "models" / name

    return sorted({folder(m["directory"]) / m["name"] for name in EXAMPLES for m in declared_models(load(name)[0])})


@pytest.fixture(scope="module")
def hidden_example_files(comfyui_server: ComfyServer) -> Iterator[None]:
    """Empty model folders as far as the examples go: other tests of the session write tiny files under the
    examples' names; they are moved aside for this module and put back after."""
    stash = comfyui_server.root / "hidden_example_models"
    moved = []
    for path in _example_files(comfyui_server):
        if path.is_symlink() or path.exists():
            target = stash / path.parent.name / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
            moved.append((target, path))
    try:
        yield
    finally:
        for target, path in moved:
            target.rename(path)
        shutil.rmtree(stash, ignore_errors=True)


def _set_settings(server: ComfyServer, settings: dict) -> None:
    """Store user settings on the (throwaway) server: the page reads them when it loads."""
    for key, value in settings.items():
        status, body = server._request("POST", f"/settings/{key}", value)
        assert status == 200, (key, body)


def _answer_huggingface(route, requests: list[tuple[str, str]]) -> None:
    """Record the request; answer like a file download (HEAD gives the size the dialog shows)."""
    requests.append((route.request.method, route.request.url))
    name = route.request.url.split("?")[0].rsplit("/", 1)[-1]
    route.fulfill(status=200, body=b"" if route.request.method == "HEAD" else b"weights",
                  headers={"content-length": "7", "content-type": "application/octet-stream",
                           "content-disposition": f'attachment; filename="{name}"'})


@pytest.fixture(scope="module")
def templates_page(comfyui_server: ComfyServer, hidden_example_files):
    if why := _missing():
        pytest.skip(why)
    if "UpscaleModelLoader" not in comfyui_server.object_info():
        # frontend 1.27.10 cannot build any node with a vae_name input when a stock model loader is missing
        pytest.skip("ComfyUI's stock nodes are incomplete (pip install -r ComfyUI/requirements.txt: spandrel)")
    from playwright.sync_api import sync_playwright

    _set_settings(comfyui_server, {**SETTINGS, **(CLEAN_CANVAS if UPDATE_THUMBNAILS else {})})
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        if UPDATE_THUMBNAILS:  # in a context of its own: the next page must not reopen what it loaded
            _write_thumbnails(browser, comfyui_server)
        context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
        requests: list[tuple[str, str]] = []
        context.route(re.compile(r"^https://huggingface\.co/"), lambda route: _answer_huggingface(route, requests))
        page = context.new_page()
        _goto(page, comfyui_server.base_url)
        page.hf_requests = requests  # (method, url) of every request for huggingface.co, in order
        yield page
        browser.close()


def _goto(page, url: str) -> None:
    page.goto(url)
    page.wait_for_function("(types) => window.comfyAPI?.app?.app?.graph"
                           " && types.every((t) => window.LiteGraph?.registered_node_types?.[t])",
                           arg=MGPU_TYPES, timeout=120_000)


def _runnable(server: ComfyServer) -> list[str]:
    """The examples whose every node this ComfyUI has (the ones the pack offers in its template browser)."""
    known = set(server.object_info()) | FRONTEND_ONLY
    return [n for n in EXAMPLES if {node["type"] for node in load(n)[0]["nodes"]} <= known]


def _example_inputs(server: ComfyServer) -> list[Path]:
    """The files of this server's input folder the examples name (the LoRA example's training clip)."""
    return sorted({server.base_dir / "input" / f for name in EXAMPLES for f in input_files(load(name)[0])})


def _write_thumbnails(browser, server: ComfyServer) -> None:
    placeholders = [p for p in _example_files(server) + _example_inputs(server) if not (p.is_symlink() or p.exists())]
    for path in placeholders:   # no loader outlined for a missing file (1.49: no "Media input missing" for a clip)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    try:
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        _goto(page, server.base_url)
        for name in _runnable(server):
            _write_thumbnail(page, name)
        context.close()
    finally:
        for path in placeholders:
            path.unlink()


def _write_thumbnail(page, name: str) -> None:
    """Fit the whole workflow in the canvas, screenshot it and save a small JPEG beside the workflow."""
    from PIL import Image

    ui, _ = load(name)
    page.evaluate("(wf) => window.comfyAPI.app.app.loadGraphData(wf, true, false, null, "
                  "{showMissingModelsDialog: false, silentAssetErrors: true})", ui)
    clip = page.evaluate("""() => {
        const app = window.comfyAPI.app.app, c = app.canvas, title = window.LiteGraph.NODE_TITLE_HEIGHT;
        let [x0, y0, x1, y1] = [Infinity, Infinity, -Infinity, -Infinity];
        for (const n of app.graph.nodes) {
            x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1] - title);
            x1 = Math.max(x1, n.pos[0] + n.size[0]); y1 = Math.max(y1, n.pos[1] + n.size[1]);
        }
        const r = c.canvas.getBoundingClientRect(), margin = 120, pad = 16;   // margin: clear of the menus
        const s = Math.min((r.width - 2 * margin) / (x1 - x0), (r.height - 2 * margin) / (y1 - y0));
        const left = r.left + (r.width - s * (x1 - x0)) / 2, top = r.top + (r.height - s * (y1 - y0)) / 2;
        c.ds.scale = s;
        c.ds.offset = [(left - r.left) / s - x0, (top - r.top) / s - y0];
        c.setDirty(true, true);
        return {x: left - pad, y: top - pad, width: s * (x1 - x0) + 2 * pad, height: s * (y1 - y0) + 2 * pad};
    }""")
    page.wait_for_timeout(500)  # let the canvas and the DOM widgets paint at the new scale
    dialogs = page.locator("[role='dialog'], .p-dialog, [data-testid='error-overlay']")
    shown = [d.inner_text()[:200] for d in dialogs.all() if d.is_visible()]
    assert not shown, f"{name}: a dialog is open over the graph, no thumbnail written: {shown}"
    image = Image.open(io.BytesIO(page.screenshot(clip=clip))).convert("RGB")
    image.thumbnail((THUMBNAIL_SIZE, THUMBNAIL_SIZE), Image.LANCZOS)
    image.save(thumbnail_path(name), "JPEG", quality=80, optimize=True, progressive=True)


def _open_template_card(page, title: str):
    """Open the template browser on the pack's category (named after its custom_nodes folder); the example's card."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    _close_dialogs(page)   # the command toggles: a browser left open by the last test would close, not open
    page.evaluate("() => window.comfyAPI.app.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    card = page.locator(f'[data-testid="template-workflow-{title}"]')
    for _ in range(5):  # the dialog selects its first category once its lists load, which can undo an early click
        page.get_by_text(PACK_LINK_NAME, exact=True).first.click()
        try:
            card.wait_for(state="visible", timeout=6_000)
            return card
        except PlaywrightTimeout:
            continue
    card.wait_for(state="visible", timeout=6_000)
    return card


def _close_dialogs(page) -> None:
    """Escape until no dialog shows (a missing-models dialog, the template browser), at most a few times."""
    dialogs = page.locator("[role='dialog'], .p-dialog")
    for _ in range(4):
        if not any(d.is_visible() for d in dialogs.all()):
            return
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)


def _missing_models_shown(page) -> list[dict]:
    """The missing model files the frontend shows after a workflow opens: name, folder, its Download button."""
    page.wait_for_selector(".comfy-missing-models, [data-testid='error-overlay']", state="visible", timeout=60_000)
    if page.locator(".comfy-missing-models").count():  # frontend 1.27: a dialog, "folder / name" per entry
        rows = page.locator(".comfy-missing-models [role='option']")
        found = []
        for row in rows.all():
            folder, name = row.inner_text().splitlines()[0].split(" / ", 1)
            found.append({"name": name, "directory": folder,
                          "download": row.get_by_role("button", name=re.compile(r"^Download"))})
        return found
    page.get_by_test_id("error-overlay-see-errors").click()  # frontend 1.49: overlay, then the Errors tab
    group = page.get_by_test_id("error-group-missing-model")
    group.wait_for(state="visible", timeout=30_000)
    found = []
    for row in group.get_by_test_id("missing-model-importable-rows").locator(":scope > div").all():
        name = row.locator("button[title]").first.get_attribute("title")
        found.append({"name": name, "directory": row.locator("span.block").first.inner_text().strip(),
                      "download": row.get_by_test_id("missing-model-download")})
    return found


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_opens_from_the_template_browser_and_lists_its_model_downloads(templates_page, comfyui_server, name):
    from PIL import Image

    page, title = templates_page, EXAMPLES[name]
    if name not in _runnable(comfyui_server):   # LTX-2 on 0.3.64: not offered, so no card opens a missing-nodes dialog
        offered = _open_template_card(page, EXAMPLES[_runnable(comfyui_server)[0]])
        assert offered.is_visible() and page.locator(f'[data-testid="template-workflow-{title}"]').count() == 0
        _close_dialogs(page)
        return
    with Image.open(thumbnail_path(name)) as img:
        thumb_width = img.width
    card = _open_template_card(page, title)
    assert card.locator("h3").inner_text().strip() == title
    # the card shows our picture (not the frontend's placeholder) once the browser has decoded it
    page.wait_for_function("([card, width]) => document.querySelector(card)?.querySelector('img')?.naturalWidth"
                           " === width", arg=[f'[data-testid="template-workflow-{title}"]', thumb_width],
                           timeout=30_000)
    card.click()

    declared = declared_models(load(name)[0])
    shown = _missing_models_shown(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"missing_models_{name}.png"))  # to look at
    assert {m["name"] for m in shown} == {m["name"] for m in declared}
    for m in shown:
        assert m["directory"] in {d["directory"] for d in declared if d["name"] == m["name"]}, m
        url = next(d["url"] for d in declared if d["name"] == m["name"])
        m["download"].click()
        assert _wait_for_request(page, url), (m["name"], url, page.hf_requests)
    _close_dialogs(page)


def _wait_for_request(page, url: str, timeout_ms: int = 15_000) -> bool:
    """Whether a GET for url reached huggingface.co (our route) within the timeout."""
    for _ in range(timeout_ms // 100):
        if ("GET", url) in page.hf_requests:
            return True
        page.wait_for_timeout(100)
    return False
