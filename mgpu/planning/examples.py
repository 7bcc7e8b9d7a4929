"""Full-size example models to plan without downloading them: ``python -m mgpu plan --example NAME`` writes their
safetensors headers (sparse files: a 28 GB checkpoint costs a few hundred KB of disk, in a temporary folder) and
plans them as it would the real files, whose headers are the same."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from mgpu.planning import layouts as L

DEVICES = "2x24GiB,cpu=64GiB"   # what an example plans for unless --devices says otherwise


@dataclass(frozen=True)
class Example:
    """Files by role (the name they are downloaded under, and their layout), and the workload ComfyUI's template
    for them makes."""
    title: str
    files: dict[str, tuple[str, Callable[[], L.Layout]]]
    width: int
    height: int
    frames: int
    dit_weight_dtype: str | None = None
    notes: list[str] = field(default_factory=list)


def _fp8(layout: Callable[[], L.Layout]) -> Callable[[], L.Layout]:
    return lambda: L.recast(layout(), "F8_E4M3")


EXAMPLES = {
    "wan2.1-14b": Example(
        "Wan 2.1 text-to-video 14B (bf16 file, run as fp8) + UMT5-XXL + Wan 2.1 VAE, 1280x720, 81 frames",
        {"dit": ("wan2.1_t2v_14B_bf16.safetensors", L.wan21_t2v_14b),
         "text_encoder": ("umt5_xxl_fp16.safetensors", L.umt5_xxl),
         "vae": ("wan_2.1_vae.safetensors", L.wan_vae)}, 1280, 720, 81, dit_weight_dtype="fp8_e4m3fn"),
    "wan2.2-a14b": Example(
        "Wan 2.2 text-to-video A14B (two fp8 experts) + UMT5-XXL fp8 + Wan 2.1 VAE, 1280x720, 81 frames",
        {"dit": ("wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", _fp8(L.wan21_t2v_14b)),
         "dit_low_noise": ("wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", _fp8(L.wan21_t2v_14b)),
         "text_encoder": ("umt5_xxl_fp8_e4m3fn_scaled.safetensors", _fp8(L.umt5_xxl)),
         "vae": ("wan_2.1_vae.safetensors", L.wan_vae)}, 1280, 720, 81),
    "ltx2-19b": Example(
        "LTX-2 19B (run as fp8) + Gemma 3 12B, 1280x720, 121 frames",
        {"dit": ("ltx-2-19b-dev.safetensors", L.ltx2_19b_file),
         "text_encoder": ("gemma_3_12B_it.safetensors", lambda: L.gemma3_12b("comfy"))}, 1280, 720, 121,
        dit_weight_dtype="fp8_e4m3fn"),
}


@contextmanager
def example_files(name: str) -> Iterator[dict[str, str]]:
    """The example's header-only files by role, in a temporary folder removed afterwards."""
    example = EXAMPLES[name]
    with tempfile.TemporaryDirectory(prefix="mgpu-example-") as folder:
        yield {role: str(L.write_safetensors(Path(folder) / file, layout(), sparse=True))
               for role, (file, layout) in example.files.items()}
