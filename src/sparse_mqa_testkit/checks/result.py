"""What a check returns (``CheckResult``), what it raises (``CheckFailure``) and how failures read.

Messages follow ``torch.testing.assert_close``: the tensor, measured vs allowed, the mismatch count, the worst
element with its index and both values; then the case, its seed and a one-line command that replays it.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field

from ..backends.spec import BackendSpec

# ratio of a failure that has no measure (wrong shape, crash, bits differ, not rejected): large but finite,
# so a search can still use ratio as ``hypothesis.target`` (which refuses inf and NaN)
FAILED_RATIO = 1e9


def finite_ratio(x: float) -> float:
    """A ratio as a finite number: inf, NaN and anything past ``FAILED_RATIO`` become ``FAILED_RATIO``."""
    x = float(x)
    return x if math.isfinite(x) and x < FAILED_RATIO else FAILED_RATIO


class CheckFailure(AssertionError):
    """A conformance check failed; ``str()`` is the full failure message."""


class CheckSkipped(Exception):
    """A check that does not apply to the backend (``CheckResult.skipped`` says why) was asked to pass: it did not
    run, so it did not pass either. The pytest harness reports it as a skip."""


def repro_command(backend_name: str, check: str, case) -> str:
    """The one-line command that replays ``check`` on ``case`` for a backend."""
    return f"sparse-mqa-check --backend {backend_name} --check {check} --replay \"{case.repro()}\""


@dataclass
class CheckResult:
    """Outcome of one check on one backend and case.

    ratio is the worst measured / allowed over tensors (< 1 passes; always finite, ``FAILED_RATIO`` for a
    failure with no measure), so a search can maximise it. per_tensor maps a tensor name to {"error", "allowed", ...}.
    skipped: why the check did not run (a CUDA-only check on a CPU backend, say); such a result has not passed.
    """

    check: str
    backend: str
    case: object
    passed: bool
    ratio: float = 0.0
    per_tensor: dict = field(default_factory=dict)
    message: str = ""
    notes: dict = field(default_factory=dict)
    skipped: str = ""

    def replayed_as(self, given: str) -> "CheckResult":
        """This result with its replay line naming the backend as the run was ``given`` it (``module:attr``),
        which the backend's own ``name`` may not resolve to."""
        if not self.passed and given != self.backend:
            self.message = self.message.replace(repro_command(self.backend, self.check, self.case),
                                                repro_command(given, self.check, self.case))
        return self

    def raise_if_failed(self) -> None:
        """CheckFailure when it failed, CheckSkipped when it did not run."""
        if self.skipped:
            raise CheckSkipped(self.message)
        if not self.passed:
            raise CheckFailure(self.message)


def backend_name(backend) -> str:
    return BackendSpec.of(backend).name


def case_footer(backend, check: str, case) -> str:
    return (f"case: {case.describe()}\n"
            f"seed: {case.seed}\n"
            f"repro: {repro_command(backend_name(backend), check, case)}")


def failure_message(backend, check: str, case, problems: list[str]) -> str:
    """Header naming check and backend, one block per problem, then the case and its repro line."""
    head = f"{check} check failed for backend {backend_name(backend)!r}"
    body = "\n".join(p.rstrip() for p in problems)
    return f"{head}\n{body}\n{case_footer(backend, check, case)}"


def exception_summary(exc: BaseException, frames: int = 4) -> str:
    """The exception line plus the last few frames: enough to find the raise without a full dump."""
    tb = traceback.extract_tb(exc.__traceback__)[-frames:]
    lines = [f"    {f.filename}:{f.lineno} in {f.name}: {f.line or ''}".rstrip() for f in tb]
    return "".join(traceback.format_exception_only(type(exc), exc)).strip() + (
        "\n  traceback (last frames):\n" + "\n".join(lines) if lines else "")


def result(check, backend, case, problems, *, ratio, per_tensor, notes=None) -> CheckResult:
    passed = not problems
    return CheckResult(check=check, backend=backend_name(backend), case=case, passed=passed,
                       ratio=finite_ratio(ratio),
                       per_tensor=per_tensor, message="" if passed else failure_message(backend, check, case,
                                                                                        problems),
                       notes=dict(notes or {}))


def skipped_result(check, backend, case, reason: str) -> CheckResult:
    """The result of a check that does not apply: not passed, with the reason."""
    return CheckResult(check=check, backend=backend_name(backend), case=case, passed=False, ratio=0.0,
                       message=f"{check} check skipped for backend {backend_name(backend)!r}: {reason}",
                       skipped=reason)
