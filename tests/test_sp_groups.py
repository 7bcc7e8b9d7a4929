"""The sequence-parallel groups are process groups of their own, never FSDP's: on NCCL one group is one stream, so
self-attention all-to-alls on FSDP's group would queue behind the next block's prefetched all-gather. ``DeviceMesh``
hands out the default group for a dimension spanning every rank (the 1 x N split), which is the group FSDP's 1-D mesh
all-gathers on. Over 2 and 4 real gloo ranks: each degree's group, directly and as the model's all-to-alls use it,
with the forward still equal to one device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tiny_models as tm
import torch
from rank_runs import gloo_mesh, run_ranks
from safetensors.torch import load_file
from test_sp_diffusers_wan import PRELOAD, REL, tiny_wan, wan_inputs

pytestmark = pytest.mark.timeout(600)


def _group_facts(mesh, degrees: list[int]) -> dict:
    """What each degree's group of this rank is: its members, whether it is WORLD or FSDP's, whether a sum over it
    adds exactly its members' ranks (nothing crosses groups), and whether a second call returns the same group."""
    import torch.distributed as dist

    from mgpu.families import sequence_groups

    groups = sequence_groups(degrees)
    facts = {}
    for degree, group in groups.items():
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total, group=group)
        facts[degree] = {"members": dist.get_process_group_ranks(group), "sum": total.item(),
                         "is_world": group is dist.group.WORLD, "is_fsdp": group is mesh.get_group(),
                         "cached": sequence_groups(degrees)[degree] is group}
    facts["distinct"] = len({id(g) for g in groups.values()}) == len(groups)
    return facts


def _all_to_all_groups(ctx, model_ops, workdir: str) -> list[dict]:
    """Load diffusers' Wan (4 heads) by the rank op with every degree, run the op on 1 row (sp = every rank) and 2
    (CFG: 2 cfg groups), and record the group of every all-to-all each forward makes."""
    import torch.distributed as dist

    seen = []
    real = dist.all_to_all_single

    def spy(*args, group=None, **kwargs):
        seen.append(group)
        return real(*args, group=group, **kwargs)

    model_ops.load(ctx, {"handle": "wan", "factory": "test_sp_diffusers_wan:tiny_wan", "sp_degree": ctx.world_size,
                         "checkpoint": f"{workdir}/wan.safetensors"}, {})
    reference = tiny_wan()
    reference.load_state_dict(load_file(f"{workdir}/wan.safetensors"))
    reference.eval()
    runs = []
    dist.all_to_all_single = spy
    try:
        for batch in (1, 2):
            inputs = wan_inputs(batch, seed=batch, per_token=False)
            seen.clear()
            kwargs = {**{k: {"t": k} for k in inputs}, "return_dict": {"v": False}}
            reply, out = model_ops.forward(ctx, {"handle": "wan", "batch": batch, "args": [], "kwargs": kwargs,
                                                 "batched": list(inputs)}, inputs)
            lo, hi = reply["rows"]
            want = reference(**inputs, return_dict=False)[0][lo:hi]
            rel = ((out["out"] - want).abs().max() / want.abs().max()).item() if "out" in out else None
            runs.append({"layout": reply["layout"], "exchanges": len(seen), "rel": rel,
                         "members": sorted({tuple(dist.get_process_group_ranks(g)) for g in seen}),
                         "on_world_or_fsdp": any(g is None or g is dist.group.WORLD or g is ctx.mesh.get_group()
                                                 for g in seen)})
    finally:
        dist.all_to_all_single = real
    return runs


@torch.no_grad()
def _rank_main(rank: int, world: int, workdir: str) -> None:
    import torch.distributed as dist

    from mgpu.ranks.rank import RankContext
    from mgpu.sharding import model_ops

    with gloo_mesh(rank, world, workdir) as mesh:
        degrees = [d for d in (1, 2, 4) if d <= world]
        facts = _group_facts(mesh, degrees)
        ctx = RankContext(rank, world, "cpu", torch.device("cpu"), "gloo", dist.group.WORLD, mesh)
        runs = _all_to_all_groups(ctx, model_ops, workdir)
        Path(f"{workdir}/rank{rank}.json").write_text(json.dumps({"facts": facts, "runs": runs}))


@pytest.mark.parametrize("world", [2, 4])
def test_each_sequence_degree_has_its_own_group(world: int, tmp_path: Path):
    tm.save_checkpoint(tm.seeded_init(tiny_wan()).eval(), tmp_path / "wan.safetensors")
    run_ranks(_rank_main, world, (world, str(tmp_path)), PRELOAD, 500)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, report in enumerate(reports):
        facts = report["facts"]
        assert facts["distinct"], facts
        for degree in [d for d in (2, 4) if d <= world]:
            fact = facts[str(degree)]
            members = list(range(rank // degree * degree, (rank // degree + 1) * degree))
            assert fact["members"] == members and fact["sum"] == sum(members), (rank, degree, fact)
            assert not fact["is_world"] and not fact["is_fsdp"], f"rank {rank}: degree {degree} is FSDP's group"
            assert fact["cached"], fact
        for run in report["runs"]:
            cfg, sp = run["layout"]
            if sp == 1:   # CFG's 2 rows on 2 ranks: one row each, nothing to exchange
                assert run["exchanges"] == 0, (rank, run)
            else:
                assert run["exchanges"] > 0 and not run["on_world_or_fsdp"], (rank, run)
                assert run["members"] == [list(range(rank // sp * sp, (rank // sp + 1) * sp))], (rank, run)
            assert run["rel"] is None or run["rel"] <= REL, (rank, run)
        assert [r["layout"] for r in report["runs"]] == [[1, world], [2, world // 2]]
