"""The device oracle (torch, float64) agrees with the NumPy oracle, the root of trust, on drawn cases: every
mode of the contract (sinks of both infinities, empty rows, topk_length, duplicates, out-of-range indices),
also when it cuts the queries into chunks; and poisoned KV rows no valid slot names never reach its results."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from sparse_mqa_testkit import oracle
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.strategies import cases
from sparse_mqa_testkit.cases.tensors import case_tensors
from sparse_mqa_testkit.checks.guards import unreferenced_rows
from sparse_mqa_testkit.compare import Expected
from sparse_mqa_testkit.oracle import device as device_oracle

TOL = dict(rtol=1e-12, atol=1e-12)


def _both(case, chunk_bytes=device_oracle.CHUNK_BYTES, kv=None):
    t = case_tensors(case)
    if kv is not None:
        t["kv"] = kv
    kw = dict(sm_scale=t["sm_scale"], d_v=t["d_v"], attn_sink=t["attn_sink"], topk_length=t["topk_length"])
    x = case.inputs()
    nkw = dict(kw, attn_sink=x["attn_sink"], topk_length=x["topk_length"])
    dev = device_oracle.forward(t["q"], t["kv"], t["indices"], chunk_bytes=chunk_bytes, **kw) + \
        device_oracle.backward(t["q"], t["kv"], t["indices"], t["grad_out"], chunk_bytes=chunk_bytes, **kw)
    ref = oracle.forward(x["q"], x["kv"], x["indices"], dtype=np.float64, **nkw) + \
        oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], dtype=np.float64, **nkw)
    return dev, ref


def _agree(dev, ref, grad_scale=1.0):
    """grad_scale: the largest |grad_out|; the gradients' absolute floor scales with it (they are linear in it,
    and where they cancel to ~0 what is left is rounding of terms that size)."""
    for name, d, r in zip(("out", "lse", "dq", "dkv", "d_sink"), dev, ref):
        if r is None:
            assert d is None, name
            continue
        assert d.dtype == torch.float64 and tuple(d.shape) == r.shape, name
        np.testing.assert_array_equal(np.isposinf(d.numpy()), np.isposinf(r), err_msg=name)
        np.testing.assert_array_equal(np.isnan(d.numpy()), np.isnan(r), err_msg=name)
        fin = np.isfinite(r)
        scale = max(1.0, float(np.abs(r[fin]).max(initial=0.0)))
        if name in ("dq", "dkv", "d_sink"):
            scale = max(scale, grad_scale)
        np.testing.assert_allclose(d.numpy()[fin], r[fin], rtol=TOL["rtol"], atol=TOL["atol"] * scale,
                                   err_msg=name)


@settings(max_examples=60, deadline=None)
@given(case=cases(max_s=6, max_skv=12, max_h=5, max_l=10))
def test_agrees_with_the_numpy_oracle(case):
    _agree(*_both(case), grad_scale=float(np.abs(case.inputs()["grad_out"].astype(np.float64)).max()))


@pytest.mark.parametrize("case", [
    Case(B=2, S=7, Skv=9, H=3, L=6, sink="mixed", topk="random", invalid="mixed", duplicates=True, seed=1),
    Case(B=1, S=5, Skv=4, H=2, L=9, sink="pos_inf", invalid="empty_rows", seed=2),
    Case(B=2, S=3, Skv=6, H=17, L=5, Dqk=24, Dv=16, sink="finite", invalid="out_of_range", seed=3),
])
def test_chunked_queries_give_the_same_results(case):
    """One query row per chunk: out, lse, dq and dkv keep their bits (on CPU, dkv's sums run in the same
    order either way); d_sink sums per chunk, so it agrees to rounding."""
    one_row = case.L * case.Dqk * 8
    dev, ref = _both(case, chunk_bytes=one_row)
    _agree(dev, ref)
    whole, _ = _both(case)
    for name, d, w in zip(("out", "lse", "dq", "dkv"), dev, whole):
        assert torch.equal(d, w), name


def test_poisoned_unreferenced_rows_never_reach_the_results():
    case = Case(S=4, Skv=32, H=2, L=4, sink="finite", invalid="holes", seed=5)
    unref = unreferenced_rows(Expected(case))
    assert unref.any()
    kv = case_tensors(case)["kv"].clone()
    kv[unref] = math.nan
    dev, ref = _both(case, kv=kv)
    _agree(dev, ref)


def test_bad_inputs_are_named():
    t = case_tensors(Case(seed=1))
    with pytest.raises(ValueError, match="grad_out is required"):
        device_oracle.backward(t["q"], t["kv"], t["indices"], None, sm_scale=1.0, d_v=t["d_v"])
    with pytest.raises(ValueError, match="sm_scale must be finite"):
        device_oracle.forward(t["q"], t["kv"], t["indices"], sm_scale=math.inf, d_v=t["d_v"])
    with pytest.raises(ValueError, match="indices must have shape"):
        device_oracle.forward(t["q"], t["kv"], t["indices"][:, :1], sm_scale=1.0, d_v=t["d_v"])
