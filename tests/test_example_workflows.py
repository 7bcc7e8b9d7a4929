"""The example workflows: UI files the frontend loads, their API twins, and a run of each twin on tiny checkpoints.

Unit tier (no ComfyUI): each UI workflow and its API twin describe the same graph (nodes, links, widget values);
every model file a loader names carries download metadata (properties.models: name, folder, the official URL, as
in ComfyUI's own Wan 2.1 and LTX-Video templates) for ComfyUI's Missing Models warning; each example has a small
JPEG thumbnail for the template browser. tests/test_web_templates.py shows both in a real browser.
Live tier (real ComfyUI, CPU): every node type and input is valid against /object_info, and each twin RUNS on
tiny checkpoints written under the file names the workflow uses. No text encoder can be tiny (ComfyUI always
builds UMT5-XXL / T5-XXL full size), so for the run the text encoder loader is dropped and each CLIPTextEncode
is replaced by the harness's MgpuTestConditioning (seeded 4096-wide embeddings), keeping the node ids and links;
the plan's text encoder is "none" and sizes, frames and steps are shrunk (sizes and frames in the plan only: the
latent nodes take them from its outputs). Everything else runs as written, and no step warns that its latent
differs from the plan. The LoRA training example runs on a tiny clip the harness writes (2 training steps at rank 4),
saves its LoRA and loss graph, and samples with the new LoRA on the same sharded MODEL.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import torch
from comfy_checkpoints import (
    LTXVDiTConfig,
    ltxv_dit_shapes,
    random_state_dict,
    write_tiny_wan21_t2v,
    write_wan21_vae,
)
from comfyui_env import PACK_LINK_NAME, ComfyServer, find_comfyui
from example_files import (
    EXAMPLES,
    EXAMPLES_DIR,
    FILE_FOLDERS,
    INPUT_FILES,
    declared_models,
    file_widgets,
    load,
    thumbnail_path,
    widget_values,
)
from PIL import Image
from safetensors.torch import load_file, save_file

import ckpt_layouts as L

NAMES = tuple(EXAMPLES)
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}


def by_id(ui: dict) -> dict[str, dict]:
    return {str(n["id"]): n for n in ui["nodes"]}


# --- unit tier: the UI file and its twin agree ------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_ui_file_has_the_shape_the_frontend_loads(name):
    ui, _ = load(name)
    assert ui["version"] == 0.4 and isinstance(ui["id"], str)
    ids = [n["id"] for n in ui["nodes"]]
    assert len(set(ids)) == len(ids) and ui["last_node_id"] == max(ids)
    assert ui["last_link_id"] == max(link[0] for link in ui["links"])
    for n in ui["nodes"]:
        assert {"id", "type", "pos", "size", "mode", "properties"} <= set(n), n["type"]
        assert n["mode"] == 0, f"{n['type']} is muted or bypassed"


@pytest.mark.parametrize("name", NAMES)
def test_ui_links_match_the_api_twin(name):
    ui, api = load(name)
    nodes = by_id(ui)
    assert {i for i, n in nodes.items() if n["type"] not in FRONTEND_ONLY} == set(api)
    seen = set()
    for link_id, src, src_slot, dst, dst_slot, typ in ui["links"]:
        dst_node, src_node = nodes[str(dst)], nodes[str(src)]
        target = dst_node["inputs"][dst_slot]
        assert target["link"] == link_id and link_id in src_node["outputs"][src_slot]["links"]
        assert src_node["outputs"][src_slot]["type"] == typ == target["type"] or typ == "*"
        assert api[str(dst)]["inputs"][target["name"]] == [str(src), src_slot], (name, target["name"])
        seen.add((str(dst), target["name"]))
    api_links = {(i, k) for i, n in api.items() for k, v in n["inputs"].items() if isinstance(v, list)}
    assert api_links == seen


@pytest.mark.parametrize("name", NAMES)
def test_ui_widget_values_match_the_api_twin(name):
    ui, api = load(name)
    for node_id, n in by_id(ui).items():
        if n["type"] in FRONTEND_ONLY:
            continue
        assert widget_values(n) == {k: v for k, v in api[node_id]["inputs"].items()
                                    if not isinstance(v, list)}, n["type"]


def test_the_wan_example_is_the_multi_gpu_text_to_video():
    _, api = load("wan21_t2v_multi_gpu")
    types = [n["class_type"] for n in api.values()]
    for t in ("MgpuPlan", "MgpuLoadDiffusionModel", "MgpuLoadTextEncoder", "MgpuLoadVAE", "CLIPTextEncode",
              "MgpuFSDPSampler", "MgpuVAEDecode", "SaveVideo"):
        assert t in types
    plan_id = next(i for i, n in api.items() if n["class_type"] == "MgpuPlan")
    loaders = [n for n in api.values() if n["class_type"].startswith("MgpuLoad")]
    assert all(n["inputs"]["plan"] == [plan_id, 0] and n["inputs"]["device"] == "auto" for n in loaders)


# ComfyUI's latent nodes the examples use: each size input, and the MGPU Plan output it is wired from.
PLAN_OUTPUTS = ("plan", "width", "height", "frames", "batch")
LATENT_WIRES = {
    "EmptyHunyuanLatentVideo": {"width": "width", "height": "height", "length": "frames", "batch_size": "batch"},
    "EmptyLTXVLatentVideo": {"width": "width", "height": "height", "length": "frames", "batch_size": "batch"},
    "LTXVEmptyLatentAudio": {"frames_number": "frames", "batch_size": "batch"},   # LTX-2's audio: as many frames
}


@pytest.mark.parametrize("name", NAMES)
def test_the_latent_size_is_typed_once_in_the_plan(name):
    """Every latent node takes its width, height, length and batch from MGPU Plan's outputs (UI links and API
    twin alike), so the video sampled is the video planned; the plan output stays slot 0 for saved workflows."""
    ui, api = load(name)
    (plan,) = [n for n in ui["nodes"] if n["type"] == "MgpuPlan"]
    assert [(o["name"], o["type"]) for o in plan["outputs"]] == [
        (n, "MGPU_PLAN" if n == "plan" else "INT") for n in PLAN_OUTPUTS]
    empty = [n["type"] for n in ui["nodes"] if n["type"].startswith(("Empty", "LTXVEmpty"))]
    assert empty and set(empty) <= set(LATENT_WIRES), empty
    links = {link[0]: link for link in ui["links"]}
    for node in ui["nodes"]:
        for slot, inp in enumerate(node.get("inputs", [])):
            if inp["name"] not in LATENT_WIRES.get(node["type"], {}):
                continue
            source = PLAN_OUTPUTS.index(LATENT_WIRES[node["type"]][inp["name"]])
            assert inp["link"] is not None, (node["type"], inp["name"])
            assert links[inp["link"]][1:] == [plan["id"], source, node["id"], slot, "INT"], (node["type"], inp)
            assert api[str(node["id"])]["inputs"][inp["name"]] == [str(plan["id"]), source]


STOCK_DECODES = {"VAEDecode", "VAEDecodeTiled"}


@pytest.mark.parametrize("name", NAMES)
def test_the_video_is_decoded_by_mgpu_vae_decode_following_the_plan(name):
    """Every example (all are multi-GPU) decodes its video where its MGPU Plan planned the decode: MGPU VAE Decode
    with devices auto and the plan connected, on the VAE that MGPU Load VAE loads by the same plan; no stock VAE
    Decode is left. LTX-2's audio keeps LTXVAudioVAEDecode (its own audio VAE, which the plan does not place)."""
    _, api = load(name)
    (plan_id,) = [i for i, n in api.items() if n["class_type"] == "MgpuPlan"]
    assert not STOCK_DECODES & {n["class_type"] for n in api.values()}
    (video,) = [n["inputs"] for n in api.values() if n["class_type"] == "CreateVideo"]
    decode = api[video["images"][0]]
    assert decode["class_type"] == "MgpuVAEDecode"
    assert decode["inputs"]["plan"] == [plan_id, 0] and decode["inputs"]["devices"] == "auto"
    vae = api[decode["inputs"]["vae"][0]]
    assert vae["class_type"] == "MgpuLoadVAE" and vae["inputs"]["plan"] == [plan_id, 0]


