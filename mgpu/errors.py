"""User-facing errors. Each message names the file, device or node involved and says what to do."""


class MgpuError(Exception):
    """Base of every error a user can cause or fix."""


class DeviceSpecError(MgpuError, ValueError):
    """A device spec (``--devices`` / ``MGPU_DEVICES``) that cannot be parsed."""


class SizingError(MgpuError, ValueError):
    """A component file that cannot be sized: missing, not safetensors, or a lying header."""


class PlanError(MgpuError):
    """Nothing fits. ``needs`` lists, per device, what was needed and what was available."""

    def __init__(self, message: str, needs: list[dict] | None = None):
        super().__init__(message)
        self.needs = needs or []


class RankFailure(MgpuError, RuntimeError):
    """A rank process raised, died or timed out. ``pool_kept``: every rank raised, so none is stuck and the pool
    stays up with its models; otherwise it was torn down and is rebuilt on next use. ``refusal``: the ranks raised
    one of our own errors (bad input, not a crash), with this message; running the same again fails the same way."""

    def __init__(self, message: str, rank: int | None = None, device: str | None = None,
                 exitcode: int | None = None, signal: str | None = None, traceback: str | None = None,
                 refusal: str | None = None, pool_kept: bool = False):
        super().__init__(message)
        self.rank = rank
        self.device = device
        self.exitcode = exitcode
        self.signal = signal
        self.traceback = traceback
        self.refusal = refusal
        self.pool_kept = pool_kept


class CallCancelled(MgpuError):
    """The caller cancelled a rank call (ComfyUI's Cancel). ``pool_kept``: the ranks stopped together at a block
    boundary and keep their models; otherwise the pool was shut down and restarts on next use."""

    def __init__(self, message: str, pool_kept: bool):
        super().__init__(message)
        self.pool_kept = pool_kept


class ShardingError(MgpuError, ValueError):
    """The model cannot be sharded as asked: no block list, checkpoint keys that do not match, ..."""


class TrainingError(MgpuError, ValueError):
    """A training run refused on the ranks before any collective: an optimizer, adapters or a checkpoint that do not
    fit the model. An ``MgpuError``, so the pool keeps its ranks (a refusal on every rank in step)."""
