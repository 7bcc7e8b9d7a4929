"""Which of ComfyUI's ``transformer_options`` reach the FSDP ranks, and how.

The sampler hands the network a dict of options with every step. A network on the ranks that silently lacks one
it reads computes a different picture with no error, the worst outcome; so every key is classified here, and one
this pack does not know is refused with its name. Checked against ComfyUI 0.3.64 and 0.33.0 (where the keys are
set: comfy/samplers.py, sampler_helpers.py, model_base.py, model_patcher.py, patcher_extension.py, hooks.py,
context_windows.py, k_diffusion/sampling.py, comfy_extras/nodes_*.py; what the networks read: comfy/ldm/*);
tests/test_comfyui_host.py walks a real sampling call on each version and checks that every key seen is here.

No ComfyUI import: plain data rules, unit-tested without ComfyUI.
"""

from __future__ import annotations

import uuid

import torch

from mgpu.errors import MgpuError
from mgpu.sharding.sharded import PerChunk

# Used on the host only: what they drive has already run (wrappers, callbacks) or concerns the host's own memory.
HOST_ONLY = {
    "wrappers": "sampler_helpers.py: DIFFUSION_MODEL and other wrappers, which run on the host around this call",
    "callbacks": "sampler_helpers.py: the patcher's callbacks, host-side",
    "mgpu_fsdp": "MGPU FSDP Sampler's settings (step timeout), read by the host",
    "easycache": "EasyCache / LazyCache nodes: the cache their DIFFUSION_MODEL wrapper keeps on the host",
    "context_window": "context windows (0.33 context_windows.py): the host splits the latent; only Wan Animate 2's "
                      "network reads the window",
    "prefetch_dynamic_vbars": "0.33 model_base.py: the host's dynamic-VRAM prefetch; the ranks hold their weights",
    "multigpu_thread_device": "0.33 samplers.py: the device of ComfyUI's own multi-GPU worker thread",
}
# Plain data the networks read, sent whole to every rank.
WHOLE = {
    "sample_sigmas": "samplers.py: the schedule (read by HunyuanVideo, hooks, context windows)",
    "rope_options": "0.33 ScaleROPE node / model_patcher.set_model_rope_options (read by Wan, Flux, ...)",
    "chroma_radiance_options": "Chroma Radiance nodes",
    "minimax_h3_sigma_shift_video": "0.33 MiniMax H3 node",
    "minimax_h3_sigma_shift_audio": "0.33 MiniMax H3 node",
    "stg_self_attn_blocks": "0.33 LTXV STG guidance (read by LTX-AV)",
    "a2v_cross_attn": "0.33 LTX-AV nodes",
    "v2a_cross_attn": "0.33 LTX-AV nodes",
    "run_vx": "0.33 LTX-AV",
    "run_ax": "0.33 LTX-AV",
}
# One entry per equal chunk of the batch rows (samplers.py): each rank gets the entries of the rows it computes.
PER_CHUNK = {
    "cond_or_uncond": "samplers.py: cond (0) or uncond (1) per chunk",
    "uuids": "samplers.py: the conditioning of each chunk",
    "sigmas": "samplers.py: the sigma of each row",
}
# Code or state that would have to run inside the network on the ranks: not supported under FSDP.
REFUSED = {
    "patches": "patching nodes (attention and block patches, e.g. PerturbedAttentionGuidance, SelfAttentionGuidance, "
               "model patches)",
    "patches_replace": "nodes that replace attention or blocks (e.g. PerturbedAttentionGuidance, IP-Adapter)",
    "optimized_attention_override": "nodes that choose the attention function (set_model_optimized_attention)",
    "ar_state": "0.33 autoregressive Wan sampling (its state lives in the network)",
    "audio_embeds": "0.33 Wan MultiTalk",
    "animate2_cache": "0.33 Wan Animate 2",
}
_ADVICE = "remove the node that sets it, or load the model on one device (MGPU Load Diffusion Model, device not fsdp)"


def plain(value) -> bool:
    """Data a rank call carries: tensors, scalars, strings, None, UUIDs, and lists, tuples, sets and str-keyed
    dicts of them (no code, no objects)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str, uuid.UUID, torch.Tensor))


def _empty(value) -> bool:
    return value is None or (isinstance(value, (dict, list, tuple, set)) and not value)


def _entries(value) -> int:
    """How many chunks a PER_CHUNK value describes (0: none, sent as is)."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else 0
    return len(value)


def _problem(key: str, value, batch: int) -> str | None:
    """Why ``key`` cannot reach the ranks, or None. Empty values of any key are harmless and travel as they are."""
    if key in HOST_ONLY or _empty(value):
        return None
    if key in REFUSED:
        return f"{key} (set by {REFUSED[key]})"
    if key not in WHOLE and key not in PER_CHUNK:
        return f"{key} (not known to this pack: a node, or a ComfyUI version it was not checked against, sets it)"
    if not plain(value):
        return f"{key} (holds {type(value).__name__}, not plain data)"
    if key in PER_CHUNK and _entries(value) and batch % _entries(value):
        return f"{key} ({_entries(value)} entries for a batch of {batch} rows)"
    return None


def for_ranks(options: dict, batch: int, label: str) -> dict:
    """The ``transformer_options`` the ranks' network gets; raises MgpuError naming every key that cannot go."""
    problems = [p for p in (_problem(k, v, batch) for k, v in options.items()) if p]
    if problems:
        raise MgpuError(f"{label}: the sampler passes transformer_options that cannot reach the FSDP ranks: "
                        f"{'; '.join(problems)}. Without them the network on the ranks would compute a different "
                        f"result and say nothing; {_ADVICE}")
    return {k: PerChunk(v) if k in PER_CHUNK and _entries(v) else v
            for k, v in options.items() if k not in HOST_ONLY}
