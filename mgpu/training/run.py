"""Host side of a training run: ``TrainingRun`` drives the rank ops of ``mgpu.training.ops`` for one sharded model,
and ``RemoteNetwork`` makes each network call a node of the host's autograd graph, so the host's loss (ComfyUI's
own, in the loader) backpropagates into the ranks."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from mgpu.errors import CallCancelled, RankFailure
from mgpu.sharding.sharded import ShardedModule

OPS = "mgpu.training.ops:"
log = logging.getLogger("mgpu")


class TrainingRun:
    """One training run on ``sharded``'s ranks (composition: the model stays a ShardedModule that samples as before
    once the run stops). ``start`` installs the adapters, each network call is ``forward`` then ``backward``,
    ``step`` is the optimizer's, ``adapters`` reads the result, ``stop`` ends the run (always: a ``finally``)."""

    def __init__(self, sharded: ShardedModule, timeout: float | None = None,
                 cancelled: Callable[[], bool] | None = None):
        self.sharded = sharded
        self.timeout = timeout
        self.cancelled = cancelled
        self.anchor = torch.zeros((), requires_grad=True)   # puts every network call in the host's graph
        self.bytes = {"outputs": 0, "output_grads": 0, "adapter_reduce": 0}
        self.started: dict | None = None
        self._graphs = itertools.count()
        self._generation = -1

    def _call(self, op: str, payload: dict, tensors: dict | None = None, cancellable: bool = False) -> list:
        """Only a forward (and the start) watch ComfyUI's Cancel: the ranks agree on it at a block boundary of the
        forward. A backward, an optimizer step or a checkpoint runs to its end (a cancel mid-way would leave no rank
        at an agreed point and tear the pool down, losing what the run kept); the next forward stops the run."""
        try:
            return self.sharded.pool.call(OPS + op, {"handle": self.sharded.handle, **payload}, tensors,
                                          timeout=self.timeout, cancelled=self.cancelled if cancellable else None,
                                          generation=self._generation)
        except (RankFailure, CallCancelled):
            self.sharded.reset_cache()   # a failed op drops the ranks' cached inputs (and a lost pool has none)
            raise

    def start(self, specs: list[dict], first: dict[str, torch.Tensor], *, factory: str, mode: str | None,
              optimizer: str, learning_rate: float, training_dtype: str, lora_dtype: str,
              gradient_checkpointing: bool) -> dict:
        """Install the adapters ``specs`` describes with the values ``first`` (LoRA keys) on every rank."""
        sync = getattr(self.sharded, "sync_patches", None)   # the model's own weight patches, as when sampling
        if sync is not None:
            sync(self.timeout, self.cancelled)
        elif not self.sharded.loaded:
            self.sharded.load(cancelled=self.cancelled)
        self._generation = self.sharded.generation
        replies = self._call("start", {"specs": specs, "adapters": factory, "mode": mode, "optimizer": optimizer,
                                       "learning_rate": learning_rate, "training_dtype": training_dtype,
                                       "lora_dtype": lora_dtype, "gradient_checkpointing": gradient_checkpointing},
                             first, cancellable=True)
        self.started = replies[0].payload
        return self.started

    def forward(self, graph: int, args: tuple, kwargs: dict) -> torch.Tensor:
        payload, tensors = self.sharded.pack_forward(args, kwargs)
        replies = self._call("forward", {**payload, "graph": graph}, tensors, cancellable=True)
        out = self.sharded.join_rows(replies).clone()   # not a view of the pool's shared memory
        self.bytes["outputs"] += out.numel() * out.element_size()
        return out

    def backward(self, graph: int, grad: torch.Tensor) -> None:
        grad = grad.detach().to("cpu").contiguous()
        self._call("backward", {"graph": graph}, {"grad": grad})
        self.bytes["output_grads"] += grad.numel() * grad.element_size()

    def step(self) -> dict:
        reply = self._call("step", {})[0].payload
        self.bytes["adapter_reduce"] += reply["reduced_bytes"]
        return reply

    def adapters(self) -> dict[str, torch.Tensor]:
        """The trained adapters under their LoRA keys, copied out of shared memory."""
        reply = self._call("state", {})[0]
        return {k: reply.tensors[k].clone() for k in reply.payload["keys"]}

    def save(self, path: str) -> dict:
        """Every rank writes its shard of the adapters and optimizer state to the folder ``path``."""
        return self._call("save_state", {"path": path})[0].payload

    def load(self, path: str) -> dict:
        """The adapters and optimizer state of a checkpoint folder (verified by the caller: its metadata is a
        pickle) into the started run, on any rank count."""
        return self._call("load_state", {"path": path})[0].payload

    def stop(self) -> None:
        """End the run on the ranks if they are still those that started it (a lost pool has nothing to end)."""
        if self.started is None or not self.sharded.loaded:
            return
        try:
            self.sharded.pool.call(OPS + "stop", {"handle": self.sharded.handle}, timeout=self.timeout,
                                   generation=self._generation)
        finally:
            self.sharded.reset_cache()   # ending the run resets the model, its cached inputs too

    def network(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The network's forward on the ranks as a differentiable function of the host's graph."""
        return RemoteNetwork.apply(self, next(self._graphs), self.anchor, args, kwargs)


class RemoteNetwork(torch.autograd.Function):
    """Forward: the ranks compute the output and keep their graph. Backward: the output's gradient goes back to
    them (every input's gradient here is None: the loss of ComfyUI's Train LoRA only trains the adapters)."""

    @staticmethod
    def forward(ctx, run: TrainingRun, graph: int, anchor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        ctx.run, ctx.graph = run, graph
        return run.forward(graph, args, kwargs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.run.backward(ctx.graph, grad)
        return None, None, None, None, None
