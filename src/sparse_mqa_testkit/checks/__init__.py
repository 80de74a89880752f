"""Conformance checks, each usable on its own in a downstream test::

    from sparse_mqa_testkit.checks import check_backward_tolerance
    check_backward_tolerance(my_backend, Case(H=17, invalid="holes")).raise_if_failed()

A check never raises on a kernel mismatch: it returns a ``CheckResult`` (``passed``, ``ratio`` = worst
measured / allowed, ``per_tensor``, ``message``, ``notes``); ``raise_if_failed()`` raises ``CheckFailure``.
"""

from .determinism import check_determinism, poison_allocator
from .guards import check_guards, unreferenced_rows
from .inputs import backend_inputs, oracle_results
from .rejection import ErrorInput, check_rejection, error_inputs
from .report import CHECKS, FAILED_RATIO, CheckFailure, CheckResult, repro_command
from .tolerance import FLOORS, K_DEFAULT, check_backward_tolerance, check_forward_tolerance, compare_tensor

CHECK_FUNCTIONS = {
    "tolerance": check_backward_tolerance,
    "forward_tolerance": check_forward_tolerance,
    "determinism": check_determinism,
    "rejection": check_rejection,
    "guards": check_guards,
}

__all__ = ["CHECKS", "CHECK_FUNCTIONS", "FAILED_RATIO", "CheckFailure", "CheckResult", "ErrorInput", "FLOORS",
           "K_DEFAULT", "backend_inputs", "check_backward_tolerance", "check_determinism",
           "check_forward_tolerance", "check_guards", "check_rejection", "compare_tensor", "error_inputs",
           "oracle_results", "poison_allocator", "repro_command", "unreferenced_rows"]
