"""FSDP2 sharding of a diffusion model on the ranks: build on meta, shard, read each rank's rows, run a step on
each rank's share of the batch; and the host-side handle that calls it like a module."""
