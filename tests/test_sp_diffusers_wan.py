"""Ulysses sequence parallelism inside diffusers' WanTransformer3DModel (``mgpu.families.wan_diffusers``), sharded
with FSDP over 2 and 4 real gloo ranks by the rank ops themselves: every degree the heads allow, batch 1 and 2, a
timestep per sample or per token, equals the single-device forward; 45 tokens divide by neither 2 nor 4, and each
rank's self-attention sees only its own chunk of them."""

from __future__ import annotations

import json
import types
from pathlib import Path

import diffusers
import pytest
import tiny_models as tm
import torch
from packaging.version import Version
from rank_runs import gloo_mesh, run_ranks

from mgpu.errors import ShardingError
from mgpu.families import Layout, family_of
from mgpu.families.sequence import token_sizes
from mgpu.families.wan_diffusers import _SpForward

pytestmark = pytest.mark.timeout(600)

FRAMES, HEIGHT, WIDTH = 3, 6, 10   # latent; patch (1, 2, 2): 3 x 3 x 5 = 45 tokens, 23/22 over 2, 12/11/11/11 over 4
TOKENS = FRAMES * (HEIGHT // 2) * (WIDTH // 2)
HEADS = 4
REL = 1e-4   # fp32: the split changes only the order of float sums
# diffusers' Wan takes a timestep per token (Wan 2.2 TI2V) from 0.35 on
PER_TOKEN = (False, True) if Version(diffusers.__version__) >= Version("0.35") else (False,)
PRELOAD = ["tiny_models", "diffusers.models.transformers.transformer_wan", "mgpu.sharding.model_ops",
           "mgpu.families.wan_diffusers"]


def tiny_wan() -> torch.nn.Module:
    """diffusers' Wan DiT, 2 layers of 4 heads x 16 (the ranks build it by path, under meta)."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=16,
                                 in_channels=4, out_channels=4, text_dim=24, freq_dim=16, ffn_dim=96, num_layers=2,
                                 rope_max_seq_len=32)


def wan_inputs(batch: int, seed: int, per_token: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    timestep = torch.rand((batch, TOKENS) if per_token else (batch,), generator=g) * 1000
    return {"hidden_states": torch.randn(batch, 4, FRAMES, HEIGHT, WIDTH, generator=g), "timestep": timestep,
            "encoder_hidden_states": torch.randn(batch, 6, 24, generator=g)}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return ((got - want).abs().max() / want.abs().max()).item()


def _op_forward(ctx, model_ops, inputs: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The rank op ``forward`` as ShardedModule calls it: tensors by reference, batch rows chosen by the op."""
    batch = inputs["hidden_states"].shape[0]
    kwargs = {**{k: {"t": k} for k in inputs}, "return_dict": {"v": False}}
    payload = {"handle": "wan", "batch": batch, "args": [], "kwargs": kwargs, "batched": list(inputs)}
    return model_ops.forward(ctx, payload, inputs)


@torch.no_grad()
def _rank_main(rank: int, world: int, workdir: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from mgpu.ranks.rank import RankContext
    from mgpu.sharding import model_ops

    with gloo_mesh(rank, world, workdir) as mesh:
        reference = tiny_wan()
        reference.load_state_dict(load_file(f"{workdir}/wan.safetensors"))
        reference.eval()
        ctx = RankContext(rank, world, "cpu", torch.device("cpu"), "gloo", dist.group.WORLD, mesh)
        loaded = model_ops.load(ctx, {"handle": "wan", "factory": f"{__name__}:tiny_wan", "sp_degree": world,
                                      "checkpoint": f"{workdir}/wan.safetensors"}, {})
        entry = ctx.objects["wan"]
        seen: list[int] = []
        query = entry["model"].blocks[0].attn1.to_q   # tokens the self-attention projects: this rank's own
        query.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        report = {"degrees": loaded["layout"]["degrees"], "direct": [], "op": []}
        for batch in (1, 2):
            for per_token in PER_TOKEN:
                inputs = wan_inputs(batch, seed=10 * batch + per_token, per_token=per_token)
                want = reference(**inputs, return_dict=False)[0]
                for degree in entry["layouts"].degrees:   # the whole batch on every group of `degree` ranks
                    entry["layouts"].use(Layout(world // degree, degree))
                    seen.clear()
                    got = entry["model"](**inputs, return_dict=False)[0]
                    report["direct"].append({"batch": batch, "per_token": per_token, "degree": degree,
                                             "tokens_seen": seen[0], "rel": _relative(got, want)})
                reply, out = _op_forward(ctx, model_ops, inputs)
                lo, hi = reply["rows"]
                report["op"].append({"batch": batch, "per_token": per_token, "layout": reply["layout"],
                                     "rows": [lo, hi],
                                     "rel": _relative(out["out"], want[lo:hi]) if "out" in out else None})
        Path(f"{workdir}/rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_forward_equals_single_device(world: int, tmp_path: Path):
    """FSDP + Ulysses over ``world`` gloo ranks == one device (fp32, relative 1e-4), for each degree and batch 1 and
    2; each rank of a degree-d group attends its own chunk of the 45 tokens; the rank op itself splits 1 row over
    every rank and CFG's 2 rows over cfg groups (2 x 1 on 2 ranks, 2 x 2 on 4)."""
    tm.save_checkpoint(tm.seeded_init(tiny_wan()).eval(), tmp_path / "wan.safetensors")
    run_ranks(_rank_main, world, (world, str(tmp_path)), PRELOAD, 500)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    degrees = [1, 2] if world == 2 else [1, 2, 4]
    for rank, report in enumerate(reports):
        assert report["degrees"] == degrees
        for run in report["direct"]:
            assert run["rel"] <= REL, (rank, run)
            sizes = token_sizes(TOKENS, run["degree"])
            assert run["tokens_seen"] == sizes[rank % run["degree"]], (rank, run)
        assert len(report["direct"]) == 2 * len(PER_TOKEN) * len(degrees)
        for run in report["op"]:
            want = [1, world] if run["batch"] == 1 else [2, world // 2]
            assert run["layout"] == want, (rank, run)
    answers = [run for report in reports for run in report["op"] if run["rel"] is not None]
    assert all(run["rel"] <= REL for run in answers), answers
    for batch in (1, 2):   # every row of each batch comes back exactly once
        rows = sorted(tuple(run["rows"]) for run in answers if run["batch"] == batch and not run["per_token"])
        assert rows == ([(0, 1)] if batch == 1 else [(0, 1), (1, 2)]), rows


def test_the_adapter_is_registered_under_diffusers_class_name():
    family = family_of(tiny_wan())
    assert family is not None and family.heads(tiny_wan()) == HEADS


@pytest.mark.parametrize("change", ["processor", "fused"])
def test_a_self_attention_the_hooks_cannot_follow_is_refused_by_name(change: str):
    """Another attention processor, or q/k/v fused into one projection, would bypass the exchanges: refused."""
    attn = tiny_wan().blocks[0].attn1
    if change == "processor":
        from diffusers.models.attention_processor import AttnProcessor2_0

        attn.processor = AttnProcessor2_0()
    else:
        attn.fused_projections = True
    state = _SpForward({2: types.SimpleNamespace(rank=lambda: 0)}, HEADS, (1, 2, 2))
    state.select(2)
    state.sizes = token_sizes(TOKENS, 2)
    with pytest.raises(ShardingError, match="sp_degree 1") as e:
        state.attention_call(attn, (), {})
    assert ("AttnProcessor2_0" if change == "processor" else "fused projections") in str(e.value)
