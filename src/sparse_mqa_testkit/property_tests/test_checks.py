"""Every check of the registry (``sparse_mqa_testkit.checks.CHECKS``) on cases drawn inside the backend's
declared domain; the checks that judge refusals also on cases outside it; and the drawing's own coverage of
the backend's boundary classes. The plugin parametrizes ``smqa_check`` over the registry and applies the
selected profile's settings."""

import pytest
from hypothesis import example, given  # noqa: F401 (example: for reproducer patches)

from sparse_mqa_testkit import Case, backend_cases  # noqa: F401 (Case: for @example(case=Case(...)) patches)
from sparse_mqa_testkit.strategies import backend_dims, boundary_examples, case_events, cases_for, draw_examples

COVERAGE_DRAWS = 300


@given(case=backend_cases())
def test_check(smqa_check, case):
    smqa_check(case)


@pytest.mark.smqa_outside_domain
@given(case=backend_cases(outside=True))
def test_check_outside_domain(smqa_check, case):
    smqa_check(case)


def test_boundary_coverage(smqa_backend, smqa_checks):
    tiles = dict(getattr(smqa_backend, "tiles", None) or {})
    drawn = draw_examples(cases_for(smqa_backend), COVERAGE_DRAWS)
    dims = set(backend_dims(smqa_backend))
    seen = set()
    for case in drawn:
        refused = smqa_backend.supports(case) if hasattr(smqa_backend, "supports") else None
        assert refused is None, f"drew a case outside the domain ({refused}): {case.repro()}"
        assert (case.Dqk, case.Dv) in dims, f"drew dims {(case.Dqk, case.Dv)} outside {sorted(dims)}"
        seen.update(case_events(case, tiles))
        smqa_checks.recorder.add_case(case)
    missing = sorted(set(boundary_examples(smqa_backend)) - seen)
    assert not missing, (f"{len(drawn)} cases drawn for backend {smqa_backend.name!r} (tiles {tiles}) never "
                         f"reached: {', '.join(missing)}")
