"""Shared by the oracle's proof tests (tests/test_oracle_*.py): run a Case through the oracle, small strategies."""

from __future__ import annotations

import numpy as np

from hypothesis import example

from sparse_mqa_testkit import oracle
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.strategies import cases

# Small sizes: every proof test runs hundreds of cases on one CPU core.
SMALL = dict(max_b=2, max_s=6, max_skv=12, max_h=5, max_l=10)


def small_cases(**kw):
    """Cases (configuration + seed) small enough for float64 finite differences and dense torch autograd."""
    return cases(**{**SMALL, **kw})


# Cases with every feature (mixed / +inf sinks, topk_length, far out-of-range values, duplicates, empty rows), so
# each run covers them whatever Hypothesis draws.
FEATURE_CASES = (
    Case(B=2, S=5, Skv=7, H=3, L=9, Dqk=16, Dv=8, sink="mixed", topk="random", invalid="mixed", duplicates=True,
         seed=10),
    Case(B=2, S=6, Skv=9, H=4, L=6, Dqk=24, Dv=16, sink="finite", topk="random", invalid="empty_rows",
         duplicates=True, seed=2),
    Case(B=1, S=4, Skv=5, H=2, L=8, Dqk=5, Dv=3, sink="pos_inf", invalid="out_of_range", duplicates=True,
         sm_scale=0.5, seed=2),
)


def every_feature(test):
    """``@example`` each of ``FEATURE_CASES`` on a ``@given(case=...)`` test."""
    for case in reversed(FEATURE_CASES):
        test = example(case=case)(test)
    return test


def kwargs(x: dict) -> dict:
    return dict(sm_scale=x["sm_scale"], d_v=x["d_v"], attn_sink=x["attn_sink"], topk_length=x["topk_length"])


def run(x: dict, dtype=np.float64) -> dict:
    """Forward and backward of the oracle on an inputs dict (as ``Case.inputs()`` makes)."""
    kw = kwargs(x)
    out, lse = oracle.forward(x["q"], x["kv"], x["indices"], dtype=dtype, **kw)
    dq, dkv, d_sink = oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], dtype=dtype, **kw)
    return {"out": out, "lse": lse, "dq": dq, "dkv": dkv, "d_sink": d_sink}


def assert_bitwise(got: dict, want: dict, what: str, keys=None) -> None:
    """np.array_equal on every result (NaN never equal), with the first differing position in the message."""
    for k in keys or want:
        a, b = got[k], want[k]
        if a is None or b is None:
            assert a is None and b is None, f"{what}: {k} is {a!r} vs {b!r}"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {k} {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if not np.array_equal(a, b):
            diff = np.argwhere(~((a == b) | (np.isnan(a) & np.isnan(b))))
            pos = tuple(diff[0])
            raise AssertionError(f"{what}: {k} differs at {len(diff)} / {a.size} positions, first {pos}: "
                                 f"{a[pos]!r} vs {b[pos]!r}")
