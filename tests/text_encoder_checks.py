"""Checks of split text encoders and the conditioning cache inside a ComfyUI interpreter on the CPU
(tests/test_comfyui_text_encoder.py starts one per check; importing comfy must not leak into pytest).

The encoders are ComfyUI's own classes at a tiny size: its Wan UMT5 (comfy.text_encoders.wan.te, ComfyUI's T5 with
a relative-attention bias in every block) and its Gemma 3 (comfy.text_encoders.llama.Gemma3_4B, collecting every
layer's output as LTX-2 does), both sized through ComfyUI's own ``<name>_model_config`` model option, with seeded
weights. ComfyUI's loader cannot make them tiny: its detection builds UMT5-XXL and Gemma 3 12B at full size.
The splits are over two "cpu" entries (this machine has no GPU): the mechanism is the same as over GPUs.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

TINY_UMT5 = {"d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 4, "vocab_size": 32128}
TINY_GEMMA3 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
               "num_key_value_heads": 1, "vocab_size": 1000}
GEMMA_TOKENS = {"gemma3": [[(2, 1.0), (17, 1.0), (5, 1.0), (311, 1.0), (42, 1.0), (7, 1.0)]]}
CPU2 = ["cpu", "cpu"]


# ----------------------------------------------------------------------------------------------- encoders

def _target(clip, tokenizer):
    return SimpleNamespace(params={}, clip=clip, tokenizer=tokenizer)


def _with_weights(clip, transformer: torch.nn.Module, seed: int):
    from comfy_checkpoints import random_state_dict

    shapes = {k: tuple(v.shape) for k, v in transformer.state_dict().items()}
    dtype = next(transformer.parameters()).dtype
    missing, unexpected = transformer.load_state_dict(random_state_dict(shapes, seed, dtype), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return clip


def _options(name: str, config: dict) -> dict:
    cpu = torch.device("cpu")
    return {f"{name}_model_config": config, "load_device": cpu, "offload_device": cpu, "initial_device": cpu}


def umt5_clip(seed: int = 0):
    """ComfyUI's Wan text encoder (UMT5) with 4 tiny blocks and the T5 tokenizer ComfyUI ships."""
    import comfy.sd
    import comfy.sd1_clip
    import comfy.text_encoders.sd3_clip
    import comfy.text_encoders.wan

    class Tokenizer(comfy.sd1_clip.SD1Tokenizer):
        def __init__(self, embedding_directory=None, tokenizer_data={}):
            super().__init__(embedding_directory=embedding_directory, tokenizer_data=tokenizer_data,
                             clip_name="umt5xxl", tokenizer=comfy.text_encoders.sd3_clip.T5XXLTokenizer)

    clip = comfy.sd.CLIP(_target(comfy.text_encoders.wan.te(), Tokenizer), model_options=_options("umt5xxl", TINY_UMT5))
    return _with_weights(clip, clip.cond_stage_model.umt5xxl.transformer, seed)


def gemma_clip(seed: int = 0):
    """ComfyUI's Gemma 3 (its Llama2_ with Gemma 3 blocks) with 4 tiny layers, every layer's output kept (LTX-2)."""
    import comfy.sd
    import comfy.sd1_clip
    import comfy.text_encoders.llama

    class Gemma(comfy.sd1_clip.SDClipModel):
        def __init__(self, device="cpu", dtype=None, model_options={}):
            super().__init__(device=device, layer="all", textmodel_json_config={}, dtype=dtype,
                             special_tokens={"start": 2, "pad": 0}, layer_norm_hidden_state=False,
                             model_class=comfy.text_encoders.llama.Gemma3_4B, enable_attention_masks=True,
                             model_options=model_options)

    class Encoder(comfy.sd1_clip.SD1ClipModel):
        def __init__(self, device="cpu", dtype=None, model_options={}):
            super().__init__(device=device, dtype=dtype, model_options=model_options, name="gemma3", clip_model=Gemma)

    class NoTokenizer:   # the tests hand it tokens
        def __init__(self, embedding_directory=None, tokenizer_data={}):
            pass

    clip = comfy.sd.CLIP(_target(Encoder, NoTokenizer), model_options=_options("gemma3", TINY_GEMMA3))
    return _with_weights(clip, clip.cond_stage_model.gemma3.transformer, seed)


