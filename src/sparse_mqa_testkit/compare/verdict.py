"""The verdict on a kernel's results: structure (shape, dtype, device, None where the contract says), the
positions of NaN / inf, then the error model's measure against its allowance, whole and row by row.

A result (or row) within one bf16 ulp of the exact value everywhere passes too: the best a bf16 output can do,
even where the exact value is representable and the output rounding is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import contract
from . import messages
from .measure import elements, measure, nonfinite_mismatch
from .model import K_DEFAULT, allowance, floors_for

ULP_PASS = 1.5  # differences between bf16 values of one binade are whole ulps: < 1.5 means at most one


@dataclass(frozen=True)
class Verdict:
    """whole_ratio: the whole result's measure over its allowance (or within an ulp); row_ratio: the worst row's;
    ratio: the larger; worst_row: its index, error, allowed, norm, and how many rows there are."""

    whole_ratio: float
    row_ratio: float
    rows_over: int
    worst_row: dict

    @property
    def ratio(self) -> float:
        return max(self.whole_ratio, self.row_ratio)


def verdict(m, al) -> Verdict:
    whole = m.err / al.allowed if al.allowed > 0 else (0.0 if m.err == 0 else math.inf)
    if m.max_ulps is not None:
        whole = min(whole, m.max_ulps / ULP_PASS)
    n_rows = m.rows["o2"].numel() if m.mode == "relative" else 0  # an all-zero oracle has no row scale
    if not n_rows:
        return Verdict(whole, 0.0, 0, {"index": (), "ratio": 0.0, "rows": 0, "error": 0.0, "allowed": 0.0,
                                       "norm": 0.0})
    row_err = m.rows["err2"].sqrt()
    ratio = torch.where(al.rows > 0, row_err / al.rows.clamp_min(1e-300), torch.where(row_err > 0, math.inf, 0.0))
    if m.is_bf16:
        ratio = torch.minimum(ratio, m.rows["ulps"] / ULP_PASS)
    flat = int(torch.argmax(ratio.reshape(-1)))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(ratio.shape)))
    worst = float(ratio.reshape(-1)[flat])
    return Verdict(whole, worst, int((ratio >= 1).sum()),
                   {"index": index, "ratio": worst, "rows": n_rows, "error": float(row_err.reshape(-1)[flat]),
                    "allowed": float(al.rows.reshape(-1)[flat]),
                    "norm": float(m.rows["o2"].sqrt().reshape(-1)[flat])})


def _f64(x):
    """A tensor (detached) or array as torch; arrays become float64 CPU tensors (bf16 widens exactly)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.from_numpy(np.array(x, dtype=np.float64))


