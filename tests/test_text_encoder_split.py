"""A text encoder's layers over several devices, and its outputs cached by prompt: the parts that need no ComfyUI.

The split (mgpu.sharding.layer_split) on a small encoder shaped like ComfyUI's T5 (blocks registered before the
embedding, a bias computed by the first block and passed on, every layer's output collected as LTX-2's Gemma does);
the map both the planner and the loader use (split_in_order); the split_devices input of MGPU Load Text Encoder; the
host cache's keys and LRU (loaders.conditioning_cache). This machine has no GPU: the splits are over "cpu" entries
(and the meta device, which shows placement without a forward). tests/test_comfyui_text_encoder.py runs the same
inside ComfyUI 0.3.64 and 0.33.
"""

from __future__ import annotations

import copy
import gc
import sys
import weakref
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loaders import placement
from loaders.components import split_devices
from loaders.conditioning_cache import HostCache, Uncacheable, clip_key, digest
from mgpu.errors import MgpuError, ShardingError
from mgpu.planning.devices import parse_spec
from mgpu.planning.partition import Component, make_plan, split_in_order
from mgpu.planning.sizing import size_component
from mgpu.sharding.layer_split import LayerSplit, units_of


# --- the map ------------------------------------------------------------------------------------------------------

def test_units_go_in_order_in_proportion_to_each_devices_room():
    assert split_in_order([1] * 10, [10, 10]) == [0] * 5 + [1] * 5
    index = split_in_order([1] * 8, [30, 10])
    assert index == [0] * 6 + [1] * 2
    assert split_in_order([5, 5, 5], [100, 100, 100]) == [0, 1, 2]


def test_units_that_fit_in_total_but_not_in_pieces_do_not_fit():
    assert split_in_order([5, 5, 5, 5], [11, 9]) is None      # 20 bytes of room, but 5-byte units need 15 + 5
    assert split_in_order([5, 5], [4, 5]) is None
    assert split_in_order([1], []) is None


@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.lists(st.integers(0, 400), min_size=1, max_size=5))
def test_a_map_is_contiguous_in_order_and_within_every_room(sizes, rooms):
    index = split_in_order(sizes, rooms)
    if index is None:
        return
    assert index == sorted(index) and len(index) == len(sizes)
    for dev, room in enumerate(rooms):
        assert sum(s for s, i in zip(sizes, index) if i == dev) <= room


# --- a small encoder shaped like ComfyUI's T5 ----------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self, dim: int, first: bool):
        super().__init__()
        self.attn, self.ff = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.rel = torch.nn.Embedding(4, 1) if first else None

    def forward(self, x, mask, past_bias=None):
        if self.rel is not None:   # T5: the first block computes the position bias, the others reuse it
            past_bias = self.rel.weight.sum() * torch.ones_like(mask)
        x = x + torch.tanh(self.attn(x)) * mask[..., None] + past_bias[..., None]
        return x + self.ff(x), past_bias


