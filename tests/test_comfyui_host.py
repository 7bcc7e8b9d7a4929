"""The ComfyUI side of a sharded model, inside ComfyUI's own model management and sampler (no server): clones keep
their rank GPUs, the host touches only GPUs where ComfyUI holds a model, every sampler option is classified, models
live as long as their MODEL, and MGPU Load VAE reads only the VAE. Each check runs in a fresh ComfyUI interpreter
(tests/comfy_host_checks.py); skipped without a ComfyUI checkout (COMFYUI_PATH)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from comfyui_env import find_comfyui, run_checks

from loaders.transformer_options import HOST_ONLY, PER_CHUNK, REFUSED, WHOLE

pytestmark = pytest.mark.comfyui


def in_comfyui(check: str, *args: Any, timeout: float = 600) -> Any:
    return run_checks("comfy_host_checks", check, *args, timeout=timeout)


def test_a_cloned_model_still_frees_its_rank_gpus(tmp_path: Path) -> None:
    """Samplers and patching nodes clone the MODEL: the clone still unloads ComfyUI's model (text encoder, VAE)
    from a rank GPU before sampling, and leaves the one on another GPU."""
    facts = in_comfyui("check_clone_frees_rank_gpus", str(tmp_path))
    assert facts["patched"] and facts["rank_devices"] == ["cuda:1", "cuda:2"]
    assert facts["left"] == ["cuda:0"]


def test_the_host_touches_only_rank_gpus_where_comfyui_holds_a_model(tmp_path: Path) -> None:
    """No model of ComfyUI's on the rank GPUs: no call names them (each would open a CUDA context there). One on
    cuda:1: it is unloaded, cuda:0 is still never asked about, and cuda:3 (no rank) keeps its model."""
    facts = in_comfyui("check_only_gpus_holding_models_are_touched", str(tmp_path))
    assert facts["nothing_held"] == []
    assert facts["one_held"] == ["cuda:1"]
    assert facts["left"] == ["cuda:3"] and facts["cuda1_detached"]


def test_every_transformer_option_of_a_real_sampling_step_is_classified(tmp_path: Path) -> None:
    seen = in_comfyui("check_transformer_options_of_real_sampling", str(tmp_path))
    assert {"cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "wrappers"} <= set(seen), seen
    known = {*HOST_ONLY, *WHOLE, *PER_CHUNK, *REFUSED}
    assert {k: v for k, v in seen.items() if k not in known} == {}


def test_models_live_as_long_as_their_model_and_a_loader_keeps_one_on_the_gpus(tmp_path: Path) -> None:
    """Loader node "4" in tabs A, B, C, then B again. A's model stays loaded and working while held, although B's
    node has the same id; once A's MODEL is garbage its shards leave the ranks before C loads; B's loader run again
    evicts B's previous model (still cached by newer ComfyUI) before loading, and that model, sampled again,
    reloads in place of the newer one and computes the same."""
    facts = in_comfyui("check_model_lifetimes", str(tmp_path))
    b, c, d = facts["handles"]
    # loads of a, b, c, d, then the reloads of b and d as each is sampled
    assert facts["at_load_start"] == [[], ["dit-0"], [b], [c], [c], [c]], facts
    assert facts["after_d"] == [c, d]
    assert facts["same"] == [True, True]


def test_vae_from_an_all_in_one_file_reads_only_the_vae(tmp_path: Path) -> None:
    """A 4 GiB DiT beside the VAE: peak memory grows by the VAE, not the DiT; the frames equal ComfyUI's own VAE
    loaded from the VAE alone; the file's metadata (LTX-Video's VAE config lives there) comes along."""
    facts = in_comfyui("check_vae_reads_only_its_tensors", str(tmp_path), 4.0)
    assert facts["same"] and facts["metadata"] == {"mgpu_test": "kept"}
    assert facts["rss_growth"] < facts["dit_bytes"] / 4, facts


def test_comfyuis_multigpu_cfg_split_refuses_a_sharded_model_with_the_way_out(tmp_path: Path) -> None:
    """ComfyUI 0.33's MultiGPU CFG Split copies the whole model to each extra GPU; a sharded MODEL already splits
    CFG over its ranks, and its host copy holds no weights: one clear refusal, not ComfyUI's "use a core loader"."""
    facts = in_comfyui("check_multigpu_cfg_split_is_refused", str(tmp_path))
    comfyui_033 = (find_comfyui() / "comfy_extras" / "nodes_multigpu.py").exists()
    assert facts["node"] == comfyui_033
    if not comfyui_033:
        return
    assert facts["raised"] == "MgpuError", facts
    assert "Remove MultiGPU CFG Split" in facts["message"] and "cuda:0, cuda:1" in facts["message"]
