"""Bad inputs and cases outside the declared domain are refused with a clear error, inputs untouched."""

import pytest
from hypothesis import example, given, settings  # noqa: F401 (example: for reproducer patches)

from sparse_mqa_testkit import profiles
from sparse_mqa_testkit.cases import Case  # noqa: F401 (for @example(case=Case(...)) patches)
from sparse_mqa_testkit.strategies import backend_cases, outside_dims
from sparse_mqa_testkit.suite import run_check


@settings(profiles.active())
@given(case=backend_cases())
def test_rejection(smqa_backend, case):
    run_check("rejection", smqa_backend, case)


@pytest.fixture(scope="session")
def restricted_backend(smqa_backend):
    if not outside_dims(smqa_backend):
        pytest.skip(f"backend {smqa_backend.name!r} declares no (Dqk, Dv) restriction: nothing outside its "
                    "domain to refuse")
    return smqa_backend


@settings(profiles.active())
@given(case=backend_cases(outside=True))
def test_rejection_outside_domain(restricted_backend, smqa_backend, case):
    run_check("rejection", smqa_backend, case)