class Stack(torch.nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.block = torch.nn.ModuleList(Block(dim, i == 0) for i in range(layers))
        self.final_layer_norm = torch.nn.LayerNorm(dim)

    def forward(self, x, mask):
        bias, every = None, []
        for block in self.block:
            x, bias = block(x, mask, bias)
            every.append(x.unsqueeze(1).clone())   # every layer's output, as ComfyUI collects for LTX-2
        return self.final_layer_norm(x), torch.cat(every, dim=1)


class Encoder(torch.nn.Module):
    def __init__(self, dim: int = 16, layers: int = 4):
        super().__init__()
        self.encoder = Stack(dim, layers)          # registered before the embedding, as in ComfyUI's T5
        self.shared = torch.nn.Embedding(50, dim)
        self.scale = torch.nn.Parameter(torch.ones(()))   # a container's own tensor

    def forward(self, ids, mask):
        return self.encoder(self.shared(ids) * self.scale, mask)


def encoder() -> Encoder:
    torch.manual_seed(0)
    return Encoder()


def test_units_are_the_blocks_and_the_largest_parts_without_blocks_in_registration_order():
    names = [(name, whole) for name, _, whole in units_of(encoder())]
    assert names == [("", False), *[(f"encoder.block.{i}", True) for i in range(4)],
                     ("encoder.final_layer_norm", True), ("shared", True)]


def test_a_split_encoder_computes_what_the_whole_one_does():
    whole = encoder()
    split = copy.deepcopy(whole)
    layers = LayerSplit.plan(split, ["cpu", "cpu"], [10**6, 10**6], "test encoder")
    layers.place(split)
    ids, mask = torch.randint(0, 50, (2, 7)), torch.tensor([[1.0] * 7, [1.0] * 4 + [0.0] * 3])
    with torch.no_grad():
        for got, want in zip(split(ids, mask), whole(ids, mask)):
            assert torch.equal(got, want)
    per_device = layers.bytes_per_device()
    assert sum(per_device) == sum(t.numel() * 4 for t in whole.parameters()) and min(per_device) > 0
    assert layers.execution_devices() == {u.name: "cpu" for u in layers.units if u.whole}


def test_units_are_placed_where_the_map_puts_them():
    """meta stands for a second GPU: a unit placed there holds no storage, and nothing moves it back."""
    model = encoder()
    layers = LayerSplit.plan(model, ["cpu", "meta"], [10**6, 10**6], "test encoder")
    layers.place(model)
    on = {u.name: layers.devices[u.device] for u in layers.units}
    assert set(on.values()) == {"cpu", "meta"} and on[""] == "cpu"   # a container's own tensors: the first device
    assert layers.where(model) == {name: [dev] for name, dev in on.items()}
    assert layers.execution_devices() == {u.name: on[u.name] for u in layers.units if u.whole}
    layers.place(model)   # again (ComfyUI loads it before every encode): nothing moves, hooks are not doubled
    assert layers.where(model) == {name: [dev] for name, dev in on.items()}
    block = model.get_submodule(layers.units[1].name)
    assert len(block._forward_pre_hooks) == len(block._forward_hooks) == 1


def test_a_dropped_split_encoder_is_freed_at_once():
    """The hooks reference no module (accelerate's forward replacement would make a cycle that only a full garbage
    collection frees, which ComfyUI reports as a leak): a split encoder nobody holds is freed by reference count."""
    gc.disable()
    try:
        model = encoder()
        LayerSplit.plan(model, ["cpu", "cpu"], [10**6, 10**6], "test encoder").place(model)
        with torch.no_grad():
            model(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3))
        gone = [weakref.ref(model), weakref.ref(model.encoder.block[1])]
        del model
        assert [ref() for ref in gone] == [None, None]
    finally:
        gc.enable()


def test_an_encoder_too_big_names_the_devices_and_their_room():
    with pytest.raises(ShardingError) as info:
        LayerSplit.plan(encoder(), ["cuda:0", "cuda:1"], [1000, 2000], "MGPU Load Text Encoder")
    msg = str(info.value)
    assert msg.startswith("MGPU Load Text Encoder (") and "does not fit on cuda:0, cuda:1" in msg
    assert "room for cuda:0 1000 B, cuda:1 2 KiB" in msg


# --- LTX-2's text encoder: Gemma, then the text projection it loads from the LTX-2 checkpoint ----------------------

class Gemma(torch.nn.Module):
    """Registered as ComfyUI's Gemma (comfy.text_encoders.llama.Llama2_): the embedding, then the layers."""

    def __init__(self, dim: int = 16, layers: int = 4):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, dim)
        self.layers = Stack(dim, layers)

    def forward(self, ids, mask):
        return self.layers(self.embed_tokens(ids), mask)


