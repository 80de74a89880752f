"""The backward's host plan: head groups, top-k padding, query chunks, workspace, fixed-point exponent."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mqa_kernels import bwd_plan
from sparse_mqa_kernels.bwd_plan import make_plan


@pytest.mark.parametrize("H, hg, ng", [(1, 16, 1), (8, 16, 1), (15, 16, 1), (16, 16, 1), (17, 32, 1),
                                       (33, 64, 1), (64, 64, 1), (65, 64, 2), (128, 64, 2), (129, 64, 3)])
def test_head_groups(H, hg, ng):
    p = make_plan(1, 4, 8, H, 4, 576, 512)
    assert (p.head_group, p.n_groups) == (hg, ng)


@settings(max_examples=200, deadline=None)
@given(H=st.integers(1, 300), L=st.integers(1, 5000), S=st.integers(1, 20000), B=st.integers(1, 4),
       budget=st.sampled_from([0, 1, 2**20, 2**26, bwd_plan.DEFAULT_WORKSPACE_BUDGET]),
       maxq=st.sampled_from([1, 7, 8, bwd_plan.MAX_QUERY_CHUNK]))
def test_plan_covers_exactly_and_stays_in_bounds(H, L, S, B, budget, maxq):
    p = make_plan(B, S, 64, H, L, 576, 512, workspace_budget=budget, max_query_chunk=maxq)
    # heads: groups partition [0, H) exactly; a block never touches a head >= H (PaddleFleet #1784)
    seen = [h for g in range(p.n_groups) for h in p.heads(g)]
    assert seen == list(range(H))
    assert p.padded_heads >= H and p.padded_heads - H < p.head_group
    assert p.head_group in bwd_plan.HEAD_GROUPS
    with pytest.raises(IndexError):
        p.heads(p.n_groups)
    # top-k: blocks cover [0, padded_L) contiguously, padding < one block
    blocks = p.topk_blocks()
    assert [t for b in blocks for t in b] == list(range(p.padded_L))
    assert p.padded_L % p.topk_block == 0 and 0 <= p.padded_L - L < p.topk_block
    # queries: chunks partition [0, S), each at most query_chunk and max_query_chunk
    chunks = p.chunks()
    assert [i for c in chunks for i in c] == list(range(S))
    assert all(1 <= len(c) <= min(p.query_chunk, maxq) for c in chunks)
    assert len(chunks) == p.n_chunks
    # budget: accumulator first; a chunk's count under the budget whenever the budget leaves room for one query
    assert p.accumulator_bytes() == (4 if p.row_scaled() else 8) * B * 64 * 576
    assert p.row_scaled() == (p.head_group == 64)
    room = budget - p.accumulator_bytes() - 8
    if room >= bwd_plan.staging_bytes_per_query(B, H) + 4 * H:
        assert p.chunk_bytes() <= room
    else:
        assert p.query_chunk == 1


def test_anchor_plan_is_one_launch():
    p = make_plan(1, 4096, 8192, 64, 2048, 576, 512)
    assert (p.head_group, p.n_groups, p.n_topk_blocks, p.n_chunks) == (64, 1, -(-2048 // bwd_plan.TOPK_BLOCK), 1)
    assert p.key() == bwd_plan.VariantKey(576, 512, 64, bwd_plan.TOPK_BLOCK, stored_pds=True)
    assert p.key() in bwd_plan.all_variants() and p.key().warp_specialized
    # stored P and dS: 2 x bf16 [1, 4096, 64, 2048], 2 GiB, under the default budget
    assert p.stored_pds and p.pds_len == 2048 and p.pds_bytes() == 4 * 4096 * 64 * 2048


def test_variants_cover_every_plan():
    vs = set(bwd_plan.all_variants())
    for H in range(1, 200):
        for dqk, dv in ((576, 512), (512, 512)):
            for budget in (0, bwd_plan.DEFAULT_PDS_BUDGET):
                assert make_plan(2, 3, 5, H, 7, dqk, dv, pds_budget=budget).key() in vs


@settings(max_examples=200, deadline=None)
@given(H=st.integers(1, 300), L=st.integers(1, 5000), S=st.integers(1, 20000), B=st.integers(1, 4),
       budget=st.sampled_from([0, 1, 2**30, bwd_plan.DEFAULT_PDS_BUDGET]), single=st.booleans())
def test_p_and_ds_are_stored_exactly_when_the_budget_holds_them(H, L, S, B, budget, single):
    p = make_plan(B, S, 64, H, L, 576, 512, pds_budget=budget, single_role=single)
    # a stored row covers every bound-pass block of L (the pass writes whole blocks), and no more
    assert p.pds_len % bwd_plan.BOUND_BLOCK == 0 and 0 <= p.pds_len - L < bwd_plan.BOUND_BLOCK
    assert p.pds_bytes() == 2 * 2 * B * S * H * p.pds_len
    assert p.stored_pds == (p.head_group == 64 and not single and p.pds_bytes() <= budget)
    assert p.key(single).stored_pds == p.stored_pds and (not p.stored_pds or p.key().warp_specialized)
    # the workspace counts them when stored, and only then
    formed = make_plan(B, S, 64, H, L, 576, 512, pds_budget=0)
    extra = p.workspace_bytes(sink=True, topk_given=False) - formed.workspace_bytes(sink=True, topk_given=False)
    assert extra == (p.pds_bytes() if p.stored_pds else 0)


def test_a_stored_key_needs_the_warp_specialised_body():
    with pytest.raises(ValueError, match="stored_pds needs the warp-specialised body"):
        bwd_plan.VariantKey(576, 512, 32, 16, stored_pds=True)
    with pytest.raises(ValueError, match="stored_pds needs the warp-specialised body"):
        bwd_plan.VariantKey(576, 512, 64, 16, single_role=True, stored_pds=True)


@pytest.mark.parametrize("bad", [dict(H=0), dict(L=0), dict(S=-1), dict(Dv=600), dict(H=1.5), dict(B=True),
                                 dict(pds_budget=-1), dict(pds_budget=1.5), dict(workspace_budget=-1)])
def test_plan_rejects_bad_sizes(bad):
    args = dict(B=1, S=2, Skv=3, H=4, L=5, Dqk=576, Dv=512) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        make_plan(**args)


@settings(max_examples=200, deadline=None)
@given(st.floats(1e-30, 1e30))
def test_fixed_point_exponent_keeps_headroom(bound):
    F = bwd_plan.fixed_point_exponent(bound)
    assert bwd_plan.F_MIN <= F <= bwd_plan.F_MAX
    # the bound scaled fits with HEADROOM_BITS to spare, and F is the largest such (unless clamped)
    assert bound * 2.0**F <= 2.0 ** (bwd_plan.ACC_BITS - bwd_plan.HEADROOM_BITS)
    if F < bwd_plan.F_MAX:
        assert bound * 2.0 ** (F + 1) > 2.0 ** (bwd_plan.ACC_BITS - bwd_plan.HEADROOM_BITS)


def test_fixed_point_exponent_edges():
    assert bwd_plan.fixed_point_exponent(0.0) == bwd_plan.F_MAX
    assert bwd_plan.fixed_point_exponent(math.inf) == 0
    assert bwd_plan.fixed_point_exponent(math.nan) == 0
    assert bwd_plan.fixed_point_exponent(1.0) == bwd_plan.ACC_BITS - bwd_plan.HEADROOM_BITS


def test_slot_mass_is_one_minus_the_sinks_without_cancelling():
    import torch

    from sparse_mqa_testkit import contract

    lse = np.array([[[1.0, np.inf, -np.inf, 3.0, 0.5]]], dtype=np.float32)
    sink = np.array([40.0, 0.0, np.inf, -np.inf, 0.0], dtype=np.float32)
    m = bwd_plan.slot_mass(lse, sink)
    assert m.dtype == np.float32 and m.shape == lse.shape
    assert 1e-17 < m[0, 0, 0] < 1.2e-17, "e^(1 - 40), where 1 - p_sink would round to 0"
    assert m[0, 0, 1] == 0 and m[0, 0, 2] == 0, "an empty row holds no mass"
    assert m[0, 0, 3] == 1, "a -inf sink takes none"
    p = contract.sink_probability(lse.astype(np.float64), sink.astype(np.float64))[0, 0, 4]
    assert abs(m[0, 0, 4] - (1 - p)) < 1e-7
    assert np.array_equal(bwd_plan.slot_mass(lse, None), np.array([[[1, 0, 0, 1, 1]]], dtype=np.float32))
    t = bwd_plan.slot_mass(torch.from_numpy(lse), torch.from_numpy(sink))
    assert t.dtype == torch.float32 and np.allclose(t.numpy(), m, rtol=1e-6, atol=0)  # exp: an ulp apart
    assert bwd_plan.slot_mass(np.array([[[np.nan]]], dtype=np.float32), np.zeros(1, np.float32))[0, 0, 0] == 1


def test_octave_ceil_and_row_exponent():
    """A bound term counts as the power of two at or above it (subnormals as 2**-126, non-finite as inf); F_j keeps
    B_j 2**F_j in (2**(ROW_HEADROOM - 1), 2**ROW_HEADROOM], clamped, with ROW_F_MIN for an infinite bound."""
    t = np.array([0.0, 1.0, 1.5, 3.0e-39, 2.0**-20 * 1.01, np.inf, np.nan], dtype=np.float32)
    assert bwd_plan.octave_ceil(t).tolist() == [0.0, 1.0, 2.0, 2.0**-126, 2.0**-19, np.inf, np.inf]
    b = np.array([1.0, 3.0, 2.0**-100, 2.0**100, 0.0, np.inf])
    f = bwd_plan.row_exponent(b)
    assert f.tolist() == [29, 27, bwd_plan.ROW_F_MAX, -71, bwd_plan.ROW_F_MAX, bwd_plan.ROW_F_MIN]
    ok = (b > 0) & np.isfinite(b) & (f < bwd_plan.ROW_F_MAX)
    scaled = b[ok] * np.exp2(f[ok])
    assert ((scaled <= 2.0**bwd_plan.ROW_HEADROOM) & (scaled > 2.0 ** (bwd_plan.ROW_HEADROOM - 1))).all()


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5000), B=st.integers(1, 3), H=st.sampled_from([33, 64, 128, 192]),
       L=st.integers(1, 2100), n_sm=st.sampled_from([1, 2, 78, 114, 132]))
def test_bound_split_covers_each_row_once_and_fills_the_last_wave(rows, B, H, L, n_sm):
    """The bound pass's launch (``BwdPlan.bound_split``): the first ``whole`` rows one block each, each later row's
    top-k blocks split over ``pieces`` blocks, every block of a row in exactly one piece and no piece empty; a split
    happens only where the last wave is at most half the machine, and then it holds more blocks than before and no
    more than the machine."""
    plan = make_plan(B, max(rows, 1), 64, H, L, 576, 512)
    whole, pieces, per = plan.bound_split(rows, n_sm)
    nb = -(-L // bwd_plan.BOUND_BLOCK)
    assert 0 <= whole <= rows and pieces >= 1 and per >= 1
    covered = [range(k * per, min((k + 1) * per, nb)) for k in range(pieces)]
    assert all(len(r) > 0 for r in covered) and sorted(b for r in covered for b in r) == list(range(nb))
    last = rows * B * plan.n_groups % n_sm
    if whole < rows:
        assert 0 < last <= n_sm // 2 and whole == rows - last
        assert last < last * pieces <= n_sm
    else:
        assert pieces == 1


def test_bound_split_of_the_anchor():
    """4096 rows on 132 SMs leave 4 in the last wave: their 32 top-k blocks each become 32 one-block pieces."""
    assert make_plan(1, 4096, 8192, 64, 2048, 576, 512).bound_split(4096, 132) == (4092, 32, 1)
    assert make_plan(1, 4096, 8192, 64, 512, 576, 512).bound_split(4096, 132) == (4092, 8, 1)
    assert make_plan(1, 4096, 8192, 64, 2048, 576, 512).bound_split(4092, 132) == (4092, 1, 32)
