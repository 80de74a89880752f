"""The forward kernel's host plan (pure Python): padding, grid coverage, and no recompile for B, S, Skv, H, L."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mqa_kernels import fwd_plan
from sparse_mqa_testkit import contract

dims_pairs = st.sampled_from(contract.PRODUCTION_DIMS)
flags = st.booleans()


@st.composite
def call_dims(draw, max_s=300):
    dqk, dv = draw(dims_pairs)
    return contract.Dims(B=draw(st.integers(1, 8)), S=draw(st.integers(1, max_s)), H=draw(st.integers(1, 300)),
                         Dqk=dqk, Dv=dv, Skv=draw(st.integers(1, 10**6)), L=draw(st.integers(1, 5000)))


@settings(max_examples=200)
@given(call_dims(), flags, flags)
def test_heads_are_padded_to_whole_groups(dims, sink, topk):
    plan = fwd_plan.plan_forward(dims, has_sink=sink, has_topk_length=topk)
    hb = plan.key.head_block
    assert plan.padded_heads % hb == 0
    assert dims.H <= plan.padded_heads < dims.H + hb
    # every real head is served by exactly one group, padding heads by none
    served = [h for g in range(plan.head_groups) for h in plan.heads_of_group(g)]
    assert served == list(range(dims.H))


@settings(max_examples=200)
@given(call_dims(), flags, flags)
def test_topk_is_padded_to_whole_stage_pairs(dims, sink, topk):
    plan = fwd_plan.plan_forward(dims, has_sink=sink, has_topk_length=topk)
    pair = plan.key.topk_tile * fwd_plan.STAGES
    assert plan.padded_topk % pair == 0
    assert dims.L <= plan.padded_topk < dims.L + pair
    assert plan.topk_tiles * plan.key.topk_tile == plan.padded_topk


@settings(max_examples=50)
@given(call_dims(max_s=40), flags, flags)
def test_grid_enumerates_each_row_and_group_once(dims, sink, topk):
    plan = fwd_plan.plan_forward(dims, has_sink=sink, has_topk_length=topk)
    gx, gy = plan.grid
    assert gy == dims.B
    blocks = sorted(plan.block_of(s, g) for s in range(dims.S) for g in range(plan.head_groups))
    assert blocks == list(range(gx))
    for x in (0, gx - 1):  # the kernel's decode
        s, g = divmod(x, plan.head_groups)
        assert plan.block_of(s, g) == x


@settings(max_examples=200)
@given(call_dims(), call_dims(), flags, flags)
def test_variant_key_ignores_b_s_skv_h_l(a, b, sink, topk):
    """No recompile when only B, S, Skv, H or L change: the key depends on the head dims and flags only."""
    b = contract.Dims(B=b.B, S=b.S, H=b.H, Dqk=a.Dqk, Dv=a.Dv, Skv=b.Skv, L=b.L)
    ka = fwd_plan.plan_forward(a, has_sink=sink, has_topk_length=topk).key
    kb = fwd_plan.plan_forward(b, has_sink=sink, has_topk_length=topk).key
    assert ka == kb
    assert ka in fwd_plan.all_variants()


def test_all_variants_are_distinct_and_cover_the_flags():
    keys = fwd_plan.all_variants()
    assert len(set(keys)) == len(keys) == len(contract.PRODUCTION_DIMS) * 4
    assert {(k.dqk, k.dv) for k in keys} == set(contract.PRODUCTION_DIMS)
    assert all(k.describe().startswith("sparse_mqa_fwd") for k in keys)


@pytest.mark.parametrize("dqk,dv", [(576, 256), (128, 128), (512, 576)])
def test_unsupported_dims_are_rejected_naming_them(dqk, dv):
    with pytest.raises(ValueError, match=rf"\({dqk}, {dv}\)"):
        fwd_plan.variant_key(dqk, dv, has_sink=False, has_topk_length=False)


def test_grid_over_cuda_limit_is_rejected():
    dims = contract.Dims(B=1, S=2**31, H=65, Dqk=576, Dv=512, Skv=8, L=8)
    with pytest.raises(ValueError, match="grid limit"):
        fwd_plan.plan_forward(dims, has_sink=False, has_topk_length=False)
    dims = contract.Dims(B=70000, S=1, H=1, Dqk=576, Dv=512, Skv=8, L=8)
    with pytest.raises(ValueError, match="batch"):
        fwd_plan.plan_forward(dims, has_sink=False, has_topk_length=False)
