"""Round to bfloat16, so the oracle is fed (and compared on) exactly what a kernel sees."""

from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)


def round_bf16(x) -> np.ndarray:
    """Round-to-nearest-even to bfloat16; returns an ``ml_dtypes.bfloat16`` array (NaN and inf kept)."""
    return np.asarray(x).astype(bfloat16)


def bf16_roundtrip(x, dtype=np.float32) -> np.ndarray:
    """``x`` rounded to bfloat16 and widened back to ``dtype``: the values a bf16 output can hold."""
    return round_bf16(x).astype(dtype)
