"""The scale tier's plan: production shapes (one case past 2^31 q elements), inside the backend's domain, and
a memory estimate that skips what does not fit, with the numbers."""

from __future__ import annotations

import pytest
import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.cases import Case, scale
from sparse_mqa_testkit.cases.strategies import draw_examples
from sparse_mqa_testkit.checks import memory


def test_fixed_cases_reach_the_production_bugs():
    qs = [c.B * c.S * c.H * c.Dqk for c in scale.FIXED]
    assert max(qs) > 2 ** 31, "one case has q past 2^31 elements (32-bit offsets)"
    assert any(c.Skv == scale.LIMITS["Skv"] and c.L == scale.LIMITS["L"] for c in scale.FIXED)
    assert {c.pattern for c in scale.FIXED} >= {"local", "hot"} and any(c.magnitude == "spread" for c in scale.FIXED)
    for c in scale.FIXED:
        assert (c.Dqk, c.Dv) in contract.PRODUCTION_DIMS and c.H in scale.HEADS
        assert c.B * c.S * c.H * c.L <= scale.WORK


def test_drawn_cases_stay_inside_the_limits():
    for c in draw_examples(scale.scale_cases(), 40, seed=3):
        assert c.H in scale.HEADS and 1 <= c.B <= 8 and 1 <= c.S <= 8192 and 1 <= c.Skv <= 131072
        assert 1 <= c.L <= 2048 and c.B * c.S * c.H * c.L <= scale.WORK and (c.Dqk, c.Dv) in contract.PRODUCTION_DIMS


def test_plan_keeps_the_backends_domain():
    class OnlySmallL:
        dims = [(576, 512)]

        def supports(self, case):
            return None if case.L <= 1024 else f"L must be <= 1024, got {case.L}"

    cases = scale.tier_cases(OnlySmallL(), "ci")
    assert cases and all(c.L <= 1024 for c in cases)
    assert scale.FIXED[0] in cases and scale.FIXED[1] not in cases
    assert scale.tier_cases(OnlySmallL(), "ci") == cases, "derandomized: the same plan every run"

    class OtherDims:
        dims = [(128, 128)]

    assert all((c.Dqk, c.Dv) in contract.PRODUCTION_DIMS for c in scale.tier_cases(OtherDims(), "dev"))


def test_device_bytes_counts_the_float64_oracle_and_grows_with_the_case():
    big, small = scale.FIXED[0], Case(S=4, Skv=8, H=64, L=16, Dqk=576, Dv=512)
    q = big.B * big.S * big.H * big.Dqk
    assert memory.device_bytes(big) > 8 * q + 2 * q, "at least the float64 dq and the bf16 q"
    assert memory.device_bytes(big) > memory.device_bytes(small)
    assert memory.device_bytes(big, repeats=4) > memory.device_bytes(big, repeats=2)


def test_a_case_that_does_not_fit_is_skipped_with_the_numbers(monkeypatch):
    assert memory.fits(scale.FIXED[0], "cpu") is None  # the host is not measured
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (40 << 30, 141 << 30))
    reason = memory.fits(scale.FIXED[0], "cuda:0")
    assert reason and "needs ~" in reason and "GiB on cuda:0, 40.0 GiB free of 141.0 GiB" in reason
    assert scale.FIXED[0].describe() in reason
    assert memory.fits(Case(S=4, Skv=8, H=64, L=16, Dqk=576, Dv=512), "cuda:0") is None


@pytest.mark.parametrize("case", scale.FIXED, ids=lambda c: c.describe())
def test_fixed_cases_fit_an_h200(case):
    # an H200 has 141 GiB; the tier must not plan cases it can only skip there
    assert memory.device_bytes(case) < 135 << 30
