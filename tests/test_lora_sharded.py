"""LoRA on an FSDP-sharded model (mgpu.weights.lora), over real gloo ranks: each rank patches its own rows, the result equals
the unsharded model with the whole delta applied, strengths change and patches come off without reloading the base,
and only the adapter tensors travel."""

from __future__ import annotations

import copy
import logging
import os
import re

import pytest
import torch
from torch import nn

import tiny_models as T
from mgpu.errors import MgpuError, RankFailure
from mgpu.weights.lora import APPLY, PatchedModule, PatchSet
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import OPS, ModelSpec

TESTS = os.path.dirname(os.path.abspath(__file__))
RANK = 8


def wide_mlp_bf16() -> T.TinyMLP:
    """``wide_mlp`` stored in bf16: the ranks' shards are bf16, patched in fp32 and rounded back."""
    return T.wide_mlp().to(torch.bfloat16)


FACTORIES = {torch.float32: "tiny_models:wide_mlp", torch.bfloat16: "test_lora_sharded:wide_mlp_bf16"}
DTYPES = {factory: dtype for dtype, factory in FACTORIES.items()}
# (ranks, reshard after forward, stored dtype): 3 ranks split dim 512 unevenly and leave the 2-row head's third
# rank empty; kept-gathered weights must not hide the patched shards.
CASES = [(2, False, torch.float32), (3, True, torch.float32), (2, True, torch.bfloat16)]


@pytest.fixture(scope="module", params=CASES, ids=["2ranks-kept-fp32", "3ranks-fp32", "2ranks-bf16"])
def setup(request, tmp_path_factory):
    ranks, reshard, dtype = request.param
    reference = T.seeded_init(T.wide_mlp().to(dtype)).eval()
    path = tmp_path_factory.mktemp("lora") / "mlp.safetensors"
    T.save_checkpoint(reference, path)
    pool = RankPool(PoolConfig(devices=["cpu"] * ranks, extra_sys_path=[TESTS], call_timeout_s=120))
    model = PatchedModule(pool, ModelSpec(factory=FACTORIES[dtype], checkpoint=str(path),
                                          reshard_after_forward=reshard))
    model.load()
    yield model, reference
    pool.close()


