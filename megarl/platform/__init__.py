"""Where megarl runs: device selection, and the CPU shim that lets megatron-core run without CUDA."""

from megarl.platform.device import Platform, init_platform

__all__ = ["Platform", "init_platform"]