TITLE_HEIGHT = 30   # LiteGraph.NODE_TITLE_HEIGHT: a node's title bar lies above its pos


@pytest.mark.parametrize("name", NAMES)
def test_no_node_covers_another_on_the_canvas(name):
    """The frontends draw each node at its saved pos and size (the title bar above it): none may hide another."""
    ui, _ = load(name)
    boxes = [(n["id"], n["type"], n["pos"][0], n["pos"][1] - TITLE_HEIGHT, n["pos"][0] + n["size"][0],
              n["pos"][1] + n["size"][1]) for n in ui["nodes"]]
    for i, (*a, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for *b, bx0, by0, bx1, by1 in boxes[i + 1:]:
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, (name, a, b)


# --- unit tier: what ComfyUI's template browser and Missing Models warning read ----------------------------------

# Official sources only: Comfy-Org's repackaged files where one exists; ComfyUI's own LTX-Video template takes the
# LTX checkpoint from Lightricks and T5-XXL from comfyanonymous (ComfyUI's author): Comfy-Org repacks neither.
OFFICIAL_ORGS = {"Comfy-Org", "comfyanonymous", "Lightricks"}
HF_FILE_URL = re.compile(r"https://huggingface\.co/(?P<org>[^/]+)/[^/]+/resolve/main/(?:[^?]+/)?(?P<file>[^/?]+)"
                         r"(?:\?download=true)?")
# The ComfyUI template each example follows (package comfyui-workflow-templates): its file URLs are the reference.
# ComfyUI has no training template: the LoRA example trains and samples the files of its Wan 2.1 one.
COMFYUI_TEMPLATES = {"wan21_t2v_multi_gpu": "text_to_video_wan", "ltxv_t2v_multi_gpu": "ltxv_text_to_video",
                     "ltx2_t2v_multi_gpu": "video_ltx2_t2v", "wan22_t2v_a14b_multi_gpu": "video_wan2_2_14B_t2v",
                     "wan21_lora_training_multi_gpu": "text_to_video_wan",
                     "wan22_lora_pair_training_multi_gpu": "video_wan2_2_14B_t2v"}


@pytest.mark.parametrize("name", NAMES)
def test_every_model_file_has_download_metadata_on_its_node(name):
    """The frontend lists a node's properties.models entries whose name is one of its widget values (like stock
    loaders in ComfyUI's templates): every file a loader names needs one, in the folder that input lists; an
    all-in-one file (named by inputs of several folders: LTX-Video's DiT + VAE, LTX-2's DiT + VAEs + text projection)
    in checkpoints, where ComfyUI's own LTX-Video and LTX-2 templates keep it and every MGPU node finds it: one file,
    one folder, no links."""
    ui, _ = load(name)
    folders_of: dict[str, set[str]] = {}
    for n in ui["nodes"]:
        for k, v in file_widgets(n).items():
            folders_of.setdefault(v, set()).add(FILE_FOLDERS[k])
    in_checkpoints = {v for v, folders in folders_of.items() if len(folders) > 1 or folders == {"checkpoints"}}
    for n in ui["nodes"]:
        files, models = file_widgets(n), n.get("properties", {}).get("models", [])
        expected = sorted((v, "checkpoints" if v in in_checkpoints else FILE_FOLDERS[k]) for k, v in files.items())
        assert sorted((m["name"], m["directory"]) for m in models) == expected, (n["type"], models)
        for m in models:
            url = HF_FILE_URL.fullmatch(m["url"])
            assert url and url["file"] == m["name"], (n["type"], m)
            assert url["org"] in OFFICIAL_ORGS, (n["type"], m)
    urls, folders = {}, {}
    for m in declared_models(ui):  # one file, one URL and one folder, whichever node names it
        assert urls.setdefault(m["name"], m["url"]) == m["url"], m
        assert folders.setdefault(m["name"], m["directory"]) == m["directory"], m


@pytest.mark.parametrize("name", ["wan21_t2v_multi_gpu", "wan21_lora_training_multi_gpu"])
def test_the_wan_files_are_comfy_orgs_repack(name):
    ui, _ = load(name)
    repack = "https://huggingface.co/Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files"
    named = {v for n in ui["nodes"] for v in file_widgets(n).values()}
    assert {m["name"] for m in declared_models(ui)} == named
    for m in declared_models(ui):
        assert m["url"] == f"{repack}/{m['directory']}/{m['name']}?download=true", m


def _templates_dir() -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ComfyUI's workflow templates are not installed (pip install -r ComfyUI/requirements.txt)")
    return Path(next(iter(spec.submodule_search_locations))).parent


def _comfyui_template(name: str) -> dict:
    site = _templates_dir()
    found = sorted(site.glob(f"comfyui_workflow_templates*/templates/{name}.json"))
    assert found, f"no template {name}.json in the installed comfyui-workflow-templates packages under {site}"
    return json.loads(found[0].read_text())


def _template_models(template: dict) -> list[dict[str, str]]:
    """Every file a ComfyUI template declares, also on the nodes of its subgraphs (the LTX-2 ones keep theirs
    there)."""
    graphs = [template, *template.get("definitions", {}).get("subgraphs", [])]
    return [m for g in graphs for m in declared_models(g)]


@pytest.mark.parametrize("name", NAMES)
def test_urls_are_those_of_comfyuis_own_template(name):
    """A file ComfyUI's matching template names has its exact URL and folder; any other file lies beside one."""
    ui, _ = load(name)
    if name in NEWER_NODES and not list(_templates_dir().glob(f"*/templates/{COMFYUI_TEMPLATES[name]}.json")):
        # the templates of a ComfyUI older than the model (0.3.64 and LTX-2): it has none of that family at all
        assert not list(_templates_dir().glob(f"*/templates/{COMFYUI_TEMPLATES[name].rsplit('_', 1)[0]}*.json"))
        return
    theirs = {m["name"]: m for m in _template_models(_comfyui_template(COMFYUI_TEMPLATES[name]))}
    folders = {m["url"].split("?")[0].rsplit("/", 1)[0] for m in theirs.values()}
    shared = 0
    for m in declared_models(ui):
        if m["name"] in theirs:
            assert (m["url"], m["directory"]) == (theirs[m["name"]]["url"], theirs[m["name"]]["directory"]), m
            shared += 1
        else:
            assert m["url"].split("?")[0].rsplit("/", 1)[0] in folders, (m, sorted(folders))
    assert shared, f"{name} shares no file with ComfyUI's {COMFYUI_TEMPLATES[name]} template"


def test_the_template_browser_lists_exactly_the_examples_with_their_thumbnails():
    """ComfyUI lists every example_workflows/*.json (its stem is the card's title) and shows <stem>.jpg on it."""
    assert {p.stem for p in EXAMPLES_DIR.glob("*.json")} == set(EXAMPLES.values())
    assert {p.stem for p in EXAMPLES_DIR.iterdir() if p.is_file() and p.suffix != ".json"} == set(EXAMPLES.values())
    for name in NAMES:
        path = thumbnail_path(name)
        with Image.open(path) as img:
            assert img.format == "JPEG" and img.width >= 256 and img.height >= 128, (path.name, img.size)
        assert path.stat().st_size <= 48 * 1024, f"{path.name}: keep thumbnails small"


# A node's title bar in a thumbnail: its mean grey level on the canvas as both frontends draw it (measured 54-66 on
# 1.27's and 1.49's dark theme). A dialog dims the canvas around it (1.27's "Some Nodes Are Missing" over the old
# LTX-2 thumbnail: 9-39) and hides what lies under its panel.
TITLE_GREY = (40, 100)


def _node_title_greys(ui: dict, image) -> dict[str, float]:
    """Mean grey level of each node's title bar in a thumbnail of ``ui``, by "id type".

    The thumbnail is the graph's bounding box (title bars included) plus 16 screen px each side, scaled as a whole
    (tests/test_web_templates.py: _write_thumbnail): width = a*graph_w + 32*t, height = a*graph_h + 32*t, with a
    the canvas units -> thumbnail px scale and t the screen px -> thumbnail px one, two equations for the two."""
    from PIL import ImageStat

    nodes = ui["nodes"]
    x0 = min(n["pos"][0] for n in nodes)
    y0 = min(n["pos"][1] - TITLE_HEIGHT for n in nodes)
    graph_w = max(n["pos"][0] + n["size"][0] for n in nodes) - x0
    graph_h = max(n["pos"][1] + n["size"][1] for n in nodes) - y0
    grey = image.convert("L")
    a = (grey.width - grey.height) / (graph_w - graph_h)
    pad = (grey.width - a * graph_w) / 2
    assert a > 0 and 0 <= pad < 0.05 * grey.width, (a, pad)   # a picture of this graph at all

    def at(x: float, y: float) -> tuple[int, int]:
        return round(pad + a * (x - x0)), round(pad + a * (y - y0))

    greys = {}
    for n in nodes:   # inside the title bar, clear of its rounded corners and the collapse dot
        (x, y), (w, _) = n["pos"], n["size"]
        box = (*at(x + 10, y - TITLE_HEIGHT + 5), *at(x + w - 10, y - 5))
        greys[f"{n['id']} {n['type']}"] = ImageStat.Stat(grey.crop(box)).mean[0]
    return greys


@pytest.mark.parametrize("name", NAMES)
def test_no_thumbnail_shows_a_dialog_over_the_graph(name):
    """Each thumbnail shows the workflow's graph, every node's title bar as the canvas draws it: no dialog over it
    (the LTX-2 one was once a screenshot of "Some Nodes Are Missing", taken on a ComfyUI without LTX-2)."""
    from PIL import Image

    ui, _ = load(name)
    with Image.open(thumbnail_path(name)) as img:
        greys = _node_title_greys(ui, img)
    hidden = {node: round(g, 1) for node, g in greys.items() if not TITLE_GREY[0] <= g <= TITLE_GREY[1]}
    assert not hidden, f"{thumbnail_path(name).name}: title bars dimmed or covered, a dialog over the graph? {hidden}"


# --- live tier ----------------------------------------------------------------------------------------------------

def _input_spec(info: dict, node_type: str, name: str) -> tuple[Any, dict]:
    spec = info[node_type]["input"]
    entry = spec.get("required", {}).get(name) or spec.get("optional", {}).get(name)
    assert entry is not None, f"{node_type} has no input {name!r}"
    return entry[0], (entry[1] if len(entry) > 1 else {})


# Stock nodes an example needs that older ComfyUI lacks: there the example is checked to need exactly these.
NEWER_NODES = {"ltx2_t2v_multi_gpu": {"LTXVAudioVAELoader", "LTXVEmptyLatentAudio", "LTXVConcatAVLatent",
                                      "LTXVSeparateAVLatent", "LTXVAudioVAEDecode"},   # LTX-2: ComfyUI 0.33+
               # 0.33 names Save LoRA Weights SaveLoRA; 0.3.64 names it SaveLoRANode (same inputs), an id 0.33
               # does not know: the example names the current one
               "wan21_lora_training_multi_gpu": {"SaveLoRA"}, "wan22_lora_pair_training_multi_gpu": {"SaveLoRA"}}
# Stock node types an older ComfyUI has under another id (the run there uses it).
OLDER_IDS = {"SaveLoRA": "SaveLoRANode"}   # ComfyUI 0.3.64


@pytest.mark.comfyui
def test_the_template_browser_offers_only_the_examples_this_comfyui_runs(comfyui_server: ComfyServer):
    """ComfyUI lists every example_workflows/*.json of a pack (GET /api/workflow_templates, what the template browser
    reads); the pack takes out the examples whose stock nodes this ComfyUI lacks: LTX-2 on 0.3.64 (no LTX-2 nodes:
    its card opened into "Some Nodes Are Missing") and the LoRA training (0.3.64's Save LoRA Weights is SaveLoRANode),
    none on 0.33. Other packs' entries are left alone."""
    server = comfyui_server
    info = server.object_info()
    runnable = {EXAMPLES[n] for n in NAMES if not NEWER_NODES.get(n, set()) - set(info)}
    other = server.base_dir / "custom_nodes" / "mgpu_other_pack" / "example_workflows"
    other.mkdir(parents=True, exist_ok=True)
    (other / "LTX-2 of another pack.json").write_text(
        json.dumps({"nodes": [{"id": 1, "type": "LTXVAudioVAELoader"}], "links": []}))
    try:
        for path in ("/api/workflow_templates", "/workflow_templates"):
            listing = server.get(path)
            assert set(listing[PACK_LINK_NAME]) == runnable, (path, listing[PACK_LINK_NAME])
            assert listing["mgpu_other_pack"] == ["LTX-2 of another pack"]
    finally:
        shutil.rmtree(other.parent)
    if "LTXVAudioVAELoader" in info:
        assert runnable == set(EXAMPLES.values())
    else:
        assert runnable == set(EXAMPLES.values()) - {EXAMPLES[n] for n in NEWER_NODES}
        for n in NEWER_NODES:
            assert f"the example workflow {EXAMPLES[n]!r} is not offered" in server.log(), n
    # the card's files stay served, for a link saved before
    for title in EXAMPLES.values():
        status, _ = server._request("GET", f"/api/workflow_templates/{PACK_LINK_NAME}/{quote(title)}.json")
        assert status == 200, title


@pytest.mark.comfyui
@pytest.mark.parametrize("name", NAMES)
def test_every_node_and_input_is_valid_for_this_comfyui(comfyui_server: ComfyServer, name):
    info = comfyui_server.object_info()
    ui, api = load(name)
    absent = {n["type"] for n in ui["nodes"]} - FRONTEND_ONLY - set(info)
    if absent and name in NEWER_NODES:   # an older ComfyUI (0.3.64 and LTX-2): only those nodes are missing
        assert absent == NEWER_NODES[name], sorted(absent)
        return
    assert not absent, sorted(absent)
    for node_id, node in api.items():
        kind = node["class_type"]
        required = set(info[kind]["input"].get("required", {}))
        assert required <= set(node["inputs"]), (kind, required - set(node["inputs"]))
        for key, value in node["inputs"].items():
            typ, opts = _input_spec(info, kind, key)
            if isinstance(value, list):  # a link: the source's output type must be what this input takes
                src = api[value[0]]["class_type"]
                assert info[src]["output"][value[1]] == typ, (kind, key, src)
            elif typ == "COMBO" or isinstance(typ, list):
                options = opts.get("options", typ if isinstance(typ, list) else [])
                if key in FILE_FOLDERS:  # the examples name the real files, which this server lacks
                    assert value == "none" or value.endswith(".safetensors"), (kind, key, value)
                elif (kind, key) in INPUT_FILES:   # the user's own file in ComfyUI's input folder
                    assert value.endswith(INPUT_FILES[kind, key]), (kind, key, value)
                else:
                    assert value in options, (kind, key, value)
            elif typ in ("INT", "FLOAT", "FLOAT,INT"):   # "FLOAT,INT": a number of either type (0.33's MultiType)
                assert isinstance(value, (int, float)) and not isinstance(value, bool), (kind, key)
                assert opts.get("min", value) <= value <= opts.get("max", value), (kind, key, value)
            elif typ == "BOOLEAN":
                assert isinstance(value, bool), (kind, key)
            elif typ == "COMFY_DYNAMICCOMBO_V3":   # ComfyUI >= 0.33 (SaveVideo's format): one of the option keys
                assert value in [o["key"] for o in opts["options"]], (kind, key, value)
            else:
                assert typ == "STRING" and isinstance(value, str), (kind, key, typ)


def _for_the_run(api: dict, width: int, height: int, frames: int, text: tuple[int, int] = (4096, 8)) -> dict:
    """The twin with test conditioning (``text``: its width and tokens) instead of the text encoder, and a tiny size
    (see the module docstring)."""
    prompt = copy.deepcopy(api)
    for node_id, node in list(prompt.items()):
        kind, inputs = node["class_type"], node["inputs"]
        if kind == "MgpuLoadTextEncoder":
            del prompt[node_id]
        elif kind == "CLIPTextEncode":
            prompt[node_id] = {"class_type": "MgpuTestConditioning",
                               "inputs": {"width": text[0], "tokens": text[1], "seed": int(node_id), "scale": 1.0}}
        elif kind == "MgpuPlan":   # the latent nodes are wired to its width, height and frames
            inputs.update(text_encoder="none", width=width, height=height, frames=frames)
        elif kind in ("MgpuFSDPSampler", "LTXVScheduler"):
            inputs.update(steps=2)
    return prompt


def model_files(api: dict) -> set[str]:
    """The DiT and VAE files the twin names (the text encoder is not run)."""
    return {v for n in api.values() for k, v in n["inputs"].items()
            if k in ("dit", "unet_name", "vae", "vae_name") and isinstance(v, str) and v != "none"}


# What MGPU VAE Decode logs when its devices auto follows a connected MGPU Plan (loaders/parallel_decode.py).
FOLLOWS_THE_PLAN = "MGPU VAE Decode: auto: the MGPU Plan"
# What a sampler step logs when its latent is not the size the plan was made for (loaders/plan_check.py).
PLAN_CHECK_WARNING = "but the MGPU Plan was made for"


def _run_twin(server: ComfyServer, prompt: dict) -> dict:
    """The history entry of ``prompt``, run to success, its video decoded by MGPU VAE Decode where the plan says."""
    start = len(server.log())
    entry = server.wait(server.post_prompt(prompt), timeout=600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[:4000]
    assert FOLLOWS_THE_PLAN in server.log()[start:], server.log_tail()
    assert PLAN_CHECK_WARNING not in server.log()[start:], server.log()[start:][-3000:]
    return entry


@pytest.mark.comfyui
@pytest.mark.parametrize("name", NAMES)
def test_mgpu_vae_decode_keeps_this_comfyuis_default_settings(comfyui_server: ComfyServer, name):
    """devices auto and VAE Decode (Tiled)'s default tiles as this ComfyUI declares them (MGPU VAE Decode copies
    them): the tiles MGPU Plan sizes a split or tiled decode by."""
    spec = comfyui_server.object_info("MgpuVAEDecode")["input"]["required"]
    _, api = load(name)
    (decode,) = [n["inputs"] for n in api.values() if n["class_type"] == "MgpuVAEDecode"]
    defaults = {k: entry[1]["default"] for k, entry in spec.items() if "default" in (entry[1:] or [{}])[0]}
    assert {k: v for k, v in decode.items() if not isinstance(v, list)} == defaults
    assert set(defaults) == {"devices", "tile_size", "overlap", "temporal_size", "temporal_overlap"}


def _saved_videos(entry: dict) -> list[dict]:
    """What SaveVideo wrote (type output; a loss graph's preview is a temp image)."""
    return [i for out in entry["outputs"].values() for i in out.get("images", []) if i.get("type") == "output"]


def _video(server: ComfyServer, entry: dict) -> tuple[int, int, int]:
    """(frames, width, height) of the video SaveVideo wrote."""
    import av

    (item,) = _saved_videos(entry)
    with av.open(str(server.output_dir / item["subfolder"] / item["filename"])) as container:
        frames = [f for f in container.decode(video=0)]
    return len(frames), frames[0].width, frames[0].height


@pytest.mark.comfyui
@pytest.mark.parametrize("dit_device", ["auto", "fsdp"])
def test_wan_twin_runs_on_tiny_checkpoints(comfyui_server: ComfyServer, dit_device: str):
    """As written (auto: the plan for this CPU machine), and with the DiT forced to fsdp (two CPU ranks here)."""
    server = comfyui_server
    _, api = load("wan21_t2v_multi_gpu")
    for node in api.values():
        if node["class_type"] == "MgpuLoadDiffusionModel":
            node["inputs"]["device"] = dit_device
    assert model_files(api) == {"wan2.1_t2v_14B_bf16.safetensors", "wan_2.1_vae.safetensors"}
    write_tiny_wan21_t2v(server.diffusion_models / "wan2.1_t2v_14B_bf16.safetensors")
    if not (server.vae / "wan_2.1_vae.safetensors").exists():
        write_wan21_vae(server.vae / "wan_2.1_vae.safetensors")
    entry = _run_twin(server, _for_the_run(api, 64, 64, 5))
    assert _video(server, entry) == (5, 64, 64)
    plan = next(out for out in entry["outputs"].values() if "mgpu_plan" in out)["mgpu_plan"][0]
    assert {p["role"] for p in plan["placements"]} == {"dit", "vae"}


# A VAE config ComfyUI's LTX-Video VideoVAE builds small (it reads the config from the checkpoint's metadata):
# 128 latent channels and 8x32x32 compression like the real one, one residual layer, channel multipliers of 1.
TINY_LTXV_VAE = {
    "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
    "encoder_blocks": [["res_x", {"num_layers": 1}], ["compress_all", {}], ["compress_all", {}], ["compress_all", {}]],
    "decoder_blocks": [["compress_all", {"residual": True, "multiplier": 1}]] * 3
                      + [["res_x", {"num_layers": 1, "inject_noise": False}]],
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "latent_log_var": "uniform", "use_quant_conv": False,
    "causal_decoder": False, "timestep_conditioning": False,
}


def write_tiny_ltxv_checkpoint(path: Path) -> None:
    """An all-in-one LTX-Video file as Lightricks ship it: DiT under model.diffusion_model., VAE under vae.,
    the VAE config in the metadata. The VAE's tensors come from ComfyUI's own class (in a subprocess, since
    importing comfy parses its command line), with unit statistics so decoding stays finite."""
    comfyui = find_comfyui()
    vae_file = path.with_suffix(".vae.tmp")
    code = f"""
import sys, json, torch
sys.path.insert(0, {str(comfyui)!r})
from comfy.cli_args import args
args.cpu = True
from safetensors.torch import save_file
from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
torch.manual_seed(0)
vae = VideoVAE(config=json.loads({json.dumps(json.dumps(TINY_LTXV_VAE))}))
sd = {{k: v.contiguous() for k, v in vae.state_dict().items()}}
for k in sd:
    if k.startswith("per_channel_statistics."):
        sd[k] = torch.zeros_like(sd[k]) if k.endswith("mean-of-means") else torch.ones_like(sd[k])
save_file(sd, {str(vae_file)!r})
"""
    subprocess.run([sys.executable, "-c", code], cwd=comfyui, check=True, capture_output=True, timeout=300)
    vae = load_file(str(vae_file))
    vae_file.unlink()
    # A DiT larger than the VAE, as in real files (4 layers of 512 wide): ComfyUI and sizing pick the right parts.
    dit = random_state_dict(ltxv_dit_shapes(LTXVDiTConfig(head_dim=16, num_layers=4)), seed=5)
    tensors = {"model.diffusion_model." + k: v for k, v in dit.items()}
    tensors.update({"vae." + k: v.to(dtype=dit["proj_out.weight"].dtype) for k, v in vae.items()})
    save_file(tensors, str(path), metadata={"config": json.dumps({"vae": TINY_LTXV_VAE})})


@pytest.mark.comfyui
def test_ltxv_twin_runs_on_a_tiny_all_in_one_checkpoint(comfyui_server: ComfyServer):
    server = comfyui_server
    _, api = load("ltxv_t2v_multi_gpu")
    (name,) = model_files(api)
    checkpoints = server.base_dir / "models" / "checkpoints"   # ComfyUI's own folder under --base-directory
    checkpoints.mkdir(parents=True, exist_ok=True)
    if not (checkpoints / name).exists():   # as the workflow's note says: there alone, as ComfyUI's LTXV template
        write_tiny_ltxv_checkpoint(checkpoints / name)
    entry = _run_twin(server, _for_the_run(api, 64, 64, 9))
    assert _video(server, entry) == (9, 64, 64)
    plan = next(out for out in entry["outputs"].values() if "mgpu_plan" in out)["mgpu_plan"][0]
    assert {p["role"]: p["family"] for p in plan["placements"]} == {"dit": "ltxv", "vae": "ltxv-vae"}


# LTX-2's audio VAE and vocoder as ComfyUI 0.33 builds them from the checkpoint's metadata, small: the real latent
# layout (8 channels x 16 frequency bins, 25 latents a second at 16 kHz) from an 8-wide encoder and decoder, and a
# 32-wide vocoder upsampling by the real 160.
TINY_LTX2_AUDIO_VAE = {
    "model": {"params": {"ddconfig": {"double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256,
                                      "downsample_time": False, "in_channels": 2, "out_ch": 2, "ch": 8,
                                      "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
                                      "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel",
                                      "causality_axis": "height"}, "sampling_rate": 16000}},
    "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}},
}
TINY_LTX2_VOCODER = {"resblock_kernel_sizes": [3], "upsample_rates": [5, 4, 2, 2, 2],
                     "upsample_kernel_sizes": [16, 16, 8, 4, 4], "resblock_dilation_sizes": [[1, 3, 5]],
                     "upsample_initial_channel": 32, "stereo": True}
# A DiT that outweighs the VAEs in the file, as in the real one (MGPU Plan sizes the biggest part as the DiT).
TINY_LTX2_DIT = {"heads": 8, "head_dim": 64, "layers": 4}   # 21.9 M parameters; the video VAE has 14.9 M


def write_tiny_ltx2_checkpoint(path: Path) -> None:
    """An all-in-one LTX-2 file as Lightricks ship it: the DiT under model.diffusion_model., the video VAE under
    vae., the audio VAE under audio_vae. and its vocoder under vocoder., every config in the metadata. The VAEs'
    keys and shapes come from ComfyUI's own classes (in a subprocess, since importing comfy parses its command line;
    ComfyUI builds them without initialising the weights), their values are seeded, with unit statistics so
    decoding stays finite."""
    comfyui = find_comfyui()
    config = {"transformer": L.ltx2_tiny_config(TINY_LTX2_DIT), "vae": TINY_LTXV_VAE,
              "audio_vae": TINY_LTX2_AUDIO_VAE, "vocoder": TINY_LTX2_VOCODER}
    code = f"""
import sys, json, torch
sys.path.insert(0, {str(comfyui)!r})
from comfy.cli_args import args
args.cpu = True
from comfy.ldm.lightricks.vae.audio_vae import AudioVAE
from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
config = json.loads({json.dumps(json.dumps(config))})
with torch.device("meta"):
    shapes = {{"vae." + k: list(v.shape) for k, v in VideoVAE(config=config["vae"]).state_dict().items()}}
    for k, v in AudioVAE(metadata={{"config": json.dumps(config)}}).state_dict().items():   # autoencoder., vocoder.
        shapes[k.replace("autoencoder.", "audio_vae.", 1)] = list(v.shape)
print(json.dumps(shapes))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=comfyui, check=True, capture_output=True, text=True,
                          timeout=300)
    vae_shapes = {k: tuple(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
    tensors = random_state_dict(vae_shapes, seed=6)
    for k in tensors:
        if "per_channel_statistics." in k:
            tensors[k] = torch.zeros_like(tensors[k]) if k.endswith("mean-of-means") else torch.ones_like(tensors[k])
    dit = L.ltx2_av_dit(**{**L.LTX2_TINY, **TINY_LTX2_DIT}, prefix="model.diffusion_model.")
    tensors.update(random_state_dict({k: s for k, (s, _) in dit.items()}, seed=5))
    save_file(tensors, str(path), metadata={"config": json.dumps(config)})


def _audio_streams(server: ComfyServer, entry: dict) -> int:
    import av

    (item,) = _saved_videos(entry)
    with av.open(str(server.output_dir / item["subfolder"] / item["filename"])) as container:
        return len(container.streams.audio)


@pytest.mark.comfyui
@pytest.mark.parametrize("dit_device", ["auto", "fsdp"])
def test_ltx2_twin_runs_on_a_tiny_all_in_one_checkpoint(comfyui_server: ComfyServer, dit_device: str):
    """ComfyUI 0.33: the twin as written (auto: the plan for this CPU machine), and with the DiT forced to fsdp (two
    CPU ranks here), saves a video with its audio. ComfyUI 0.3.64 has no LTX-2 nodes to run it with."""
    server = comfyui_server
    _, api = load("ltx2_t2v_multi_gpu")
    if not NEWER_NODES["ltx2_t2v_multi_gpu"] <= set(server.object_info()):
        assert not NEWER_NODES["ltx2_t2v_multi_gpu"] & set(server.object_info())
        return
    (name,) = model_files(api)
    checkpoints = server.base_dir / "models" / "checkpoints"   # ComfyUI's own folder under --base-directory
    checkpoints.mkdir(parents=True, exist_ok=True)
    if not (checkpoints / name).exists():   # as the workflow's note says: there alone, as ComfyUI's LTX-2 template
        write_tiny_ltx2_checkpoint(checkpoints / name)
    for node in api.values():
        if node["class_type"] == "MgpuLoadDiffusionModel":
            node["inputs"]["device"] = dit_device
    entry = _run_twin(server, _for_the_run(api, 64, 64, 9, text=(48, 1024)))
    assert _video(server, entry) == (9, 64, 64) and _audio_streams(server, entry) == 1
    plan = next(out for out in entry["outputs"].values() if "mgpu_plan" in out)["mgpu_plan"][0]
    assert {p["role"]: p["family"] for p in plan["placements"]} == {"dit": "ltx2-av", "vae": "ltxv-vae"}


# --- Wan 2.2 A14B: ComfyUI's two-expert workflow with the MGPU loaders -----------------------------------------------

WAN22 = "wan22_t2v_a14b_multi_gpu"


def test_the_wan22_example_is_comfyuis_two_expert_workflow_on_one_plan():
    """As ComfyUI's Wan 2.2 14B template (without its speed LoRA): the high-noise expert for steps 0-10 of 20 with
    its leftover noise, the low-noise one for the rest, ModelSamplingSD3 shift 8 on each; both loaders follow a
    plan that names both experts."""
    _, api = load(WAN22)
    by_type = {}
    for node_id, n in api.items():
        by_type.setdefault(n["class_type"], []).append((node_id, n["inputs"]))
    (plan_id, plan), = by_type["MgpuPlan"]
    loaders = dict((i, n) for i, n in by_type["MgpuLoadDiffusionModel"])
    assert sorted(n["unet_name"] for n in loaders.values()) == sorted([plan["dit"], plan["dit_low_noise"]])
    assert "high_noise" in plan["dit"] and "low_noise" in plan["dit_low_noise"]
    for kind in ("MgpuLoadDiffusionModel", "MgpuLoadTextEncoder", "MgpuLoadVAE"):
        assert all(n["plan"] == [plan_id, 0] and n["device"] == "auto" for _, n in by_type[kind])
    samplers = sorted((n["start_at_step"], n) for _, n in by_type["KSamplerAdvanced"])
    (_, first), (_, second) = samplers
    assert (first["end_at_step"], first["return_with_leftover_noise"], first["add_noise"]) == (10, "enable", "enable")
    assert (second["start_at_step"], second["end_at_step"], second["add_noise"]) == (10, 10000, "disable")
    assert first["steps"] == second["steps"] == 20
    assert api[second["latent_image"][0]]["inputs"] is first   # the second continues the first's latent

    def expert_of(sampler: dict) -> str:
        shift = api[sampler["model"][0]]
        assert shift["class_type"] == "ModelSamplingSD3" and shift["inputs"]["shift"] == 8
        return loaders[shift["inputs"]["model"][0]]["unet_name"]

    assert (expert_of(first), expert_of(second)) == (plan["dit"], plan["dit_low_noise"])
    (_, latent), = by_type["EmptyHunyuanLatentVideo"]
    assert (latent["width"], latent["height"], latent["length"]) == ([plan_id, 1], [plan_id, 2], [plan_id, 3])


@pytest.mark.comfyui
@pytest.mark.parametrize("dit_device", ["auto", "fsdp"])
def test_wan22_twin_runs_on_tiny_checkpoints(comfyui_server: ComfyServer, dit_device: str):
    """As written (auto: the plan for this CPU machine puts both experts on the CPU), and with both loaders forced
    to fsdp (both experts on the same two CPU ranks); 4 steps, the switch after 2."""
    server = comfyui_server
    _, api = load(WAN22)
    prompt = _for_the_run(api, 64, 64, 5)
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "MgpuLoadDiffusionModel":
            inputs["device"] = dit_device
            write_tiny_wan21_t2v(server.diffusion_models / inputs["unet_name"],
                                 seed=1 if "high" in inputs["unet_name"] else 2)
        elif node["class_type"] == "KSamplerAdvanced":   # the high-noise one ends, the low-noise one starts at 2
            inputs.update(steps=4, **({"end_at_step": 2} if inputs["start_at_step"] == 0 else {"start_at_step": 2}))
    vae = next(n["inputs"]["vae_name"] for n in api.values() if n["class_type"] == "MgpuLoadVAE")
    if not (server.vae / vae).exists():
        write_wan21_vae(server.vae / vae)
    entry = _run_twin(server, prompt)
    assert _video(server, entry) == (5, 64, 64)
    plan = next(out for out in entry["outputs"].values() if "mgpu_plan" in out)["mgpu_plan"][0]
    experts = {p["role"]: p["experts"] for p in plan["placements"] if p["role"].startswith("dit")}
    assert experts == {"dit": "both_resident", "dit_low_noise": "both_resident"}


# --- Wan 2.1 LoRA training: MGPU Train LoRA on the sharded DiT, then a sample with the new LoRA -----------------------

LORA_TRAINING = "wan21_lora_training_multi_gpu"


def test_the_lora_example_trains_on_the_sharded_dit_and_samples_with_the_new_lora():
    """The clip is cut and scaled to the plan's frames, width and height (typed once, in MGPU Plan: the training
    latents are the size of the sample's), encoded by stock VAE Encode on MGPU Load VAE's VAE and captioned by stock
    CLIP Text Encode on MGPU Load Text Encoder's; MGPU Train LoRA trains on MGPU Load Diffusion Model's MODEL (device
    fsdp, the plan connected); stock Save LoRA Weights (with the steps), Plot Loss Graph and Load LoRA Model take its
    outputs, and the sampler samples the same sharded MODEL with the LoRA."""
    _, api = load(LORA_TRAINING)
    (plan_id,) = [i for i, n in api.items() if n["class_type"] == "MgpuPlan"]
    (train_id, train), = [(i, n["inputs"]) for i, n in api.items() if n["class_type"] == "MgpuTrainLoRA"]

    def source(link: list, kind: str) -> dict:
        node = api[link[0]]
        assert node["class_type"] == kind, (link, node["class_type"], kind)
        return node["inputs"]

    dit = source(train["model"], "MgpuLoadDiffusionModel")
    assert dit["device"] == "fsdp" and dit["plan"] == [plan_id, 0]
    encode = source(train["latents"], "VAEEncode")
    assert source(encode["vae"], "MgpuLoadVAE")["plan"] == [plan_id, 0]
    scale = source(encode["pixels"], "ImageScale")
    assert (scale["width"], scale["height"], scale["crop"]) == ([plan_id, 1], [plan_id, 2], "center")
    cut = source(scale["image"], "ImageFromBatch")
    assert (cut["batch_index"], cut["length"]) == (0, [plan_id, 3])
    source(source(cut["image"], "GetVideoComponents")["video"], "LoadVideo")
    assert source(source(train["positive"], "CLIPTextEncode")["clip"], "MgpuLoadTextEncoder")["plan"] == [plan_id, 0]
    assert (train["algorithm"], train["existing_lora"]) == ("LoRA", "[None]")

    (save,) = [n["inputs"] for n in api.values() if n["class_type"] == "SaveLoRA"]
    assert save["lora"] == [train_id, 0] and save["steps"] == [train_id, 2] and save["prefix"].startswith("loras/")
    (graph,) = [n["inputs"] for n in api.values() if n["class_type"] == "LossGraphNode"]
    assert graph["loss"] == [train_id, 1]
    (sampler,) = [n["inputs"] for n in api.values() if n["class_type"] == "MgpuFSDPSampler"]
    shift = source(sampler["model"], "ModelSamplingSD3")
    with_lora = source(shift["model"], "LoraModelLoader")
    assert with_lora["model"] == train["model"] and with_lora["lora"] == [train_id, 0]
    assert with_lora["strength_model"] == 1.0 and with_lora["bypass"] is False   # bypass: ComfyUI 0.33's input
    assert "mgpufox" in source(sampler["positive"], "CLIPTextEncode")["text"]   # the caption's trigger word
    assert "mgpufox" in source(train["positive"], "CLIPTextEncode")["text"]


def write_clip(path: Path, frames: int = 7, width: int = 96, height: int = 80) -> Path:
    """A short mp4 (a moving colour gradient) for Load Video: more frames and another size than the plan's, so the
    example's cut and scale do their work."""
    import av
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    y, x = np.mgrid[0:height, 0:width]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=16)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(frames):
            rgb = np.stack([(x * 2 + t * 20) % 256, (y * 3) % 256, (x + y + t * 35) % 256], -1).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return path


def _training_run(server: ComfyServer, api: dict) -> dict:
    """A training example's twin for the run (``_for_the_run`` at 64 x 64 x 5), with the Wan VAE and the clip its
    Load Video names written where the server reads them."""
    if not (server.vae / "wan_2.1_vae.safetensors").exists():
        write_wan21_vae(server.vae / "wan_2.1_vae.safetensors")
    (clip,) = [n["inputs"]["file"] for n in api.values() if n["class_type"] == "LoadVideo"]
    write_clip(server.base_dir / "input" / clip)
    return _for_the_run(api, 64, 64, 5)


@pytest.mark.comfyui
def test_lora_training_twin_runs_on_tiny_checkpoints(comfyui_server: ComfyServer):
    """The twin as written (the DiT on fsdp: two CPU ranks here), 2 optimizer steps at rank 4: the LoRA is saved
    (its 2 steps in the name, rank-4 adapters), the loss graph written, and the video sampled with the new LoRA on
    the same sharded MODEL. On ComfyUI 0.3.64 Save LoRA Weights runs under its old id."""
    server = comfyui_server
    info = server.object_info()
    _, api = load(LORA_TRAINING)
    assert model_files(api) == {"wan2.1_t2v_14B_bf16.safetensors", "wan_2.1_vae.safetensors"}
    write_tiny_wan21_t2v(server.diffusion_models / "wan2.1_t2v_14B_bf16.safetensors")
    prompt = _training_run(server, api)
    for node in prompt.values():
        if node["class_type"] == "MgpuTrainLoRA":
            node["inputs"].update(steps=2, rank=4)
        elif node["class_type"] not in info and node["class_type"] in OLDER_IDS:
            node["class_type"] = OLDER_IDS[node["class_type"]]
    (prefix,) = [n["inputs"]["prefix"] for n in api.values() if n["class_type"] == "SaveLoRA"]
    before = set(server.output_dir.glob(f"{prefix}_2_steps_*.safetensors"))
    entry = _run_twin(server, prompt)

    (saved,) = set(server.output_dir.glob(f"{prefix}_2_steps_*.safetensors")) - before
    lora = load_file(str(saved))
    downs = {k: v for k, v in lora.items() if k.endswith(".lora_down.weight")}
    assert downs and all(v.shape[0] == 4 for v in downs.values()), sorted(lora)[:4]
    assert all(k.startswith("diffusion_model.") for k in lora), sorted(lora)[:4]
    (graph_id,) = [i for i, n in api.items() if n["class_type"] == "LossGraphNode"]
    (image,) = entry["outputs"][graph_id]["images"]
    with Image.open(server.base_dir / image["type"] / image["subfolder"] / image["filename"]) as img:
        assert img.format == "PNG" and img.width > 100
    assert _video(server, entry) == (5, 64, 64)
    assert "MGPU Train LoRA: 2 optimizer steps" in server.log()


# --- Wan 2.2 A14B: a LoRA per expert from one dataset, planned for training, then sampled with the pair --------------

LORA_PAIR = "wan22_lora_pair_training_multi_gpu"


def test_the_pair_example_trains_each_expert_on_its_share_and_samples_with_comfyuis_wan22_graph():
    """MGPU Plan, made for training (train on) with both experts, feeds both loaders (fsdp), both MGPU Train LoRA
    nodes and the decode; one dataset (the clip cut and scaled to the plan's size, one caption) trains the
    high-noise expert's LoRA on timesteps 0 to 0.5 and the low-noise expert's on 0.5 to 1, each saved under its own
    run; each LoRA goes onto its own expert, and ComfyUI's Wan 2.2 graph samples: the high-noise expert for steps
    0-10 of 20 (the schedule's first half, where its LoRA trained), the low-noise one from there."""
    _, api = load(LORA_PAIR)
    (plan_id,) = [i for i, n in api.items() if n["class_type"] == "MgpuPlan"]
    plan = api[plan_id]["inputs"]
    assert plan["train"] is True and plan["dit_low_noise"] != "none" and plan["dit"] != plan["dit_low_noise"]
    trains = {n["inputs"]["timestep_start"]: (i, n["inputs"]) for i, n in api.items()
              if n["class_type"] == "MgpuTrainLoRA"}
    assert set(trains) == {0.0, 0.5}
    (high_id, high), (low_id, low) = trains[0.0], trains[0.5]
    assert (high["timestep_end"], low["timestep_end"]) == (0.5, 1.0)
    assert high["latents"] == low["latents"] and high["positive"] == low["positive"]
    assert high["run_name"] != low["run_name"] and high["checkpoint_every"] > 0
    for train, expert in ((high, plan["dit"]), (low, plan["dit_low_noise"])):
        assert train["plan"] == [plan_id, 0]
        loader = api[train["model"][0]]["inputs"]
        assert loader["unet_name"] == expert and loader["device"] == "fsdp" and loader["plan"] == [plan_id, 0]
    samplers = sorted((n["inputs"] for n in api.values() if n["class_type"] == "KSamplerAdvanced"),
                      key=lambda s: s["start_at_step"])
    assert [(s["start_at_step"], s["end_at_step"], s["steps"]) for s in samplers] == [(0, 10, 20), (10, 10000, 20)]
    for sampler, train_id, train in zip(samplers, (high_id, low_id), (high, low)):
        with_lora = api[api[sampler["model"][0]]["inputs"]["model"][0]]
        assert with_lora["class_type"] == "LoraModelLoader"
        assert with_lora["inputs"]["lora"] == [train_id, 0] and with_lora["inputs"]["model"] == train["model"]
    saves = {n["inputs"]["lora"][0]: n["inputs"] for n in api.values() if n["class_type"] == "SaveLoRA"}
    assert set(saves) == {high_id, low_id} and saves[high_id]["prefix"] != saves[low_id]["prefix"]


@pytest.mark.comfyui
def test_lora_pair_twin_runs_on_tiny_checkpoints(comfyui_server: ComfyServer):
    """The twin as written on tiny experts: the plan (train on, this CPU machine) places both experts on the same
    cpu ranks, both MGPU Train LoRA nodes follow it (2 optimizer steps each, rank 4), each saves its LoRA, and the
    Wan 2.2 graph samples with the pair. On ComfyUI 0.3.64 Save LoRA Weights runs under its old id."""
    server = comfyui_server
    info = server.object_info()
    _, api = load(LORA_PAIR)
    for node in api.values():
        if node["class_type"] == "MgpuLoadDiffusionModel":
            name = node["inputs"]["unet_name"]
            write_tiny_wan21_t2v(server.diffusion_models / name, seed=1 if "high" in name else 2)
    prompt = _training_run(server, api)
    for node in prompt.values():
        if node["class_type"] == "MgpuTrainLoRA":
            node["inputs"].update(steps=2, rank=4, checkpoint_every=1)
        elif node["class_type"] == "MgpuPlan":
            node["inputs"].update(lora_rank=4)
        elif node["class_type"] == "KSamplerAdvanced":   # 4 steps, the switch after 2
            inputs = node["inputs"]
            inputs.update(steps=4, **({"end_at_step": 2} if inputs["start_at_step"] == 0 else {"start_at_step": 2}))
        elif node["class_type"] not in info and node["class_type"] in OLDER_IDS:
            node["class_type"] = OLDER_IDS[node["class_type"]]
    prefixes = sorted(n["inputs"]["prefix"] for n in api.values() if n["class_type"] == "SaveLoRA")
    before = {p: set(server.output_dir.glob(f"{p}_2_steps_*.safetensors")) for p in prefixes}
    start = len(server.log())
    entry = _run_twin(server, prompt)
    log = server.log()[start:]
    saved = {p: set(server.output_dir.glob(f"{p}_2_steps_*.safetensors")) - before[p] for p in prefixes}
    loras = [load_file(str(next(iter(files)))) for files in saved.values()]
    assert all(len(files) == 1 for files in saved.values()), saved
    assert set(loras[0]) == set(loras[1]) and any(not torch.equal(loras[0][k], loras[1][k]) for k in loras[0])
    assert log.count("MGPU Train LoRA: following the MGPU Plan") == 2, log[-3000:]
    assert log.count("MGPU Train LoRA: 2 optimizer steps") == 2
    for run in ("mgpu_wan22_high_lora", "mgpu_wan22_low_lora"):
        assert (server.output_dir / "mgpu_training" / run / "step_000002").is_dir(), run
    assert _video(server, entry) == (5, 64, 64)
