"""What one suite test observed, for the conformance table, and the one way a check runs inside the suite.

A ``Recorder`` belongs to one test item (the plugin keeps it in the item's stash and hands it to the
``smqa_check`` / ``smqa_checks`` fixtures): cases run, the worst ratio and where it was, the boundary classes
covered with their worst ratio, and the failure with its replay line. ``data()`` is JSON-able and travels to
the xdist controller in the report's ``user_properties``. ``run_check`` runs one registry check on one case,
records it, feeds ``hypothesis.target`` (the nightly profile climbs it) and raises on failure.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest
from hypothesis import target
from hypothesis.control import currently_in_test_context

from ..cases import Case
from ..cases.coverage import effective_events
from ..cases.strategies import case_events
from ..checks.registry import get_check
from ..checks.result import FAILED_RATIO, finite_ratio, repro_command
from ..compare.verdict import ULP_PASS

PROPERTY = "smqa"  # key in TestReport.user_properties
PROGRESS_ENV = "SMQA_PROGRESS"  # seconds between progress lines (the nightly driver sets it)
DEADLINE_ENV = "SMQA_DEADLINE"  # epoch seconds the run should end by, for "time left"


def measured(ratio) -> float | None:
    """A check's ratio as a measure, or None for a failure that has none (a crash, a wrong shape, bits that
    differ, a bad input accepted: ``FAILED_RATIO``)."""
    r = float(ratio)
    return None if not r < FAILED_RATIO else r


def merge_coverage(into: dict, labels: dict) -> dict:
    """Add ``labels`` (label -> {"n", "effective", "max_ratio", "failed"}) into ``into``: counts add, worst ratios
    take the max (None: no measured case yet). effective: the cases that make the class's boundary matter."""
    for label, v in labels.items():
        slot = into.setdefault(label, {"n": 0, "effective": 0, "max_ratio": None, "failed": 0})
        slot["n"] += v["n"]
        slot["effective"] = slot.get("effective", 0) + v.get("effective", v["n"])
        slot["failed"] = slot.get("failed", 0) + v.get("failed", 0)
        if v["max_ratio"] is not None:
            slot["max_ratio"] = max(slot["max_ratio"] or 0.0, v["max_ratio"])
    return into


@dataclass
class Recorder:
    """Everything one test item observed; ``data()`` is JSON-able.

    backend is the name the run was given (a registered name or ``module:attr``), which replay lines use.
    worst: the case with the highest ratio, with the tensor and measure behind it, or a failure's reason when
    it has no measure. failure: the last failure (Hypothesis replays the shrunk one last), with the highest
    ratio seen before shrinking.
    """

    check: str
    backend: str
    test: str = ""  # the test function as FILE::NAME, the file's absolute path (where a reproducer patch goes)
    tiles: dict = field(default_factory=dict)
    cases: int = 0
    failed: int = 0
    worst: dict | None = None
    coverage: dict = field(default_factory=dict)  # label -> {"n", "max_ratio", "failed"}
    failure: dict | None = None
    unreachable: dict = field(default_factory=dict)  # class label -> why the backend's domain has no case in it
    rejected: list = field(default_factory=list)  # explicit merges left out because they cancelled a boundary
    say: Callable[[str], None] | None = field(default=None, repr=False)  # where progress lines go

    def add_case(self, case: Case, ratio: float | None = None, failed: bool = False) -> None:
        self.cases += 1
        _progress(self)
        r = None if ratio is None else finite_ratio(ratio)
        bites = effective_events(case, self.tiles)
        merge_coverage(self.coverage, {label: {"n": 1, "effective": int(label in bites), "max_ratio": r,
                                               "failed": int(failed)} for label in case_events(case, self.tiles)})

    def add(self, result) -> None:
        ratio = measured(result.ratio)
        self.add_case(result.case, ratio, failed=not result.passed)
        worst = {"case": result.case.repro(), "failed": not result.passed, **_worst(result, ratio)}
        if self.worst is None or worst_rank(worst) >= worst_rank(self.worst):
            self.worst = worst
        if not result.passed:
            self.failed += 1
            self.failure = {"case": result.case.repro(), "message": result.message, "ratio": ratio,
                            "repro": repro_command(self.backend, result.check, result.case),
                            "highest_ratio": self.worst.get("ratio")}

    def data(self) -> dict:
        data = {k: getattr(self, k) for k in ("check", "backend", "test", "cases", "failed", "worst", "coverage",
                                              "failure", "unreachable", "rejected")}
        return {**data, "tiles": {k: v if isinstance(v, int) else repr(v) for k, v in self.tiles.items()}}


