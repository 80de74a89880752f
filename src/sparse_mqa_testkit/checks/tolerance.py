"""Tolerance: a backend's results against the float64 oracle under the error model (``sparse_mqa_testkit.compare``),
over each whole result and row by row."""

from __future__ import annotations

import math

from ..backends.spec import BackendSpec
from ..compare import Expected, compare_outputs
from ..compare.model import K_DEFAULT
from .result import exception_summary, result


def _tolerance(check: str, direction: str, backend, case, k, floor, expected):
    spec = BackendSpec.of(backend)
    try:
        exp = expected or Expected.for_backend(spec, case)
        outs = exp.call(spec.device).results(spec.backend, direction)
    except Exception as exc:  # a crash is a failure, reported with where it came from
        return result(check, spec, case, [f"{direction} raised {exception_summary(exc)}"], ratio=math.inf,
                      per_tensor={})
    per_tensor, problems, worst = compare_outputs(outs, exp, k=k, floor=floor, device=spec.device)
    return result(check, spec, case, problems, ratio=worst, per_tensor=per_tensor)


def check_backward_tolerance(backend, case, *, k: float = K_DEFAULT, floor=None, expected: Expected | None = None):
    """dq, dkv, d_sink of ``backend.backward`` against the float64 oracle under the error model.

    floor: None (``compare.FLOORS``), a number for every result, or {result: floor}. expected: the case's
    ``compare.Expected``, when the caller has it already.
    """
    return _tolerance("tolerance", "backward", backend, case, k, floor, expected)


def check_forward_tolerance(backend, case, *, k: float = K_DEFAULT, floor=None, expected: Expected | None = None):
    """out and lse of ``backend.forward`` against the float64 oracle; passes with a note if it has no forward."""
    if not BackendSpec.of(backend).has_forward:
        return result("forward_tolerance", backend, case, [], ratio=0.0, per_tensor={},
                      notes={"skipped": "backend has no forward"})
    return _tolerance("forward_tolerance", "forward", backend, case, k, floor, expected)
