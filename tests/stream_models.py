"""A tiny two-stream network shaped like ComfyUI 0.33's LTX-2 (LTXAVModel) for the sharding tests, without ComfyUI:
its forward takes a [video, audio] list of latents and a (video, audio) timestep pair and answers with a list, and
a method outside its forward (``preprocess``, like ``preprocess_text_embeds``) runs the root's text connector.
The ranks import it by file name (``stream_models:two_stream``)."""

from __future__ import annotations

import torch
from torch import nn

import tiny_models as T


class StreamBlock(nn.Module):
    def __init__(self, video: int, audio: int):
        super().__init__()
        self.video = nn.Linear(video, video)
        self.audio = nn.Linear(audio, audio)
        self.audio_to_video = nn.Linear(audio, video)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor], context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v, a = x
        v = v + torch.tanh(self.video(v) + self.audio_to_video(a.mean(1, keepdim=True)) + context.mean(1, keepdim=True))
        return v, a + torch.tanh(self.audio(a))


class TwoStream(nn.Module):
    def __init__(self, video: int = 12, audio: int = 6, text: int = 5, layers: int = 3):
        super().__init__()
        self.connector = nn.Linear(text, video)   # in the root FSDP unit: gathered only around forward
        self.time = nn.Linear(1, video)
        self.blocks = nn.ModuleList(StreamBlock(video, audio) for _ in range(layers))

    def preprocess(self, context: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.connector(context)) * scale

    def forward(self, x: list[torch.Tensor], timestep: tuple[torch.Tensor, torch.Tensor],
                context: torch.Tensor) -> list[torch.Tensor]:
        v, a = x
        v = v + self.time(timestep[0][:, None, None].to(v.dtype))
        a = a * timestep[1][:, None, None]
        for block in self.blocks:
            v, a = block((v, a), context)
        return [v, a]


def two_stream() -> TwoStream:
    return TwoStream()


def reference(seed: int = 0) -> TwoStream:
    return T.seeded_init(TwoStream(), seed).eval()


def inputs(batch: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": [torch.randn(batch, 4, 12, generator=g), torch.randn(batch, 3, 6, generator=g)],
            "timestep": (torch.rand(batch, generator=g), torch.rand(batch, generator=g)),
            "context": torch.randn(batch, 2, 12, generator=g)}
