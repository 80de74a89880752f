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
    if a.dtype == bfloat16:
        t = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype is not None:
        t = t.to(dtype)
    return t.to(device)


def input_tensors(x: dict, device="cpu") -> dict:
    """An inputs dict (``Case.inputs()``'s keys) as torch tensors on ``device``; sm_scale and d_v stay numbers."""
    return {k: (v if k in ("sm_scale", "d_v") else to_torch(v, device)) for k, v in x.items()}


def case_tensors(case, device="cpu") -> dict:
    """``case.inputs()`` as torch tensors with kernel dtypes on ``device`` (sm_scale and d_v stay numbers)."""
    return input_tensors(case.inputs(), device)
