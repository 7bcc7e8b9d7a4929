"""The example workflows the pack ships, and the model files they name: shared by the tests that read them.

ComfyUI's template browser lists every example_workflows/*.json of a pack under its file name, which is also the
title on the card and the tab name once opened (no title field exists for custom-node templates in frontends 1.27
to 1.49), so the UI files carry readable names. Their API twins keep short ids, handy on a command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "example_workflows"
# API twin id -> UI workflow file stem (the template title)
EXAMPLES = {
    "wan21_t2v_multi_gpu": "Wan 2.1 text-to-video 14B (multi-GPU)",
    "ltxv_t2v_multi_gpu": "LTX-Video 13B text-to-video (multi-GPU)",
    "wan22_t2v_a14b_multi_gpu": "Wan 2.2 text-to-video A14B (multi-GPU)",
    "ltx2_t2v_multi_gpu": "LTX-2 19B text-to-video with audio (multi-GPU)",   # ComfyUI 0.33 and newer
    "wan21_lora_training_multi_gpu": "Wan 2.1 LoRA training on several GPUs",   # offered on 0.33 (Save LoRA's id)
    "wan22_lora_pair_training_multi_gpu": "Wan 2.2 A14B LoRA pair training on several GPUs",   # 0.33, as above
}
# Combo inputs of the loaders that name model files, and the ComfyUI model folder each lists.
FILE_FOLDERS = {
    "dit": "diffusion_models", "dit_low_noise": "diffusion_models", "unet_name": "diffusion_models",
    "text_encoder": "text_encoders", "clip_name": "text_encoders", "clip_name2": "text_encoders",
    "vae": "vae", "vae_name": "vae",
    "ckpt_name": "checkpoints",   # ComfyUI's own LTX-2 audio VAE loader reads the all-in-one checkpoint there
}
NONE = "none"
# Combo inputs that name a file of ComfyUI's input folder (the user's own data, no download), and its extension.
INPUT_FILES = {("LoadVideo", "file"): ".mp4"}


def ui_path(example: str) -> Path:
    return EXAMPLES_DIR / f"{EXAMPLES[example]}.json"


def thumbnail_path(example: str) -> Path:
    """Where the template browser looks for the card's picture: <stem>.jpg beside the workflow (jpg only)."""
    return EXAMPLES_DIR / f"{EXAMPLES[example]}.jpg"


def load(example: str) -> tuple[dict, dict]:
    """(UI workflow, API twin) of an example, by its id."""
    ui = json.loads(ui_path(example).read_text())
    api = json.loads((EXAMPLES_DIR / "api" / f"{example}.api.json").read_text())
    return ui, api


def widget_values(node: dict) -> dict[str, Any]:
    """A UI node's widget values by input name (the frontend stores control_after_generate right after a seed).

    A widget input with a link (the latent's width wired from MGPU Plan) keeps its stored value in widgets_values,
    but the link is what runs: it is left out here, as ComfyUI's API export leaves it out."""
    inputs = [i for i in node.get("inputs", []) if "widget" in i]
    names = [i["name"] for i in inputs]
    values = list(node.get("widgets_values") or [])
    for seed in ("seed", "noise_seed"):   # noise_seed: KSamplerAdvanced's
        if seed in names:
            values.pop(names.index(seed) + 1)
    return {i["name"]: v for i, v in zip(inputs, values) if i.get("link") is None}


def file_widgets(node: dict) -> dict[str, str]:
    """The model files a UI node names, by input (inputs set to "none" name no file)."""
    return {k: v for k, v in widget_values(node).items() if k in FILE_FOLDERS and v != NONE}


def declared_models(ui: dict) -> list[dict[str, str]]:
    """Every properties.models entry of a UI workflow's nodes, in node order."""
    return [m for n in ui["nodes"] for m in n.get("properties", {}).get("models", [])]


def input_files(ui: dict) -> list[str]:
    """The files of ComfyUI's input folder a UI workflow's nodes name (the LoRA example's training clip)."""
    return [v for n in ui["nodes"] for k, v in widget_values(n).items() if (n["type"], k) in INPUT_FILES]
