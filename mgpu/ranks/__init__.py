"""Rank processes: starting, calling, cancelling and cleaning up one worker per device, and the shared-memory
transport of tensors between the host and its ranks."""
