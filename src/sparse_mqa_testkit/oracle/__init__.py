"""The NumPy oracle: the contract's forward and backward in float32 or float64, and bf16 rounding helpers."""

from .bf16 import bf16_roundtrip, bfloat16, round_bf16
from .reference import backward, forward, to_numpy

__all__ = ["forward", "backward", "round_bf16", "bf16_roundtrip", "bfloat16", "to_numpy"]
