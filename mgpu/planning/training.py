"""What one training step holds on each FSDP rank, and the training choices the plan makes with it.

MGPU Train LoRA trains ComfyUI's LoRA adapters over a base that stays sharded as stored (``mgpu.training``). Per rank:

* resident in every phase: the base's shard as stored (``partition.rank_need``'s shard), the rank process's own
  memory (``estimates.rank_process_bytes``);
* the adapter state (``adapter_state_bytes``): every rank holds the whole adapter, its gradient and the optimizer's
  state, plus one fp32 all-reduce bucket;
* while a step runs: the activations of this rank's rows and tokens (``train_activation_bytes``: every block's saved
  tensors, or with gradient checkpointing only every block's input and one block recomputed at a time) and FSDP2's
  gathered blocks, the same in the backward, which gathers each block again (``estimates.fsdp_buffer_bytes``).

On the host: the dataset's latents and conditioning (``dataset_bytes``).

The activation coefficients are measured on ComfyUI's own Wan blocks at real dimensions with Train LoRA's adapters,
forward and backward (``bench/calibrate_training.py``, table in bench/RESULTS.md), rounded up; the plan adds
``estimates.ACTIVATION_SAFETY`` as it does for sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mgpu.errors import SizingError
from mgpu.planning.estimates import ACTIVATION_SAFETY, Workload, dit_tokens, largest_block_params, latent_shape
from mgpu.planning.sizing import ComponentSize

MiB = 1024**2

# Optimizer state tensors per trained parameter, in the parameter's dtype (torch's implementations; SGD without
# momentum keeps none). The node's choices (loaders.training.OPTIMIZERS).
OPTIMIZER_STATES = {"AdamW": 2, "Adam": 2, "RMSprop": 1, "SGD": 0}
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
CHECKPOINTING = ("auto", "on", "off")
TRAINABLE_FAMILIES = ("wan",)   # by family prefix; loaders.training.NOT_TRAINABLE says why LTX's are not
ALL_REDUCE_BUCKET_BYTES = 25 * MiB   # mgpu.training.ops.BUCKET_BYTES: the gradients are summed in fp32 buckets

# Calibrated per block, in U = rows x tokens x hidden x act_bytes, F = the same with the FFN width, and W = one
# block's weights in the compute dtype (ComfyUI's weight adapters patch the whole weight per layer, and autograd keeps
# the patched weight for the backward). Measured on Wan 2.1 1.3B / 14B and Wan 2.2 5B (ComfyUI 0.33, 256 and 512
# tokens, rank 32): saved per block 28.0 U + 2.0 F (the three fit within 0.1 U) + 1.04-1.10 W; checkpointed 1.00 U;
# the backward's peak above what is saved -4.0 U + 0.6-0.9 W (it frees as it goes), 24.0 U + 2.0 F + 1.7-2.1 W
# with checkpointing (one block recomputed); outside the blocks 3.1-3.4 U + 0.95 x their weights. Rounded up
# (bench/RESULTS.md).
TRAIN_SAVED = {"U": 28.5, "F": 2.0, "W": 1.1}        # no checkpointing: what each block keeps for its backward
TRAIN_CHECKPOINTED_U = 1.0                           # checkpointing: each block keeps its input
TRAIN_BACKWARD = {"U": 0.0, "F": 0.0, "W": 1.0}      # the backward of one block, above everything saved
TRAIN_OUTSIDE = {"U": 4.0, "W": 1.0}                 # outside the blocks: embeddings, head; W: their weights


@dataclass(frozen=True)
class Training:
    """A LoRA training workload beside the latent's size (``estimates.Workload``: width x height x frames of one
    dataset item, its ``batch`` the rows of each forward, the node's batch_size): MGPU Train LoRA's inputs that
    decide memory, with its defaults."""

    lora_rank: int = 8
    optimizer: str = "AdamW"
    checkpointing: str = "auto"      # auto: off when it fits (no recompute), else on
    training_dtype: str = "bf16"
    lora_dtype: str = "bf16"
    dataset: int = 1                 # latents in the dataset (held in host RAM)
    grad_accumulation: int = 1       # the node's grad_accumulation_steps: rows per optimizer step = batch x this

    def __post_init__(self):
        for name, value, allowed in (("optimizer", self.optimizer, OPTIMIZER_STATES),
                                     ("checkpointing", self.checkpointing, CHECKPOINTING),
                                     ("training_dtype", self.training_dtype, DTYPE_BYTES),
                                     ("lora_dtype", self.lora_dtype, DTYPE_BYTES)):
            if value not in allowed:
                raise SizingError(f"training {name} {value!r}: choose one of {', '.join(allowed)}")
        if min(self.lora_rank, self.dataset, self.grad_accumulation) < 1:
            raise SizingError(f"{self}: lora_rank, dataset and grad_accumulation must all be >= 1")


def adapter_params(size: ComponentSize, lora_rank: int) -> int:
    """Trained parameters of ComfyUI's Train LoRA on this model: rank x (out + in) per weight matrix, and every 1-D
    weight and bias whole (its ``BiasDiff``), from the file's shapes (``ComponentSize.adapter_sides`` /
    ``adapter_vectors``)."""
    return lora_rank * size.adapter_sides + size.adapter_vectors


def adapter_state_bytes(size: ComponentSize, train: Training) -> int:
    """The adapter on every rank: its values and gradient in the LoRA dtype, the optimizer's state, one fp32
    all-reduce bucket."""
    values = adapter_params(size, train.lora_rank) * DTYPE_BYTES[train.lora_dtype]
    bucket = min(ALL_REDUCE_BUCKET_BYTES, adapter_params(size, train.lora_rank) * 4)
    return values * (2 + OPTIMIZER_STATES[train.optimizer]) + bucket


def train_activation_bytes(size: ComponentSize, tokens: int, rows: int, *, act_bytes: int = 2,
                           checkpointing: bool) -> int:
    """Calibrated live-tensor peak of one training forward + backward over ``rows`` x ``tokens`` on a rank, without
    the safety factor, the gathered weights or the adapter state.

    Per block, saved for the backward: ``TRAIN_SAVED`` (U, F and the patched weights W); the backward of one block
    adds ``TRAIN_BACKWARD`` above what is saved. Without checkpointing every block's saved tensors wait for the
    backward: layers x saved + backward. With it, each block keeps its input (``TRAIN_CHECKPOINTED_U`` x U) and one
    block at a time is recomputed: layers x input + saved + backward. Outside the blocks ``TRAIN_OUTSIDE``: U, and
    their weights, patched as the blocks' are.
    """
    hidden, ffn, layers = (size.dims.get(k) for k in ("hidden", "ffn", "layers"))
    if not (hidden and ffn and layers):
        raise SizingError(f"{size.path or size.family}: training memory needs a recognised DiT with hidden, ffn and "
                          f"layers (got family {size.family!r})")
    unit = rows * tokens * hidden * act_bytes
    terms = {"U": unit, "F": rows * tokens * ffn * act_bytes, "W": math.ceil(largest_block_params(size)) * act_bytes}
    saved = sum(TRAIN_SAVED[k] * v for k, v in terms.items())
    backward = sum(TRAIN_BACKWARD[k] * v for k, v in terms.items())
    kept = layers * TRAIN_CHECKPOINTED_U * unit + saved if checkpointing else layers * saved
    per_param = size.total_bytes / size.params if size.params else 2
    outside = TRAIN_OUTSIDE["U"] * unit + TRAIN_OUTSIDE["W"] * size.bytes_outside_blocks / per_param * act_bytes
    return math.ceil(kept + backward + outside)


def training_working_bytes(size: ComponentSize, wl: Workload, *, rows: int, sp: int = 1) -> int:
    """A rank's working memory for one step of ``wl`` (its ``train`` decided: checkpointing "on" or "off"; "auto"
    counts as on) over ``rows`` rows and 1/``sp`` of the tokens: ACTIVATION_SAFETY x the calibrated activations,
    plus the adapter state. FSDP2's gathered blocks are ``estimates.fsdp_buffer_bytes``."""
    train = wl.train
    if not size.family.startswith(TRAINABLE_FAMILIES):
        raise SizingError(f"{size.path or size.family}: MGPU Train LoRA trains Wan DiTs ({size.family} is not one: "
                          "LTX-Video's and LTX-2's blocks add to their input in place, which autograd refuses, as in "
                          "ComfyUI's own Train LoRA)")
    tokens = math.ceil(dit_tokens(size, wl) / sp)
    activations = train_activation_bytes(size, tokens, rows, act_bytes=DTYPE_BYTES[train.training_dtype],
                                         checkpointing=train.checkpointing != "off")
    return math.ceil(ACTIVATION_SAFETY * activations) + adapter_state_bytes(size, train)