def transformer(clip) -> torch.nn.Module:
    inner = clip.cond_stage_model
    return getattr(inner, inner.clip).transformer


def split(clip, devices=CPU2, planned=None):
    from loaders import text_encoder_split

    return text_encoder_split.split_clip(clip, list(devices), planned, "test encoder")


def cached(clip, name: str):
    from loaders import conditioning_cache

    return conditioning_cache.cached(clip, ((name, 0, 0), "test", "cpu,cpu"))


def encode(clip, text: str) -> torch.Tensor:
    """Stock CLIPTextEncode's conditioning tensor."""
    import nodes

    ((cond, _),) = nodes.CLIPTextEncode().encode(clip, text)[0]
    return cond


def encode_tokens(clip, tokens: dict) -> torch.Tensor:
    ((cond, _),) = clip.encode_from_tokens_scheduled(tokens)
    return cond


class Calls:
    """Forward calls of a module, counted from outside."""

    def __init__(self, module: torch.nn.Module):
        self.n = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.n += 1


class Moves:
    """``.to()`` calls on a module tree (Module.to spied on): where ComfyUI moved what."""

    def __init__(self, root: torch.nn.Module):
        self.names = {id(m): n or "<root>" for n, m in root.named_modules()}
        self.seen: list[str] = []
        original = torch.nn.Module.to

        def to(module, *args, **kwargs):
            if id(module) in self.names:
                self.seen.append(self.names[id(module)])
            return original(module, *args, **kwargs)

        torch.nn.Module.to = to

    def take(self) -> list[str]:
        seen, self.seen = self.seen, []
        return seen


def _loaded(patcher_types=("SplitModelPatcher", "DeviceShare")) -> list[list]:
    """ComfyUI's record of the split encoder: [patcher class, device, loaded bytes]."""
    import comfy.model_management as mm

    return [[type(m.model).__name__, str(m.device), m.model_loaded_memory()] for m in mm.current_loaded_models
            if m.model is not None and type(m.model).__name__ in patcher_types]


# ------------------------------------------------------------------------------------------------- checks

def check_split_encodes_like_one_device(folder: str) -> dict:
    """The same weights on one device and split over two: conditioning, map and ComfyUI's accounting."""
    facts = {}
    for family, make, run in (("umt5", umt5_clip, lambda c: encode(c, "a red fox in the snow")),
                              ("gemma3", gemma_clip, lambda c: encode_tokens(c, GEMMA_TOKENS))):
        one, parts = make(seed=1), split(make(seed=1))
        want, got = run(one), run(parts)
        layers = parts.patcher.split
        facts[family] = {
            "patcher": type(parts.patcher).__name__, "equal": torch.equal(want, got), "shape": list(got.shape),
            "finite": bool(torch.isfinite(got).all()), "bytes": layers.bytes_per_device(),
            "devices_used": sorted({u.device for u in layers.units}),
            "in_order": (order := [u.device for u in layers.units if u.whole]) == sorted(order),
            "placed_as_mapped": layers.where(parts.cond_stage_model)
            == {u.name: [layers.devices[u.device]] for u in layers.units},
            "accounting": _loaded(),
        }
        del parts
        # an MGPU Plan that gives the second device three times the first's bytes
        facts[family]["planned 1:3"] = split(make(seed=1), planned=[10**9, 3 * 10**9]).patcher.split.bytes_per_device()
    return facts


def _lora(clip, strength: float = 1.0):
    """LoraLoader's clip side: a LoRA on one attention projection, in the generic text_encoders. naming."""
    import comfy.sd

    key = "text_encoders.umt5xxl.transformer.encoder.block.1.layer.0.SelfAttention.q"
    q = transformer(clip).encoder.block[1].layer[0].SelfAttention.q.weight
    g = torch.Generator().manual_seed(5)
    lora = {f"{key}.lora_up.weight": torch.randn(q.shape[0], 4, generator=g),
            f"{key}.lora_down.weight": torch.randn(4, q.shape[1], generator=g)}
    return comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)[1]


