"""Two diffusion models on the same FSDP ranks (Wan 2.2 A14B's experts): both resident, or one at a time.

An MGPU Plan that names both experts decides (``Plan.expert``: the loader finds its own expert by its file).
Otherwise, a loader whose ranks already hold another model weighs what its plan (the connected one, or its own:
``placement.plan_to_follow``) says each rank holds of it (``Placement.rank_need``) against the free memory the ranks
report (``mgpu.planning.partition.fits_beside``). One at a time means ``pools.take_turns``: every (re)load of one
frees the others first (``pools.make_room``), so two experts' shards plus a gathered block never sit on a rank
together; the price is a reload at each switch, which ``_ComfyShardedModule.load`` logs with its seconds.

No ComfyUI import here: the decision is plain bookkeeping over the pool and the plan.
"""

from __future__ import annotations

import logging
import os

from mgpu.planning.devices import format_bytes
from mgpu.planning.partition import ONE_AT_A_TIME, fits_beside

from . import pools
from .placement import is_own

log = logging.getLogger("mgpu")


def _name(sharded) -> str:
    return os.path.basename(sharded.spec.checkpoint)


def kept_gathered(sharded) -> int:
    """Per rank bytes a loaded model keeps gathered between its steps (0 when it reshards after each step). They are
    taken once it has run, which the ranks' free memory shows only if that was before: counted either way, erring
    toward taking turns."""
    if sharded.spec.reshard_after_forward or not sharded.load_replies:
        return 0
    return int(sharded.load_replies[0].get("gathered_bytes_per_forward", 0))


def share_ranks(sharded, plan, node: str) -> str | None:
    """Decide, before ``sharded`` loads, whether it stays beside the models already on its ranks or takes turns
    with them; log why. Returns ``ONE_AT_A_TIME`` when it takes turns, else None. ``plan``: the plan its loader
    follows, which shards it over these ranks."""
    placed = plan.expert(sharded.spec.checkpoint)
    if placed is not None and placed.strategy == "fsdp":
        turns = placed.experts == ONE_AT_A_TIME
        if turns:   # with the other expert too, should its loader not follow this plan
            pools.take_turns(sharded, [o for o in pools.loaded_beside(sharded) if plan.expert(o.spec.checkpoint)])
        log.info("%s: %s: the MGPU Plan holds the two experts %s on the FSDP ranks (%s)", node, _name(sharded),
                 placed.experts.replace("_", " "), ", ".join(placed.devices))
        return ONE_AT_A_TIME if turns else None
    others = pools.loaded_beside(sharded)
    if not others:
        return None
    ranks = pools.rank_memory(sharded.pool)
    held = sum(kept_gathered(o) for o in others)
    fits, why = fits_beside(plan.placement("dit").rank_need, ranks, keep=not sharded.spec.reshard_after_forward,
                            held=held)
    names = ", ".join(_name(o) for o in others)
    free = ", ".join(f"rank {i} {format_bytes(d.free_bytes)}" for i, d in enumerate(ranks))
    whose = "no MGPU Plan" if is_own(plan) else "the MGPU Plan names one DiT"
    if fits:
        log.info("%s: %s: %s stays on the FSDP ranks beside %s: it needs %s (free now: %s)", node, whose,
                 _name(sharded), names, why, free)
        return None
    pools.take_turns(sharded, others)
    log.info("%s: %s: %s takes turns with %s on the FSDP ranks, one loaded at a time (each switch reloads one): it "
             "needs %s (free now: %s)", node, whose, _name(sharded), names, why, free)
    return ONE_AT_A_TIME
