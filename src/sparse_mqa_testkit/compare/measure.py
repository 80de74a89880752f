"""What a result measures against the float64 oracle: whole and per row, over the entries the oracle has finite.

Rows (``contract.Argument.rows``): a (query, head) of dq, out and lse, a KV row (b, j) of dkv, a head of d_sink.
Sums are float64 on the oracle's device, a slice of the leading dimension at a time (``COMPARE_BYTES``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import contract

COMPARE_BYTES = 1 << 30  # float64 temporaries of a comparison, per slice of the leading dimension


def bf16_ulp(x):
    """Spacing of bfloat16 values at |x| (float64 torch), at least the smallest subnormal 2^-133."""
    _, e = torch.frexp(x)
    ulp = torch.ldexp(torch.ones_like(x), (e - 8).to(torch.int32))
    return torch.where(x == 0, torch.full_like(x, 2.0 ** -133), ulp).clamp_min(2.0 ** -133)


def slices(t):
    """Slices of the leading dimension whose float64 copies stay within COMPARE_BYTES."""
    per = max(1, t[0].numel() * 8) if t.dim() and t.shape[0] else 1
    step = max(1, COMPARE_BYTES // per)
    return [slice(i, i + step) for i in range(0, t.shape[0], step)] if t.dim() else [slice(None)]


def whole_index(sl, idx) -> tuple:
    """An index into ``o[sl]`` as an index into ``o``."""
    idx = tuple(int(i) for i in idx)
    return (idx[0] + (sl.start or 0),) + idx[1:] if idx else idx


def finite_slices(a, o):
    """Per slice of the leading dimension (``slices``): (slice, the oracle in float64, where it is finite,
    kernel - oracle with 0 where it is not), on the oracle's device."""
    zero = torch.zeros((), dtype=torch.float64, device=o.device)
    for sl in slices(o):
        oo = o[sl].to(torch.float64)
        fin = torch.isfinite(oo)
        yield sl, oo, fin, torch.where(fin, a[sl].to(o.device, torch.float64) - oo, zero)


@dataclass(frozen=True)
class Nonfinite:
    """The first class of non-finite values whose positions differ between kernel and oracle."""

    label: str  # "NaN", "+inf" or "-inf"
    count: int
    index: tuple


def nonfinite_mismatch(a, o) -> Nonfinite | None:
    """The first class of NaN / +inf / -inf whose positions differ, else None."""
    for label, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        count, first = 0, None
        for sl in slices(o):
            bad = fn(a[sl]) != fn(o[sl])
            n = int(bad.sum())
            if n and first is None:
                first = whole_index(sl, torch.nonzero(bad)[0])
            count += n
        if count:
            return Nonfinite(label, count, first)
    return None


@dataclass
class Measure:
    """One result's errors. Per row (float64 tensors of the row shape): ``err2`` (kernel - oracle)^2, ``ref2``
    (bf16-output oracle - oracle)^2, ``o2`` oracle^2, ``n`` finite entries, ``ulps`` the largest difference in
    bf16 ulps (bf16 results). Whole result: ``norm`` of the oracle, ``err`` and ``ref_err`` relative to it
    (absolute when the oracle is all zero: ``mode``)."""

    rows: dict
    is_bf16: bool
    n_fin: int
    norm: float
    mode: str
    err: float
    ref_err: float

    @property
    def scale(self) -> float:
        return self.norm if self.norm > 0 else 1.0

    @property
    def max_ulps(self) -> float | None:
        return float(self.rows["ulps"].max()) if self.rows["ulps"].numel() and self.is_bf16 else None


def measure(name: str, a, o, r) -> Measure:
    """The per-row sums and whole-result errors of kernel ``a`` and bf16-output oracle ``r`` against the
    float64 oracle ``o`` (tensors of one shape)."""
    is_bf16 = contract.kernel_dtype(name) == "bfloat16"
    lead = contract.argument(name).rows
    out = {k: torch.zeros(o.shape[:lead], dtype=torch.float64, device=o.device) for k in ("err2", "ref2", "o2", "ulps")}
    out["n"] = torch.zeros(o.shape[:lead], dtype=torch.int64, device=o.device)
    red = tuple(range(lead, o.dim()))

    def total(x):
        return x.sum(red) if red else x

    for sl, oo, fin, d in finite_slices(a, o):
        rz = torch.where(fin, r[sl].to(o.device, torch.float64) - oo, 0.0)
        oz = torch.where(fin, oo, 0.0)
        out["err2"][sl], out["ref2"][sl], out["o2"][sl] = total(d * d), total(rz * rz), total(oz * oz)
        out["n"][sl] = total(fin.long())
        if is_bf16:
            ulps = (d.abs() / bf16_ulp(torch.maximum(a[sl].to(o.device, torch.float64).abs(), oo.abs())))
            ulps = ulps.masked_fill(~fin, 0)
            out["ulps"][sl] = ulps.amax(red) if red else ulps
    norm = math.sqrt(float(out["o2"].sum()))
    scale = norm if norm > 0 else 1.0
    return Measure(rows=out, is_bf16=is_bf16, n_fin=int(out["n"].sum()), norm=norm,
                   mode="relative" if norm > 0 else "absolute", err=math.sqrt(float(out["err2"].sum())) / scale,
                   ref_err=math.sqrt(float(out["ref2"].sum())) / scale)


def largest(sl, x) -> tuple:
    """(the largest value of ``x``, shaped like ``o[sl]``; its index into ``o``)."""
    flat = int(torch.argmax(x.reshape(-1)))
    return float(x.reshape(-1)[flat]), whole_index(sl, torch.unravel_index(torch.tensor(flat), tuple(x.shape)))


@dataclass(frozen=True)
class Elements:
    """The elementwise view of a failure: how many elements exceed allowed x (|oracle| + rms), the worst of them
    (index, its excess over its bound) and the greatest absolute difference."""

    mismatches: int
    worst_index: tuple
    worst_excess: float
    top_diff: float
    top_index: tuple


def elements(a, o, allowed: float, m: Measure) -> Elements:
    rms = m.norm / math.sqrt(max(m.n_fin, 1))
    mism, worst, top = 0, (-1.0, None), (-1.0, None)
    for sl, oo, fin, d in finite_slices(a, o):
        d = d.abs()
        bound = allowed * (torch.where(fin, oo, 0.0).abs() + rms) if m.mode == "relative" else \
            torch.full_like(oo, allowed)
        excess = torch.nan_to_num(d / bound.clamp_min(1e-300), nan=math.inf)
        mism += int((d > bound).sum())
        worst = max(worst, largest(sl, excess), key=lambda t: t[0])  # ties keep the first
        top = max(top, largest(sl, d), key=lambda t: t[0])
    return Elements(mism, worst[1], worst[0], top[0], top[1])
