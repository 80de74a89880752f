"""What a result may be off by: k times the error a bf16-output pipeline has to make, plus a small floor, for
the whole result and for each of its rows (``error_model`` gives the terms beside the output rounding).

    allowed = k * max(hypot(rounding, delta, repeats), operands) + floor

rounding is the bf16-output oracle's own error (float32 math rounded to the output's kernel dtype); delta,
repeats and operands are the error model's terms. Output rounding is about as large as the operands' while a
result's terms do not cancel (k was calibrated there); where they cancel the operands' is the larger, and k
applies to it instead. The floor is relative to the larger of the result's norm and its ``unsummed`` norm (a
float32 sum is accurate relative to that); a row's floor is the same on the row's own (or unsummed) norm plus
the same share of a typical row's norm, so a row that is nearly zero is not held to a relative measure it
cannot have. Calibration and surveys: BENCHMARKS.md, "Tolerance model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .error_model import ALL_TERMS
from .measure import Measure

K_DEFAULT = 2.5  # real bf16 kernels land at ~1.4x the output rounding (BENCHMARKS.md)

# Relative-L2 floors per result: fp32 math error with a 10x margin (lse: a few float32 ulps of exp/log).
FLOORS = {"dq": 1e-5, "dkv": 1e-5, "out": 1e-5, "d_sink": 1e-5, "lse": 1e-5}
# bf16 results only, divided by sqrt(number of finite entries): one 2^-7 relative unit spread over the entries.
# A result of a handful of entries can have a luckily exact output rounding while a kernel's rounding of P and
# dS before its matmuls is not (3.9e-3 at n = 4, ~0 at production sizes).
SMALL_SAMPLE = 2.0 ** -7


@dataclass
class Allowance:
    """``allowed`` for the whole result and ``rows`` (a tensor of the row shape), with the model's parts: the
    whole result's ``model_err`` (relative) built from ``ref_err``, ``extras`` (Delta, repeated rows) and
    ``operand``, and ``floor`` (the whole result's, after the unsummed spread and the small-sample term)."""

    k: float
    allowed: float
    model_err: float
    extras: dict
    operand: float
    floor: float
    rows: torch.Tensor


def floors_for(name: str, floor, is_bf16: bool) -> tuple[float, float]:
    """(relative floor, small-sample coefficient): the defaults for ``name``, or ``floor`` alone when given."""
    if floor is None:
        return FLOORS.get(name, 1e-5), (SMALL_SAMPLE if is_bf16 else 0.0)
    return float(floor), 0.0


def allowance(name: str, m: Measure, terms: dict | None, *, k: float = K_DEFAULT, floor=None) -> Allowance:
    """The whole result's and every row's allowed error under the model. ``terms``: the error model's squared
    absolute errors per row ({"delta", "repeat", "operand", "unsummed"}); a missing one counts as zero."""
    base, small = floors_for(name, floor, m.is_bf16)
    rows = m.rows
    zero = torch.zeros_like(rows["o2"])
    t2 = {t: (terms or {}).get(t, zero).to(zero.device, torch.float64) for t in ALL_TERMS}
    scale = m.scale
    extras = {"Delta": math.sqrt(float(t2["delta"].sum())) / scale,
              "repeated rows": math.sqrt(float(t2["repeat"].sum())) / scale}
    operand = math.sqrt(float(t2["operand"].sum())) / scale
    # the whole result: output rounding and, independent of it, Delta from the bf16 out and coherent operand
    # rounding on repeated rows; or the operands' rounding where the result cancels
    model_err = max(math.hypot(m.ref_err, *extras.values()), operand)
    unsummed = (terms or {}).get("unsummed")
    u_norm = zero if unsummed is None else unsummed.to(zero.device, torch.float64).sqrt()
    spread = max(1.0, float(u_norm.square().sum().sqrt()) / scale)  # cancellation: the floor on the terms' norm
    whole_floor = base * spread + small / math.sqrt(max(m.n_fin, 1))
    # row by row: the same model on each row, the floor on the row's own norm plus a typical row's share
    n_rows = rows["o2"].numel() if m.mode == "relative" else 0
    row_norm = rows["o2"].sqrt()
    typical = m.norm / math.sqrt(max(n_rows, 1))
    row_model = torch.maximum((rows["ref2"] + t2["delta"] + t2["repeat"]).sqrt(), t2["operand"].sqrt())
    row_floor = base * (torch.maximum(row_norm, u_norm) + typical) + small / rows["n"].clamp_min(1).sqrt() * row_norm
    return Allowance(k=k, allowed=k * model_err + whole_floor, model_err=model_err, extras=extras,
                     operand=operand, floor=whole_floor, rows=k * row_model + row_floor)
