"""Every check of the registry (``sparse_mqa_testkit.checks.CHECKS``): first on explicit cases that visit every
boundary class the backend's declared domain allows, then on cases Hypothesis draws inside that domain; and
the checks that judge refusals also on cases outside it; with ``--smqa-scale`` (or the scale profile alone) the
production-shaped tier. The plugin parametrizes ``smqa_check`` over the registry and applies the selected
profile's settings."""

import pytest
from hypothesis import example, given  # noqa: F401 (example: for reproducer patches)

from sparse_mqa_testkit import Case, backend_cases  # noqa: F401 (Case: for @example(case=Case(...)) patches)
from sparse_mqa_testkit.checks.memory import DETERMINISM_REPEATS


def test_check_boundaries(smqa_check, smqa_plan):
    """Each boundary class once, as an explicit case that makes its boundary matter; then what actually ran must
    cover every class the domain allows, effectively (those it cannot reach are listed with the reason, and the
    merges left out for cancelling a boundary, in the table)."""
    boundaries = smqa_plan.boundaries
    smqa_check.recorder.unreachable = dict(boundaries.unreachable)
    smqa_check.recorder.rejected = list(boundaries.rejected)
    for case in boundaries.examples:
        smqa_check(case)
    coverage = smqa_check.recorder.coverage
    missing = sorted(c for c in boundaries.classes if not coverage.get(c, {}).get("effective"))
    assert not missing, (f"{smqa_check}: the explicit cases never made {', '.join(missing)} bite; they were "
                         f"{[c.repro() for c in boundaries.examples]}")


@given(case=backend_cases())
def test_check(smqa_check, case):
    smqa_check(case)


@pytest.mark.smqa_outside_domain
@given(case=backend_cases(outside=True))
def test_check_outside_domain(smqa_check, case):
    smqa_check(case)


@pytest.mark.smqa_scale
def test_scale(smqa_checks, smqa_scale_case):
    """A production-shaped case (``sparse_mqa_testkit.scale``): the backward (and forward) against the float64
    device oracle row by row, then bitwise determinism over two runs."""
    smqa_checks.tolerance(smqa_scale_case)
    smqa_checks.forward_tolerance(smqa_scale_case)
    smqa_checks.determinism(smqa_scale_case, repeats=DETERMINISM_REPEATS)
