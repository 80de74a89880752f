"""The oracle's arithmetic: float32 against float64 within a stated error bound; any float input dtype.

The float32 bound (first-order rounding analysis, u = 2**-24):

    A     = scale * max over rows, heads and valid slots of sum_d |q_d k_d|   (largest |score| before cancellation)
    kappa = (Dqk + Lc + 4) * (1 + 2 A),   Lc = the most valid slots in a row

A score is a length-Dqk dot product, so it is off by at most Dqk u A; exp turns that absolute error into a
relative error of P, and the softmax sum adds Lc u more: every P_t carries a relative error below kappa u, and so
does every quantity built from P with sums no longer than Dqk or Lc. Each result X is then within
C * kappa * u * M_X of its float64 value, M_X being a bound on the size of X's terms:

    lse    1 + max |lse|                                       (an absolute error, being a log)
    out    max |V|
    dq     2 scale max|kv| dPmax                               dPmax = max_row |dO|_2 * max_j |V_j|_2 >= |dP|, |Delta|
    dkv    nmax H (2 scale dPmax max|q| + max|dO|)             nmax  = most valid slots pointing at one kv row
    d_sink B S dPmax

with C = 4 for the first-order terms dropped. This is ~1e-4 relative at the drawn sizes: far above float32's
real error (the test records the worst ratio seen), far below a step slipping to bfloat16 (4e-3).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

from sparse_mqa_testkit import contract, oracle
from support import assert_bitwise, kwargs, run, small_cases

U32 = 2.0**-24
C = 4.0


def _magnitudes(case, x):
    q = x["q"].astype(np.float64)
    kv = x["kv"].astype(np.float64)
    go = x["grad_out"].astype(np.float64)
    idx = x["indices"]
    valid = contract.valid_mask(idx, case.Skv, x["topk_length"])
    safe = np.where(valid, idx, 0)
    k = kv[np.arange(case.B)[:, None, None], safe]  # [B,S,L,Dqk]
    a = case.scale * np.einsum("bshd,bsld->bshl", np.abs(q), np.abs(k))
    a = float(np.where(valid[:, :, None], a, 0).max(initial=0))
    lc = int(valid.sum(-1).max(initial=0))
    kappa = (case.Dqk + lc + 4) * (1 + 2 * a)
    v = kv[..., : case.Dv]
    dpmax = float(np.linalg.norm(go, axis=-1).max() * np.linalg.norm(v, axis=-1).max())
    counts = np.zeros((case.B, case.Skv), int)
    b = np.broadcast_to(np.arange(case.B)[:, None, None], idx.shape)
    np.add.at(counts, (b[valid], idx[valid]), 1)
    nmax = int(counts.max(initial=0))
    mags = {
        "out": float(np.abs(v).max()),
        "dq": 2 * case.scale * float(np.abs(kv).max()) * dpmax,
        "dkv": nmax * case.H * (2 * case.scale * dpmax * float(np.abs(q).max()) + float(np.abs(go).max())),
        "d_sink": case.B * case.S * dpmax,
    }
    return kappa, mags


WORST = {"ratio": 0.0}


@settings(max_examples=250, deadline=None)
@given(case=small_cases())
def test_float32_within_the_stated_bound_of_float64(case):
    x = case.inputs()
    r32, r64 = run(x, np.float32), run(x, np.float64)
    kappa, mags = _magnitudes(case, x)
    for k in ("out", "lse", "dq", "dkv", "d_sink"):
        a, b = r32[k], r64[k]
        if b is None:
            assert a is None
            continue
        assert a.dtype == np.float32 and b.dtype == np.float64
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(b), err_msg=f"{k}: +inf positions")
        fin = np.isfinite(b)
        m = 1 + float(np.abs(b[fin]).max(initial=0)) if k == "lse" else mags[k]
        bound = C * kappa * U32 * m
        err = float(np.abs(a[fin].astype(np.float64) - b[fin]).max(initial=0))
        WORST["ratio"] = max(WORST["ratio"], err / bound if bound else 0.0)
        assert err <= bound, f"{k}: float32 is {err:.3e} from float64, bound {bound:.3e} (kappa {kappa:.1f})"


@settings(max_examples=40, deadline=None)
@given(case=small_cases().map(lambda c: c.replace(magnitude="unit")))  # float16 holds neither 2^20 nor 2^-20 N(0,1)
def test_any_float_input_dtype_is_widened_exactly(case):
    """bf16, float16, float32 and float64 inputs holding the same values give bitwise the same results, in the
    asked dtype; float64 results really are float64."""
    x = case.inputs()
    # values every input dtype holds exactly: float16-rounded bf16 values (both round-trip through float64)
    vals = {k: x[k].astype(np.float16).astype(np.float64) for k in ("q", "kv", "grad_out")}
    if x["attn_sink"] is not None:
        vals["attn_sink"] = x["attn_sink"].astype(np.float16).astype(np.float64)
    vals = {k: v.astype(ml_dtypes.bfloat16).astype(np.float64) for k, v in vals.items()}
    for dtype in (np.float32, np.float64):
        want = run({**x, **vals}, dtype)
        for k, v in want.items():
            assert v is None or v.dtype == dtype, f"{k} is {v.dtype}, asked {np.dtype(dtype).name}"
        for in_dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
            y = {**x, **{k: v.astype(in_dtype) for k, v in vals.items()}}
            assert_bitwise(run(y, dtype), want, f"{np.dtype(in_dtype).name} inputs, {np.dtype(dtype).name} math")


def test_torch_tensors_are_read_like_numpy():
    torch = pytest.importorskip("torch", reason="reading torch tensors needs torch")
    from sparse_mqa_testkit.cases import Case

    x = Case(B=2, S=3, Skv=7, H=3, L=5, sink="mixed", topk="random", invalid="mixed", seed=3).inputs()
    t = {k: (torch.tensor(v.astype(np.float32)).to(torch.bfloat16) if v is not None and v.dtype == ml_dtypes.bfloat16
             else None if v is None else torch.tensor(v)) for k, v in x.items() if k not in ("sm_scale", "d_v")}
    y = {**x, **t}
    assert_bitwise(run(y, np.float32), run(x, np.float32), "torch tensors")


def test_float64_is_float64_arithmetic():
    """A change below float32's resolution must move float64 results (and may not move float32 ones)."""
    from sparse_mqa_testkit.cases import Case

    x = Case(B=1, S=2, Skv=6, H=2, L=4, sink="finite", seed=9).inputs()
    q = x["q"].astype(np.float64)
    nudged = {**x, "q": q * (1 + 1e-12)}
    a = oracle.forward(q, x["kv"], x["indices"], dtype=np.float64, **kwargs(x))[0]
    b = oracle.forward(nudged["q"], x["kv"], x["indices"], dtype=np.float64, **kwargs(x))[0]
    assert a.dtype == np.float64 and not np.array_equal(a, b)


def teardown_module(module):
    print(f"\nfloat32 vs float64: worst error / bound = {WORST['ratio']:.2e}")
