"""The web extension in a real browser: Debian's chromium driven by Playwright, on ComfyUI's real frontend.

Loads the Wan example workflow the way ComfyUI serves it (/api/workflow_templates/<pack>/...), points the MGPU Plan
at header-only (sparse) files of the real Wan 2.1 14B layouts and at a simulated 2x24GiB machine, queues the Plan
node, and checks the chart the extension draws in the node and the device labels of the loaders. A screenshot is
kept in test-artifacts/ to look at.

Needs: chromium (apt-get install chromium), playwright (pip; no `playwright install`: the system chromium is used),
comfyui-frontend-package==1.27.10, and a ComfyUI checkout (COMFYUI_PATH). Skips with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

import ckpt_layouts as L
from comfyui_env import PACK_LINK_NAME, ComfyServer
from example_files import EXAMPLES

pytestmark = pytest.mark.comfyui

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
DIT, TE, VAE = "mgpu_web_wan14b_bf16.safetensors", "mgpu_web_umt5_fp8.safetensors", "mgpu_web_wan_vae.safetensors"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]
MGPU_TYPES = ["MgpuPlan", "MgpuLoadDiffusionModel", "MgpuLoadTextEncoder", "MgpuLoadVAE", "MgpuFSDPSampler", "Note"]


def _missing() -> str | None:
    if not Path(CHROMIUM).is_file():
        return "chromium is not installed (apt-get install -y chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install playwright; the system chromium is used)"
    if importlib.util.find_spec("comfyui_frontend_package") is None:
        return "ComfyUI's frontend is not installed (pip install comfyui-frontend-package==1.27.10)"
    return None


@pytest.fixture(scope="module")
def page(comfyui_server: ComfyServer):
    if why := _missing():
        pytest.skip(why)
    if "UpscaleModelLoader" not in comfyui_server.object_info():
        # frontend 1.27.10 cannot build any node with a vae_name input when a stock model loader is missing
        pytest.skip("ComfyUI's stock nodes are incomplete (pip install -r ComfyUI/requirements.txt: spandrel)")
    from playwright.sync_api import sync_playwright

    L.write_safetensors(comfyui_server.diffusion_models / DIT, L.wan21_t2v_14b(), sparse=True)
    L.write_safetensors(comfyui_server.text_encoders / TE, L.umt5_xxl(dtype="F8_E4M3"), sparse=True)
    L.write_safetensors(comfyui_server.vae / VAE, L.wan_vae(), sparse=True)
    # a fresh user would first get the template browser (which lists our examples) over the canvas
    status, _ = comfyui_server._request("POST", "/settings/Comfy.TutorialCompleted", True)
    assert status == 200
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        pg = browser.new_page(viewport={"width": 1600, "height": 1000})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(comfyui_server.base_url)
        pg.wait_for_function("(types) => window.comfyAPI?.app?.app?.graph"
                             " && types.every((t) => window.LiteGraph?.registered_node_types?.[t])",
                             arg=MGPU_TYPES, timeout=120_000)
        pg.mgpu_errors = errors
        yield pg
        browser.close()


def _load_example(page, server: ComfyServer, name: str) -> None:
    listed = server.get("/workflow_templates")[PACK_LINK_NAME]
    # offered as a template (which examples this ComfyUI is offered: test_example_workflows); API twins are not
    assert EXAMPLES[name] in listed and not any(title.endswith(".api") for title in listed), listed
    page.evaluate("""async (url) => {
        const workflow = await (await fetch(url)).json();
        // the model folders lack the examples' files: keep frontend 1.27's Missing Models dialog off the canvas
        await window.comfyAPI.app.app.loadGraphData(workflow, true, true, null, {showMissingModelsDialog: false});
    }""", f"/api/workflow_templates/{PACK_LINK_NAME}/{EXAMPLES[name]}.json")


def _node(page, node_type: str) -> int:
    return page.evaluate("(t) => window.comfyAPI.app.app.graph.nodes.find((n) => n.type === t).id", node_type)


def test_plan_chart_is_drawn_in_the_node(page, comfyui_server: ComfyServer):
    _load_example(page, comfyui_server, "wan21_t2v_multi_gpu")
    plan_id = _node(page, "MgpuPlan")
    page.evaluate("""([id, files]) => {
        const app = window.comfyAPI.app.app;
        const node = app.graph.getNodeById(id);
        const set = (name, value) => { node.widgets.find((w) => w.name === name).value = value; };
        set("dit", files[0]); set("text_encoder", files[1]); set("vae", files[2]);
        set("devices", "2x24GiB,cpu=64GiB");
        app.canvas.ds.scale = 1;
        app.canvas.ds.offset = [-node.pos[0] + 30, -node.pos[1] + 60];
        app.canvas.setDirty(true, true);
        return app.queuePrompt(0, 1, [String(id)]);
    }""", [plan_id, [DIT, TE, VAE]])

    page.wait_for_selector('.mgpu-plan .mgpu-device[data-device="cpu"]', state="visible", timeout=120_000)
    rows = page.evaluate("""() => [...document.querySelectorAll(".mgpu-plan .mgpu-device")].map((row) => ({
        device: row.dataset.device,
        title: row.querySelector(".mgpu-device-title").textContent,
        peak: row.querySelector(".mgpu-peak")?.dataset.phase,
        phases: Object.fromEntries([...row.querySelectorAll(".mgpu-phase")].map((line) => [line.dataset.phase, {
            kinds: [...line.querySelectorAll(".mgpu-seg")].map((s) => s.dataset.kind),
            widths: [...line.querySelectorAll(".mgpu-seg")].map((s) => s.getBoundingClientRect().width),
            headroom: line.querySelector(".mgpu-headroom").getBoundingClientRect().width,
            bar: line.querySelector(".mgpu-bar").getBoundingClientRect().width,
        }])),
    }))""")
    assert [r["device"] for r in rows] == ["cuda:0", "cuda:1", "cpu"]
    for row in rows[:2]:  # the fp8 DiT is sharded over both simulated GPUs: its shard is there in every phase
        assert list(row["phases"]) == ["encode", "sample", "decode"] and row["peak"] in row["phases"]
        assert "simulated 24 GiB" in row["title"] and "headroom" in row["title"]
        for phase in row["phases"].values():
            assert "dit" in phase["kinds"] and all(w > 0 for w in phase["widths"]) and phase["headroom"] > 0
            drawn = sum(phase["widths"]) + phase["headroom"]
            assert drawn == pytest.approx(phase["bar"], abs=3), row  # holdings + headroom fill the bar
        assert row["phases"]["sample"]["kinds"][-1] == "working"
    drawn = [(r["device"], name, k) for r in rows for name, ph in r["phases"].items() for k in ph["kinds"]]
    assert {k for _, _, k in drawn} == {"text_encoder", "dit", "vae", "working"}
    assert {name for _, name, k in drawn if k == "text_encoder"} == {"encode"}  # freed before sampling
    table = page.inner_text(".mgpu-plan .mgpu-table")
    assert "dit: fsdp on cuda:0, cuda:1" in table and "headroom" in table

    ARTIFACTS.mkdir(exist_ok=True)
    page.wait_for_timeout(300)  # let the canvas paint the resized node under the DOM widget
    page.screenshot(path=str(ARTIFACTS / "mgpu_plan_chart.png"))
    page.locator(".mgpu-plan").screenshot(path=str(ARTIFACTS / "mgpu_plan_chart_node.png"))
    assert not page.mgpu_errors or all("reading 'id'" in e for e in page.mgpu_errors), page.mgpu_errors

    # the chart is a view, not a value: the saved workflow keeps the Plan node's widgets_values as they were
    saved = page.evaluate("(id) => window.comfyAPI.app.app.graph.getNodeById(id).serialize()", plan_id)
    # (a workflow saved before the optional dit_low_noise and training inputs gets them last, at their defaults:
    # its values keep their places)
    assert len(saved["widgets_values"]) == 19 and saved["widgets_values"][9] == "2x24GiB,cpu=64GiB"
    assert saved["widgets_values"][12:] == ["none", False, 8, "AdamW", "auto", 1, 1]


def test_device_combos_show_labels_but_keep_values(page, comfyui_server: ComfyServer):
    labels = comfyui_server.get("/mgpu/devices")["labels"]
    _load_example(page, comfyui_server, "wan21_t2v_multi_gpu")
    vae_id = _node(page, "MgpuLoadVAE")
    page.wait_for_function("(label) => window.comfyAPI.app.app.graph.nodes.some((n) => n.widgets?.some("
                           "(w) => w.name === 'device' && w._displayValue === label))", arg=labels["auto"])
    shown = page.evaluate("""(id) => {
        const node = window.comfyAPI.app.app.graph.getNodeById(id);
        const w = node.widgets.find((w) => w.name === "device");
        return {value: w.value, shown: w._displayValue, saved: node.serialize().widgets_values};
    }""", vae_id)
    assert shown == {"value": "auto", "shown": labels["auto"], "saved": ["wan_2.1_vae.safetensors", "auto"]}

    # a real click on the combo opens ComfyUI's menu, whose entries carry the labels; picking one stores the value
    box = page.evaluate("""(id) => {
        const app = window.comfyAPI.app.app;
        const node = app.graph.getNodeById(id);
        const w = node.widgets.find((w) => w.name === "device");
        app.canvas.ds.scale = 1;
        app.canvas.ds.offset = [-node.pos[0] + 100, -node.pos[1] + 100];
        app.canvas.setDirty(true, true);
        const rect = app.canvas.canvas.getBoundingClientRect();
        return {x: rect.left + 100 + node.size[0] / 2, y: rect.top + 100 + w.y + 10};
    }""", vae_id)
    page.wait_for_timeout(200)
    page.mouse.click(box["x"], box["y"])
    menu = page.locator(".litecontextmenu").last
    menu.wait_for(state="visible", timeout=10_000)
    entries = menu.locator(".litemenu-entry").all_inner_texts()
    assert entries[0] == labels["auto"] and len(entries) == 2, entries  # no GPU here: auto, cpu
    assert entries[1].startswith("cpu host RAM, ") and " free of " in entries[1]  # free memory is live
    menu.locator(".litemenu-entry", has_text="cpu host RAM").click()
    value = page.evaluate("(id) => window.comfyAPI.app.app.graph.getNodeById(id).widgets"
                          ".find((w) => w.name === 'device').value", vae_id)
    assert value == "cpu"