class Ltxav(torch.nn.Module):
    """Shaped like ComfyUI 0.33's LTXAVTEModel: Gemma, then the text projection (registered after it) over every
    layer's output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gemma3_12b = Gemma()
        self.text_embedding_projection = torch.nn.Linear(16 * 4, 16, bias=False)

    def forward(self, ids, mask):
        _, every = self.gemma3_12b(ids, mask)
        return self.text_embedding_projection(every.movedim(1, -1).flatten(2))


def test_the_loader_puts_the_text_projection_with_the_last_layers_and_computes_as_one_device():
    whole = Ltxav()
    split = copy.deepcopy(whole)
    layers = LayerSplit.plan(split, ["cpu", "meta"], [10**6, 10**6], "test encoder")
    device = {u.name: u.device for u in layers.units}
    assert device["gemma3_12b.embed_tokens"] == 0
    assert device["text_embedding_projection"] == device["gemma3_12b.layers.block.3"] == 1
    two_cpus = LayerSplit.plan(split, ["cpu", "cpu"], [10**6, 10**6], "test encoder")
    two_cpus.place(split)
    ids, mask = torch.randint(0, 50, (2, 7)), torch.ones(2, 7)
    with torch.no_grad():
        assert torch.equal(split(ids, mask), whole(ids, mask))


def test_the_plan_puts_ltx2s_text_projection_after_gemmas_last_block(tmp_path):
    """LTX-2 19B (fp8, its projection in the checkpoint) + Gemma 3 12B on 2 x 24 GiB: the encoder is split, and the
    projection's bytes count on the GPU of the last blocks, where the loader puts it, not with the embeddings."""
    from ckpt_layouts import gemma3_12b, layout_bytes, ltx2_19b, recast, write_safetensors
    from mgpu.planning.estimates import Workload

    projection = {"text_embedding_projection.aggregate_embed.weight": ((3840, 3840 * 49), "BF16")}
    dit = size_component(write_safetensors(tmp_path / "ltx-2-19b-dev-fp8.safetensors",
                                           {**recast(ltx2_19b(), "F8_E4M3"), **projection}, sparse=True))
    gemma = size_component(write_safetensors(tmp_path / "gemma_3_12B_it.safetensors", gemma3_12b("comfy"),
                                             sparse=True))
    plan = make_plan([Component("dit", dit), Component("text_encoder", gemma)], parse_spec("2x24GiB,cpu=64GiB"),
                     Workload(1280, 720, 121, 1, cfg=True))
    te = plan.placement("text_encoder")
    parts = dit.text_encoder_parts.total_bytes
    assert parts >= layout_bytes(projection) and te.weight_bytes == gemma.total_bytes + parts
    assert (te.strategy, te.devices) == ("split", ["cuda:0", "cuda:1"])
    blocks = gemma.blocks[0].bytes_per_block
    (a0, b0), (a1, b1) = te.layers_by_device["cuda:0"], te.layers_by_device["cuda:1"]
    assert (a0, b1, a1) == (0, 47, b0 + 1)
    assert te.resident_bytes["cuda:0"] == gemma.bytes_outside_blocks + sum(blocks[a0:b0 + 1])
    assert te.resident_bytes["cuda:1"] == sum(blocks[a1:b1 + 1]) + parts


# --- the split_devices input -----------------------------------------------------------------------------------------

TWO = parse_spec("2x24GiB,cpu=64GiB")
NODE = "MGPU Load Text Encoder"


