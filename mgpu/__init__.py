"""comfy-mgpu runtime: devices, sizing, partitioner, rank pool and FSDP sharding.

Host-independent: nothing in this package imports ComfyUI.
"""

__version__ = "0.1.0"
