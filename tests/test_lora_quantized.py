"""LoRA on weights stored quantized on the FSDP ranks (fp8 here; GGUF and ComfyUI's quantized tensors take the same
path), over real gloo ranks: such a weight cannot take a row delta, so the patch runs in the forward
(``y += s · up (down x)``) and the stored weight is never touched. The result equals the single-device model with the
weights dequantized to fp32 and the whole delta merged in fp32; strengths change, LoRAs stack and come off without a
reload (removal is bit-identical), and what cannot be a forward term is refused by name before anything changes."""

from __future__ import annotations

import copy
import logging
import os
import re

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import tiny_models as T
from mgpu.errors import RankFailure
from mgpu.ranks.pool import PoolConfig, RankPool
from mgpu.sharding.sharded import OPS, ModelSpec, ShardedModule
from mgpu.weights.lora import APPLY, PatchedModule, PatchSet
from test_lora_sharded import lora, spy_calls

TESTS = os.path.dirname(os.path.abspath(__file__))
FP8 = torch.float8_e4m3fn
TOLERANCE = 1e-4   # relative to the output's largest value: fp32 everywhere, only the order of the sums differs


class QuantNet(nn.Module):
    """A patch embedding (Conv2d, kernel = stride, as Wan's), blocks of Linear + LayerNorm, a Wan-like modulation and
    a 2-row head. dim 20 splits 7/7/6 over 3 ranks and the head leaves rank 2 no rows."""

    def __init__(self, channels: int = 4, dim: int = 20, hidden: int = 36, layers: int = 3):
        super().__init__()
        self.patch = nn.Conv2d(channels, dim, 2, stride=2)
        self.blocks = nn.ModuleList(T.TinyBlock(dim, hidden) for _ in range(layers))
        self.modulation = nn.Parameter(torch.empty(1, 1, dim))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2) + self.modulation
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def stored_fp8(name: str) -> bool:
    """Every weight and the blocks' Linear biases are fp8 (as ComfyUI's weight_dtype fp8 stores a layer's bias too);
    the patch bias, the norms' biases and the head bias stay fp32: they take row patches beside the forward terms."""
    return name.endswith("weight") or name == "modulation" or name.startswith("blocks.") and ".fc" in name


def quant_net() -> QuantNet:
    """The ranks' model: QuantNet with the ``stored_fp8`` parameters in fp8 (run under meta by the loader)."""
    model = QuantNet()
    for module_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if stored_fp8(f"{module_name}.{name}".lstrip(".")):
                module._parameters[name] = nn.Parameter(p.data.to(FP8), requires_grad=False)
    return model


def inputs(seed: int = 0) -> torch.Tensor:
    return torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks-uneven"])
def setup(request, tmp_path_factory):
    """(the sharded fp8 model, the single-device reference: the same fp8 values dequantized to fp32)."""
    state = {k: v.to(FP8) if stored_fp8(k) else v for k, v in T.seeded_init(QuantNet()).state_dict().items()}
    path = tmp_path_factory.mktemp("lora_quant") / "net.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    reference = QuantNet()
    reference.load_state_dict({k: v.float() for k, v in state.items()})
    pool = RankPool(PoolConfig(devices=["cpu"] * request.param, extra_sys_path=[TESTS], call_timeout_s=120))
    model = PatchedModule(pool, ModelSpec(factory="test_lora_quantized:quant_net", checkpoint=str(path),
                                          param_dtype="fp32"))
    model.load()
    yield model, reference.eval()
    pool.close()


