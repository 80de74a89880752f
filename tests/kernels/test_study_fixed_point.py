"""``benchmarks/study_fixed_point.py`` (lead 1 of the deterministic backward's speed work): its per-row bound is a
bound, on the adversarial magnitudes, and the int32 scheme built on it is exact where it should be."""

import numpy as np
import pytest

from sparse_mqa_testkit.cases import Case
from support import benchmark_module

SMALL = dict(B=2, S=12, Skv=24, H=17, L=20, Dqk=64, Dv=32, sink="finite")


@pytest.fixture(scope="module")
def study():
    return benchmark_module("study_fixed_point")


@pytest.mark.parametrize("modes", [dict(), dict(magnitude="peaky"), dict(magnitude="spread", pattern="local"),
                                   dict(pattern="hot"), dict(sink="far"), dict(sink="huge"),
                                   dict(sink="mixed", invalid="mixed", topk="random"), dict(duplicates=True)])
def test_the_per_row_bound_bounds_every_column_of_the_row(study, modes):
    _, _, rows, terms, bounds = study.contributions(Case(**{**SMALL, **modes, "seed": 3}))
    total = np.zeros(bounds["norms"].shape + terms.shape[-1:])
    np.add.at(total, rows, np.abs(terms.astype(np.float64)))
    named = np.zeros(total.shape[:-1], dtype=np.int64)
    np.add.at(named, rows, 1)
    for bound in (bounds["norms"], bounds["exact"]):
        assert np.all(total.max(-1) <= bound.astype(np.float64) * (1 + 2**-7))  # bf16 P and dS: within HEADROOM
        assert np.all(bound[named == 0] == 0)  # a row no slot names gets no scale of its own
    assert np.all(bounds["exact"] <= bounds["norms"] * (1 + 2**-20))  # Cauchy-Schwarz


def test_the_int32_scheme_stays_inside_int32_and_within_the_error_model(study):
    r = study.schemes(Case(**{**SMALL, "pattern": "hot", "seed": 5}), np.random.default_rng(0))
    for dp in study.BOUNDS:
        assert 0 < r[f"int32, F per row, dP {dp}"][2] <= 2 ** (study.HEADROOM - 31) * (1 + 2**-7)
    for scheme, (acc_error, ratio, _, _) in ((k, v) for k, v in r.items() if k != "terms per row"):
        assert acc_error < 2**-9 and ratio < 1, (scheme, r)


def test_the_bound_is_reached_when_do_lies_along_v_and_q_along_one_axis(study):
    """Each part of the bound is needed: with dO along v, Delta of the opposite sign and q on one axis, the first
    column of the contribution dS q + P dO equals the bound (so dropping a term, Delta's, P dO's or dP's, fails)."""
    from sparse_mqa_kernels.backward_model import Block

    dqk, dv, scale, p = 8, 4, 0.7, 0.375
    v = np.zeros(dqk, dtype=np.float32)
    v[0] = 3.0
    kv = v[None, None, :]  # [B=1, Skv=1, Dqk]
    q = np.zeros(dqk, dtype=np.float32)
    q[0] = 1.5
    grad_out = np.zeros(dv, dtype=np.float32)
    grad_out[0] = 2.0  # along v[:Dv]
    delta = -5.0  # dP = dO . v = 6: |dP - Delta| = |dO| |v| + |Delta|
    one = (1, 1, 1)  # one batch, one query, one head; one slot
    blk = Block((np.array([0]), np.array([0])), None, np.ones(one, bool),
                (np.full(one + (1,), p, np.float32), q.reshape(one + (dqk,)), grad_out.reshape(one + (dv,)),
                 np.full(one + (1,), delta, np.float32)))
    ds = p * (float(grad_out @ v[:dv]) - delta) * scale
    contrib = ds * q.astype(np.float64)
    contrib[:dv] += p * grad_out
    for dp in study.BOUNDS:
        bound = study.row_bound(blk, kv, dv, scale, dp)
        assert bound.shape == (1,) and abs(contrib).max() == pytest.approx(float(bound[0]), rel=1e-6), dp
