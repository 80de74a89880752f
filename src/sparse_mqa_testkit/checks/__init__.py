"""Conformance checks, each usable on its own in a downstream test::

    from sparse_mqa_testkit import Case, check_backward_tolerance
    check_backward_tolerance(my_backend, Case(H=17, invalid="holes")).raise_if_failed()

A check never raises on a kernel mismatch: it returns a ``CheckResult`` (``passed``, ``ratio`` = worst
measured / allowed, ``per_tensor``, ``message``, ``notes``); ``raise_if_failed()`` raises ``CheckFailure``.
A check that does not apply to the backend (the execution checks on a CPU backend: "CUDA only") returns a result
with ``skipped`` set, which has not passed; ``raise_if_failed()`` raises ``CheckSkipped`` for it.
``CHECKS`` (``checks.registry``) declares them all.
"""

from .allocations import check_allocations
from .determinism import check_determinism
from .graph import check_graph
from .guards import check_guards
from .host_sync import check_host_sync
from .registry import CHECKS, Check, get_check
from .rejection import check_rejection
from .repeats import check_repeats
from .result import CheckFailure, CheckResult, CheckSkipped
from .streams import check_streams
from .tolerance import check_backward_tolerance, check_forward_tolerance

__all__ = ["CHECKS", "Check", "CheckFailure", "CheckResult", "CheckSkipped", "check_allocations",
           "check_backward_tolerance", "check_determinism", "check_forward_tolerance", "check_graph",
           "check_guards", "check_host_sync", "check_rejection", "check_repeats", "check_streams", "get_check"]