def worst_rank(worst: dict) -> tuple:
    """Failures above passes; among them, no measure (a crash) above the highest ratio."""
    r = worst.get("ratio")
    return (worst.get("failed", False), math.inf if r is None else r)


def _worst(result, ratio) -> dict:
    """The tensor and measure behind a result's ratio, or the reason of a failure that has no measure."""
    if ratio is None:
        lines = result.message.splitlines()
        return {"ratio": None, "reason": lines[1].strip() if len(lines) > 1 else "failed"}
    best = {"ratio": finite_ratio(ratio)}
    top = -1.0
    for name, t in (result.per_tensor or {}).items():
        m = tensor_measure(t)
        if m is not None and m["ratio"] > top:
            top = m["ratio"]
            best.update(tensor=name, **m)
    return best


def tensor_measure(t: dict) -> dict | None:
    """The measure behind one tensor's ratio, so that error / allowed = ratio: the whole tensor's (``measure``
    "whole") or its worst row's ("row", with the row's index), whichever the ratio is; "ulps" when a bf16 ulp
    count decided it (error = ulps, allowed = 1.5); "bitwise" for a bitwise comparison that held. None when the
    entry has no finite ratio."""
    r = t.get("ratio")
    error, allowed = float(t.get("error", 0.0)), float(t.get("allowed", 0.0))
    if r is None and allowed:
        r = error / allowed
    if r is None or not math.isfinite(r):
        return None
    row = t.get("worst_row") or {}
    if row.get("rows") and row.get("ratio", 0.0) >= t.get("whole_ratio", r):
        out = {"measure": "row", "row": list(row.get("index", ())), "error": float(row["error"]),
               "allowed": float(row["allowed"])}
    elif allowed == 0 and error == 0 and r == 0:
        return {"measure": "bitwise", "ratio": 0.0, "error": 0.0, "allowed": 0.0}
    else:
        out = {"measure": "whole", "error": error, "allowed": allowed}
    if not (out["allowed"] > 0 and math.isclose(out["error"] / out["allowed"], r, rel_tol=1e-6, abs_tol=1e-12)):
        out.update(measure=out["measure"] + " ulps", error=r * ULP_PASS, allowed=ULP_PASS)
    return {**out, "ratio": finite_ratio(r)}


_last_progress = [0.0]  # one progress line per PROGRESS_ENV seconds in this process, whichever test prints it


def _progress(rec: Recorder) -> None:
    every = float(os.environ.get(PROGRESS_ENV) or 0)
    now = time.time()
    if not every or now - _last_progress[0] < every:
        return
    _last_progress[0] = now
    left = ""
    if os.environ.get(DEADLINE_ENV):
        left = f", {max(0.0, float(os.environ[DEADLINE_ENV]) - now) / 60:.1f} min left"
    worst = f", worst ratio {rec.worst['ratio']:.3f}" if rec.worst and rec.worst.get("ratio") is not None else ""
    line = f"[smqa] {rec.check}[{rec.backend}]: {rec.cases} examples, {rec.failed} failures{worst}{left}"
    if rec.say is not None:
        rec.say(line)
    else:
        print(line, file=sys.stderr, flush=True)


def run_check(check: str, backend, case: Case, *, recorder: Recorder | None = None, **options):
    """Run a registry check, record it on ``recorder``, target its ratio, raise ``CheckFailure`` on failure; a
    check that does not apply to the backend is a pytest skip with its reason."""
    result = get_check(check).function(backend, case, **options)
    if result.skipped:
        pytest.skip(result.skipped)
    if recorder is not None:
        recorder.add(result.replayed_as(recorder.backend))
    if currently_in_test_context() and measured(result.ratio) is not None:
        # a failure without a measure is no score to climb (and 1e9 would only clutter Hypothesis's report)
        target(result.ratio, label=f"{check} ratio")
    result.raise_if_failed()
    return result
