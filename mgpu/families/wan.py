"""Ulysses sequence parallelism for ComfyUI's ``WanModel`` (comfy/ldm/wan/model.py, 0.3.64 and 0.33.0) and the
subclasses whose forward runs the same blocks and head on every token (VACE, Fun Camera, SCAIL), by hooks on their
own modules; their code runs unchanged:

- each block's pre-hook: the first block of a forward cuts the tokens (after the patch embedding, and after any
  reference or pose tokens ComfyUI concatenates) to this rank's chunk; every block gets the matching rows of the rope
  table and, with per-token timesteps (Wan 2.2 TI2V), of the modulation ``e0``;
- each VACE block's pre-hook (``VaceWanModel.vace_blocks``) does the same for its second token stream: the VACE
  context enters the first VACE block with every token and is cut there, as is the patch-embedded latent it adds;
  later VACE blocks get the chunk the previous one returned, so each rank adds its own rows of ``c_skip``;
- each self-attention's pre-hook hands the attention call ComfyUI's own ``optimized_attention_override`` hook, which
  exchanges (local tokens, all heads) for (all tokens, local heads) around the attention kernel ComfyUI chose, and
  back; cross-attention is left alone (local queries, replicated text context);
- the head's pre-hook cuts a per-token ``e``, its post-hook gathers the head's output (``out_dim`` x patch values per
  token, not the hidden states), so ComfyUI's unpatchify sees every token on every rank of the group.

Subclasses that group the tokens by frame outside the self-attention (S2V's, HuMo's and WanDancer's audio, Animate's
face adapter) or run their blocks through other methods (Animate 2, the causal model) are not registered
(``mgpu.families.ADAPTERS``): they keep FSDP + batch split, and the load says so by class name.
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


class _SpForward(SequenceGroups):
    """One model's sequence split; ``select`` picks the degree for the next forwards (1: every hook passes through),
    ``sizes`` is set by the first block of each forward, cleared when one starts."""

    def __init__(self, groups: dict[int, ProcessGroup], model: str):
        super().__init__(groups)
        self.model = model
        self.sizes: list[int] | None = None

    def begin(self, module: nn.Module, args: tuple) -> None:
        self.sizes = None

    def cut(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's rows of dim 1 of a per-token tensor (or per latent frame, spread over the frame's tokens);
        size 1 there (shared by all tokens) stays whole."""
        total = sum(self.sizes)
        if t.shape[1] == total:
            lo, hi = token_range(self.sizes, self.index)
            return t[:, lo:hi]
        if t.shape[1] == 1:
            return t
        if total % t.shape[1] == 0:   # one row per latent frame (ComfyUI's WAN22.process_timestep for Wan 2.2 TI2V):
            lo, hi = token_range(self.sizes, self.index)   # each frame's tokens take its row, as repeat_e spreads it
            return t[:, torch.arange(lo, hi, device=t.device) // (total // t.shape[1])]
        raise ShardingError(f"{self.model} sequence parallelism: {what} has {t.shape[1]} token rows for {total} "
                            "tokens, so its rows cannot be split with the tokens; run this model without sequence "
                            "parallelism (sp_degree 1)")

    def block_inputs(self, signature: inspect.Signature, module: nn.Module, args: tuple,
                     kwargs: dict) -> tuple[tuple, dict]:
        if self.parts == 1:
            return None
        bound = signature.bind(*args, **kwargs)
        inputs = bound.arguments
        if self.sizes is None:
            self.sizes = token_sizes(inputs["x"].shape[1], self.parts)
            inputs["x"] = self.cut(inputs["x"], "the hidden states")
        self.cut_block_rows(inputs)
        return bound.args, bound.kwargs

    def vace_inputs(self, signature: inspect.Signature, module: nn.Module, args: tuple,
                    kwargs: dict) -> tuple[tuple, dict] | None:
        """A ``VaceWanAttentionBlock(c, x=x_orig, e=e0, freqs=freqs, ...)``: ``c`` (the VACE context, as many
        tokens as x) has every token in the first VACE block and this rank's chunk after it; ``x_orig`` (the
        patch-embedded latent the first block adds to c) always has every token. A tensor of ``local`` tokens is
        never cut again: local equals all only on the rank whose chunk starts at 0, where the cut changes nothing."""
        if self.parts == 1:
            return None
        bound = signature.bind(*args, **kwargs)
        inputs = bound.arguments
        if self.sizes is None:   # ComfyUI runs a main block first; the VACE blocks' x is whole all the same
            self.sizes = token_sizes(inputs["x"].shape[1], self.parts)
        for name, what in (("c", "the VACE context"), ("x", "the hidden states the VACE context adds")):
            if inputs[name].shape[1] == sum(self.sizes):
                inputs[name] = self.cut(inputs[name], what)
        self.cut_block_rows(inputs["kwargs"])
        return bound.args, bound.kwargs

    def cut_block_rows(self, inputs: dict) -> None:
        """A block's rope rows and per-token modulation rows, for this rank's tokens."""
        inputs["freqs"] = self.cut(inputs["freqs"], "the rope table")
        if inputs["e"].ndim == 4:   # [B, 1 or tokens, 6, dim]; a 3-D e is [B, 6, dim], one for all tokens
            inputs["e"] = self.cut(inputs["e"], "the per-token timestep modulation")

    def head_inputs(self, signature: inspect.Signature, module: nn.Module, args: tuple,
                    kwargs: dict) -> tuple[tuple, dict] | None:
        if self.sizes is None:
            return None
        bound = signature.bind(*args, **kwargs)
        if bound.arguments["e"].ndim == 3:   # [B, 1 or tokens, dim]
            bound.arguments["e"] = self.cut(bound.arguments["e"], "the per-token timestep embedding")
        return bound.args, bound.kwargs

    def head_output(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return out if self.sizes is None else gather_tokens(out, self.sizes, self.group)

    def self_attention_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.sizes is None:
            return None
        options = kwargs.get("transformer_options")
        if options is None:
            raise ShardingError(f"{self.model} sequence parallelism needs the self-attention to receive "
                                "transformer_options (ComfyUI >= 0.3.64 passes them); this ComfyUI does not: use "
                                "sp_degree 1")
        outer = options.get("optimized_attention_override")
        override = functools.partial(self.attention, outer)
        return args, {**kwargs, "transformer_options": {**options, "optimized_attention_override": override}}

    def attention(self, outer: Callable | None, func: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  *args: Any, heads: int, **kwargs: Any) -> torch.Tensor:
        """ComfyUI's attention ``func`` (or an override already set, ``outer``) on (all tokens, local heads)."""
        if args or kwargs.get("mask") is not None or kwargs.get("skip_reshape") or kwargs.get("skip_output_reshape"):
            raise ShardingError(f"{self.model} sequence parallelism: the self-attention was called with a mask or "
                                "another layout than [batch, tokens, heads x dim]; use sp_degree 1")
        attend = func if outer is None else functools.partial(outer, func)
        return exchanged_attention(lambda q, k, v, local_heads: attend(q, k, v, heads=local_heads, **kwargs),
                                   q, k, v, heads, self.sizes, self.group)


def parallelize_wan(model: nn.Module, groups: dict[int, ProcessGroup]) -> Callable[[int], None]:
    """Hooks that split ``model``'s tokens over the sequence group of the degree selected (``groups``: degree ->
    process group of the ranks computing one sample together); returns ``select(degree)``, degree 1 until called.

    Every rank of the chosen group must run each forward with the same batch rows: they compute one sample together."""
    name = type(model).__name__
    bad = [d for d in groups if model.num_heads % d]
    if bad:
        raise ShardingError(f"{name} has {model.num_heads} attention heads, which sequence-parallel degree "
                            f"{bad[0]} does not divide; pick the degree with mgpu.families.sequence.choose_sp_degree")
    state = _SpForward(groups, name)
    model.register_forward_pre_hook(state.begin)
    stacks = [(model.blocks, state.block_inputs), (getattr(model, "vace_blocks", ()), state.vace_inputs)]
    for blocks, inputs_hook in stacks:
        for block in blocks:
            block.register_forward_pre_hook(functools.partial(inputs_hook, inspect.signature(block.forward)),
                                            with_kwargs=True)
            block.self_attn.register_forward_pre_hook(state.self_attention_inputs, with_kwargs=True)
    model.head.register_forward_pre_hook(functools.partial(state.head_inputs, inspect.signature(model.head.forward)),
                                         with_kwargs=True)
    model.head.register_forward_hook(state.head_output, with_kwargs=True)
    return state.select


FAMILY = Family(heads=lambda model: model.num_heads, parallelize=parallelize_wan)
