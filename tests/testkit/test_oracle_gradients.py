"""The float64 oracle backward against central finite differences of the float64 oracle forward.

Directional check: for the scalar phi(theta) = <dO, out(theta)> and a random direction v,
(phi(theta + eps v) - phi(theta - eps v)) / (2 eps) must equal <J^T dO, v> = <backward(dO), v>, for q, kv and
the sink separately, to a relative error of 1e-6. out is finite everywhere (empty rows and +inf sinks give 0),
so phi is differentiable; lse is not part of phi (the backward takes no lse cotangent, and lse is +inf on empty
rows). Only finite sinks are perturbed; +-inf sinks stay where they are.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from sparse_mqa_testkit import oracle
from support import every_feature, kwargs, small_cases

# Relative step: float64 rounding error in phi is ~1e-16 |phi| / eps ~ 1e-10 relative, the central-difference
# truncation error ~ eps^2 |phi'''| ~ 1e-12: both far below the 1e-6 asked of the gradient.
EPS = 1e-6
RTOL = 1e-6


U64 = 2.0**-53


def _phi(x, q, kv, sink):
    """phi = <dO, out> and a bound on the size of what its rounding scales with, sum |dO| max |V| (for the
    rounding-noise floor): out = sum_t p_t V_t carries rounding errors of a few u sum_t p_t |V_t| <= u max |V|
    however much its slots cancel, not of u |out|."""
    kw = {**kwargs(x), "attn_sink": sink}
    out, _ = oracle.forward(q, kv, x["indices"], dtype=np.float64, **kw)
    assert np.isfinite(out).all()
    dO = x["grad_out"].astype(np.float64)
    v = np.abs(kv[..., :out.shape[-1]])
    return float(np.sum(dO * out)), float(np.sum(np.abs(dO))) * float(v[np.isfinite(v)].max(initial=0.0))


def _check(name, fd_noise, grad, v):
    """|fd - <grad, v>| <= RTOL * sum|grad * v| + noise.

    Relative to the terms' own size, so cancellation in <grad, v> is judged fairly. ``noise`` is the finite
    difference's own rounding floor, 16 u sum |dO| max |V| / h (``_phi``): it matters where the true derivative is 0
    (e.g. Skv = 1, where out does not depend on q at all and phi moves by a few ulps only) and where a large dO
    meets slots that cancel in out (dO of 1e6 on an out of 1e-3: phi's rounding, divided by h, is then 1e-5 of a
    derivative of order 1).
    """
    fd, noise = fd_noise
    analytic = float(np.sum(grad * v))
    allowed = RTOL * float(np.sum(np.abs(grad * v))) + noise
    assert abs(fd - analytic) <= allowed, (
        f"d{name}: finite difference {fd!r} vs backward {analytic!r} (|diff| {abs(fd - analytic):.3e}, "
        f"allowed {allowed:.3e})")


@settings(max_examples=250, deadline=None)
@given(case=small_cases())
@every_feature
def test_backward_matches_central_differences(case):
    x = case.inputs()
    q = x["q"].astype(np.float64)
    kv = x["kv"].astype(np.float64)
    sink = None if x["attn_sink"] is None else x["attn_sink"].astype(np.float64)
    dq, dkv, d_sink = oracle.backward(q, kv, x["indices"], x["grad_out"], dtype=np.float64,
                                      **{**kwargs(x), "attn_sink": sink})
    rng = np.random.default_rng(case.seed ^ 0x5EED)

    h = EPS * max(1.0, float(np.abs(q).max()), float(np.abs(kv).max()))

    def fd(vq, vkv, vs):
        plus, mag = _phi(x, q + h * vq, kv + h * vkv, None if sink is None else sink + h * vs)
        minus, _ = _phi(x, q - h * vq, kv - h * vkv, None if sink is None else sink - h * vs)
        return (plus - minus) / (2 * h), 16 * U64 * mag / h

    zq, zkv = np.zeros_like(q), np.zeros_like(kv)
    zs = None if sink is None else np.zeros_like(sink)
    vq = rng.standard_normal(q.shape)
    _check("q", fd(vq, zkv, zs), dq, vq)
    vkv = rng.standard_normal(kv.shape)
    _check("kv", fd(zq, vkv, zs), dkv, vkv)
    if sink is not None:
        # perturb finite sinks only: +-inf + eps is still +-inf, and inf - inf would poison the difference
        vs = np.where(np.isfinite(sink), rng.standard_normal(sink.shape), 0.0)
        _check("sink", fd(zq, zkv, vs), d_sink, vs)


def test_the_check_catches_a_gradient_off_by_a_part_in_ten_thousand():
    """Meta-test: the noise floor stays far below a real error: each gradient scaled by 1 + 1e-4 fails the check,
    including on a case with dO of 1e6 (where the floor is widest)."""
    import pytest

    from sparse_mqa_testkit.cases import Case

    for magnitude in ("unit", "spread"):
        case = Case(B=1, S=4, Skv=10, H=2, L=6, Dqk=8, Dv=4, sink="finite", magnitude=magnitude, seed=3)
        x = case.inputs()
        q, kv, sink = (x[k].astype(np.float64) for k in ("q", "kv", "attn_sink"))
        grads = oracle.backward(q, kv, x["indices"], x["grad_out"], dtype=np.float64,
                                **{**kwargs(x), "attn_sink": sink})
        rng = np.random.default_rng(0)
        h = EPS * max(1.0, float(np.abs(q).max()), float(np.abs(kv).max()))
        for k, (name, g) in enumerate(zip(("q", "kv", "sink"), grads)):
            v = rng.standard_normal(g.shape)
            shifted = [t + h * v if j == k else t for j, t in enumerate((q, kv, sink))]
            plus, mag = _phi(x, *shifted)
            shifted = [t - h * v if j == k else t for j, t in enumerate((q, kv, sink))]
            minus, _ = _phi(x, *shifted)
            fd = ((plus - minus) / (2 * h), 16 * U64 * mag / h)
            _check(name, fd, g, v)
            with pytest.raises(AssertionError, match=f"d{name}: finite difference"):
                _check(name, fd, g * (1 + 1e-4), v)
