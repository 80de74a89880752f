"""Conformance checks, each usable on its own in a downstream test::

    from sparse_mqa_testkit import Case, check_backward_tolerance
    check_backward_tolerance(my_backend, Case(H=17, invalid="holes")).raise_if_failed()

A check never raises on a kernel mismatch: it returns a ``CheckResult`` (``passed``, ``ratio`` = worst
measured / allowed, ``per_tensor``, ``message``, ``notes``); ``raise_if_failed()`` raises ``CheckFailure``.
``CHECKS`` (``checks.registry``) declares them all.
"""

from .determinism import check_determinism
from .guards import check_guards
from .registry import CHECKS, Check, get_check
from .rejection import check_rejection
from .result import CheckFailure, CheckResult
from .tolerance import check_backward_tolerance, check_forward_tolerance

__all__ = ["CHECKS", "Check", "CheckFailure", "CheckResult", "check_backward_tolerance", "check_determinism",
           "check_forward_tolerance", "check_guards", "check_rejection", "get_check"]
