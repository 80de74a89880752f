"""The scale tier: a handful of production-shaped cases per CUDA backend, each checked for tolerance against
the device oracle and for bitwise determinism.

Small drawn cases never reach bugs that live at production sizes: 32-bit offsets past 2^31 elements, block
tails deep in a 2048-wide top-k loop, thousands of terms reaching one KV row. ``FIXED`` names the cases every
run has (one with q past 2^31 elements, a 128K cache with a 2048-wide top-k, hot rows with a fan-in of 10^5);
``scale_cases`` draws more inside ``LIMITS``. The tier does not shrink a failure (each example costs seconds
of device time, and a shrink would replay dozens): its replay line is the reproducer. What a case needs on the
device is estimated up front (``device_bytes``); a case that does not fit is skipped with the numbers.
"""

from __future__ import annotations

from hypothesis import strategies as st

from .. import contract
from ..backends.spec import BackendSpec
from .case import Case
from .strategies import cases, draw_examples

LIMITS = dict(B=8, S=8192, Skv=131072, L=2048)
HEADS = (64, 128)
WORK = 1 << 30  # B * S * H * L: the float64 oracle's work (~1e13 flop at 576 dims) stays seconds per case
DRAWN = {"dev": 1, "ci": 2, "scale": 2, "nightly": 6}  # drawn cases beside FIXED, per profile

FIXED = (
    # q = 8 * 4096 * 128 * 576 = 2.4e9 elements, past 2^31: 32-bit offsets overflow here
    Case(B=8, S=4096, Skv=8192, H=128, L=16, Dqk=576, Dv=512, sink="finite", pattern="local", seed=1),
    # a 128K cache and a 2048-wide top-k: many KV blocks per row; gradients spanning 2^+-20
    Case(B=1, S=1024, Skv=131072, H=64, L=2048, Dqk=576, Dv=512, sink="finite", pattern="local",
         magnitude="spread", seed=2),
    # hot rows: 8 KV rows named by all 2 x 512 queries x 128 heads (fan-in 131072 each), mixed invalid slots
    Case(B=2, S=512, Skv=32768, H=128, L=2048, Dqk=576, Dv=512, sink="mixed", topk="random", invalid="mixed",
         pattern="hot", seed=3),
)


@st.composite
def scale_cases(draw, *, dims=contract.PRODUCTION_DIMS) -> Case:
    """A production-shaped case: H 64 or 128, B <= 8, S <= 8192, Skv <= 128K, L <= 2048 (often the full 2048),
    B * S * H * L <= ``WORK``; patterns, magnitudes, sinks and invalid slots drawn as everywhere."""
    modes = draw(cases(dims=dims, max_b=1, max_s=1, max_skv=1, max_h=1, max_l=1))  # every field but the sizes
    h = draw(st.sampled_from(HEADS))
    b = draw(st.integers(1, LIMITS["B"]))
    l_ = draw(st.sampled_from((LIMITS["L"], 1024, 512, 128)) | st.integers(1, LIMITS["L"]))
    s = draw(st.integers(1, max(1, min(LIMITS["S"], WORK // (b * h * l_)))))
    skv = draw(st.sampled_from((LIMITS["Skv"], 65536, 8192)) | st.integers(1, LIMITS["Skv"]))
    return modes.replace(B=b, S=s, Skv=skv, H=h, L=l_)


def tier_cases(backend, profile: str, seed: int | None = None) -> list[Case]:
    """The tier's cases for ``backend``: the ``FIXED`` ones inside its domain, then ``DRAWN[profile]`` drawn
    ones (derandomized unless ``seed``)."""
    spec = BackendSpec.of(backend)
    dims = tuple(d for d in (spec.dims or contract.PRODUCTION_DIMS) if d in contract.PRODUCTION_DIMS) \
        or contract.PRODUCTION_DIMS

    def inside(c: Case) -> bool:
        return (c.Dqk, c.Dv) in dims and spec.supports(c) is None

    strategy = scale_cases(dims=dims).filter(inside)
    return [c for c in FIXED if inside(c)] + draw_examples(strategy, DRAWN.get(profile, 2), seed=seed)