@pytest.fixture(autouse=True)
def _no_comfyui_devices(monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    placement._live_gpu_ids.cache_clear()
    yield
    placement._live_gpu_ids.cache_clear()


def test_split_devices_lists_devices_in_order_or_auto_takes_every_gpu_or_the_plans_split():
    assert split_devices("cuda:1, cuda:0", devices=TWO) == ["cuda:1", "cuda:0"]
    assert split_devices("cpu,cpu", devices=parse_spec("cpu=8GiB")) == ["cpu", "cpu"]
    assert split_devices("auto", devices=TWO) == ["cuda:0", "cuda:1"]
    planned = SimpleNamespace(placement=lambda role: SimpleNamespace(strategy="split", devices=["cuda:1", "cuda:0"]))
    assert split_devices("auto", planned, devices=TWO) == ["cuda:1", "cuda:0"]


@pytest.mark.parametrize("spec, devices, says", [
    ("auto", "1x24GiB,cpu=8GiB", f"{NODE}: split_devices auto splits over every GPU, and this machine has 1 GPU"),
    ("cuda:0,cuda:0", "2x24GiB", "names a GPU twice"),
    ("cuda:0,cpu", "2x24GiB,cpu=8GiB", "mixes cpu with GPUs"),
    ("cuda:0", "2x24GiB", "names one device; list two or more"),
    ("cuda:0,cuda:7", "2x24GiB", f"{NODE}: device cuda:7 does not exist"),
    ("cuda:0,auto", "2x24GiB", "or is just auto; 'auto' cannot be one of them"),
    ("cuda:0,fsdp", "2x24GiB", "fsdp shards only the diffusion model"),
])
def test_split_devices_that_cannot_work_are_refused_by_name(spec, devices, says):
    with pytest.raises(MgpuError) as info:
        split_devices(spec, devices=parse_spec(devices))
    assert says in str(info.value) and str(info.value).startswith(NODE)


# --- the host cache ----------------------------------------------------------------------------------------------

TOKENS = {"umt5xxl": [[(4, 1.0), (9, 1.2), (1, 1.0)]]}


def test_a_key_changes_with_every_token_weight_and_tensor_byte():
    assert digest(TOKENS) == digest(copy.deepcopy(TOKENS))
    assert digest(TOKENS) != digest({"umt5xxl": [[(4, 1.0), (9, 1.1), (1, 1.0)]]})
    assert digest(TOKENS) != digest({"umt5xxl": [[(4, 1.0), (8, 1.2), (1, 1.0)]]})
    embed = torch.zeros(2, 4)
    assert digest([embed]) != digest([embed.to(torch.float16)]) != digest([embed.reshape(4, 2)])
    changed = embed.clone()
    changed[1, 3] = 1e-6
    assert digest([embed]) != digest([changed])
    assert digest({"a": 1, "b": 2}) == digest({"b": 2, "a": 1}) and digest([1, 2]) != digest((1, 2))
    with pytest.raises(Uncacheable):
        digest([object()])


def fake_clip(**patcher) -> SimpleNamespace:
    fields = dict(forced_hooks=None, object_patches={}, weight_wrapper_patches={}, hook_patches={}, patches={},
                  patches_uuid="u1")
    return SimpleNamespace(patcher=SimpleNamespace(**{**fields, **patcher}), apply_hooks_to_conds=None,
                           layer_idx=None, mgpu_encoder_key=(("umt5.safetensors", 10, 1),))


def test_the_key_holds_the_layer_the_patches_and_the_output_form_and_hooks_bypass_the_cache():
    base = clip_key(fake_clip(), TOKENS, True, True)
    assert base == clip_key(fake_clip(patches_uuid="another, without patches"), TOKENS, True, True)
    lora = fake_clip(patches={"w": ["lora"]})
    assert clip_key(lora, TOKENS, True, True) not in (base, None)
    assert clip_key(fake_clip(patches={"w": ["lora"]}, patches_uuid="u2"), TOKENS, True, True) != \
        clip_key(lora, TOKENS, True, True)
    skip = fake_clip()
    skip.layer_idx = -2
    assert clip_key(skip, TOKENS, True, True) != base
    assert clip_key(fake_clip(), TOKENS, "unprojected", True) != base
    assert clip_key(fake_clip(forced_hooks=object()), TOKENS, True, True) is None
    assert clip_key(fake_clip(object_patches={"manual_cast_dtype": torch.float32}), TOKENS, True, True) not in \
        (base, None, clip_key(fake_clip(object_patches={"manual_cast_dtype": torch.float16}), TOKENS, True, True))
    assert clip_key(fake_clip(object_patches={"forward": print}), TOKENS, True, True) is None
    assert clip_key(fake_clip(), {"t": [[(object(), 1.0)]]}, True, True) is None


def test_the_cache_hands_back_copies_and_drops_the_least_recently_used_beyond_its_bytes():
    cache = HostCache(max_bytes=3 * 4096)
    out = {"cond": torch.randn(1, 8, 128), "pooled_output": None, "attention_mask": torch.ones(1, 8)}
    cache.put("a", out)
    hit = cache.get("a")
    assert torch.equal(hit["cond"], out["cond"]) and hit["pooled_output"] is None
    hit["cond"].zero_()   # a node that edits its conditioning in place does not edit the cache
    assert torch.equal(cache.get("a")["cond"], out["cond"])
    cache.put("b", (torch.zeros(1024), None))
    cache.get("a")              # a used last: b goes first
    cache.put("c", torch.zeros(1024))
    assert cache.get("b") is None and cache.get("a") is not None and cache.bytes <= cache.max_bytes
    cache.put("huge", torch.zeros(4096))   # larger than the whole cache: not kept, nothing dropped for it
    assert cache.get("huge") is None and cache.get("c") is not None