def lora(out_dim: int, in_dim: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """up, down as a LoRA file stores them (bf16), large enough to change the output clearly."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_dim, RANK, generator=g).to(dtype) * 0.05,
            torch.randn(RANK, in_dim, generator=g).to(dtype) * 0.05)


def adapters(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA on every block's fc1 and fc2, and on the head (2 rows: one rank may hold none)."""
    found = {f"blocks.{i}.fc{j}.weight": lora(*((1024, 512) if j == 1 else (512, 1024)), seed=seed * 100 + i * 2 + j)
             for i in range(4) for j in (1, 2)}
    found["head.weight"] = lora(2, 512, seed=seed * 100 + 99)
    return found


def patch_set(key: str, *loras: tuple[float, dict], diff: dict | None = None, model_scale: float = 1.0) -> PatchSet:
    """``loras``: (strength, adapters) stacked in order, alpha = RANK / 2 as in many LoRA files; ``diff``: name ->
    (strength, tensor)."""
    ps = PatchSet(key=key)
    for n, (strength, found) in enumerate(loras):
        for name, (up, down) in found.items():
            ps.tensors[f"{n}.{name}.up"], ps.tensors[f"{n}.{name}.down"] = up, down
            ps.patches.setdefault(name, []).append({"kind": "lora", "up": f"{n}.{name}.up", "down": f"{n}.{name}.down",
                                                    "scale": strength * 0.5, "model_scale": model_scale})
    for name, (strength, tensor) in (diff or {}).items():
        ps.tensors[f"diff.{name}"] = tensor
        ps.patches.setdefault(name, []).append({"kind": "diff", "diff": f"diff.{name}", "scale": strength})
    return ps


@torch.no_grad()
def patched_reference(reference: nn.Module, ps: PatchSet) -> nn.Module:
    """The unsharded model with each full delta formed and applied in fp32, as ComfyUI's calculate_weight does."""
    model = copy.deepcopy(reference)
    params = dict(model.named_parameters())
    for name, ops in ps.patches.items():
        w = params[name].float()
        for op in ops:
            w *= op.get("model_scale", 1.0)
            if op["kind"] == "lora":
                w += op["scale"] * (ps.tensors[op["up"]].float() @ ps.tensors[op["down"]].float())
            else:
                w += op["scale"] * ps.tensors[op["diff"]].float()
        params[name].copy_(w)
    return model


def forward(model: PatchedModule, seed: int = 0) -> torch.Tensor:
    x = T.mlp_inputs(3, seed)["x"].to(DTYPES[model.spec.factory])
    return model(x=x)


def expected(reference: nn.Module, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return reference(x=T.mlp_inputs(3, seed)["x"].to(next(reference.parameters()).dtype))


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = 1e-5 if want.dtype == torch.float32 else 2e-2
    assert (got.float() - want.float()).abs().max().item() <= tol * max(1.0, want.float().abs().max().item())


def spy_calls(model: PatchedModule, monkeypatch) -> list[tuple[str, int]]:
    """(op, bytes of the tensors it carried) of every pool call from now on."""
    calls: list[tuple[str, int]] = []
    real = model.pool.call

    def call(op, payload=None, tensors=None, **kwargs):
        calls.append((op, sum(t.numel() * t.element_size() for t in (tensors or {}).values())))
        return real(op, payload, tensors, **kwargs)

    monkeypatch.setattr(model.pool, "call", call)
    return calls


def test_patched_forward_equals_the_whole_delta_applied(setup, monkeypatch):
    model, reference = setup
    model.set_patches(PatchSet())
    base = forward(model)
    ps = patch_set("one", (0.8, adapters(1)), diff={"blocks.0.fc1.bias": (1.0, torch.randn(1024) * 0.1)})
    want = expected(patched_reference(reference, ps))
    assert (want.float() - base.float()).abs().max() > 1e-2   # the patch changes the output clearly
    calls = spy_calls(model, monkeypatch)
    model.set_patches(ps)
    assert_close(forward(model), want)
    assert_close(forward(model, seed=1), expected(patched_reference(reference, ps), seed=1))
    # sent once, before the first forward after the change; only the adapters travel, never the model
    assert [op for op, _ in calls] == [APPLY, OPS + "forward", OPS + "forward"]
    model_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert calls[0][1] == ps.nbytes < model_bytes / 20


def test_strength_change_stacking_and_removal_need_no_reload(setup, monkeypatch):
    model, reference = setup
    model.set_patches(PatchSet())
    base = forward(model)
    calls = spy_calls(model, monkeypatch)
    first, second = adapters(2), adapters(3)
    for ps in (patch_set("a", (1.0, first)), patch_set("b", (0.3, first)),            # strength changed
               patch_set("c", (0.3, first), (-0.7, second), model_scale=0.9)):       # a second LoRA stacked
        model.set_patches(ps)
        assert_close(forward(model), expected(patched_reference(reference, ps)))
    replies = model.sync_patches()
    assert replies == []   # the same set is not sent again
    model.set_patches(PatchSet())
    assert torch.equal(forward(model), base)   # the base back, bit for bit
    assert OPS + "load" not in [op for op, _ in calls]


def test_the_rank_receives_only_the_adapter_bytes(setup):
    model, reference = setup
    ps = patch_set("bytes", (1.0, adapters(4)))
    model.set_patches(ps)
    replies = model.sync_patches()
    model_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
    assert [r["received_bytes"] for r in replies] == [ps.nbytes] * model.pool.world_size
    assert ps.nbytes < model_bytes / 20
    model.set_patches(PatchSet())
    model.sync_patches()


def test_patches_come_back_after_a_reload(setup):
    model, reference = setup
    ps = patch_set("reload", (0.5, adapters(5)))
    model.set_patches(ps)
    forward(model)
    model.free()   # as ComfyUI's Unload models does: the next forward reads the base weights from disk again
    assert_close(forward(model), expected(patched_reference(reference, ps)))
    model.set_patches(PatchSet())


def test_keys_matching_no_weight_are_warned_once_and_the_rest_applied(setup, caplog):
    model, reference = setup
    ps = patch_set("unmatched", (1.0, adapters(6)))
    ps.tensors["stray"] = torch.zeros(4)
    ps.patches["blocks.9.fc1.weight"] = [{"kind": "diff", "diff": "stray", "scale": 1.0}]
    ps.unmatched = ["diffusion_model.not_a_weight"]
    model.set_patches(ps)
    with caplog.at_level(logging.WARNING, logger="mgpu"):
        model.sync_patches()
    warnings = [r.getMessage() for r in caplog.records if "match no weight" in r.getMessage()]
    assert len(warnings) == 1 and "blocks.9.fc1.weight" in warnings[0] and "not_a_weight" in warnings[0]
    del ps.patches["blocks.9.fc1.weight"]
    assert_close(forward(model), expected(patched_reference(reference, ps)))
    model.set_patches(PatchSet())


def test_a_patch_that_does_not_fit_is_refused_and_changes_nothing(setup):
    model, reference = setup
    model.set_patches(PatchSet())
    base = forward(model)
    ps = patch_set("good", (1.0, adapters(7)))
    ps.patches["blocks.1.fc1.weight"][0]["up"] = "0.blocks.1.fc2.weight.up"   # 512 rows for a 1024-row weight
    model.set_patches(ps)
    with pytest.raises(RankFailure, match=r"blocks\.1\.fc1\.weight: LoRA up \(512, 8\)"):
        model.sync_patches()
    model.set_patches(PatchSet())
    assert torch.equal(forward(model), base)


# ------------------------------------------------------------------------------------------------ ComfyUI's patches

@pytest.fixture
def comfy_patches():
    """loaders.weight_patches with ComfyUI importable (in this process: no server needed)."""
    if T.comfyui_path() is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH")
    T._import_comfy()
    from comfy.weight_adapter import LoHaAdapter, LoRAAdapter

    from loaders import weight_patches
    return weight_patches, LoRAAdapter, LoHaAdapter


def test_comfyui_patches_become_row_ops_or_are_refused_by_name(comfy_patches):
    weight_patches, LoRAAdapter, LoHaAdapter = comfy_patches
    key, shape = "diffusion_model.blocks.0.fc1.weight", torch.Size((1024, 512))
    up, down = lora(1024, 512, seed=1)
    plain = LoRAAdapter(set(), (up, down, 4.0, None, None, None))
    bias = torch.zeros(1024)
    ps = weight_patches.patch_set({key: [(0.5, plain, 0.9, None, None)],
                                   "diffusion_model.blocks.0.fc1.bias": [(1.0, ("diff", (bias,)), 1.0, None, None)],
                                   "model_sampling.sigmas": [(1.0, (bias,), 1.0, None, None)]},
                                  "uuid", {key: shape, "diffusion_model.blocks.0.fc1.bias": bias.shape}, "Loader")
    assert ps.patches == {"blocks.0.fc1.weight": [{"kind": "lora", "up": "t0", "down": "t1", "scale": 0.5 * 4.0 / RANK,
                                                   "model_scale": 0.9}],
                          "blocks.0.fc1.bias": [{"kind": "diff", "diff": "t2", "scale": 1.0}]}
    assert ps.unmatched == ["model_sampling.sigmas"] and ps.key == "uuid"
    assert weight_patches.patch_set({}, "uuid", {}, "Loader").key == "base"
    refused = {
        "a loha adapter": LoHaAdapter(set(), (up, down, None, up, down, None, None, None)),
        "a LoRA with a DoRA scale": LoRAAdapter(set(), (up, down, 4.0, None, torch.ones(1024), None)),
        "a model merge": [(up, None)],
        "a 'model_as_lora' patch": ("model_as_lora", (up,)),
    }
    for what, adapter in refused.items():
        with pytest.raises(MgpuError, match=rf"Loader: the weight {key} carries {re.escape(what)}"):
            weight_patches.patch_set({key: [(1.0, adapter, 1.0, None, None)]}, "uuid", {key: shape}, "Loader")


def test_a_lora_for_another_model_is_refused_naming_the_weights_and_the_loader_node(comfy_patches):
    """A LoRA for another size of the model (a Wan 14B LoRA on Wan 1.3B) or another family: its names match, its
    shapes do not. Stock ComfyUI logs an error per weight and samples without them; here one error says so."""
    weight_patches, LoRAAdapter, _ = comfy_patches
    shapes = {f"diffusion_model.blocks.{i}.fc1.weight": torch.Size((1024, 512)) for i in range(5)}
    up, down = lora(5120, 5120, seed=1)
    patches = {key: [(1.0, LoRAAdapter(set(), (up, down, 4.0, None, None, None)), 1.0, None, None)] for key in shapes}
    patches["diffusion_model.blocks.0.fc1.bias"] = [(1.0, ("diff", (torch.zeros(5120),)), 1.0, None, None)]
    shapes["diffusion_model.blocks.0.fc1.bias"] = torch.Size((1024,))
    with pytest.raises(MgpuError) as refused:
        weight_patches.patch_set(patches, "uuid", shapes, "Loader")
    text = str(refused.value)
    assert text.startswith("Loader: 6 of the 6 weights a LoRA patches do not fit this model")
    assert "diffusion_model.blocks.0.fc1.weight: LoRA up (5120, 8) and down (8, 5120) for a (1024, 512) weight" in text
    assert "and 3 more" in text and "LoraLoaderModelOnly" in text and "made for another model" in text