def check_cache_hits_and_misses(folder: str) -> dict:
    """Stock CLIPTextEncode on a cached split CLIP: the same text twice runs and loads the encoder once; another
    text, a LoRA'd clone and a clip-skip clone each run it; every output equals the one-device encoder's."""
    import comfy.model_management as mm

    one = umt5_clip(seed=2)
    clip = cached(split(umt5_clip(seed=2)), "cache")
    runs = Calls(transformer(clip))
    loads = []
    original = mm.load_models_gpu

    def load_models_gpu(models, *args, **kwargs):
        loads.extend(type(m).__name__ for m in models)
        return original(models, *args, **kwargs)

    mm.load_models_gpu = load_models_gpu
    steps = {}

    def step(name: str, c, text: str, reference) -> torch.Tensor:
        before_runs, before_loads = runs.n, len(loads)
        cond = encode(c, text)
        steps[name] = {"ran": runs.n - before_runs, "loaded": len(loads) - before_loads,
                       "equal_to_one_device": torch.equal(cond, encode(reference, text))}
        return cond

    first = step("first", clip, "a red fox", one)
    again = step("same text", clip, "a red fox", one)
    step("other text", clip, "a blue fox", one)
    lora = step("lora", _lora(clip), "a red fox", _lora(one))
    step("lora again", _lora(clip), "a red fox", _lora(one))   # LoraLoader run again: a new patch set
    step("base after lora", clip, "a red fox", one)
    step("base, new text, after lora", clip, "a green fox", one)   # the LoRA left the split weights
    skip = clip.clone()
    skip.clip_layer(-2)
    ref_skip = one.clone()
    ref_skip.clip_layer(-2)
    step("clip skip", skip, "a red fox", ref_skip)
    mm.load_models_gpu = original
    return {"steps": steps, "same_tensors": torch.equal(first, again), "lora_differs": not torch.equal(first, lora),
            "class_after_clone": type(skip).__name__, "patcher_after_lora": type(_lora(clip).patcher).__name__}


def check_deferred_clip(folder: str) -> dict:
    """MGPU Load Text Encoder run again for an encoder it loaded before returns ``conditioning_cache.deferred``: a
    CLIP that loads nothing for a cached text, and loads its weights for anything that needs them (another text,
    LoraLoader, CLIPSetLastLayer, ComfyUI's clip_layer without a clone, a split encoder); every output equals the
    same encoder loaded at once (stock comfy.sd.CLIP, no cache). ComfyUI 0.33's bookkeeping of a prompt's models
    (PromptModelTracker, its RAM cache's is_dynamic) loads nothing."""
    import comfy.model_patcher
    import comfy.sd
    import nodes

    from loaders import conditioning_cache as cc

    loads: list[str] = []
    fail = []

    def loader(split_it: bool = False):
        def load():
            if fail:
                raise RuntimeError(fail.pop())
            loads.append("split" if split_it else "one")
            clip = umt5_clip(seed=4)
            return split(clip) if split_it else clip
        return load

    key, split_key = ((f"{folder}/te", 1, 1), "wan", ("cpu",)), ((f"{folder}/te", 1, 1), "wan", ("cpu", "cpu"))
    one = umt5_clip(seed=4)   # the reference: ComfyUI's CLIP as loaded, never cached
    facts: dict = {"before any load": cc.deferred(key, loader(), "test") is None}
    eager = cc.cached(loader()(), key)
    facts["eager equal"] = torch.equal(encode(eager, "a red fox"), encode(one, "a red fox"))
    loads.clear()

    def deferred():
        clip = cc.deferred(key, loader(), "test")
        assert clip is not None
        return clip

    hit = deferred()
    facts["is a comfy CLIP"] = isinstance(hit, comfy.sd.CLIP)
    tracker = getattr(comfy.model_patcher, "PromptModelTracker", None)
    if tracker is not None:   # ComfyUI 0.33
        tracker().add([hit, (hit,)])
        facts["model patcher output"] = comfy.model_patcher.is_model_patcher_output(hit)
        facts["dynamic"] = hit.is_dynamic()
    facts["hit equal"] = torch.equal(encode(hit, "a red fox"), encode(one, "a red fox"))
    facts["loads after a hit"] = list(loads)
    facts["miss equal"] = torch.equal(encode(hit, "a blue fox"), encode(one, "a blue fox"))
    facts["loads after a miss"] = list(loads)
    facts["patcher after the miss"] = type(hit.patcher).__name__

    loads.clear()
    facts["lora equal"] = torch.equal(encode(_lora(deferred()), "a red fox"), encode(_lora(one), "a red fox"))
    ref_skip = nodes.CLIPSetLastLayer().set_last_layer(one, -2)[0]
    skipped = nodes.CLIPSetLastLayer().set_last_layer(deferred(), -2)[0]
    facts["clip skip equal"] = torch.equal(encode(skipped, "a red fox"), encode(ref_skip, "a red fox"))
    own_layer = deferred()
    own_layer.clip_layer(-2)   # set before the weights load: it stays (a text not encoded at -2 yet: a miss)
    facts["clip_layer kept"] = torch.equal(encode(own_layer, "a brown fox"), encode(ref_skip, "a brown fox"))
    facts["loads for lora, skip, clip_layer"] = list(loads)

    loads.clear()
    fail.append("no memory")
    retried = deferred()
    try:
        encode(retried, "a grey fox")
        facts["failed load"] = None
    except RuntimeError as e:
        facts["failed load"] = str(e)
    facts["after a failed load"] = torch.equal(encode(retried, "a grey fox"), encode(one, "a grey fox"))

    cc.cached(loader(split_it=True)(), split_key)
    encode(cc.deferred(split_key, loader(split_it=True), "test"), "a red fox")
    parts = cc.deferred(split_key, loader(split_it=True), "test")
    loads.clear()
    facts["split miss equal"] = torch.equal(encode(parts, "a white fox"), encode(one, "a white fox"))
    facts["split patcher"] = type(parts.patcher).__name__
    facts["split loads"] = list(loads)

    max_bytes, cc.CACHE.max_bytes = cc.CACHE.max_bytes, 0
    facts["cache off"] = cc.deferred(key, loader(), "test") is None
    cc.CACHE.max_bytes = max_bytes
    return facts


