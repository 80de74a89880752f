"""The conformance table points at the failing tensor and measure, shows a failure without a measure by its
reason, never a sentinel number, and says how long warm-up and checks took."""

from __future__ import annotations

import torch

from sparse_mqa_testkit import Case, check_backward_tolerance, check_forward_tolerance
from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.harness.recording import PROPERTY, Recorder
from sparse_mqa_testkit.harness.table import format_table, merged, summarize
from support import Base2LseForward


class DkvOneRowShort(ReferenceBackend):
    name = "dkv-short"

    def backward(self, *args, **kwargs):
        dq, dkv, ds = super().backward(*args, **kwargs)
        return dq, dkv[:, :-1], ds


class DqOff(ReferenceBackend):
    name = "dq-off"

    def backward(self, *args, **kwargs):
        dq, dkv, ds = super().backward(*args, **kwargs)
        return (dq.float() * 1.1).to(torch.bfloat16), dkv, ds


def _row(rec: Recorder, outcome="failed") -> dict:
    return {**rec.data(), "nodeid": "x", "outcome": outcome, "reason": "", "duration": 0.5}


def test_a_shape_failure_shows_its_reason_not_another_tensor_or_a_sentinel():
    rec = Recorder(check="tolerance", backend="dkv-short")
    for seed in range(3):
        rec.add(check_backward_tolerance(DkvOneRowShort(), Case(seed=seed)))
    table = format_table([_row(rec)])
    line = next(x for x in table.splitlines() if x.startswith("tolerance"))
    assert "dkv: shape (1, 15, 16) is not the contract's (1, 16, 16)" in line and "dq" not in line
    assert "1000000000" not in table and "1e+09" not in table
    assert "FAIL" in table  # the boundary classes the failing cases were in


def test_a_measured_failure_shows_the_failing_tensor_and_its_ratio():
    rec = Recorder(check="tolerance", backend="dq-off")
    rec.add(check_backward_tolerance(DqOff(), Case(H=3, seed=1)))
    worst = rec.worst
    assert worst["tensor"] == "dq" and worst["ratio"] > 1 and worst["failed"]
    rec = Recorder(check="forward_tolerance", backend="base2")
    res = check_forward_tolerance(Base2LseForward(), Case(S=4, sink="finite", seed=4))
    rec.add(res)
    assert rec.worst["tensor"] == max(res.per_tensor, key=lambda n: res.per_tensor[n]["ratio"])
    line = next(x for x in format_table([_row(rec)]).splitlines() if x.startswith("forward_tolerance"))
    assert f"{rec.worst['tensor']} " in line and f"({rec.worst['ratio']:.2f})" in line


def test_the_highest_ratio_of_the_search_stays_beside_the_shrunk_failure():
    rec = Recorder(check="tolerance", backend="dq-off")
    big, small = DqOff(), DqOff()
    small.backward = lambda *a, **k: (lambda r: ((r[0].float() * 1.02).to(torch.bfloat16), r[1], r[2]))(
        ReferenceBackend.backward(small, *a, **k))
    rec.add(check_backward_tolerance(big, Case(H=3, seed=1)))
    rec.add(check_backward_tolerance(small, Case(H=3, seed=1)))  # the shrunk case, replayed last
    assert rec.failure["highest_ratio"] > rec.failure["ratio"]


def test_rows_of_one_check_merge_and_timing_is_shown():
    a, b = Recorder(check="tolerance", backend="x"), Recorder(check="tolerance", backend="x")
    a.add(check_backward_tolerance(ReferenceBackend(), Case(seed=1)))
    b.add(check_backward_tolerance(ReferenceBackend(), Case(seed=2)))
    rows = merged([_row(a, "passed"), _row(b, "passed")])
    assert len(rows) == 1 and rows[0]["cases"] == 2
    table = format_table([_row(a, "passed")], {"x": {"compile_s": 62.5, "keys": 12, "check_s": 183.0}})
    assert "time on x: warm-up 62.5 s (12 kernel keys), checks 183.0 s" in table


def _report(when: str, outcome: str, data: dict):
    from _pytest.reports import TestReport

    longrepr = ("f.py", 1, "Skipped: no GPU") if outcome == "skipped" else None
    return TestReport("t.py::test_x", ("t.py", 1, "test_x"), {}, outcome, longrepr, when,
                      user_properties=[(PROPERTY, data)])


def test_a_passed_setup_is_never_an_error_row():
    data = Recorder(check="by_hand", backend="mine").data()
    assert summarize([_report("setup", "passed", data)]) == []
    assert summarize([_report("teardown", "passed", data)]) == []
    (row,) = summarize([_report("setup", "passed", data), _report("call", "passed", data),
                        _report("teardown", "passed", data)])
    assert row["outcome"] == "passed"
    assert [r["outcome"] for r in summarize([_report("setup", "failed", data)])] == ["error"]
    assert [r["outcome"] for r in summarize([_report("setup", "skipped", data)])] == ["skipped"]


class OneDkvRowOff(ReferenceBackend):
    name = "one-row-off"

    def backward(self, *args, **kwargs):
        dq, dkv, ds = super().backward(*args, **kwargs)
        dkv = dkv.clone()
        dkv[0, 0] = (dkv[0, 0].float() * 1.5).to(torch.bfloat16)
        return dq, dkv, ds


def _cell(table: str, check: str) -> tuple[float, float, float, str]:
    import re

    line = next(x for x in table.splitlines() if x.startswith(check + " "))
    m = re.search(r"(\w+(?: row \([\d, ]+\))?) ([\d.e+-]+)(?: ulps)? / ([\d.e+-]+) \(([\d.]+)\)", line)
    assert m, line
    return float(m.group(2)), float(m.group(3)), float(m.group(4)), m.group(1)


def test_the_numbers_in_a_cell_divide_to_its_ratio():
    """The worst row's ratio with that row's error and allowance, the whole tensor's with the whole's: never one
    measure's numbers beside the other's ratio."""
    case = Case(S=8, Skv=48, H=4, L=24, seed=3)
    res = check_backward_tolerance(OneDkvRowOff(), case)
    assert not res.passed and res.per_tensor["dkv"]["worst_row"]["ratio"] > res.per_tensor["dkv"]["whole_ratio"]
    rec = Recorder(check="tolerance", backend="one-row-off")
    rec.add(res)
    error, allowed, ratio, what = _cell(format_table([_row(rec)]), "tolerance")
    assert what == "dkv row (0, 0)" and abs(error / allowed - ratio) <= 0.005 + 0.01 * ratio  # as printed
    rec = Recorder(check="tolerance", backend="reference")
    for seed in range(4):
        rec.add(check_backward_tolerance(ReferenceBackend(), Case(S=8, Skv=48, H=4, L=24, seed=seed)))
    error, allowed, ratio, what = _cell(format_table([_row(rec, "passed")]), "tolerance")
    assert abs(error / allowed - ratio) <= 0.005 + 0.01 * ratio, (what, error, allowed, ratio)
