"""The checks, declared once: the CLI, the pytest plugin, the table and the property tests all read ``CHECKS``.

A new check is one function ``check_x(backend, case, **options) -> CheckResult`` and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..backends.spec import BackendSpec
from . import graph
from .allocations import check_allocations
from .determinism import check_determinism
from .execution import cuda_only
from .guards import check_guards
from .host_sync import check_host_sync
from .rejection import check_rejection
from .repeats import check_repeats
from .streams import check_streams
from .tolerance import check_backward_tolerance, check_forward_tolerance


@dataclass(frozen=True)
class Check:
    """One conformance check.

    directions: what it calls (``backward``, ``forward``); a check of the forward alone is skipped for a
    backend without one. outside_domain: it also judges cases the backend declares it does not support.
    requires: why it does not apply to a backend (``BackendSpec -> str | None``), beyond its directions.
    execution: it judges how a call runs on a CUDA device (CUDA only; the suite draws fewer cases for it,
    ``harness.profiles.EXECUTION_EXAMPLES``).
    """

    name: str
    function: Callable
    directions: tuple[str, ...]
    help: str
    outside_domain: bool = False
    requires: Callable | None = None
    execution: bool = False

    def applies_to(self, backend) -> str | None:
        """None when the check can run on ``backend``, else why not."""
        spec = BackendSpec.of(backend)
        if not set(self.directions) & set(spec.directions):
            return f"backend {spec.name!r} has no {self.directions[0]}()"
        return self.requires(spec) if self.requires is not None else None


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
    Check("graph", graph.check_graph, ("backward", "forward"),
          "captured in a CUDA graph after warm-up and replayed, then replayed again after every captured input "
          "(indices and topk_length too, rows going empty) was overwritten in place: equal to eager calls",
          requires=graph.unavailable, execution=True),
    Check("streams", check_streams, ("backward", "forward"),
          "called on a side stream while the ambient stream is parked, and on the current stream with inputs "
          "written by a side stream: equal to a plain call (no work on the default stream)",
          requires=cuda_only, execution=True),
    Check("host_sync", check_host_sync, ("backward", "forward"),
          "a warmed-up call under torch.cuda.set_sync_debug_mode('error') never makes the host wait",
          requires=cuda_only, execution=True),
    Check("allocations", check_allocations, ("backward", "forward"),
          "a warmed-up call holds at most its outputs plus the workspace_bytes it declares (torch's caching "
          "allocator, requested bytes), and keeps nothing", requires=cuda_only, execution=True),
    Check("repeats", check_repeats, ("backward", "forward"),
          "the same bits (or within tolerance) over N calls, each after its outputs and a workspace-sized "
          "allocator were poisoned with NaN; N from the profile", requires=cuda_only, execution=True),
)}

def get_check(name: str) -> Check:
    """The registry entry for ``name`` (``check_tolerance`` and ``backward_tolerance`` name ``tolerance`` too)."""
    key = name.removeprefix("check_")
    key = {"backward_tolerance": "tolerance"}.get(key, key)
    if key not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(CHECKS)}, got {name!r}")
    return CHECKS[key]
