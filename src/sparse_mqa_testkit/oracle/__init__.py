"""The oracle: the contract's forward and backward in float32 or float64. ``host`` is NumPy (the root of trust,
itself proved by finite differences); ``device`` is its torch twin for production-sized cases on a GPU (import
it as ``sparse_mqa_testkit.oracle.device``; this package does not import torch)."""

from .bf16 import bf16_roundtrip, bfloat16, round_bf16
from .host import backward, forward, to_numpy

__all__ = ["forward", "backward", "round_bf16", "bf16_roundtrip", "bfloat16", "to_numpy"]
