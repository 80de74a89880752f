"""The oracle at the contract's limits: sinks of -inf and +inf, one valid slot, empty rows, poisoned kv rows."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mqa_testkit import contract
from support import assert_bitwise, run, small_cases


@settings(max_examples=60, deadline=None)
@given(case=small_cases(sink_modes=("none",)))
def test_sink_minus_inf_is_bitwise_no_sink(case):
    x = case.inputs()
    want = run(x)
    got = run({**x, "attn_sink": np.full(case.H, -np.inf, np.float32)})
    assert_bitwise(got, want, "sink -inf vs None", keys=("out", "lse", "dq", "dkv"))
    assert want["d_sink"] is None
    assert np.array_equal(got["d_sink"], np.zeros(case.H)), f"d_sink for a -inf sink: {got['d_sink']}"


@settings(max_examples=60, deadline=None)
@given(case=small_cases(sink_modes=("pos_inf", "mixed")))
def test_sink_plus_inf_gives_zero_out_and_no_gradient(case):
    x = case.inputs()
    r = run(x)
    inf = np.isposinf(x["attn_sink"])
    assert not np.isnan(np.concatenate([np.ravel(v) for v in r.values()])).any()
    assert not r["out"][:, :, inf].any(), "out must be 0 for +inf-sink heads"
    assert not r["dq"][:, :, inf].any(), "dq must be 0 for +inf-sink heads"
    assert not r["d_sink"][inf].any(), "d_sink must be 0 for +inf-sink heads"
    # no dkv contribution: the same dkv as without those heads at all (to rounding: H changes BLAS kernels)
    if inf.all():
        assert not r["dkv"].any()
    else:
        keep = ~inf
        y = dict(x, q=x["q"][:, :, keep], grad_out=x["grad_out"][:, :, keep], attn_sink=x["attn_sink"][keep])
        want = run(y)["dkv"]
        np.testing.assert_allclose(r["dkv"], want, rtol=0, atol=1e-13 * max(1.0, np.abs(want).max()))


@settings(max_examples=60, deadline=None)
@given(case=small_cases(sink_modes=("none", "finite")), slot=st.integers(0, 9))
def test_one_valid_slot_gives_that_v_row(case, slot):
    x = case.inputs()
    rng = np.random.default_rng(case.seed + 6)
    B, S, L = x["indices"].shape
    slot = slot % L
    j = rng.integers(0, case.Skv, size=(B, S))
    idx = np.full((B, S, L), -1, np.int32)
    idx[:, :, slot] = j
    y = {**x, "indices": idx, "topk_length": None}
    r = run(y)
    v = x["kv"].astype(np.float64)[np.arange(B)[:, None], j][:, :, None, : case.Dv]  # [B,S,1,Dv]
    s = case.scale * np.einsum("bshd,bsd->bsh", x["q"].astype(np.float64),
                               x["kv"].astype(np.float64)[np.arange(B)[:, None], j])
    np.testing.assert_allclose(r["lse"], s, rtol=1e-14, atol=1e-14)
    if x["attn_sink"] is None:
        # P = exp(s - lse) = exp(0) = 1 exactly, so out is the V row itself, bitwise
        assert np.array_equal(r["out"], np.broadcast_to(v, r["out"].shape))
    else:
        p = 1.0 / (1.0 + np.exp(x["attn_sink"].astype(np.float64) - s))  # sigmoid(s - sink)
        np.testing.assert_allclose(r["out"], p[..., None] * v, rtol=1e-13, atol=1e-15)


@settings(max_examples=60, deadline=None)
@given(case=small_cases(invalid_modes=("empty_rows", "mixed", "tails")))
def test_empty_rows(case):
    """Rows with no valid slot: out 0, lse +inf, dq 0, no dkv or d_sink contribution, no NaN anywhere."""
    x = case.inputs()
    r = run(x)
    for k, v in r.items():
        assert v is None or not np.isnan(v).any(), f"{k} has NaN"
    empty = ~contract.valid_mask(x["indices"], case.Skv, x["topk_length"]).any(-1)  # [B, S]
    assert not r["out"][empty].any()
    assert np.isposinf(r["lse"][empty]).all()
    assert np.isfinite(r["lse"][~empty]).all()
    assert not r["dq"][empty].any()
    # no dkv / d_sink contribution: give those rows a different grad_out and q; nothing may move a bit
    rng = np.random.default_rng(case.seed + 7)
    noise = lambda a: np.where(empty[:, :, None, None], rng.standard_normal(a.shape), a).astype(a.dtype)  # noqa
    y = dict(x, q=noise(x["q"]), grad_out=noise(x["grad_out"]))
    got = run(y)
    assert_bitwise(got, r, "empty rows' q and grad_out changed", keys=("dkv", "d_sink"))


@settings(max_examples=120, deadline=None)
@given(case=small_cases())
def test_never_reads_a_kv_row_no_valid_slot_points_at(case):
    """NaN in every kv row that no valid slot references (kv[b, 0] and kv[b, Skv-1] made unreferenced first)
    gives results bitwise equal to the clean run, and dkv 0 (not NaN) on those rows."""
    x = case.inputs()
    idx = x["indices"].copy()
    # free rows 0 and Skv-1, the rows a clamped or wrapped invalid index would land on
    idx[(idx == 0) | (idx == case.Skv - 1)] = -1
    x = {**x, "indices": idx}
    valid = contract.valid_mask(idx, case.Skv, x["topk_length"])
    used = np.zeros((case.B, case.Skv), bool)
    b = np.broadcast_to(np.arange(case.B)[:, None, None], idx.shape)
    used[b[valid], idx[valid]] = True
    kv = x["kv"].copy()
    kv[~used] = np.nan
    for dtype in (np.float64, np.float32):
        clean, dirty = run(x, dtype), run({**x, "kv": kv}, dtype)
        assert_bitwise(dirty, clean, f"unreferenced kv rows set to NaN ({np.dtype(dtype).name})")
        assert not dirty["dkv"][~used].any()


def test_a_hot_kv_row_does_not_blow_up_memory():
    """Half of all slots on kv row 0, the rest spread over 4096 rows: dkv's grouping stays within a few times
    the contributions' size (one grid padded to the hottest row would take ~270 MB here)."""
    import tracemalloc

    from sparse_mqa_testkit.cases import Case

    case = Case(B=1, S=64, Skv=4096, H=2, L=64, Dqk=8, Dv=8, seed=11)
    x = case.inputs()
    idx = x["indices"].copy()
    idx[..., ::2] = 0
    x = {**x, "indices": idx}
    tracemalloc.start()
    try:
        r = run(x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    # dkv is additive over query rows: row 0's gradient from every 8th query row equals the sum of theirs
    per_row = [run({**x, "q": x["q"][:, i:i + 1], "indices": idx[:, i:i + 1], "grad_out": x["grad_out"][:, i:i + 1]})
               for i in range(0, case.S, 8)]
    assert np.isfinite(r["dkv"]).all()
    part = sum(p["dkv"][0, 0] for p in per_row)
    sub = run({**x, "q": x["q"][:, ::8], "indices": idx[:, ::8], "grad_out": x["grad_out"][:, ::8]})["dkv"][0, 0]
    np.testing.assert_allclose(sub, part, rtol=1e-12, atol=1e-12)


def test_a_long_kv_cache_is_not_copied_whole():
    """Few slots into a long cache: only the referenced rows are gathered (no cast or copy of all of kv)."""
    import tracemalloc

    from sparse_mqa_testkit import oracle
    from sparse_mqa_testkit.cases import Case

    case = Case(B=1, S=2, Skv=200_000, H=2, L=8, Dqk=16, Dv=8, invalid="holes", seed=5)
    x = case.inputs()
    kw = dict(sm_scale=x["sm_scale"], d_v=x["d_v"], dtype=np.float64)
    dkv_bytes = case.Skv * case.Dqk * 8
    peaks = {}
    for name, call in (("forward", lambda: oracle.forward(x["q"], x["kv"], x["indices"], **kw)),
                       ("backward", lambda: oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], **kw))):
        tracemalloc.start()
        try:
            r = call()
            peaks[name] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    # kv is 6.4 MB of bf16; any copy of it (cast or padded) would show. The backward's dkv is [B, Skv, Dqk].
    assert peaks["forward"] < x["kv"].nbytes / 4, peaks
    assert peaks["backward"] < dkv_bytes + x["kv"].nbytes / 4, peaks
    dkv = r[1]
    valid = contract.valid_mask(x["indices"], case.Skv, None)
    used = np.unique(x["indices"][valid])
    rest = np.ones(case.Skv, bool)
    rest[used] = False
    assert not dkv[0, rest].any() and dkv[0, used].any()
