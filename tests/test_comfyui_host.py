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


def test_a_loader_without_a_plan_loads_as_with_the_equivalent_plan_connected(tmp_path: Path) -> None:
    """MGPU Load Diffusion Model with no plan makes the plan MGPU Plan makes for its file and follows it through the
    same ``resolve``: the 14B DiT on 2 x 24 GiB sharded over both (bf16: too large for one), on one GPU in fp8, and
    fsdp over both, each with the same gathered-weights decision as with the plan connected. The one difference:
    without a plan the ranks set up every sequence degree, since the prompt's batch is a guess."""
    facts = in_comfyui("check_loader_decides_alike_with_and_without_a_plan", str(tmp_path))
    pairs = list(zip(facts[::2], facts[1::2]))
    assert [(own["device"], own["dtype"]) for own, _ in pairs] == \
        [("auto", "default"), ("auto", "fp8_e4m3fn"), ("fsdp", "default")]
    for own, planned in pairs:
        assert (own["connected"], planned["connected"]) == (False, True)
        assert own["resolved"] == ["own"] and planned["resolved"] == ["MGPU Plan"]
        assert [{k: v for k, v in load.items() if k != "sp"} for load in own["loads"]] == \
            [{k: v for k, v in load.items() if k != "sp"} for load in planned["loads"]], (own, planned)
        assert any(line.startswith("MGPU Load Diffusion Model: no MGPU Plan: ") for line in own["log"])
        assert not any("no MGPU Plan" in line for line in planned["log"])
    sharded, fp8, forced = (own["loads"][0] for own, _ in pairs)
    assert sharded == {"fsdp": ["cuda:0", "cuda:1"], "dtype": None, "reshard": True, "sp": 2}
    assert pairs[0][1]["loads"][0]["sp"] == 1   # the plan's CFG split: cond and uncond on one rank each
    assert fp8 == {"single": "cuda:0", "dtype": "float8_e4m3fn"}
    assert forced == sharded
    assert "no MGPU Plan: the gathered weights are freed after every step" in "\n".join(pairs[2][0]["log"])
