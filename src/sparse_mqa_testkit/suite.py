"""What the conformance suite, its pytest plugin and the main job share.

- ``run_check``: run one check on one case, record it, feed ``hypothesis.target`` and raise on failure;
- ``Recorder``: per-test tally (cases, worst ratio, boundary classes covered with their worst ratio), carried
  to the controller in ``user_properties`` so it works under xdist;
- ``summarize`` / ``format_table``: the table the plugin and ``sparse-mqa-check`` print;
- fixture objects: ``DrawnCase`` (a case with its tensors), ``Oracle``, ``Checks`` (the check helpers bound to a
  backend), and ``draw_examples`` (deterministic draws outside ``@given``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .cases import Case
from .strategies import case_events

PROPERTY = "smqa"  # key in TestReport.user_properties


def check_function(name: str):
    """The check function for a ``--check`` name (``tolerance``, ``determinism``, ...; ``checks.CHECKS``)."""
    from .checks import CHECK_FUNCTIONS

    key = name.removeprefix("check_")
    key = {"backward_tolerance": "tolerance"}.get(key, key)
    if key not in CHECK_FUNCTIONS:
        raise ValueError(f"check must be one of {', '.join(CHECK_FUNCTIONS)}, got {name!r}")
    return CHECK_FUNCTIONS[key]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e6


# ---- recording ------------------------------------------------------------------------------------------------
@dataclass
class Recorder:
    """Everything one test item observed; ``data()`` is JSON-able."""

    check: str
    backend: str
    tiles: dict = field(default_factory=dict)
    cases: int = 0
    failed: int = 0
    worst: dict | None = None
    coverage: dict = field(default_factory=dict)  # label -> {"n", "max_ratio"}
    failure: dict | None = None

    def add_case(self, case: Case, ratio: float | None = None) -> None:
        self.cases += 1
        _progress(self)
        for label in case_events(case, self.tiles):
            slot = self.coverage.setdefault(label, {"n": 0, "max_ratio": None})
            slot["n"] += 1
            if ratio is not None:
                slot["max_ratio"] = max(slot["max_ratio"] or 0.0, _finite(ratio))

    def add(self, result) -> None:
        ratio = float(result.ratio)
        self.add_case(result.case, ratio)
        if not result.passed:
            self.failed += 1
            # Hypothesis replays the shrunk example last, so the last failure is the one to report
            from .checks import repro_command

            self.failure = {"case": result.case.repro(), "message": result.message,
                            # the backend as the run named it (a module:attr spec may differ from its .name)
                            "repro": repro_command(self.backend, result.check, result.case)}
        if self.worst is None or _finite(ratio) >= self.worst["ratio"]:
            self.worst = {"ratio": _finite(ratio), "case": result.case.repro(), **_worst_tensor(result)}

    def data(self) -> dict:
        return {k: getattr(self, k) for k in ("check", "backend", "cases", "failed", "worst", "coverage",
                                               "failure")}


def _worst_tensor(result) -> dict:
    best = {}
    for name, t in (result.per_tensor or {}).items():
        err, allowed = t.get("error"), t.get("allowed")
        if err is None or not allowed:
            continue
        r = float(err) / float(allowed)
        if not best or r > best["_r"]:
            best = {"_r": r, "tensor": name, "error": float(err), "allowed": float(allowed)}
    best.pop("_r", None)
    return best


current: Recorder | None = None  # set by the plugin around each suite test

PROGRESS_ENV = "SMQA_PROGRESS"  # seconds between progress lines (the nightly driver sets it)
DEADLINE_ENV = "SMQA_DEADLINE"  # epoch seconds the run should end by, for "time left"
_last_progress = [0.0]


def _progress(rec: Recorder) -> None:
    every = float(os.environ.get(PROGRESS_ENV) or 0)
    now = time.time()
    if not every or now - _last_progress[0] < every:
        return
    _last_progress[0] = now
    left = ""
    if os.environ.get(DEADLINE_ENV):
        left = f", {max(0.0, float(os.environ[DEADLINE_ENV]) - now) / 60:.1f} min left"
    worst = f", worst ratio {rec.worst['ratio']:.3f}" if rec.worst else ""
    # pytest captures sys.stderr inside tests; progress goes to the real one
    print(f"[smqa] {rec.check}[{rec.backend}]: {rec.cases} examples, {rec.failed} failures{worst}{left}",
          file=sys.__stderr__, flush=True)


def run_check(check: str, backend, case: Case, **kwargs):
    """Run a check, record it on the current test, target its ratio (nightly climbs it), raise on failure."""
    from hypothesis import target
    from hypothesis.control import currently_in_test_context

    result = check_function(check)(backend, case, **kwargs)
    if current is not None:
        if not result.passed and current.backend != result.backend:
            # replay by the spec the run was given (module:attr), which the backend's .name may not resolve
            from .checks import repro_command

            result.message = result.message.replace(repro_command(result.backend, result.check, case),
                                                    repro_command(current.backend, result.check, case))
        current.add(result)
    if currently_in_test_context():
        target(_finite(float(result.ratio)), label=f"{check} ratio")
    result.raise_if_failed()
    return result


# ---- the table ------------------------------------------------------------------------------------------------
def summarize(reports) -> list[dict]:
    """One row per suite test from pytest reports (call phase, or setup when skipped/errored)."""
    rows = {}
    for rep in reports:
        props = dict(getattr(rep, "user_properties", ()) or ())
        data = props.get(PROPERTY)
        if data is None:
            continue
        if rep.when == "call" or rep.nodeid not in rows:
            outcome = rep.outcome if rep.when == "call" else ("skipped" if rep.skipped else "error")
            reason = ""
            if rep.skipped and isinstance(rep.longrepr, tuple):
                reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
            rows[rep.nodeid] = {**data, "nodeid": rep.nodeid, "outcome": outcome, "reason": reason,
                                "duration": round(float(getattr(rep, "duration", 0.0)), 3)}
    return list(rows.values())


def write_json(path, rows: list[dict], **meta) -> None:
    import json
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**meta, "rows": rows, "coverage": coverage(rows)}, indent=1))


def _worst_text(row: dict) -> str:
    w = row.get("worst")
    if not w:
        return "-"
    if "tensor" in w:
        return f"{w['tensor']} {w['error']:.3g} / {w['allowed']:.3g} ({w['ratio']:.2f})"
    return f"ratio {w['ratio']:.2f}"


def format_table(rows: list[dict]) -> str:
    """check | backend | cases | worst error vs allowed | verdict, then the boundary classes covered."""
    verdict = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "error": "ERROR"}
    table = [("check", "backend", "cases", "worst error / allowed (ratio)", "verdict")]
    for r in sorted(rows, key=lambda r: (r["backend"], r["check"])):
        v = verdict.get(r["outcome"], r["outcome"].upper())
        if r["outcome"] == "skipped" and r.get("reason"):
            v += f" ({r['reason']})"
        table.append((r["check"], r["backend"], str(r["cases"]), _worst_text(r), v))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in table]
    lines.insert(1, "-" * len(lines[0]))
    for backend, labels in coverage(rows).items():
        if not labels:
            continue
        lines += ["", f"boundary classes covered on {backend} (cases, worst ratio over its checks):"]
        cells = [f"{k}: {v['n']}" + (f" ({v['max_ratio']:.2f})" if v["max_ratio"] is not None else "")
                 for k, v in sorted(labels.items())]
        width = max(map(len, cells)) + 2
        for i in range(0, len(cells), 3):
            lines.append("  " + "".join(c.ljust(width) for c in cells[i:i + 3]).rstrip())
    return "\n".join(lines)


def coverage(rows: list[dict]) -> dict:
    """backend -> label -> {"n", "max_ratio"} summed over a run's tests."""
    out: dict = {}
    for r in rows:
        per = out.setdefault(r["backend"], {})
        for label, v in (r.get("coverage") or {}).items():
            slot = per.setdefault(label, {"n": 0, "max_ratio": None})
            slot["n"] += v["n"]
            if v["max_ratio"] is not None:
                slot["max_ratio"] = max(slot["max_ratio"] or 0.0, v["max_ratio"])
    return out