def compare_tensor(name: str, kernel, oracle64, ref64, *, k: float = K_DEFAULT, floor: float | None = None,
                   terms: dict | None = None):
    """Compare one result with the float64 oracle under the error model, over the whole result and per row.

    ref64: the bf16-output oracle's result; terms: the error model's squared errors per row
    (``error_model.row_terms``), none meaning zero; k = inf judges the structure and non-finite positions only.
    Returns (entry, problem): entry has error, allowed, ratio (the larger of the whole result's and the worst
    row's), reference_error, floor, k, mode, worst_row (index, error, allowed, ratio), mismatches, numel,
    worst_index, worst_kernel, worst_oracle; problem is a message block, or None when it passes.
    """
    a, o, r = _f64(kernel), _f64(oracle64), _f64(ref64)
    base = floors_for(name, floor, contract.kernel_dtype(name) == "bfloat16")[0]
    entry = {"error": math.inf, "allowed": base, "ratio": math.inf, "reference_error": 0.0, "floor": base, "k": k,
             "numel": int(o.numel())}
    if tuple(a.shape) != tuple(o.shape):
        return entry, f"{name}: shape {tuple(a.shape)} is not the oracle's {tuple(o.shape)}"
    nf = nonfinite_mismatch(a, o)
    if nf is not None:
        entry.update(mismatches=nf.count, worst_index=nf.index, worst_kernel=float(a[nf.index]),
                     worst_oracle=float(o[nf.index]), mode="nonfinite")
        return entry, messages.nonfinite(name, nf, o.numel(), a, o)
    if math.isinf(k):  # no bound on the values: the structure and the nonfinite positions only
        entry.update(error=0.0, allowed=math.inf, ratio=0.0, mode="nonfinite only")
        return entry, None
    m = measure(name, a, o, r)
    al = allowance(name, m, terms, k=k, floor=floor)
    v = verdict(m, al)
    entry.update(error=m.err, allowed=al.allowed, reference_error=m.ref_err, mode=m.mode,
                 delta_error=al.extras["Delta"], repeat_error=al.extras["repeated rows"], operand_error=al.operand,
                 whole_ratio=v.whole_ratio, ratio=v.ratio, rows_over=v.rows_over, worst_row=v.worst_row)
    if m.max_ulps is not None:
        entry["max_ulps"] = m.max_ulps
    if v.ratio < 1:
        return entry, None
    el = elements(a, o, al.allowed, m)
    entry.update(mismatches=el.mismatches, worst_index=el.worst_index, worst_kernel=float(a[el.worst_index]),
                 worst_oracle=float(o[el.worst_index]))
    return entry, messages.over_tolerance(name, m, al, v, el, a, o)


def structural_problem(name: str, value, expected_shape, *, device: str | None = None) -> str | None:
    """Shape / dtype / device of one result against the contract, as a problem line (None when fine)."""
    want_dtype = contract.kernel_dtype(name)
    if value is None:
        return f"{name}: missing (got None), expected a {want_dtype} tensor of shape {tuple(expected_shape)}"
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return f"{name}: expected a tensor, got {type(value).__name__}"
    shape = tuple(int(d) for d in value.shape)
    if shape != tuple(expected_shape):
        return f"{name}: shape {shape} is not the contract's {tuple(expected_shape)}"
    got = contract.dtype_name(value)
    if got != want_dtype:
        return f"{name}: dtype {got} is not the contract's {want_dtype}"
    if device is not None and hasattr(value, "device"):
        if str(value.device).split(":")[0] != str(device).split(":")[0]:
            return f"{name}: on device {value.device}, expected {device} like the inputs"
    return None


def compare_outputs(results: dict, expected, *, k=K_DEFAULT, floor=None, device=None):
    """Structure + error model for named results (``{"dq": .., "dkv": .., "d_sink": ..}`` or out, lse) against
    ``expected`` (``compare.Expected``). A result the contract ties to an argument (d_sink to attn_sink) must be
    None exactly when that argument is. Returns (per_tensor, problems, worst_ratio)."""
    dims = expected.case.dims
    per_tensor, problems, worst = {}, [], 0.0
    floors = floor if isinstance(floor, dict) else {n: floor for n in results}
    for name, val in results.items():
        tied = contract.argument(name).with_arg
        if tied is not None and expected.inputs.get(tied) is None:
            if val is not None:
                problems.append(f"{name}: must be None when {tied} is None, got a tensor")
                per_tensor[name] = {"error": math.inf, "allowed": 0.0, "ratio": math.inf}
                worst = math.inf
            continue
        prob = structural_problem(name, val, dims.shape(name), device=device)
        if prob:
            problems.append(prob)
            per_tensor[name] = {"error": math.inf, "allowed": 0.0, "ratio": math.inf, "problem": prob}
            worst = math.inf
            continue
        entry, prob = compare_tensor(name, val, expected.exact[name], expected.rounded[name], k=k,
                                     floor=floors.get(name), terms=expected.terms.get(name))
        per_tensor[name] = entry
        worst = max(worst, entry["ratio"])
        if prob:
            problems.append(prob)
    return per_tensor, problems, worst