def check_comfyui_keeps_the_split_placed(folder: str) -> dict:
    """A split encoder through encode, clone, LoRA and a KSampler run that loads a DiT: ComfyUI never moves the
    encoder as a whole (only its units move, onto their devices); unloading (Unload models, a device's share, the
    pack's release for ComfyUI 0.3.x) releases every part, and the next encode places it again."""
    import comfy.model_management as mm
    import comfy.sd
    import nodes
    from comfy_checkpoints import write_tiny_wan21_t2v

    from loaders import text_encoder_split

    one = umt5_clip(seed=3)
    clip = cached(split(umt5_clip(seed=3)), "placed")
    layers = clip.patcher.split
    model = clip.cond_stage_model
    units = {u.name for u in layers.units if u.whole}
    moves = Moves(model)
    facts: dict = {}

    def placed_as_mapped() -> bool:
        return layers.placed and layers.where(model) == {u.name: [layers.devices[u.device]] for u in layers.units}

    encode(clip, "one")
    facts["first encode moved"] = sorted(set(moves.take()) - units)
    facts["placed after encode"] = placed_as_mapped()
    facts["accounting"] = _loaded()
    skip = clip.clone()
    skip.clip_layer(-2)
    encode(skip, "two")
    facts["clone moved"] = moves.take()
    encode(_lora(clip), "three")
    facts["lora moved"] = sorted(set(moves.take()) - units)

    dit = comfy.sd.load_diffusion_model(str(write_tiny_wan21_t2v(Path(folder) / "wan.safetensors")))
    g = torch.Generator().manual_seed(0)
    cond = [[torch.randn(1, 8, 4096, generator=g), {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    nodes.common_ksampler(dit, 0, 1, 2.0, "euler", "simple", cond, cond, latent)
    facts["ksampler moved"] = moves.take()
    facts["placed after ksampler"] = placed_as_mapped()
    facts["still loaded after ksampler"] = _loaded()

    mm.unload_all_models()
    facts["unload moved"] = moves.take()
    facts["placed after unload"] = layers.placed
    facts["loaded after unload"] = [entry[2] for entry in _loaded()]
    facts["encode after unload equal"] = torch.equal(encode(clip, "four"), encode(one, "four"))
    facts["placed again"] = placed_as_mapped()

    (i,) = [i for i, m in enumerate(mm.current_loaded_models) if type(m.model).__name__ == "DeviceShare"]
    mm.current_loaded_models.pop(i).model_unload(1e30)   # what ComfyUI's free_memory does to make room there
    facts["placed after a share unloads"] = layers.placed
    encode(clip, "five")
    text_encoder_split.release_all()
    facts["placed after release_all"] = layers.placed
    facts["encode after release_all equal"] = torch.equal(encode(clip, "six"), encode(one, "six"))
    return facts
