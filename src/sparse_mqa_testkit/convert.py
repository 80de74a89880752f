"""NumPy <-> torch at the package's edges (bf16 goes through float32, which is exact both ways)."""

from __future__ import annotations

import numpy as np
import torch

from .oracle.bf16 import bfloat16


def to_torch(a, device="cpu", dtype=None):
    """A NumPy array (ml_dtypes bf16 included) as a torch tensor on ``device``; ``dtype`` casts after."""
    if a is None:
        return None
    a = np.asarray(a)
    if not a.flags.writeable:  # torch shares memory with the array it is given; a read-only one is copied
        a = a.copy()
    if a.dtype == bfloat16:
        t = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype is not None:
        t = t.to(dtype)
    return t.to(device)


def input_tensors(x: dict, device="cpu") -> dict:
    """An inputs dict (``Case.inputs()``'s keys) as torch tensors on ``device``; numbers (sm_scale, d_v) stay."""
    return {k: (to_torch(v, device) if isinstance(v, np.ndarray) else v) for k, v in x.items()}
