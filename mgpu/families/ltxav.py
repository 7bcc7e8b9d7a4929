"""Ulysses sequence parallelism for ComfyUI 0.33's ``LTXAVModel`` (comfy/ldm/lightricks/av_model.py: LTX-2, a video
and an audio stream in every block), by hooks on its own modules; its code runs unchanged. The video tokens (tens of
thousands) are split over the ranks of a group; the audio stream (a few hundred tokens) stays whole, computed the
same on every rank of the group:

- each block's pre-hook: the first block of a forward cuts the video hidden states (after patchify, guide filtering
  and the keyframe position embedding, which need every token) to this rank's chunk; every block gets this rank's rows
  of the two video rope tables (self-attention's, and the cross-stream one in the audio heads) and of the three video
  modulation timesteps. ComfyUI keeps those per latent frame when a frame's tokens share one (``CompressedTimestep``):
  a rank gets the frames that cover its chunk, and its rows are cut from ComfyUI's own expansion of them;
- ``attn1`` (video self-attention): the all-to-all exchange around ComfyUI's attention, guide masks applied after
  it, exactly as for ``LTXVModel`` (``mgpu.families.ltxv``, whose hooks these reuse);
- ``audio_to_video_attn`` (video queries, audio keys and values) and the text cross-attentions: untouched (local
  queries, whole keys);
- ``video_to_audio_attn`` (audio queries, video keys and values): its keys and values (this rank's rows, after
  ComfyUI's projection, norm and rope) are all-gathered inside the attention call (ComfyUI's
  ``optimized_attention_override``), so every rank attends with every audio query over every video token and the
  audio stays the same on every rank;
- ``norm_out``'s post-hook gathers the video tokens after the final norm (a per-token norm), so ComfyUI's output
  modulation (from its expansion of every token's embedded timestep), ``proj_out``, the guide scatter and unpatchify
  see every token.

A dense self-attention mask (no ComfyUI builds one for LTX-2) and per-token rows that match neither the video tokens
nor one row for all raise a ``ShardingError`` that says to turn sequence parallelism off.
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
from mgpu.families.ltxv import _GUIDE_ATTENTION, _OFF, _SpForward, heads_of
from mgpu.families.sequence import gather_tokens, token_range, token_sizes

# Block inputs with one row per video token (or per latent frame, or one for all): cut to this rank's tokens.
_VIDEO_TIMESTEPS = ("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep")
_VIDEO_ROPES = ("v_pe", "v_cross_pe")


@functools.cache
def _window_class(compressed: type) -> type:
    """A subclass of ComfyUI's ``CompressedTimestep`` (so its blocks take it as theirs) holding the latent frames
    that cover one rank's tokens: its expansions keep that rank's ``tokens`` rows, from ``skip`` on."""

    class Window(compressed):
        __slots__ = ("skip", "tokens")

        def rows(self, t: torch.Tensor) -> torch.Tensor:
            return t[:, self.skip:self.skip + self.tokens]

        def expand(self) -> torch.Tensor:
            return self.rows(super().expand())

        def expand_for_computation(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
            return tuple(self.rows(t) for t in super().expand_for_computation(*args, **kwargs))

    Window.__name__ = Window.__qualname__ = f"Local{compressed.__name__}"
    return Window


class _AvSpForward(_SpForward):
    """``LTXVModel``'s split (self-attention exchange, guide masks, output gather) with LTX-2's block inputs and the
    video-to-audio attention. ``cuts`` keeps each cut block input for the forward, keyed by name."""

    model = "LTXAVModel"

    def begin(self, module: nn.Module | None, args: tuple) -> None:
        super().begin(module, args)
        self.cuts: dict[str, tuple[Any, Any]] = {}

    def finish(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.cuts = {}   # the whole rope tables and timesteps can go before the next forward

    def block_inputs(self, signature: inspect.Signature, module: nn.Module, args: tuple,
                     kwargs: dict) -> tuple[tuple, dict] | None:
        if self.parts == 1:
            return None
        bound = signature.bind(*args, **kwargs)
        inputs = bound.arguments
        if not self.local:
            vx, ax = inputs["x"]
            self.sizes = token_sizes(vx.shape[1], self.parts)
            inputs["x"] = (self.cut(vx, "the video hidden states").clone(), ax)   # the full tensor can go
            self.local = True
        for name in _VIDEO_TIMESTEPS:
            inputs[name] = self.once(name, inputs.get(name), self.local_timestep)
        for name in _VIDEO_ROPES:
            inputs[name] = self.once(name, inputs.get(name), self.local_rope_rows)
        return bound.args, bound.kwargs

    def once(self, name: str, value: Any, local: Callable[[Any, str], Any]) -> Any:
        """``local(value)``, made once per forward: every block gets the same tables."""
        if value is None:
            return None
        cached = self.cuts.get(name)
        if cached is None or cached[0] is not value:
            cached = self.cuts[name] = (value, local(value, f"the block input {name}"))
        return cached[1]

    def local_rope_rows(self, pe: tuple, what: str) -> tuple:
        return tuple(self.cut(p, what).contiguous() if isinstance(p, torch.Tensor) else p for p in pe)

    def local_timestep(self, ts: Any, what: str) -> Any:
        """This rank's rows of a video modulation timestep: a tensor, or ComfyUI's ``CompressedTimestep`` (one row
        per frame of ``patches_per_frame`` tokens; 1: per token, or one row for all)."""
        if isinstance(ts, torch.Tensor):
            return self.cut(ts, what)
        per_frame, total = ts.patches_per_frame, sum(self.sizes)
        rows = ts.num_frames * per_frame
        if rows == 1:
            return ts
        if rows != total:
            raise ShardingError(f"LTXAVModel sequence parallelism: {what} covers {rows} tokens, the video has "
                                f"{total}, so its rows cannot be split with the tokens; {_OFF}")
        lo, hi = token_range(self.sizes, self.index)
        first, end = lo // per_frame, -(-hi // per_frame)
        window = _window_class(type(ts))(ts.data[:, first:end], per_frame, per_frame=True)
        window.skip, window.tokens = lo - first * per_frame, hi - lo
        return window

    def audio_query_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not self.local:
            return None
        options = kwargs.get("transformer_options") or {}
        override = functools.partial(self.gathered_attention, options.get("optimized_attention_override"))
        return args, {**kwargs, "transformer_options": {**options, "optimized_attention_override": override}}

    def gathered_attention(self, outer: Callable | None, func: Callable, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """ComfyUI's attention ``func`` (or an override already set, ``outer``) for the whole audio's queries over
        every video token: this rank's keys and values, all-gathered in one collective."""
        if len(args) > 1 or kwargs.get("mask") is not None or kwargs.get("skip_reshape"):
            raise ShardingError("LTXAVModel sequence parallelism: the video-to-audio attention was called with a "
                                f"mask or another layout than [batch, tokens, heads x dim]; {_OFF}")
        k, v = gather_tokens(torch.stack((k, v)), self.sizes, self.group, dim=2).unbind(0)
        kernel = func if outer is None else functools.partial(outer, func)
        return kernel(q, k, v, *args, **kwargs)