def step_options(wl: Workload) -> list[Workload]:
    """The ways to run ``wl``'s training step, best first, each with its checkpointing decided: the asked rows per
    forward, without checkpointing before with it when the choice is "auto" (no recompute: about a third faster);
    then fewer rows per forward (a divisor of the batch) with more gradient accumulation, so that every optimizer
    step still sums ``batch x grad_accumulation`` rows."""
    train = wl.train
    modes = ("off", "on") if train.checkpointing == "auto" else (train.checkpointing,)
    out = []
    for micro in (m for m in range(wl.batch, 0, -1) if wl.batch % m == 0):
        accumulation = train.grad_accumulation * wl.batch // micro
        for mode in modes:
            out.append(replace(wl, batch=micro, train=replace(train, checkpointing=mode,
                                                              grad_accumulation=accumulation)))
    return out


def dataset_bytes(size: ComponentSize, wl: Workload) -> int:
    """Host RAM for the dataset: each latent in fp32 (channels x frames x height x width) and its conditioning
    (the text encoder's tokens at the DiT's text width, fp32)."""
    channels = size.dims.get("z_channels", 16)
    text = size.dims.get("text_len", 512) * size.dims.get("text_dim", 4096) * 4
    return wl.train.dataset * (channels * math.prod(latent_shape(size, wl)) * 4 + text)
