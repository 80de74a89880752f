"""``Case``: arrays are a pure function of the fields, with the contract's kernel dtypes, and each mode makes
what it says."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.cases import INVALID_MODES, ORDERS, SINK_MODES, SPREAD_BITS, TOPK_MODES, Case
from sparse_mqa_testkit.cases.draws import HOT_ROWS
from sparse_mqa_testkit.cases.strategies import cases

small = cases(max_b=2, max_s=6, max_skv=12, max_h=5, max_l=10)
random_slots = small.map(lambda c: c.replace(pattern="random"))  # the invalid modes alone make -1 slots
ARRAYS = ("q", "kv", "indices", "topk_length", "attn_sink", "grad_out")


def _valid(case, x):
    return contract.valid_mask(x["indices"], case.Skv, x["topk_length"])


@settings(max_examples=60)
@given(case=small)
def test_inputs_are_deterministic_per_seed_with_kernel_dtypes_and_shapes(case):
    x, y = case.inputs(), case.inputs()
    for name in ARRAYS:
        if x[name] is None:
            assert y[name] is None
            continue
        assert np.array_equal(x[name], y[name], equal_nan=True), f"{name} differs between two inputs() calls"
        assert contract.dtype_name(x[name]) == contract.KERNEL_DTYPES[name], name
        assert x[name].shape == case.dims.shape(name), name
    assert x["sm_scale"] == case.scale and x["d_v"] == case.Dv
    other = case.replace(seed=(case.seed + 1) % 2**32).inputs()
    flat = lambda a: np.concatenate([a[k].astype(np.float32).ravel() for k in ("q", "kv", "grad_out")])  # noqa
    assert not np.array_equal(flat(other), flat(x)), "another seed must give other arrays"


@given(case=small)
def test_repro_round_trips(case):
    rebuilt = eval(case.repro(), {"Case": Case})  # noqa: S307 - the repro line is meant to be eval'd
    assert rebuilt == case
    assert Case().repro() == "Case()"
    d = case.describe()
    for part in (f"B{case.B} ", f"S{case.S} ", f"Skv{case.Skv} ", f"H{case.H} ", f"L{case.L} ",
                 f"{case.Dqk}/{case.Dv}", f"sink={case.sink}", f"seed={case.seed}"):
        assert part in d, (part, d)


@settings(max_examples=40)
@given(case=random_slots.map(lambda c: c.replace(invalid="none", topk="none")))
def test_invalid_none_means_every_slot_valid(case):
    x = case.inputs()
    assert _valid(case, x).all()


@settings(max_examples=40)
@given(case=random_slots.map(lambda c: c.replace(invalid="empty_rows")))
def test_empty_rows_mode_has_an_all_invalid_row(case):
    x = case.inputs()
    valid = _valid(case, x)
    assert not valid[0, 0].any(), "row (0, 0) is always emptied"
    idx = x["indices"]
    row_empty = ((idx < 0) | (idx >= case.Skv)).all(-1)
    # an emptied row holds only invalid values; the others keep their (valid) slots
    assert row_empty[0, 0]
    assert ((idx >= 0) & (idx < case.Skv) | row_empty[..., None]).all()


@settings(max_examples=40)
@given(case=random_slots.map(lambda c: c.replace(invalid="out_of_range")))
def test_out_of_range_mode_uses_the_far_values(case):
    idx = case.inputs()["indices"].astype(np.int64)
    bad = idx[(idx < 0) | (idx >= case.Skv)]
    assert set(bad.tolist()) <= {case.Skv, case.Skv + 1, 2**31 - 1, -(2**31), -2}


@settings(max_examples=40)
@given(case=random_slots.map(lambda c: c.replace(invalid="holes")))
def test_holes_mode_uses_minus_one(case):
    idx = case.inputs()["indices"]
    assert set(idx[(idx < 0) | (idx >= case.Skv)].tolist()) <= {-1}


@settings(max_examples=40)
@given(case=random_slots.map(lambda c: c.replace(invalid="tails")))
def test_tails_mode_invalidates_a_suffix(case):
    idx = case.inputs()["indices"]
    bad = (idx < 0) | (idx >= case.Skv)
    # once a slot is invalid, every later slot of the row is
    assert (np.maximum.accumulate(bad, axis=-1) == bad).all()


def test_mixed_mode_covers_every_kind():
    seen = set()
    for seed in range(40):
        c = Case(S=6, Skv=10, L=8, invalid="mixed", seed=seed)
        idx = c.inputs()["indices"]
        bad = (idx < 0) | (idx >= c.Skv)
        if bad.all(-1).any():
            seen.add("empty row")
        if ((idx >= c.Skv) | (idx < -1)).any():
            seen.add("out of range")
        if (idx == -1).any():
            seen.add("-1")
    assert seen == {"empty row", "out of range", "-1"}


@settings(max_examples=40)
@given(case=small.filter(lambda c: c.L > 1).map(lambda c: c.replace(duplicates=True, invalid="none")))
def test_duplicates_mode_really_duplicates(case):
    idx = case.inputs()["indices"]
    srt = np.sort(idx, axis=-1)
    assert (srt[..., 1:] == srt[..., :-1]).any(-1).all(), "every row must repeat an index"


@settings(max_examples=40)
@given(case=small.filter(lambda c: c.L <= c.Skv).map(lambda c: c.replace(duplicates=False, invalid="none")))
def test_without_duplicates_rows_are_distinct(case):
    idx = case.inputs()["indices"]
    srt = np.sort(np.where(idx >= 0, idx, -1 - np.arange(case.L)), axis=-1)  # -1 slots are not indices
    assert not (srt[..., 1:] == srt[..., :-1]).any()


@settings(max_examples=40)
@given(case=small.map(lambda c: c.replace(pattern="local", invalid="none", topk="none", order="random",
                                         duplicates=False)))
def test_local_pattern_is_causal_with_a_window(case):
    # query i sits at cache position p = (i + 1) Skv / S - 1; its first 3/4 slots are p, p - 1, ... and the
    # rest fall before the window; only positions below 0 and repeats are -1
    idx = case.inputs()["indices"]
    pos = (np.arange(case.S) + 1) * case.Skv // case.S - 1
    window = case.L - case.L // 4
    near = pos[:, None] - np.arange(window)[None, :]
    assert np.array_equal(idx[..., :window], np.broadcast_to(np.where(near >= 0, near, -1), idx[..., :window].shape))
    far = idx[..., window:]
    assert ((far == -1) | ((far >= 0) & (far <= (pos - window)[None, :, None]))).all()


@settings(max_examples=40)
@given(case=small.filter(lambda c: c.L >= 2).map(lambda c: c.replace(pattern="hot", invalid="none", order="random")))
def test_hot_pattern_shares_rows_across_queries(case):
    idx = case.inputs()["indices"]
    n = min(HOT_ROWS, case.L // 2)
    head = idx[..., :n]
    assert (head == head[:, :1]).all(), "every query of a batch names the same hot rows first"


@settings(max_examples=30)
@given(case=small.filter(lambda c: c.S >= 2))
def test_spread_magnitude_scales_grad_out_along_the_queries(case):
    unit, spread = case.replace(magnitude="unit").inputs(), case.replace(magnitude="spread").inputs()
    ratio = spread["grad_out"].astype(np.float64) / unit["grad_out"].astype(np.float64)
    want = np.exp2(np.linspace(-SPREAD_BITS, SPREAD_BITS, case.S))[None, :, None, None]
    ok = unit["grad_out"].astype(np.float64) != 0
    assert np.allclose(ratio[ok], np.broadcast_to(want, ratio.shape)[ok], rtol=2 ** -7)
    for name in ("q", "kv", "indices"):
        assert np.array_equal(spread[name], unit[name]), name


@settings(max_examples=40)
@given(case=small.map(lambda c: c.replace(order="sorted", invalid="none")))
def test_sorted_order(case):
    idx = case.inputs()["indices"]
    assert (np.diff(idx, axis=-1) >= 0).all()


@settings(max_examples=60)
@given(case=small, mode=st.sampled_from(SINK_MODES))
def test_sink_modes(case, mode):
    sink = case.replace(sink=mode).inputs()["attn_sink"]
    if mode == "none":
        assert sink is None
        return
    assert sink.shape == (case.H,) and sink.dtype == np.float32
    if mode == "finite":
        assert np.isfinite(sink).all()
    elif mode == "neg_inf":
        assert np.isneginf(sink).all()
    elif mode == "pos_inf":
        assert np.isposinf(sink[0]) and (np.isposinf(sink) | np.isfinite(sink)).all()
    else:
        assert not np.isnan(sink).any()


def test_mixed_sinks_cover_all_three_kinds():
    kinds = set()
    for seed in range(20):
        s = Case(H=6, sink="mixed", seed=seed).inputs()["attn_sink"]
        kinds |= {"finite"} if np.isfinite(s).any() else set()
        kinds |= {"-inf"} if np.isneginf(s).any() else set()
        kinds |= {"+inf"} if np.isposinf(s).any() else set()
    assert kinds == {"finite", "-inf", "+inf"}


@settings(max_examples=40)
@given(case=small.map(lambda c: c.replace(topk="random")))
def test_topk_random_lengths(case):
    tl = case.inputs()["topk_length"]
    assert tl.dtype == np.int32 and tl.shape == (case.B, case.S)
    assert ((tl >= 0) & (tl <= case.L + 2)).all()


def test_topk_random_reaches_zero_and_past_l():
    tl = np.concatenate([Case(S=8, L=4, topk="random", seed=s).inputs()["topk_length"].ravel() for s in range(10)])
    assert (tl == 0).any() and (tl > 4).any()


def test_scale_and_dims():
    c = Case(B=2, S=3, Skv=5, H=4, L=6, Dqk=16, Dv=8)
    assert c.scale == 0.25 and Case(sm_scale=0.5).scale == 0.5
    assert c.dims == contract.Dims(B=2, S=3, H=4, Dqk=16, Dv=8, Skv=5, L=6)


@pytest.mark.parametrize("fields, pattern", [
    (dict(B=0), r"Case\.B must be an int >= 1"),
    (dict(L=2.0), r"Case\.L must be an int >= 1"),
    (dict(Dqk=8, Dv=9), r"Case\.Dv must be <= Dqk = 8"),
    (dict(sink="maybe"), r"Case\.sink must be one of"),
    (dict(topk="all"), r"Case\.topk must be one of"),
    (dict(invalid="some"), r"Case\.invalid must be one of"),
    (dict(order="reverse"), r"Case\.order must be one of"),
])
def test_case_rejects_bad_fields(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        Case(**fields)


def test_modes_are_the_documented_ones():
    assert SINK_MODES == ("none", "finite", "neg_inf", "pos_inf", "mixed", "huge", "far")
    assert TOPK_MODES == ("none", "random", "edges")
    assert set(INVALID_MODES) == {"none", "holes", "out_of_range", "tails", "empty_rows", "mixed", "leading",
                                  "middle"}
    assert ORDERS == ("random", "sorted")
