"""The checks, declared once: the CLI, the pytest plugin, the table and the property tests all read ``CHECKS``.

A new check is one function ``check_x(backend, case, **options) -> CheckResult`` and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..backends.spec import BackendSpec
from .determinism import check_determinism
from .guards import check_guards
from .rejection import check_rejection
from .tolerance import check_backward_tolerance, check_forward_tolerance


@dataclass(frozen=True)
class Check:
    """One conformance check.

    directions: what it calls (``backward``, ``forward``); a check of the forward alone is skipped for a
    backend without one. outside_domain: it also judges cases the backend declares it does not support.
    """

    name: str
    function: Callable
    directions: tuple[str, ...]
    help: str
    outside_domain: bool = False

    def applies_to(self, backend) -> str | None:
        """None when the check can run on ``backend``, else why not."""
        spec = BackendSpec.of(backend)
        if not set(self.directions) & set(spec.directions):
            return f"backend {spec.name!r} has no {self.directions[0]}()"
        return None


CHECKS = {c.name: c for c in (
    Check("tolerance", check_backward_tolerance, ("backward",),
          "dq, dkv and d_sink within k x the error a bf16-output kernel must make (float64 oracle)"),
    Check("forward_tolerance", check_forward_tolerance, ("forward",),
          "out and lse within k x the error a bf16-output kernel must make (float64 oracle)"),
    Check("determinism", check_determinism, ("backward", "forward"),
          "the same bits on every call, with a NaN-poisoned allocator and other streams (for a backend that "
          "claims determinism; drift within tolerance otherwise)"),
    Check("rejection", check_rejection, ("backward", "forward"),
          "bad dtypes, shapes, devices and values refused with a message naming the argument, cases outside "
          "the declared domain refused, the caller's tensors untouched", outside_domain=True),
    Check("guards", check_guards, ("backward", "forward"),
          "NaN in KV rows no valid slot names changes nothing; every output element written on every call"),
)}

def get_check(name: str) -> Check:
    """The registry entry for ``name`` (``check_tolerance`` and ``backward_tolerance`` name ``tolerance`` too)."""
    key = name.removeprefix("check_")
    key = {"backward_tolerance": "tolerance"}.get(key, key)
    if key not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {name!r}")
    return CHECKS[key]