# ---- fixture objects ------------------------------------------------------------------------------------------
def draw_examples(strategy, n: int) -> list:
    """The first ``n`` examples of a derandomized run of ``strategy`` (the same every time), outside @given."""
    from hypothesis import HealthCheck, Phase, given, settings

    box: list = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def grab(x):
        if len(box) < n:
            box.append(x)

    grab()
    return box


@dataclass
class DrawnCase:
    """A case and its torch tensors on the backend's device, with ``out``/``lse`` from the float64 oracle
    rounded to kernel dtypes (what a forward returns), ready for ``backend.backward(**drawn.backward_args)``."""

    case: Case
    tensors: dict

    @property
    def backward_args(self) -> dict:
        t = self.tensors
        return {k: t[k] for k in ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices", "sm_scale",
                                  "topk_length")}

    @property
    def forward_args(self) -> dict:
        t = self.tensors
        return {k: t[k] for k in ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length")}


def drawn_case(backend, case: Case) -> DrawnCase:
    from .checks.inputs import backend_inputs

    return DrawnCase(case, backend_inputs(backend, case))


class Oracle:
    """The NumPy oracle on a case: ``oracle.forward(case)`` -> (out, lse), ``oracle.backward(case)`` ->
    (dq, dkv, d_sink), float64 unless ``dtype`` says otherwise."""

    def forward(self, case: Case, dtype=np.float64):
        from . import oracle

        x = case.inputs()
        return oracle.forward(x["q"], x["kv"], x["indices"], sm_scale=x["sm_scale"], d_v=x["d_v"],
                              attn_sink=x["attn_sink"], topk_length=x["topk_length"], dtype=dtype)

    def backward(self, case: Case, dtype=np.float64):
        from . import oracle

        x = case.inputs()
        return oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], sm_scale=x["sm_scale"],
                               d_v=x["d_v"], attn_sink=x["attn_sink"], topk_length=x["topk_length"], dtype=dtype)


class Checks:
    """The checks bound to one backend: ``smqa_checks.tolerance(case)`` runs, records and raises on failure."""

    def __init__(self, backend):
        self.backend = backend

    def __repr__(self) -> str:
        return f"<checks for backend {getattr(self.backend, 'name', '?')}>"

    def run(self, check: str, case: Case, **kwargs):
        return run_check(check, self.backend, case, **kwargs)

    def __getattr__(self, check: str):
        if check.startswith("_"):
            raise AttributeError(check)
        try:
            check_function(check)  # an unknown name fails here, not when called
        except ValueError as e:
            raise AttributeError(str(e)) from None
        return lambda case, **kw: self.run(check, case, **kw)
