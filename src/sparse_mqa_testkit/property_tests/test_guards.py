"""Rows that must never be read are poisoned with NaN; outputs must be fully written."""

from hypothesis import example, given, settings  # noqa: F401 (example: for reproducer patches)

from sparse_mqa_testkit import profiles
from sparse_mqa_testkit.cases import Case  # noqa: F401 (for @example(case=Case(...)) patches)
from sparse_mqa_testkit.strategies import backend_cases
from sparse_mqa_testkit.suite import run_check


@settings(profiles.active())
@given(case=backend_cases())
def test_guards(smqa_backend, case):
    run_check("guards", smqa_backend, case)
