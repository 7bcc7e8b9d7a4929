"""``mgpu.training.adapters`` on plain torch layers (no ComfyUI): an ``OutputLoRA`` is ComfyUI's LoRA arithmetic
applied to the input, attaching it changes nothing until it trains, and detaching gives the layer back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mgpu.training import adapters


def test_an_output_lora_equals_the_weight_plus_scaled_up_down_and_detaches_cleanly():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10), nn.GELU(), nn.Linear(10, 6))
    x = torch.randn(3, 12, generator=g)
    before = model(x)
    up, down = torch.randn(10, 4, generator=g), torch.randn(4, 12, generator=g)
    specs = [{"key": "0.weight", "kind": "adapter"}]
    found = adapters.build_output_loras(specs, {"0.lora_up.weight": up, "0.lora_down.weight": down,
                                                "0.alpha": torch.tensor(2.0)}, "fp32", torch.device("cpu"))
    undo = adapters.attach(model, found)
    merged = torch.nn.functional.linear(x, model[0].weight + 2.0 / 4 * up @ down, model[0].bias)
    want = model[2](model[1](merged))
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert list(adapters.trainable(found)) == ["0.lora_up.weight", "0.lora_down.weight"]
    assert set(adapters.state(found)) == {"0.lora_up.weight", "0.lora_down.weight", "0.alpha"}
    adapters.detach(undo)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def test_a_layer_that_cannot_take_its_adapter_is_refused_before_any_changes():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    specs = [{"key": f"{i}.weight", "kind": "adapter"} for i in (0, 1)]
    values = {f"{i}.lora_{side}.weight": torch.zeros(shape) for i in (0, 1) for side, shape in (("up", (4, 2)),
                                                                                                  ("down", (2, 4)))}
    found = adapters.build_output_loras(specs, values, "fp32", torch.device("cpu"))
    with pytest.raises(ValueError, match="'1.weight'"):
        adapters.attach(model, found)
    assert not model[0]._forward_hooks
