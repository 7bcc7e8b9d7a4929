"""Ulysses sequence parallelism without ComfyUI: the token split, the all-to-alls and the output gather on real gloo
ranks against the whole tensor, the degree choice, the rows each rank of a ("cfg", "sp") mesh computes, and the
fallback of a model without an adapter to FSDP + batch split."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import tiny_models as tm
import torch
from rank_runs import gloo_mesh, run_ranks

from mgpu.families import Layout, parallelize, plan_sp_degree
from mgpu.families.sequence import (SpDegree, choose_sp_degree, gather_tokens, heads_to_seq, seq_to_heads,
                                    token_range, token_sizes)
from mgpu.planning.parallel import best_split
from mgpu.sharding.model_ops import batch_rows, rank_rows

PRELOAD = ["tiny_models", "mgpu.families.sequence"]
HEADS, HEAD_DIM, BATCH = 12, 4, 2


def test_token_chunks_cover_every_token_once_in_order():
    for tokens in range(0, 30):
        for parts in range(1, 6):
            sizes = token_sizes(tokens, parts)
            ranges = [token_range(sizes, r) for r in range(parts)]
            assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(tokens))
            assert max(sizes) - min(sizes) <= 1


def test_the_degree_divides_heads_and_ranks_and_says_why_it_changed():
    assert choose_sp_degree(40, 8, 8) == SpDegree(8, None)   # Wan 14B: degree 8 is fine
    wan_1_3b = choose_sp_degree(12, 8, 8, "WanModel")
    assert wan_1_3b.degree == 4
    assert "WanModel" in wan_1_3b.note and "12 attention heads" in wan_1_3b.note and "degree 4" in wan_1_3b.note
    odd_ranks = choose_sp_degree(12, 4, 6)
    assert odd_ranks.degree == 3 and "6 ranks" in odd_ranks.note and "heads" in odd_ranks.note
    assert choose_sp_degree(7, 4, 4).degree == 1


def test_rows_of_a_cfg_by_sp_mesh():
    """2 x 2: each CFG branch on one pair of ranks, the first of each pair answers; batch 1 leaves a pair idle."""
    two_by_two = Layout(cfg=2, sp=2)
    assert [rank_rows(2, two_by_two, r) for r in range(4)] == [(0, 1, True), (0, 1, False), (1, 2, True),
                                                               (1, 2, False)]
    assert [rank_rows(1, two_by_two, r)[2] for r in range(4)] == [True, False, False, False]
    assert [rank_rows(2, Layout(cfg=1, sp=4), r) for r in range(4)] == [(0, 2, True)] + [(0, 2, False)] * 3
    for batch in range(4):   # no sequence parallelism: the batch split of before
        assert [rank_rows(batch, Layout(cfg=3, sp=1), r) for r in range(3)] == [
            (*batch_rows(batch, 3, r), batch_rows(batch, 3, r)[0] < batch_rows(batch, 3, r)[1]) for r in range(3)]


@pytest.mark.parametrize("ranks, rows, degrees, split", [
    (2, 2, [1, 2], (2, 1)),          # CFG on 2 ranks: one branch each, nothing exchanged
    (2, 1, [1, 2], (1, 2)),          # cfg 1: the tokens split instead
    (4, 2, [1, 2, 4], (2, 2)),       # CFG on 4: 2 branches x 2 sequence halves
    (4, 1, [1, 2, 4], (1, 4)),
    (4, 1, [1, 2], (2, 2)),          # heads allow 2 at most: one pair computes, the other idles
    (4, 4, [1, 2, 4], (4, 1)),       # two videos with CFG: a row each
    (2, 3, [1, 2], (1, 2)),          # 3 rows: 1.5 rows' worth of tokens per rank beats 2 rows on one
    (3, 2, [1], (3, 1)),             # no sequence split: the plain batch split
])
def test_each_forward_takes_the_split_with_the_least_work_per_rank(ranks, rows, degrees, split):
    assert best_split(ranks, rows, degrees) == split


def test_a_model_without_an_adapter_keeps_the_batch_split_and_logs_it(caplog):
    mesh = types.SimpleNamespace(size=lambda: 4, device_type="cpu")   # no mesh is built for degree 1
    with caplog.at_level(logging.WARNING, logger="mgpu.families"):
        layouts = parallelize(tm.tiny_mlp(), mesh, 2)
    layout = layouts.for_rows(1)
    assert (layout.cfg, layout.sp) == (4, 1) and layouts.degrees == [1]
    assert "TinyMLP has no sequence-parallel adapter" in layout.note and "batch split" in layout.note
    assert layout.note in caplog.text
    assert plan_sp_degree(tm.tiny_mlp(), 1, 4).note is None


# ------------------------------------------------------------------------------------------ on gloo ranks

def _whole(tokens: int, seed: int) -> torch.Tensor:
    """The same [B, tokens, H, D] tensor on every rank (as the single-device model would hold it)."""
    return torch.randn(BATCH, tokens, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, tokens, H, D] attention over every token, per head."""
    return torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _check_exchanges(group, parts: int, index: int, tokens: int, seed: int) -> None:
    sizes = token_sizes(tokens, parts)
    lo, hi = token_range(sizes, index)
    q, k, v = (_whole(tokens, seed + i) for i in range(3))
    heads = slice(index * HEADS // parts, (index + 1) * HEADS // parts)
    swapped = seq_to_heads(q[:, lo:hi], sizes, group)
    assert torch.equal(swapped, q[:, :, heads]), f"seq_to_heads, {tokens} tokens over {parts}"
    assert torch.equal(heads_to_seq(swapped, sizes, group), q[:, lo:hi]), "heads_to_seq does not invert it"
    local = [seq_to_heads(t[:, lo:hi], sizes, group) for t in (q, k, v)]
    got = heads_to_seq(_attention(*local), sizes, group)
    torch.testing.assert_close(got, _attention(q, k, v)[:, lo:hi], rtol=0, atol=1e-6)
    assert torch.equal(gather_tokens(q[:, lo:hi].flatten(2), sizes, group), q.flatten(2)), "gather_tokens"


@torch.no_grad()
def _rank_main(rank: int, world: int, workdir: str) -> None:
    with gloo_mesh(rank, world, workdir) as mesh:
        group = mesh.get_group()
        for tokens in (45, 7, world - 1, 1):   # uneven chunks; fewer tokens than ranks leaves some empty
            _check_exchanges(group, world, rank, tokens, seed=tokens)
        if world == 4:   # ("cfg", "sp") = (2, 2): each pair exchanges its own sample only
            from mgpu.families import sequence_groups

            cfg, position = divmod(rank, 2)
            _check_exchanges(sequence_groups([2])[2], 2, position, 45, seed=100 * (cfg + 1))
        if world == 3:
            _check_fallback(rank, world, mesh, workdir)
        Path(f"{workdir}/ok{rank}").touch()


def _check_fallback(rank: int, world: int, mesh, workdir: str) -> None:
    """The rank op with sp_degree 3 on a model without an adapter: FSDP + one batch row per rank, as before."""
    import torch.distributed as dist

    from mgpu.ranks.rank import RankContext
    from mgpu.sharding import model_ops

    ctx = RankContext(rank, world, "cpu", torch.device("cpu"), "gloo", dist.group.WORLD, mesh)
    reply = model_ops.load(ctx, {"handle": "mlp", "factory": "tiny_models:tiny_mlp", "sp_degree": 3,
                                 "checkpoint": f"{workdir}/mlp.safetensors"}, {})
    assert (reply["layout"]["cfg"], reply["layout"]["sp"]) == (3, 1) and "no sequence-parallel" in reply["layout"]["note"]
    x = tm.mlp_inputs(3)["x"]
    rows, out = model_ops.forward(ctx, {"handle": "mlp", "batch": 3, "args": [], "kwargs": {"x": {"t": "x"}},
                                        "batched": ["x"]}, {"x": x})
    assert rows == {"rows": [rank, rank + 1], "layout": [3, 1]}
    torch.testing.assert_close(out["out"], tm.reference("mlp")(x)[rank:rank + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("world", [3, 4])
def test_all_to_all_and_gather_equal_the_whole_tensor(world: int, tmp_path: Path):
    """(local tokens, all heads) -> (all tokens, local heads) is exactly the whole tensor's heads, back is exactly
    the local tokens, attention in between equals attention over the whole tensor, and the gather restores it."""
    tm.save_checkpoint(tm.reference("mlp"), tmp_path / "mlp.safetensors")
    run_ranks(_rank_main, world, (world, str(tmp_path)), PRELOAD, 120)
    assert sorted(p.name for p in tmp_path.glob("ok*")) == [f"ok{r}" for r in range(world)]
