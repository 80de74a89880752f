"""The suite catches real bugs: each deliberately broken CPU backend (tests/broken_backends.py) fails the check
we expect, on a fixed case and in a small Hypothesis search, while ``reference`` passes every check."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from sparse_mqa_testkit.backends import get_backend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.strategies import cases
from sparse_mqa_testkit.checks import CHECKS
from support import BROKEN, EmulatedKernel

# bug -> (the check that must catch it, a small case that triggers it)
EXPECTED = {
    "flipped_sink": ("tolerance", Case(S=4, H=3, sink="finite", seed=1)),
    "minus_one_as_zero": ("tolerance", Case(S=4, invalid="holes", seed=2)),
    "topk_ignored": ("tolerance", Case(S=4, topk="random", seed=3)),
    "base2_lse_forward": ("forward_tolerance", Case(S=4, sink="finite", seed=4)),
    "base2_lse_backward": ("tolerance", Case(S=4, seed=5)),
    "float16_accepted": ("rejection", Case(S=2, seed=6)),
    "random_order_dkv": ("determinism", Case(S=4, Skv=8, seed=7)),
    "head_group_dropped": ("tolerance", Case(S=2, H=17, seed=8)),
    "stale_row": ("guards", Case(S=8, Skv=24, invalid="empty_rows", seed=9)),
    "mask_multiply": ("guards", Case(S=4, Skv=64, L=4, invalid="holes", seed=10)),
}

SEARCH = settings(max_examples=20, derandomize=True, database=None, deadline=None,
                  phases=(Phase.generate,), suppress_health_check=list(HealthCheck))


def make(bug):
    return BROKEN[bug]()


def test_every_bug_has_an_expectation():
    assert set(EXPECTED) == set(BROKEN)


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_fixed_case_caught_by_expected_check(bug):
    check, case = EXPECTED[bug]
    res = CHECKS[check].function(make(bug), case)
    assert not res.passed, f"{bug} slipped through {check} on {case.repro()}"
    assert res.check == check
    assert "repro: sparse-mqa-check --backend" in res.message and case.repro() in res.message
    with pytest.raises(AssertionError):
        res.raise_if_failed()


def _applicable(backend):
    """The checks that apply to a CPU backend (the execution checks are CUDA only: skipped, tested elsewhere)."""
    return [(n, c.function) for n, c in CHECKS.items() if c.applies_to(backend) is None]


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_reference_passes_every_check_on_the_same_case(bug):
    _, case = EXPECTED[bug]
    ref = get_backend("reference")
    for name, fn in _applicable(ref):
        res = fn(ref, case)
        assert res.passed, res.message


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_a_plausible_bf16_kernel_passes_every_check_on_the_same_case(bug):
    # the other side of the coin: a bug-free kernel with real bf16 rounding and unordered atomics is not flagged
    _, case = EXPECTED[bug]
    for name, fn in _applicable(EmulatedKernel()):
        res = fn(EmulatedKernel(), case)
        assert res.passed, res.message


@pytest.mark.parametrize("bug", sorted(EXPECTED))
def test_search_finds_a_failing_case(bug):
    check, _ = EXPECTED[bug]
    fn = CHECKS[check].function
    backend = make(bug)
    tiles = getattr(backend, "tiles", None) or None
    strategy = cases(tiles=tiles, max_s=8, max_skv=32, max_l=12)
    hits = []

    @SEARCH
    @given(strategy)
    def probe(case):
        if not hits:
            res = fn(backend, case)
            if not res.passed:
                hits.append(res)

    probe()
    assert hits, f"{check} found no failing case for {bug} in {SEARCH.max_examples} drawn cases"
    assert hits[0].check == check and hits[0].message
    found = hits[0].case
    assert fn(get_backend("reference"), found).passed, f"reference fails {check} on {found.repro()}"
