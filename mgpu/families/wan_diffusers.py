"""Ulysses sequence parallelism for diffusers' ``WanTransformer3DModel`` (the model ``python -m mgpu demo`` runs), by
hooks on diffusers' own modules; its code runs unchanged (diffusers 0.33, whose self-attention is the generic
``Attention`` with ``WanAttnProcessor2_0``, to 0.42, ``WanAttention`` with ``WanAttnProcessor``):

- the model's pre-hook takes the token count from the latent and the patch size, and cuts a per-token timestep
  ([B, tokens], Wan 2.2 TI2V, diffusers >= 0.35) to this rank's chunk, so the modulation it becomes is per local token;
- the first block's pre-hook cuts the hidden states (after the patch embedding) to this rank's contiguous chunk;
- inside each self-attention (``attn1``; the cross-attention ``attn2`` keeps local queries over the replicated text),
  q and k after their norms (RMSNorm across all heads needs every head of a token) and v after its projection go from
  (local tokens, all heads) to (all tokens, heads / P), the attention runs with ``heads / P`` (the module's ``heads``
  is set on each call), and the input of ``to_out[0]`` goes back. The rotary table stays whole: the processor applies
  it after the exchange, to every token of the local heads;
- ``proj_out``'s output (``out_channels`` x patch values per token) is gathered, so the unpatchify sees every token.

diffusers' own ``enable_parallelism(ContextParallelConfig(ulysses_degree=...))`` is not used: it needs diffusers >=
0.36 (the floor is 0.33), a token count that divides the degree (it asserts), and is fixed once per model, where the
ranks here switch degree per forward (CFG rows on cfg groups, a cfg-1 step over every rank).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from mgpu.errors import ShardingError
from mgpu.families import Family
from mgpu.families.sequence import (SequenceGroups, gather_tokens, heads_to_seq, seq_to_heads, token_range,
                                    token_sizes)

NAME = "WanTransformer3DModel"
# diffusers' Wan self-attention processors whose steps the hooks follow: projections, norms across heads,
# unflatten by ``attn.heads``, rotary, attention, flatten, ``to_out``. Another processor is refused by name.
PROCESSORS = ("WanAttnProcessor", "WanAttnProcessor2_0")


def heads_of(model: nn.Module) -> int:
    """Attention heads of every block (a degree must divide them)."""
    return model.config.num_attention_heads


class _SpForward(SequenceGroups):
    """One model's sequence split; ``select`` picks the degree for the next forwards (1: every hook passes through),
    ``sizes`` is set by the model's pre-hook of each forward (None at degree 1)."""

    model = NAME

    def __init__(self, groups: dict[int, ProcessGroup], heads: int, patch: tuple[int, ...]):
        super().__init__(groups)
        self.heads, self.patch = heads, tuple(patch)
        self.sizes: list[int] | None = None

    def cut(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """This rank's rows of dim 1 of a per-token tensor."""
        total = sum(self.sizes)
        if t.shape[1] != total:
            raise ShardingError(f"{NAME} sequence parallelism: {what} has {t.shape[1]} token rows for {total} "
                                "tokens, so it cannot be split with the tokens; run without sequence parallelism "
                                "(sp_degree 1)")
        lo, hi = token_range(self.sizes, self.index)
        return t[:, lo:hi]

    def model_inputs(self, signature: inspect.Signature, module: nn.Module, args: tuple,
                     kwargs: dict) -> tuple[tuple, dict] | None:
        self.sizes = None
        if self.parts == 1:
            return None
        bound = signature.bind(*args, **kwargs)
        latent = bound.arguments["hidden_states"]   # [B, C, frames, height, width]
        tokens = math.prod(n // p for n, p in zip(latent.shape[2:], self.patch))
        self.sizes = token_sizes(tokens, self.parts)
        timestep = bound.arguments["timestep"]
        if timestep.ndim == 2:   # [B, tokens]: one timestep per token (Wan 2.2 TI2V)
            bound.arguments["timestep"] = self.cut(timestep, "the per-token timestep")
        return bound.args, bound.kwargs

    def block_inputs(self, signature: inspect.Signature, module: nn.Module, args: tuple,
                     kwargs: dict) -> tuple[tuple, dict] | None:
        if self.sizes is None:
            return None
        bound = signature.bind(*args, **kwargs)
        bound.arguments["hidden_states"] = self.cut(bound.arguments["hidden_states"], "the hidden states")
        return bound.args, bound.kwargs

    def attention_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Each self-attention call: the processor splits q, k, v into ``module.heads`` heads; with the exchange
        around it, that is the heads of this rank. Refuses what the hooks cannot follow."""
        if self.sizes is None:
            module.heads = self.heads
            return
        processor = type(getattr(module, "processor", None)).__name__
        if processor not in PROCESSORS or getattr(module, "fused_projections", False):
            raise ShardingError(f"{NAME} sequence parallelism follows diffusers' {' / '.join(PROCESSORS)} with "
                                f"separate q, k, v projections; this self-attention has {processor}"
                                + (" with fused projections (unfuse_projections())" if processor in PROCESSORS
                                   else "") + ": use sp_degree 1")
        module.heads = self.heads // self.parts

    def to_heads(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        """[B, local tokens, heads x dim] -> [B, all tokens, heads / P x dim]."""
        if self.sizes is None:
            return None
        b, local, inner = out.shape
        return seq_to_heads(out.view(b, local, self.heads, inner // self.heads), self.sizes, self.group).flatten(2)

    def to_tokens(self, module: nn.Module, args: tuple) -> tuple | None:
        """The attention output, [B, all tokens, heads / P x dim] -> [B, local tokens, heads x dim]."""
        if self.sizes is None:
            return None
        x, *rest = args
        b, tokens, inner = x.shape
        group_heads = self.heads // self.parts
        local = heads_to_seq(x.view(b, tokens, group_heads, inner // group_heads), self.sizes, self.group)
        return (local.flatten(2), *rest)

    def output(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        return None if self.sizes is None else gather_tokens(out, self.sizes, self.group)


def _hook_self_attention(attn: nn.Module, state: _SpForward) -> None:
    attn.register_forward_pre_hook(state.attention_call, with_kwargs=True)
    for name in ("q", "k"):   # the norm across heads (qk_norm "rms_norm_across_heads") runs on local tokens first
        norm = getattr(attn, f"norm_{name}", None)
        (norm if norm is not None else getattr(attn, f"to_{name}")).register_forward_hook(state.to_heads)
    attn.to_v.register_forward_hook(state.to_heads)
    attn.to_out[0].register_forward_pre_hook(state.to_tokens)


def parallelize_wan_diffusers(model: nn.Module, groups: dict[int, ProcessGroup]) -> Callable[[int], None]:
    """Hooks that split ``model``'s tokens over the sequence group of the degree selected (``groups``: degree -> group
    of the ranks computing one sample together); returns ``select(degree)``, degree 1 until called.

    Every rank of the chosen group must run each forward with the same batch rows: they compute one sample together."""
    heads = heads_of(model)
    bad = [d for d in groups if heads % d]
    if bad:
        raise ShardingError(f"{NAME} has {heads} attention heads, which sequence-parallel degree {bad[0]} does not "
                            "divide; pick the degree with mgpu.families.sequence.choose_sp_degree")
    state = _SpForward(groups, heads, model.config.patch_size)
    model.register_forward_pre_hook(functools.partial(state.model_inputs, inspect.signature(model.forward)),
                                    with_kwargs=True)
    first = model.blocks[0]
    first.register_forward_pre_hook(functools.partial(state.block_inputs, inspect.signature(first.forward)),
                                    with_kwargs=True)
    for block in model.blocks:
        _hook_self_attention(block.attn1, state)
    model.proj_out.register_forward_hook(state.output)
    return state.select


FAMILY = Family(heads=heads_of, parallelize=parallelize_wan_diffusers)
