"""Small instances of real model code for the sharding tests, and their checkpoints.

Factories build uninitialised models (they also run under ``mgpu.sharding.fsdp.build_meta``); ``seeded_init`` gives them
deterministic weights independent of constructors and the global RNG, so ranks and the reference agree.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from safetensors.torch import save_file
from torch import nn

COMFY_PREFIX = "model.diffusion_model."
class TinyBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class TinyMLP(nn.Module):
    """Blocks plus a root with a persistent and a non-persistent buffer.

    dim 20 splits 7/7/6 over 3 ranks and the 2-row head leaves rank 2 an empty shard: the uneven FSDP cases.
    """

    def __init__(self, in_dim: int = 8, dim: int = 20, hidden: int = 36, out_dim: int = 2, layers: int = 4):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(TinyBlock(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, out_dim)
        self.register_buffer("shift", torch.zeros(in_dim))                              # in the checkpoint
        self.register_buffer("freqs", torch.linspace(0.5, 2.0, dim), persistent=False)  # rebuilt, not loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x + self.shift) * self.freqs
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def tiny_mlp() -> TinyMLP:
    return TinyMLP()


def wide_mlp() -> TinyMLP:
    """TinyMLP at 17 MB of fp32: large enough that bytes read from disk are measurable against the noise of a rank."""
    return TinyMLP(dim=512, hidden=1024)


def slow_mlp(seconds_per_block: float) -> TinyMLP:
    """TinyMLP whose every block takes ``seconds_per_block``: a step long enough to cancel in the middle."""
    model = TinyMLP()
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: time.sleep(seconds_per_block))
    return model


def mlp_inputs(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, 5, 8, generator=g)}


def tiny_diffusers_wan() -> nn.Module:
    """diffusers' WanTransformer3DModel, 3 layers of 2 heads x 16 dims; its rotary tables are non-persistent buffers."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=4, text_dim=24, freq_dim=16, ffn_dim=40, num_layers=3,
                                 rope_max_seq_len=32)


def sleepy_diffusers_wan(flag: str) -> nn.Module:
    """``tiny_diffusers_wan`` whose forward waits while the file ``flag`` exists: a forward that is surely in flight
    when a test kills a rank."""
    model = tiny_diffusers_wan()
    forward = model.forward

    def waiting_forward(*args, **kwargs):
        while os.path.exists(flag):
            time.sleep(0.05)
        return forward(*args, **kwargs)

    model.forward = waiting_forward
    return model


def diffusers_wan_inputs(batch: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Latent and text in the compute dtype, timestep in fp32: what diffusers' Wan pipeline passes."""
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(batch, 4, 2, 8, 8, generator=g).to(dtype),
            "timestep": torch.rand(batch, generator=g) * 1000,
            "encoder_hidden_states": torch.randn(batch, 6, 24, generator=g).to(dtype)}


def run_diffusers_wan(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs, return_dict=False)[0]


def comfyui_path() -> str | None:
    """A ComfyUI checkout as the suite finds it (COMFYUI_PATH, custom_nodes layout); None when absent."""
    from comfyui_env import find_comfyui

    found = find_comfyui()
    return str(found) if found and (found / "comfy" / "ldm" / "wan" / "model.py").is_file() else None


def _import_comfy() -> None:
    path = comfyui_path()
    if path is None:
        raise RuntimeError("no ComfyUI checkout: set COMFYUI_PATH")
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args

    # model_management probes the GPU at import; without one it must be told to run on the CPU.
    comfy.cli_args.args.cpu = comfy.cli_args.args.cpu or not torch.cuda.is_available()


def tiny_comfy_wan(dtype: torch.dtype | None = None) -> nn.Module:
    """ComfyUI's own comfy.ldm.wan.model.WanModel, 3 layers of 2 heads x 16 dims.

    With ``dtype`` it is built the way ComfyUI loads a bf16 checkpoint: weights in ``dtype`` except the patch
    embedding, which Wan keeps in fp32 (so one FSDP unit holds two dtypes).
    """
    _import_comfy()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    return WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=6, in_dim=4, dim=32, ffn_dim=40, freq_dim=16,
                    text_dim=24, out_dim=4, num_heads=2, num_layers=3, dtype=dtype,
                    operations=comfy.ops.disable_weight_init)


def comfy_wan_inputs(batch: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The same inputs as ``diffusers_wan_inputs`` under the names ComfyUI's BaseModel passes."""
    names = {"hidden_states": "x", "timestep": "timestep", "encoder_hidden_states": "context"}
    return {names[k]: v for k, v in diffusers_wan_inputs(batch, seed, dtype).items()}


def run_kwargs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., dict], Callable[..., torch.Tensor]]] = {
    "mlp": (tiny_mlp, mlp_inputs, run_kwargs),
    "diffusers_wan": (tiny_diffusers_wan, diffusers_wan_inputs, run_diffusers_wan),
    "comfy_wan": (tiny_comfy_wan, comfy_wan_inputs, run_kwargs),
    "comfy_wan_bf16": (partial(tiny_comfy_wan, torch.bfloat16), partial(comfy_wan_inputs, dtype=torch.bfloat16),
                       run_kwargs),
}


@torch.no_grad()
def seeded_init(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic weights of a sensible scale: matrices ~ 1/sqrt(fan_in), norm gains ~ 1, the rest ~ 0.1."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g)
        if p.ndim >= 2:
            p.copy_(noise / (p[0].numel() ** 0.5))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)
    return model


def reference(name: str, seed: int = 0) -> nn.Module:
    """A fully built, seeded, single-device model in eval mode."""
    return seeded_init(MODELS[name][0](), seed).eval()


def checkpoint_prefix(model: nn.Module) -> str:
    """The key prefix the model's real checkpoints use: ComfyUI saves diffusion models under model.diffusion_model."""
    return COMFY_PREFIX if type(model).__module__.startswith("comfy.") else ""


def save_checkpoint(model: nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None) -> dict:
    """Save ``model`` as safetensors in its real key layout (optionally cast to ``dtype``); returns what was saved."""
    prefix = checkpoint_prefix(model)
    state = {prefix + k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().clone()
             for k, v in model.state_dict().items()}
    save_file(state, os.fspath(path))
    return state