def adapters(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA on every block's fc1 and fc2 (fp8), the head (fp8, 2 rows) and the conv patch embedding (fp8; up
    [out, r, 1, 1] and down [r, in, k, k] as LoRA files store a conv's)."""
    found = {f"blocks.{i}.fc{j}.weight": lora(*((36, 20) if j == 1 else (20, 36)), seed=seed * 100 + i * 2 + j)
             for i in range(3) for j in (1, 2)}
    found["head.weight"] = lora(2, 20, seed=seed * 100 + 98)
    up, down = lora(20, 16, seed=seed * 100 + 99)
    found["patch.weight"] = (up[:, :, None, None], down.reshape(8, 4, 2, 2))
    return found


def diffs(seed: int) -> dict[str, torch.Tensor]:
    """Diffs as LoRA files carry them: on fp8 biases and a LayerNorm weight (forward terms), on fp32 biases (rows),
    and a full-size diff on an fp8 Linear weight."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.1 for name, shape in (
        ("blocks.0.fc1.bias", (36,)), ("blocks.1.norm.weight", (20,)), ("blocks.1.norm.bias", (20,)),
        ("patch.bias", (20,)), ("head.bias", (2,)), ("blocks.2.fc2.weight", (20, 36)))}


def patch_set(key: str, *loras: tuple[float, dict], diff: dict | None = None) -> PatchSet:
    """``loras``: (strength, adapters) stacked in order, alpha = rank / 2; ``diff``: name -> (strength, tensor)."""
    ps = PatchSet(key=key)
    for n, (strength, found) in enumerate(loras):
        for name, (up, down) in found.items():
            ps.tensors[f"{n}.{name}.up"], ps.tensors[f"{n}.{name}.down"] = up, down
            ps.patches.setdefault(name, []).append({"kind": "lora", "up": f"{n}.{name}.up", "down": f"{n}.{name}.down",
                                                    "scale": strength * 0.5})
    for name, (strength, tensor) in (diff or {}).items():
        ps.tensors[f"diff.{name}"] = tensor
        ps.patches.setdefault(name, []).append({"kind": "diff", "diff": f"diff.{name}", "scale": strength})
    return ps


@torch.no_grad()
def merged(reference: nn.Module, ps: PatchSet) -> nn.Module:
    """The dequantized single-device model with each whole delta merged in fp32, as ComfyUI's calculate_weight."""
    model = copy.deepcopy(reference)
    params = dict(model.named_parameters())
    for name, ops in ps.patches.items():
        w = params[name]
        for op in ops:
            if op["kind"] == "lora":
                delta = ps.tensors[op["up"]].float().flatten(1) @ ps.tensors[op["down"]].float().flatten(1)
                w += op["scale"] * delta.view(w.shape)
            else:
                w += op["scale"] * ps.tensors[op["diff"]].float()
    return model


def expected(reference: nn.Module, ps: PatchSet, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return merged(reference, ps)(inputs(seed))


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().max().item() <= TOLERANCE * want.abs().max().item()


def test_quantized_weights_take_the_patches_in_the_forward(setup, monkeypatch):
    model, reference = setup
    model.set_patches(PatchSet())
    base = model(inputs())
    assert_close(base, expected(reference, PatchSet()))
    ps = patch_set("one", (0.8, adapters(1)), diff={name: (1.0, t) for name, t in diffs(1).items()})
    want = expected(reference, ps)
    assert (want - base).abs().max() > 0.1 * want.abs().max()   # the patches change the output clearly
    calls = spy_calls(model, monkeypatch)
    model.set_patches(ps)
    assert_close(model(inputs()), want)
    assert_close(model(inputs(1)), expected(reference, ps, seed=1))
    assert [op for op, _ in calls] == [APPLY, OPS + "forward", OPS + "forward"]   # sent once, adapters only
    assert calls[0][1] == ps.nbytes


def test_each_lora_term_matches_its_merge(setup):
    """One weight at a time (a Linear, the conv, a row-patched bias beside an fp8 weight): no term hides another."""
    model, reference = setup
    loras, found_diffs = adapters(2), diffs(2)
    for name in ("blocks.1.fc2.weight", "patch.weight", "head.weight"):
        ps = patch_set(name, (1.0, {name: loras[name]}))
        model.set_patches(ps)
        assert_close(model(inputs()), expected(reference, ps))
    for name in ("blocks.1.norm.weight", "blocks.0.fc1.bias", "head.bias"):
        ps = patch_set(name, diff={name: (1.0, found_diffs[name])})
        model.set_patches(ps)
        assert_close(model(inputs()), expected(reference, ps))
    model.set_patches(PatchSet())


def test_strength_change_stacking_and_removal_need_no_reload(setup, monkeypatch):
    model, reference = setup
    model.set_patches(PatchSet())
    base = model(inputs())
    calls = spy_calls(model, monkeypatch)
    first, second, found_diffs = adapters(3), adapters(4), diffs(3)
    for ps in (patch_set("a", (1.0, first)), patch_set("b", (0.3, first)),                        # strength changed
               patch_set("c", (0.3, first), (-0.7, second), diff={"blocks.0.fc1.bias": (0.5, found_diffs[
                   "blocks.0.fc1.bias"]), "head.bias": (1.0, found_diffs["head.bias"])})):     # a second LoRA stacked
        model.set_patches(ps)
        assert_close(model(inputs()), expected(reference, ps))
    model.set_patches(PatchSet())
    assert torch.equal(model(inputs()), base)   # the base back, bit for bit: no hook left, no weight touched
    assert OPS + "load" not in [op for op, _ in calls]


def test_patches_come_back_after_a_reload(setup):
    model, reference = setup
    ps = patch_set("reload", (0.5, adapters(5)), diff={"blocks.1.norm.weight": (1.0, diffs(5)["blocks.1.norm.weight"])})
    model.set_patches(ps)
    model(inputs())
    model.free()   # a pool rebuild or ComfyUI's Unload models: the next forward loads the base and applies again
    assert_close(model(inputs()), expected(reference, ps))
    model.set_patches(PatchSet())


def test_keys_matching_no_weight_are_warned_once_beside_forward_terms(setup, caplog):
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
    assert_close(model(inputs()), expected(reference, ps))
    model.set_patches(PatchSet())


REFUSED = {   # what cannot be a forward term on an fp8 weight -> the words of the refusal
    "set": ("blocks.0.fc1.weight", {"kind": "set", "set": "w"}, "a set patch replaces the stored weight"),
    "strength_model": ("blocks.0.fc1.weight", {"kind": "diff", "diff": "w", "scale": 1.0, "model_scale": 0.5},
                       "strength_model 0.5 scales the stored weight itself"),
    "other module": ("modulation", {"kind": "diff", "diff": "m", "scale": 1.0},
                     "a patch on the 'modulation' of a QuantNet cannot run in the forward"),
    "lora on a norm": ("blocks.0.norm.weight", {"kind": "lora", "up": "nu", "down": "nd", "scale": 1.0},
                       "a LoRA on a LayerNorm cannot run in the forward"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_run_in_the_forward_is_refused_by_name_and_changes_nothing(setup, case):
    model, reference = setup
    kept = patch_set("kept", (1.0, adapters(7)))
    model.set_patches(kept)
    before = model(inputs())
    name, op, words = REFUSED[case]
    ps = patch_set("refused", (0.5, adapters(8)))
    ps.tensors |= {"w": torch.zeros(36, 20), "m": torch.zeros(1, 1, 20), "nu": torch.zeros(20, 1),
                   "nd": torch.zeros(1, 1)}
    ps.patches[name] = [op]
    model.set_patches(ps)
    with pytest.raises(RankFailure, match=rf"{name} is stored as float8_e4m3fn on the ranks.*{re.escape(words)}.*"
                                          "weight_dtype bf16, fp16 or fp32"):
        model.sync_patches()
    # the refused set changed nothing: the ranks still hold the previous one (a forward that sends no patch set)
    assert torch.equal(ShardedModule.forward(model, inputs()), before)
    model.set_patches(PatchSet())


# ------------------------------------------------------------------------------------------------ GGUF

GGUF_LORAS = {   # weight -> (out, in) and its type in gguf_files.ALL_TYPES_LAYOUT
    "blocks.0.q.weight": (256, 256),       # Q8_0
    "blocks.0.k.weight": (256, 256),       # Q4_K
    "blocks.1.ffn.0.weight": (512, 256),   # Q6_K
    "head.weight": (2, 256),               # Q8_0, 2 rows: none on the third of 3 ranks
    "embed.weight": (256, 32),             # F16: a plain tensor, rows patched
    "blocks.1.v.weight": (256, 256),       # BF16 in the file, a plain tensor here: rows patched
}


def test_gguf_weights_take_the_same_forward_path(tmp_path):
    """A GGUF file (blocks gathered as their bytes, dequantized after the gather): its quantized weights take the
    LoRA in the forward, its F16/BF16 ones by rows; == the dequantized model with the deltas merged in fp32."""
    from gguf_files import ALL_TYPES_LAYOUT, QuantStack, reference_model, stack_inputs, write_stack

    path = tmp_path / "stack.gguf"
    reference = reference_model(QuantStack, write_stack(path, QuantStack(), ALL_TYPES_LAYOUT))
    pool = RankPool(PoolConfig(devices=["cpu"] * 3, extra_sys_path=[TESTS], call_timeout_s=120))
    try:
        model = PatchedModule(pool, ModelSpec(factory="gguf_files:quant_stack", checkpoint=str(path),
                                              param_dtype="fp32"))
        x = stack_inputs()
        base = model(x)
        loras = {name: lora(*shape, seed=i) for i, (name, shape) in enumerate(GGUF_LORAS.items())}
        ps = patch_set("gguf", (1.0, loras), diff={"blocks.0.q.bias": (1.0, torch.randn(256) * 0.1)})
        model.set_patches(ps)
        assert {r["at_forward"] for r in model.sync_patches()} == {4}   # the Q8_0, Q4_K, Q6_K and Q8_0 weights
        with torch.no_grad():
            want = merged(reference, ps)(x)
        assert (want - base).abs().max() > 0.1 * want.abs().max()
        assert_close(model(x), want)
        ps.tensors["set"] = torch.zeros(256, 256)
        ps.patches["blocks.0.k.weight"] = [{"kind": "set", "set": "set"}]
        ps.key = "refused"
        model.set_patches(ps)
        with pytest.raises(RankFailure, match=r"blocks\.0\.k\.weight is stored as GGUFWeight \(Q4_K\) on the ranks"):
            model.sync_patches()
        model.set_patches(PatchSet())
        assert torch.equal(model(x), base)
    finally:
        pool.close()
