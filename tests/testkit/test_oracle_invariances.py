"""Invariances the oracle keeps BITWISE (np.array_equal), on drawn cases.

Each transformation changes the inputs without changing the math: the slots' order within a row, extra invalid
slots, extra heads that attend to nothing, extra query rows with no valid slot, and which invalid value an
invalid slot holds (or what a slot past topk_length holds). The oracle canonicalises its slots (sorted, cut to
the longest valid run), so none of these may move a single bit.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mqa_testkit import contract
from support import assert_bitwise, run, small_cases


def _invalid_values(rng, shape, s_kv):
    """Random invalid index values: every kind the contract names (-1, -2, -2**31, 2**31-1, Skv, Skv+1)."""
    pool = np.array(sorted({v for vals in contract.invalid_values(s_kv).values() for v in vals}), dtype=np.int64)
    return pool[rng.integers(0, len(pool), size=shape)].astype(np.int32)


def _topk_positions(x):
    L = x["indices"].shape[-1]
    if x["topk_length"] is None:
        return np.zeros(x["indices"].shape, dtype=bool)
    return np.arange(L) >= x["topk_length"][..., None]


@settings(max_examples=120, deadline=None)
@given(case=small_cases())
def test_permuting_slots(case):
    x = case.inputs()
    rng = np.random.default_rng(case.seed + 1)
    # permute within [0, topk_length) and within the rest separately, so every slot keeps its validity
    past = _topk_positions(x)
    key = past * 2.0 + rng.random(x["indices"].shape)
    perm = np.argsort(key, axis=-1)
    y = {**x, "indices": np.take_along_axis(x["indices"], perm, axis=-1)}
    assert_bitwise(run(y), run(x), "slots permuted")


@settings(max_examples=120, deadline=None)
@given(case=small_cases(), extra=st.integers(1, 7))
def test_appending_invalid_slots(case, extra):
    x = case.inputs()
    rng = np.random.default_rng(case.seed + 2)
    B, S, _ = x["indices"].shape
    tail = _invalid_values(rng, (B, S, extra), case.Skv)
    y = {**x, "indices": np.concatenate([x["indices"], tail], axis=-1)}
    assert_bitwise(run(y), run(x), f"{extra} invalid slots appended")


@settings(max_examples=120, deadline=None)
@given(case=small_cases(), extra=st.integers(1, 5))
def test_padding_heads_that_attend_to_nothing(case, extra):
    """Extra heads with q = 0, grad_out = 0 and sink -inf, appended: the real heads' results are unchanged.

    The one invariance that is NOT bitwise: H is a matmul dimension (heads are summed into dkv, and H = 1 makes
    NumPy call gemv instead of gemm), and BLAS picks its kernel and unrolling by the matrix sizes, so a change
    of H may reorder a sum. Checked to float64 rounding instead: 1e-13 relative to the array's largest value.
    The padded heads themselves must have exactly zero dq and d_sink (they attend, but carry no cotangent).
    """
    x = case.inputs()
    H = case.H
    keep = np.arange(H)  # real heads first, padding appended

    def pad(a, fill):
        shape = list(a.shape)
        shape[2] = H + extra
        out = np.full(shape, fill, dtype=a.dtype)
        out[:, :, keep] = a
        return out

    y = dict(x, q=pad(x["q"], 0), grad_out=pad(x["grad_out"], 0))
    if x["attn_sink"] is not None:
        sink = np.full(H + extra, -np.inf, np.float32)
        sink[keep] = x["attn_sink"]
        y["attn_sink"] = sink
    got, want = run(y), run(x)
    sub = {k: (None if v is None else v[..., keep] if k in ("lse", "d_sink") else v)
           for k, v in got.items()}
    sub["out"], sub["dq"] = got["out"][:, :, keep], got["dq"][:, :, keep]
    for k, w in want.items():
        if w is None:
            assert sub[k] is None
            continue
        np.testing.assert_array_equal(np.isposinf(sub[k]), np.isposinf(w), err_msg=f"{k}: +inf positions")
        fin = np.isfinite(w)
        np.testing.assert_allclose(sub[k][fin], w[fin], rtol=0, atol=1e-13 * max(1.0, np.abs(w[fin]).max(initial=0)),
                                   err_msg=f"{extra} heads padded: {k}")
    assert not got["dq"][:, :, H:].any(), "padded heads must get dq = 0"
    if got["d_sink"] is not None:
        assert not got["d_sink"][H:].any(), "padded heads must get d_sink = 0"


@settings(max_examples=120, deadline=None)
@given(case=small_cases(), extra=st.integers(1, 5))
def test_padding_query_rows_with_no_valid_slot(case, extra):
    """Extra rows (random q, grad_out, topk_length) whose indices are all invalid, at random positions."""
    x = case.inputs()
    rng = np.random.default_rng(case.seed + 4)
    B, S, L = x["indices"].shape
    keep = np.sort(rng.choice(S + extra, size=S, replace=False))

    def pad(a, fill):
        shape = list(a.shape)
        shape[1] = S + extra
        out = fill(shape).astype(a.dtype)
        out[:, keep] = a
        return out

    noise = lambda shape: rng.standard_normal(shape)  # noqa: E731
    y = dict(x, q=pad(x["q"], noise), grad_out=pad(x["grad_out"], noise),
             indices=pad(x["indices"], lambda shape: _invalid_values(rng, shape, case.Skv)))
    if x["topk_length"] is not None:
        y["topk_length"] = pad(x["topk_length"], lambda shape: rng.integers(0, L + 3, size=shape))
    got, want = run(y), run(x)
    sub = {k: (v if k in ("dkv", "d_sink") else v[:, keep]) for k, v in got.items()}
    assert_bitwise(sub, want, f"{extra} empty rows padded")


@settings(max_examples=120, deadline=None)
@given(case=small_cases())
def test_which_invalid_value_a_slot_holds(case):
    """Every value-invalid slot gets another invalid value (-1 -> 2**31-1 -> -2**31 -> Skv ...), and every slot
    past topk_length gets any int32 at all, valid-looking ones included."""
    x = case.inputs()
    rng = np.random.default_rng(case.seed + 5)
    idx = x["indices"]
    value_invalid = (idx < 0) | (idx >= case.Skv)
    past = _topk_positions(x)
    new = np.where(value_invalid, _invalid_values(rng, idx.shape, case.Skv), idx)
    anything = rng.integers(-(2**31), 2**31, size=idx.shape, dtype=np.int64)
    anything = np.where(rng.random(idx.shape) < 0.5, rng.integers(0, case.Skv, size=idx.shape), anything)
    new = np.where(past, anything, new).astype(np.int32)
    assert_bitwise(run({**x, "indices": new}), run(x), "invalid values changed")
    # the cycle the contract names, applied to every value-invalid slot at once
    for v in (-1, 2**31 - 1, -(2**31), case.Skv):
        y = {**x, "indices": np.where(value_invalid, v, idx).astype(np.int32)}
        assert_bitwise(run(y), run(x), f"invalid slots set to {v}")



@settings(max_examples=60, deadline=None)
@given(case=small_cases(dims=((16, 8), (5, 3), (24, 16))))
def test_dkv_grouping_does_not_change_a_bit(case):
    """dkv sums each kv row's contributions in order, in one padded grid or in one grid per multiplicity
    class (chosen by how skewed the references are), gathered in blocks of rows of any size: all must give
    the same bits (Dqk > 1)."""
    from sparse_mqa_testkit.oracle import host as reference

    x = case.inputs()
    want = run(x)
    saved = reference._ONE_GRID_SLACK, reference._GATHER_BYTES
    try:
        reference._ONE_GRID_SLACK = -(10**9)  # always one grid per class
        got = run(x)
        reference._GATHER_BYTES = 1  # one kv row per gathered block
        got_rows = run(x)
    finally:
        reference._ONE_GRID_SLACK, reference._GATHER_BYTES = saved
    assert_bitwise(got, want, "per-class grids vs one grid", keys=("dkv",))
    assert_bitwise(got_rows, want, "row-by-row gathers vs one gather", keys=("dkv",))


@settings(max_examples=40, deadline=None)
@given(case=small_cases())
def test_repeated_calls_and_memory_layout_change_nothing(case):
    """Two calls give the same bits, and so do inputs in Fortran order or as strided views of larger arrays."""
    x = case.inputs()
    want = run(x)
    assert_bitwise(run(x), want, "second call")

    def strided(a):
        if a is None:
            return None
        big = np.zeros(tuple(2 * n for n in a.shape), a.dtype)
        view = big[tuple(slice(None, None, 2) for _ in a.shape)]
        view[...] = a
        return view

    for label, f in (("Fortran order", lambda a: None if a is None else np.asfortranarray(a)), ("strided", strided)):
        y = {k: (f(v) if isinstance(v, np.ndarray) else v) for k, v in x.items()}
        assert_bitwise(run(y), want, label)
