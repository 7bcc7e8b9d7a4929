"""Ulysses sequence parallelism, the model-independent part: which tokens each rank holds, the all-to-all that turns
(local tokens, all heads) into (all tokens, local heads) and back, and the gather of the final output.

Token counts need not divide the degree: ranks hold contiguous chunks whose sizes differ by at most one (the first
ranks take the extra), and the all-to-alls use those sizes as uneven split sizes, so no padding ever reaches the
attention (nothing to mask, nothing to strip: the result is exact). Heads must divide the degree: each rank attends
with ``heads / degree`` whole heads over every token, which is the single-device attention of those heads.

Every exchange is differentiable (``torch.distributed.nn.functional``), so training backpropagates through it: an
all-to-all's gradient goes back by the reverse all-to-all, an all-gather's is summed over the ranks and each keeps its
own chunk. A gathered output's gradient therefore enters on one rank of the group (the one that answered for the
output; the others backpropagate zeros) and reaches every rank's tokens through that sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as differentiable

from mgpu.errors import ShardingError


class SequenceGroups:
    """What an adapter's hooks share across forwards: the sequence-parallel group of each degree set up at load, and
    the one ``select`` picked for the next forwards (degree 1: no group, every hook passes through)."""

    model = "the model"   # the network's class name, for messages

    def __init__(self, groups: dict[int, dist.ProcessGroup]):
        self.groups = {d: (g, g.rank()) for d, g in groups.items()}
        self.parts, self.group, self.index = 1, None, 0

    def select(self, degree: int) -> None:
        if degree != 1 and degree not in self.groups:
            raise ShardingError(f"{self.model} sequence parallelism was set up for degrees {sorted(self.groups)}, "
                                f"not {degree}")
        self.parts = degree
        self.group, self.index = self.groups.get(degree, (None, 0))


def token_sizes(tokens: int, parts: int) -> list[int]:
    """How many of ``tokens`` each of ``parts`` ranks holds: contiguous chunks, the first ranks take the extra."""
    base, extra = divmod(tokens, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def token_range(sizes: list[int], index: int) -> tuple[int, int]:
    """Tokens ``[lo, hi)`` of rank ``index`` for chunk ``sizes``."""
    lo = sum(sizes[:index])
    return lo, lo + sizes[index]


@dataclass(frozen=True)
class SpDegree:
    """The sequence-parallel degree to use, and why it differs from the one asked for (None when it does not)."""

    degree: int
    note: str | None = None


def choose_sp_degree(heads: int, wanted: int, ranks: int, model: str = "the model") -> SpDegree:
    """The largest degree <= ``wanted`` that divides both the attention ``heads`` (each rank attends with whole heads)
    and the ``ranks`` (the rest of the ranks split the batch: ranks = cfg groups x degree).

    Wan 1.3B has 12 heads (degrees 1, 2, 3, 4, 6, 12), Wan 14B 40 (1, 2, 4, 5, 8, 10, 20, 40)."""
    if wanted < 1:
        raise ValueError(f"a sequence-parallel degree is at least 1, got {wanted}")
    degree = max(d for d in range(1, min(wanted, ranks) + 1) if heads % d == 0 and ranks % d == 0)
    if degree == wanted:
        return SpDegree(degree)
    why = [] if heads % wanted == 0 else [f"its {heads} attention heads"]
    why += [] if ranks % wanted == 0 else [f"the {ranks} ranks"]
    return SpDegree(degree, f"{model}: sequence-parallel degree {wanted} does not divide {' and '.join(why)}; "
                            f"using degree {degree}, the largest that divides both the heads and the ranks")


def seq_to_heads(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """[B, local tokens, H, ...] -> [B, all tokens, H / P, ...]: rank j receives head group j of every rank's tokens.

    One ``all_to_all_single`` along dim 0: the send buffer is this rank's tokens once per head group (equal splits),
    the receive buffer every rank's tokens in rank order (splits = ``sizes``), which is the global token order."""
    parts = len(sizes)
    b, local, heads, *rest = x.shape
    if heads % parts:
        raise ValueError(f"{heads} heads cannot be split over {parts} sequence-parallel ranks (choose_sp_degree)")
    send = x.reshape(b, local, parts, heads // parts, *rest).movedim(2, 0).movedim(2, 1).contiguous()
    recv = send.new_empty((sum(sizes), b, heads // parts, *rest))
    recv = differentiable.all_to_all_single(recv, send.flatten(0, 1), output_split_sizes=sizes,
                                            input_split_sizes=[local] * parts, group=group)
    return recv.movedim(0, 1)


def heads_to_seq(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: [B, all tokens, H / P, ...] -> [B, local tokens, H, ...]."""
    parts = len(sizes)
    local = sizes[dist.get_rank(group)]
    b, tokens, group_heads, *rest = x.shape
    send = x.movedim(1, 0).contiguous()
    recv = send.new_empty((parts * local, b, group_heads, *rest))
    recv = differentiable.all_to_all_single(recv, send, output_split_sizes=[local] * parts, input_split_sizes=sizes,
                                            group=group)
    return recv.unflatten(0, (parts, local)).movedim(0, 2).movedim(0, 1).flatten(2, 3)


def exchanged_attention(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
                        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, sizes: list[int],
                        group: dist.ProcessGroup) -> torch.Tensor:
    """Ulysses around one self-attention: q, k, v as [B, local tokens, heads x dim] go through one all-to-all to
    (all tokens, this rank's heads), ``attend(q, k, v, local heads)`` runs the model's own attention there, and its
    output comes back to [B, local tokens, heads x dim]."""
    b, local, inner = q.shape
    size = inner // heads
    qkv = seq_to_heads(torch.stack([t.view(b, local, heads, size) for t in (q, k, v)], dim=3),
                       sizes, group)                  # [B, tokens, heads / P, 3, head dim]
    tokens, group_heads = qkv.shape[1], heads // len(sizes)
    q, k, v = (qkv[:, :, :, i].reshape(b, tokens, group_heads * size) for i in range(3))
    out = attend(q, k, v, group_heads)
    return heads_to_seq(out.view(b, tokens, group_heads, size), sizes, group).reshape(b, local, inner)


def gather_tokens(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Every rank's chunk of ``dim``, concatenated in rank order, on every rank of ``group``.

    Chunks are padded to the largest for one equal-size all-gather (backends differ in uneven-size support)."""
    longest = max(sizes)
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, longest - x.shape[dim]]
    padded = torch.nn.functional.pad(x, pad).contiguous()
    parts = differentiable.all_gather(padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)
