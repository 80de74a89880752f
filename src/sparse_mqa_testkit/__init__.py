"""sparse-mqa-testkit: reference oracle and conformance suite for absorbed-MQA sparse attention backward kernels.

Everything a kernel author needs is importable from here::

    from sparse_mqa_testkit import BackendBase, Case, backend_cases, check_backward_tolerance

``sparse_mqa_testkit.contract`` holds the contract every piece imports. The names below are loaded on first
use, so that the pytest plugin (loaded wherever the package is installed) costs nothing where it is not used.
"""

from .lazy import lazy_exports

__version__ = "0.1.0"

_PUBLIC = {
    "Case": "cases",
    "backend_cases": "cases.strategies",
    "cases_for": "cases.strategies",
    "Call": "calls",
    "CHECKS": "checks",
    "CheckFailure": "checks",
    "CheckResult": "checks",
    "CheckSkipped": "checks",
    "check_allocations": "checks",
    "check_backward_tolerance": "checks",
    "check_determinism": "checks",
    "check_forward_tolerance": "checks",
    "check_graph": "checks",
    "check_guards": "checks",
    "check_host_sync": "checks",
    "check_rejection": "checks",
    "check_repeats": "checks",
    "check_streams": "checks",
    "Backend": "backends",
    "BackendBase": "backends",
    "MissingDependency": "backends",
    "get_backend": "backends",
    "BackendSpec": "backends",
    "ByHeads": "backends",
    "forward": "oracle",
    "backward": "oracle",
}

__all__ = sorted(_PUBLIC) + ["__version__"]
__getattr__ = lazy_exports(__name__, {name: f"{__name__}.{module}" for name, module in _PUBLIC.items()})
