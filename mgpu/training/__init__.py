"""LoRA training over the FSDP ranks, rank side (no ComfyUI here).

One run, end to end: the host builds the adapters' first values exactly as ComfyUI's Train LoRA does (same modules,
same order, same random draws) and ``ops.start`` installs them on every rank as replicated trainable modules in the
layers' ``weight_function`` / ``bias_function`` lists, the hook ComfyUI's casting layers already apply after the
weight is cast, so FSDP's all-gathered (fp8 upcast, GGUF dequantized) weight gets the adapter's delta as on one
device. Every network call of a step is ``ops.forward`` (this rank's rows, gradients on, the graph kept) and, when
the host's loss backpropagates into it, ``ops.backward`` (this rank's rows of the output gradient); ``ops.step``
sums the adapters' gradients over the ranks (one fp32 all-reduce per bucket, once per optimizer step) and runs the
optimizer on every rank over identical adapters; ``ops.state`` returns them. The frozen base stays sharded in its
stored form; FSDP gathers each block again for its backward (and its recompute, with gradient checkpointing).
"""
