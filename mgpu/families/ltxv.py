"""Ulysses sequence parallelism for ComfyUI's ``LTXVModel`` (comfy/ldm/lightricks/model.py: LTX-Video 0.9.x in
ComfyUI 0.3.64, and LTX-Video / LTX-2 video-only in 0.33.0), by hooks on its own modules; its code runs unchanged:

- ``adaln_single``'s post-hook: a timestep per token (keyframe, guide and i2v conditioning give one) is embedded for
  every token, then cut to this rank's chunk, so the blocks' modulation and the output modulation (which ComfyUI
  computes outside any module, from the same embedding) see this rank's rows only;
- each block's pre-hook: the first block of a forward cuts the hidden states (after patchify, keyframe filtering and
  the keyframe position embedding, which all need every token) to this rank's chunk; every block gets the matching
  rows of the rope table (cos / sin in 0.3.64, rotation matrices in 0.33);
- each ``attn1`` (self-attention) pre-hook hands the attention call ComfyUI's own ``optimized_attention_override``
  hook, which exchanges (local tokens, all heads) for (all tokens, local heads) around the attention kernel and
  back. ``attn2`` (cross-attention to the text, with its text mask) is left alone: local queries, whole context;
- ``proj_out``'s post-hook gathers its output (``in_channels`` values per token, not the hidden states), so
  ComfyUI's keyframe scatter and unpatchify see every token on every rank of the group.

Self-attention masks: none (LTX-Video 0.9.x, no guides or guides at strength 1) and ComfyUI 0.33's
``GuideAttentionMask`` (guides at another strength or with a pixel mask) are supported: after the exchange every
rank holds every query, so ComfyUI's own guide-mask attention runs on it unchanged, for the rank's heads. A dense
tensor mask (no ComfyUI version builds one for this network) raises a ``ShardingError``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mgpu.errors import ShardingError
from mgpu.families import Family
from mgpu.families.sequence import SequenceGroups, exchanged_attention, gather_tokens, token_range, token_sizes

_OFF = "run this model with sequence_parallel off (MGPU Load Diffusion Model) or sp_degree 1"
# ComfyUI 0.33's attention for guide masks (comfy/ldm/lightricks/model.py), looked up in the network's own module
_GUIDE_ATTENTION = "_attention_with_guide_mask"


def heads_of(model: nn.Module) -> int:
    """Attention heads (0.3.64 keeps them only on the attention modules; 32 in every real LTX-Video file)."""
    return model.transformer_blocks[0].attn1.heads


class _SpForward(SequenceGroups):
    """One model's sequence split; ``select`` picks the degree for the next forwards (1: every hook passes through).
    ``sizes`` is set by a per-token timestep embedding or the first block, ``local`` once the hidden states are cut;
    both are cleared when a forward starts."""

    model = "LTXVModel"

    def __init__(self, groups: dict[int, ProcessGroup], guide_attention: Callable | None):
        super().__init__(groups)
        self.guide_attention = guide_attention
        self.begin(None, ())

    def begin(self, module: nn.Module | None, args: tuple) -> None:
        self.sizes: list[int] | None = None
        self.local = False
        self.rope: tuple[Any, tuple] | None = None   # (the forward's rope table, this rank's rows of it)

    def cut(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's rows of dim 1 of a per-token tensor; size 1 there (shared by all tokens) stays whole."""
        total = sum(self.sizes)
        if t.shape[1] == total:
            lo, hi = token_range(self.sizes, self.index)
            return t[:, lo:hi]
        if t.shape[1] == 1:
            return t
        raise ShardingError(f"{self.model} sequence parallelism: {what} has {t.shape[1]} token rows for {total} "
                            f"tokens, so its rows cannot be split with the tokens; {_OFF}")

    def timestep_output(self, signature: inspect.Signature, module: nn.Module, args: tuple, kwargs: dict,
                        out: tuple[torch.Tensor, torch.Tensor]) -> tuple | None:
        """``adaln_single`` returns (block modulation, embedding) with batch x (1 or tokens) rows: keep this rank's."""
        if self.parts == 1:
            return None
        batch = signature.bind(*args, **kwargs).arguments.get("batch_size")
        tokens = out[1].shape[0] // batch if batch else 1
        if tokens == 1:
            return None
        self.sizes = token_sizes(tokens, self.parts)
        return tuple(self.cut(t.unflatten(0, (batch, tokens)), "the per-token timestep").flatten(0, 1) for t in out)

    def block_inputs(self, signature: inspect.Signature, module: nn.Module, args: tuple,
                     kwargs: dict) -> tuple[tuple, dict] | None:
        if self.parts == 1:
            return None
        bound = signature.bind(*args, **kwargs)
        inputs = bound.arguments
        if not self.local:
            if self.sizes is None:
                self.sizes = token_sizes(inputs["x"].shape[1], self.parts)
            inputs["x"] = self.cut(inputs["x"], "the hidden states").clone()   # the full tensor can go
            self.local = True
        rows = inputs["timestep"].shape[1]
        if rows not in (1, self.sizes[self.index]):
            raise ShardingError(f"{self.model} sequence parallelism: the timestep modulation has {rows} rows for "
                                f"{self.sizes[self.index]} local tokens; {_OFF}")
        inputs["pe"] = self.local_rope(inputs["pe"])
        return bound.args, bound.kwargs

    def local_rope(self, pe: tuple) -> tuple:
        """This rank's rows of the rope table's tensors, cut once per forward (every block gets the same table)."""
        if self.rope is None or self.rope[0] is not pe:
            cut = tuple(self.cut(p, "the rope table").contiguous() if isinstance(p, torch.Tensor) else p for p in pe)
            self.rope = (pe, cut)
        return self.rope[1]

    def output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return gather_tokens(out, self.sizes, self.group) if self.local else out

    def self_attention_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.local:
            return None
        options = kwargs.get("transformer_options")
        if options is None:
            raise ShardingError(f"{self.model} sequence parallelism needs the self-attention to receive "
                                f"transformer_options (ComfyUI >= 0.3.64 passes them); this ComfyUI does not: {_OFF}")
        guide = self.guide_mask(kwargs.get("mask"))
        override = functools.partial(self.attention, options.get("optimized_attention_override"), guide, options)
        kwargs = {**kwargs, "transformer_options": {**options, "optimized_attention_override": override}}
        if guide is not None:
            kwargs["mask"] = None   # ComfyUI would split the queries by global token index: done after the exchange
        return args, kwargs

    def guide_mask(self, mask: Any) -> Any:
        """``mask`` when it is a guide mask this ComfyUI can apply after the exchange; None when there is none."""
        if mask is None:
            return None
        if type(mask).__name__ == "GuideAttentionMask" and self.guide_attention is not None:
            return mask
        raise ShardingError(f"{self.model} sequence parallelism: the self-attention got a {type(mask).__name__} mask, "
                            "which it cannot split over the ranks (supported: none, and ComfyUI's "
                            f"GuideAttentionMask); {_OFF}")

    def attention(self, outer: Callable | None, guide: Any, options: dict, func: Callable, q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """ComfyUI's attention ``func`` (or an override already set, ``outer``; or ComfyUI's guide-mask attention,
        which calls them itself) on (all tokens, local heads). LTXV passes ``heads`` by position."""
        if "heads" in kwargs:
            heads = kwargs.pop("heads")
        else:
            heads, *args = args
        if args or kwargs.get("mask") is not None or kwargs.get("skip_reshape") or kwargs.get("skip_output_reshape"):
            raise ShardingError(f"{self.model} sequence parallelism: the self-attention was called with a mask or "
                                f"another layout than [batch, tokens, heads x dim]; {_OFF}")
        if guide is not None:
            def attend(q, k, v, local_heads):
                return self.guide_attention(q, k, v, local_heads, guide, kwargs.get("attn_precision"), options)
        else:
            kernel = func if outer is None else functools.partial(outer, func)

            def attend(q, k, v, local_heads):
                return kernel(q, k, v, heads=local_heads, **kwargs)
        return exchanged_attention(attend, q, k, v, heads, self.sizes, self.group)


def parallelize_ltxv(model: nn.Module, groups: dict[int, ProcessGroup]) -> Callable[[int], None]:
    """Hooks that split ``model``'s tokens over the sequence group of the degree selected (``groups``: degree ->
    process group of the ranks computing one sample together); returns ``select(degree)``, degree 1 until called.

    Every rank of the chosen group must run each forward with the same batch rows: they compute one sample together."""
    heads = heads_of(model)
    bad = [d for d in groups if heads % d]
    if bad:
        raise ShardingError(f"{type(model).__name__} has {heads} attention heads, which sequence-parallel degree "
                            f"{bad[0]} does not divide; pick the degree with mgpu.families.sequence.choose_sp_degree")
    guide_attention = getattr(inspect.getmodule(type(model)), _GUIDE_ATTENTION, None)
    state = _SpForward(groups, guide_attention)
    model.register_forward_pre_hook(state.begin)
    adaln = model.adaln_single
    adaln.register_forward_hook(functools.partial(state.timestep_output, inspect.signature(adaln.forward)),
                                with_kwargs=True)
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(functools.partial(state.block_inputs, inspect.signature(block.forward)),
                                        with_kwargs=True)
        block.attn1.register_forward_pre_hook(state.self_attention_inputs, with_kwargs=True)
    model.proj_out.register_forward_hook(state.output)
    return state.select


FAMILY = Family(heads=heads_of, parallelize=parallelize_ltxv)
