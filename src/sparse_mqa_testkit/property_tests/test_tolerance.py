"""Backward (and forward) results within k x the error of a bf16-output oracle, per tensor."""

import pytest
from hypothesis import example, given, settings  # noqa: F401 (example: for reproducer patches)

from sparse_mqa_testkit import profiles
from sparse_mqa_testkit.cases import Case  # noqa: F401 (for @example(case=Case(...)) patches)
from sparse_mqa_testkit.strategies import backend_cases
from sparse_mqa_testkit.suite import run_check


@settings(profiles.active())
@given(case=backend_cases())
def test_tolerance(smqa_backend, case):
    run_check("tolerance", smqa_backend, case)


@settings(profiles.active())
@given(case=backend_cases())
def test_forward_tolerance(smqa_backend, case):
    if not callable(getattr(smqa_backend, "forward", None)):
        pytest.skip(f"backend {smqa_backend.name!r} has no forward()")
    run_check("forward_tolerance", smqa_backend, case)
