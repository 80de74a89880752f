"""A case's tensors in torch on a device: ``Case.inputs()`` converted, or, for a ``large`` case, drawn by torch on
the device itself (``TorchDraws``, the twin of ``case.NumpyDraws``)."""

from __future__ import annotations

import numpy as np
import torch

from ..convert import input_tensors, to_torch
from .case import host_inputs
from .draws import draw_indices


def case_tensors(case, device="cpu") -> dict:
    """``case.inputs()`` as torch tensors with kernel dtypes on ``device`` (sm_scale and d_v stay numbers); a
    ``large`` case is drawn by torch on ``device`` instead (the same on every device of that kind)."""
    if case.large:
        return large_case_tensors(case, device)
    return input_tensors(host_inputs(case), device)


ROWS_PER_DRAW = 1 << 24  # elements of one chunk of random keys or normals: temporaries stay small


class TorchDraws:
    """``cases.NumpyDraws``'s twin: draws from a torch generator on a device, in chunks."""

    xp = torch

    def __init__(self, generator: torch.Generator, device):
        self.g, self.device = generator, torch.device(device)

    def random(self, shape):
        return torch.rand(shape, generator=self.g, device=self.device)

    def integers(self, low, high, shape):
        return torch.randint(low, high, shape, generator=self.g, device=self.device)

    def distinct(self, shape, n):
        *rows, k = shape
        out = torch.empty((*rows, k), dtype=torch.int64, device=self.device).reshape(-1, k)
        step = max(1, ROWS_PER_DRAW // n)
        for r in range(0, out.shape[0], step):
            m = min(step, out.shape[0] - r)
            out[r:r + m] = torch.rand((m, n), generator=self.g, device=self.device).argsort(-1)[:, :k]
        return out.reshape(*rows, k)

    def arange(self, n):
        return torch.arange(n, device=self.device)

    def array(self, values):
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def sort(self, x):
        return x.sort(-1).values

    def int32(self, x):
        return x.to(torch.int32)

    def int64(self, x):
        return x.to(torch.int64)

    def normal_bf16(self, shape, scale=None):
        """N(0, 1) in bf16, one leading index at a time; ``scale`` [shape[1]] multiplies along dim 1."""
        out = torch.empty(shape, dtype=torch.bfloat16, device=self.device)
        for i in range(shape[0]):
            x = torch.randn(shape[1:], generator=self.g, device=self.device)
            if scale is not None:
                x *= scale.view(-1, *([1] * (x.dim() - 1)))
            out[i] = x.to(torch.bfloat16)
        return out


def large_case_tensors(case, device) -> dict:
    """A large case's tensors, drawn by torch on ``device`` from the case's seed: q, kv, grad_out (scaled like
    ``Case.inputs``), the indices by ``cases.draw_indices``; topk_length and the sink from NumPy (they are
    small)."""
    g = torch.Generator(device=device).manual_seed(case.seed)
    draws = TorchDraws(g, device)
    B, S, Skv, H = case.B, case.S, case.Skv, case.H
    spread = torch.from_numpy(np.exp2(case.spread_exponents())).float().to(device)
    t = {"q": draws.normal_bf16((B, S, H, case.Dqk)), "kv": draws.normal_bf16((B, Skv, case.Dqk)),
         "grad_out": draws.normal_bf16((B, S, H, case.Dv), scale=spread), "indices": draw_indices(case, draws)}
    if case.q_bits():
        t["q"].mul_(2.0 ** case.q_bits())  # a power of two: exact in bf16
    rng = np.random.default_rng(case.seed)
    t["topk_length"] = to_torch(case.topk_lengths(rng), device)
    t["attn_sink"] = to_torch(case.sinks(rng), device)
    return {**t, "sm_scale": case.scale, "d_v": case.Dv}
