"""The contract module's helpers: base-2 LSE conversions, the validity mask, dtype and shape validation."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.contract import Dims, lse_from_base2, lse_to_base2, valid_mask

finite = st.floats(-60, 60, allow_nan=False, allow_infinity=False)


# ---- base-2 LSE -------------------------------------------------------------------------------------------------
@given(lse=finite, gap=st.floats(-60, 8))
def test_base2_round_trip_with_a_finite_sink(lse, gap):
    sink = lse + gap
    lse2 = lse_to_base2(np.array([lse]), np.array([sink]))
    # what the kernel keeps: log2(e^lse + e^sink), computed here independently
    m = max(lse, sink)
    assert lse2[0] == pytest.approx(math.log2(math.exp(lse - m) + math.exp(sink - m)) + m / math.log(2),
                                    rel=1e-14, abs=1e-13)
    back = lse_from_base2(lse2, np.array([sink]))[0]
    # recovering lse means subtracting e^sink from the total: the error grows like e^(sink - lse)
    tol = 8e-16 * (abs(m) + 1) * (1 + math.exp(gap))
    assert abs(back - lse) <= tol, (back, lse, tol)


@given(lse=st.lists(finite, min_size=1, max_size=8))
def test_base2_round_trip_without_a_sink_or_with_minus_inf(lse):
    lse = np.array(lse)
    assert np.array_equal(lse_to_base2(lse), lse * contract.LOG2E)
    neg = np.full(lse.shape, -np.inf)
    assert np.array_equal(lse_to_base2(lse, neg), lse_to_base2(lse)), "a -inf sink must change nothing"
    np.testing.assert_allclose(lse_from_base2(lse_to_base2(lse)), lse, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(lse_from_base2(lse_to_base2(lse, neg), neg), lse, rtol=1e-15, atol=1e-15)


def test_base2_empty_rows_and_infinite_sinks():
    # rows: [empty, finite] x heads: [no-mass sink, finite sink, +inf sink]
    lse = np.array([[np.inf, np.inf, np.inf], [1.5, 1.5, 1.5]])
    sink = np.array([-np.inf, 0.25, np.inf])
    lse2 = lse_to_base2(lse, sink)
    assert np.isposinf(lse2[0]).all(), "an empty row stays +inf, whatever the sink"
    assert lse2[1, 0] == 1.5 * contract.LOG2E
    assert lse2[1, 1] == pytest.approx(np.logaddexp(1.5, 0.25) * contract.LOG2E, rel=1e-15)
    assert np.isposinf(lse2[1, 2])
    back = lse_from_base2(lse2, sink)
    assert np.isposinf(back[0, :2]).all(), "+inf (empty row) maps back to +inf"
    assert back[1, 0] == pytest.approx(1.5, rel=1e-15)
    assert back[1, 1] == pytest.approx(1.5, rel=1e-14)
    # documented: with a +inf sink the row's own mass is lost, so the inverse is NaN there
    assert np.isnan(back[:, 2]).all()
    assert lse_from_base2(lse2[..., :2], None).shape == (2, 2)


# ---- the invalid-index rule -------------------------------------------------------------------------------------
@settings(max_examples=50)
@given(b=st.integers(1, 2), s=st.integers(1, 4), l_=st.integers(1, 6), skv=st.integers(1, 8),
       seed=st.integers(0, 2**32 - 1), topk=st.booleans())
def test_valid_mask_is_the_rule_slot_by_slot(b, s, l_, skv, seed, topk):
    rng = np.random.default_rng(seed)
    pool = np.array([-(2**31), -2, -1, skv, skv + 1, 2**31 - 1] + list(range(skv)), dtype=np.int64)
    idx = pool[rng.integers(0, len(pool), size=(b, s, l_))].astype(np.int32)
    tl = rng.integers(-1, l_ + 3, size=(b, s)).astype(np.int32) if topk else None
    mask = valid_mask(idx, skv, tl)
    assert mask.shape == idx.shape and mask.dtype == bool
    for bi in range(b):
        for i in range(s):
            for t in range(l_):
                want = 0 <= int(idx[bi, i, t]) < skv and (tl is None or t < int(tl[bi, i]))
                assert mask[bi, i, t] == want, (bi, i, t, idx[bi, i, t], None if tl is None else tl[bi, i])


# ---- dtypes and shapes ------------------------------------------------------------------------------------------
def test_kernel_dtypes_table():
    assert contract.KERNEL_DTYPES == {
        "q": "bfloat16", "kv": "bfloat16", "out": "bfloat16", "grad_out": "bfloat16", "dq": "bfloat16",
        "dkv": "bfloat16", "lse": "float32", "attn_sink": "float32", "d_sink": "float32",
        "indices": "int32", "topk_length": "int32"}


def test_validate_kernel_dtypes_messages():
    bf16 = np.zeros(2, ml_dtypes.bfloat16)
    contract.validate_kernel_dtypes(q=bf16, kv=bf16, grad_out=bf16, lse=np.zeros(2, np.float32),
                                    indices=np.zeros(2, np.int32), attn_sink=None)
    with pytest.raises(ValueError, match=r"^grad_out must be bfloat16, got float16$"):
        contract.validate_kernel_dtypes(grad_out=np.zeros(2, np.float16))
    with pytest.raises(ValueError, match=r"^indices must be int32, got int64$"):
        contract.validate_kernel_dtypes(indices=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"^lse must be float32, got bfloat16$"):
        contract.validate_kernel_dtypes(lse=bf16)
    with pytest.raises(ValueError, match=r"^attn_sink must be float32, got float64$"):
        contract.validate_kernel_dtypes(q=bf16, attn_sink=np.zeros(2))


def test_validate_kernel_dtypes_reads_torch_dtypes():
    torch = pytest.importorskip("torch", reason="torch dtype names need torch")
    contract.validate_kernel_dtypes(q=torch.zeros(2, dtype=torch.bfloat16),
                                    topk_length=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^q must be bfloat16, got float32$"):
        contract.validate_kernel_dtypes(q=torch.zeros(2))
    assert contract.dtype_name(torch.bfloat16) == "bfloat16"


def test_dtype_name():
    assert contract.dtype_name(np.zeros(1, ml_dtypes.bfloat16)) == "bfloat16"
    assert contract.dtype_name(np.float32) == "float32"
    assert contract.dtype_name(np.dtype(np.int32)) == "int32"


def test_dims_shape():
    d = Dims(B=2, S=3, H=4, Dqk=10, Dv=6, Skv=7, L=5)
    assert {n: d.shape(n) for n in ("q", "dq", "kv", "dkv", "indices", "topk_length", "attn_sink", "d_sink",
                                    "out", "grad_out", "lse")} == {
        "q": (2, 3, 4, 10), "dq": (2, 3, 4, 10), "kv": (2, 7, 10), "dkv": (2, 7, 10), "indices": (2, 3, 5),
        "topk_length": (2, 3), "attn_sink": (4,), "d_sink": (4,), "out": (2, 3, 4, 6),
        "grad_out": (2, 3, 4, 6), "lse": (2, 3, 4)}
    with pytest.raises(KeyError):
        d.shape("bogus")


def test_validate_shapes_returns_dims():
    q = np.zeros((2, 3, 4, 10), np.float32)
    kv = np.zeros((2, 7, 10), np.float32)
    idx = np.zeros((2, 3, 5), np.int32)
    assert contract.validate_shapes(q, kv, idx, d_v=6) == Dims(B=2, S=3, H=4, Dqk=10, Dv=6, Skv=7, L=5)
    with pytest.raises(ValueError, match=r"^lse must have shape \(2, 3, 4\)"):
        contract.validate_shapes(q, kv, idx, d_v=6, lse=np.zeros((2, 3, 5), np.float32))
    with pytest.raises(ValueError, match=r"^out must have rank 4"):
        contract.validate_shapes(q, kv, idx, d_v=6, out=np.zeros((2, 3, 4), np.float32))


@pytest.mark.parametrize("bad, pattern", [(math.nan, "finite"), (math.inf, "finite"), ("1", "a float, got str"),
                                          (None, "a float, got NoneType"), (False, "a float, got bool")])
def test_validate_sm_scale(bad, pattern):
    assert contract.validate_sm_scale(np.float32(0.25)) == 0.25
    assert contract.validate_sm_scale(2) == 2.0
    with pytest.raises(ValueError, match=rf"^sm_scale must be {pattern}"):
        contract.validate_sm_scale(bad)


# ---- an empty row's lse: +inf, and -inf taken as the same ------------------------------------------------------
def test_neg_inf_lse_is_an_empty_row_like_pos_inf():
    """-inf (the log of zero mass) gives what +inf gives: no sink mass, no kernel mass; never NaN, also with a
    -inf sink (logaddexp(-inf, -inf) = -inf made sink - denominator NaN)."""
    import torch

    sink = np.array([0.3, -np.inf, np.inf], dtype=np.float32)
    pos = np.full((1, 1, 3), np.inf, dtype=np.float32)
    for lse in (pos, -pos):
        p = contract.sink_probability(lse, sink)
        assert np.array_equal(p, [[[0.0, 0.0, 1.0]]]), p
        assert np.array_equal(contract.lse_to_base2(lse, sink), pos * np.float32(contract.LOG2E))
        assert np.isposinf(contract.lse_to_base2(lse)).all()
        t = contract.sink_probability(torch.from_numpy(lse), torch.from_numpy(sink))
        assert torch.equal(t, torch.tensor([[[0.0, 0.0, 1.0]]]))


def test_the_suite_hands_neg_inf_to_a_backward_for_empty_rows():
    from sparse_mqa_testkit.backends.reference import ReferenceBackend
    from sparse_mqa_testkit.cases import Case
    from sparse_mqa_testkit.compare import Expected

    case = Case(S=6, invalid="empty_rows", sink="neg_inf", empty_lse="neg_inf", seed=3)
    lse = Expected.for_backend(ReferenceBackend(), case).call()["lse"]
    assert bool(lse.isneginf().any()) and not bool(lse.isposinf().any())
    assert "empty_lse='neg_inf'" in case.repro() and "empty_lse=neg_inf" in case.describe()


def test_referenced_rows_follow_the_contract_in_numpy_and_torch():
    import torch

    idx = np.array([[[0, 3, 3, -1], [5, 2, 9, 1]], [[4, 4, 0, 2], [-7, 1, 2, 3]]], dtype=np.int32)
    tl = np.array([[4, 2], [0, 3]], dtype=np.int32)
    want = np.zeros((2, 6), bool)
    valid = contract.valid_mask(idx, 6, tl)
    for b, i, t in zip(*np.nonzero(valid)):
        want[b, idx[b, i, t]] = True
    assert want.tolist() == [[True, False, True, True, False, True], [False, True, True, False, False, False]]
    assert np.array_equal(contract.referenced_rows(idx, tl, 6), want)
    got = contract.referenced_rows(torch.from_numpy(idx), torch.from_numpy(tl), 6)
    assert got.dtype == torch.bool and np.array_equal(got.numpy(), want)