def _guide_attention(model: nn.Module) -> Callable | None:
    """ComfyUI's guide-mask attention, from the module of the class (LTXVModel's) that defines it."""
    modules = (inspect.getmodule(cls) for cls in type(model).__mro__)
    return next((getattr(m, _GUIDE_ATTENTION) for m in modules if hasattr(m, _GUIDE_ATTENTION)), None)


def parallelize_ltxav(model: nn.Module, groups: dict[int, ProcessGroup]) -> Callable[[int], None]:
    """Hooks that split ``model``'s video tokens over the sequence group of the degree selected (``groups``: degree
    -> process group of the ranks computing one sample together); returns ``select(degree)``, degree 1 until called."""
    heads = heads_of(model)
    bad = [d for d in groups if heads % d]
    if bad:
        raise ShardingError(f"LTXAVModel has {heads} video attention heads, which sequence-parallel degree {bad[0]} "
                            "does not divide; pick the degree with mgpu.families.sequence.choose_sp_degree")
    state = _AvSpForward(groups, _guide_attention(model))
    model.register_forward_pre_hook(state.begin)
    model.register_forward_hook(state.finish)
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(functools.partial(state.block_inputs, inspect.signature(block.forward)),
                                        with_kwargs=True)
        block.attn1.register_forward_pre_hook(state.self_attention_inputs, with_kwargs=True)
        block.video_to_audio_attn.register_forward_pre_hook(state.audio_query_inputs, with_kwargs=True)
    model.norm_out.register_forward_hook(state.output)
    return state.select


FAMILY = Family(heads=heads_of, parallelize=parallelize_ltxav)
