"""The conformance table: one row per suite test from pytest's reports, printed and written as JSON.

check | backend | cases | worst error vs allowed | verdict, then the boundary classes covered per backend. The
worst cell shows one measure, whose error / allowed is its ratio: the whole tensor's, or its worst row's (with the
row's index) where that row's ratio is the larger.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..cases.strategies import COMMON_TILES
from .recording import PROPERTY, merge_coverage, worst_rank


def summarize(reports) -> list[dict]:
    """One row per suite test from pytest reports: its call phase, or a setup or teardown that skipped or
    raised. A setup or teardown that passed says nothing of the test's outcome and makes no row."""
    rows = {}
    for rep in reports:
        props = dict(getattr(rep, "user_properties", ()) or ())
        data = props.get(PROPERTY)
        if data is None or (rep.when != "call" and rep.passed):
            continue
        if rep.when == "call" or rep.nodeid not in rows:
            outcome = rep.outcome if rep.when == "call" else ("skipped" if rep.skipped else "error")
            reason = ""
            if rep.skipped and isinstance(rep.longrepr, tuple):
                reason = str(rep.longrepr[2]).removeprefix("Skipped: ")
            rows[rep.nodeid] = {**data, "nodeid": rep.nodeid, "outcome": outcome, "reason": reason,
                                "duration": round(float(getattr(rep, "duration", 0.0)), 3)}
    return list(rows.values())


def coverage(rows: list[dict]) -> dict:
    """backend -> label -> {"n", "max_ratio"} summed over a run's tests."""
    out: dict = {}
    for r in rows:
        merge_coverage(out.setdefault(r["backend"], {}), r.get("coverage") or {})
    return out


def timings(rows: list[dict], compile: dict) -> dict:
    """backend -> {"compile_s": warm-up seconds (None without one), "keys": pooled kernel keys, "check_s": the
    suite tests' own seconds}: compilation and checking, apart."""
    out = {}
    for r in rows:
        t = out.setdefault(r["backend"], {"compile_s": None, "keys": None, "check_s": 0.0})
        t["check_s"] = round(t["check_s"] + r.get("duration", 0.0), 3)
    for name, done in compile.items():
        if name in out:
            out[name].update(compile_s=done["seconds"], keys=done["keys"])
    return out


def write_json(path, rows: list[dict], **meta) -> None:
    """The rows and their coverage as JSON, replaced in one step (a reader, or a kill, never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**meta, "rows": rows, "coverage": coverage(rows)}, indent=1))
    os.replace(tmp, path)


def merged(rows: list[dict]) -> list[dict]:
    """One row per (check, backend): a check's explicit boundary examples and its drawn cases together."""
    order = {"error": 3, "failed": 2, "passed": 1, "skipped": 0}
    out: dict = {}
    for r in rows:
        key = (r["check"], r["backend"])
        if key not in out:
            out[key] = dict(r)
            continue
        m = out[key]
        m["cases"] += r["cases"]
        if r.get("worst") and (not m.get("worst") or worst_rank(r["worst"]) > worst_rank(m["worst"])):
            m["worst"] = r["worst"]
        if order.get(r["outcome"], 3) > order.get(m["outcome"], 3) or m["outcome"] == "skipped":
            m.update(outcome=r["outcome"], reason=r.get("reason", ""), failure=r.get("failure") or m.get("failure"))
        m["coverage"] = merge_coverage(dict(m.get("coverage") or {}), r.get("coverage") or {})
        m["unreachable"] = {**(m.get("unreachable") or {}), **(r.get("unreachable") or {})}
        m["rejected"] = list(dict.fromkeys((m.get("rejected") or []) + (r.get("rejected") or [])))
    return list(out.values())


def _worst_text(row: dict) -> str:
    w = row.get("worst")
    if not w:
        return "-"
    if w.get("ratio") is None:
        reason = w.get("reason", "failed")
        return reason if len(reason) <= 60 else reason[:57] + "..."
    if "tensor" not in w:
        return f"ratio {w['ratio']:.2f}"
    kind = w.get("measure", "whole")
    if kind == "bitwise":
        return f"{w['tensor']} bitwise equal"
    where = f" row {tuple(w.get('row', ()))}" if kind.startswith("row") else ""
    unit = " ulps" if kind.endswith("ulps") else ""
    return f"{w['tensor']}{where} {w['error']:.3g}{unit} / {w['allowed']:.3g} ({w['ratio']:.2f})"


def _verdict(outcome: str) -> str:
    return {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "error": "ERROR"}.get(outcome, outcome.upper())


def verdict_line(row: dict) -> str:
    """One finished suite test as a line: verdict, test, cases, the worst measure, seconds; then a failure's replay
    line."""
    verdict = _verdict(row["outcome"])
    name = re.sub(r"@[^\]]*$", "", row["nodeid"].rpartition("::")[2])  # without an xdist group
    tail = f" ({row['reason']})" if row.get("reason") else f", {_worst_text(row)}"
    line = f"[smqa] {verdict} {name}: {row['cases']} cases{tail}, {row.get('duration', 0.0):.1f} s"
    if row.get("failure"):
        line += f"\n  replay: {row['failure']['repro']}"
    return line


def format_table(rows: list[dict], timing: dict | None = None) -> str:
    """check | backend | cases | worst error vs allowed | verdict, then per backend the compile and check time,
    the boundary classes covered and those its domain cannot reach."""
    table = [("check", "backend", "cases", "worst: tensor [row] error / allowed (ratio)", "verdict")]
    rows = merged(rows)
    for r in sorted(rows, key=lambda r: (r["backend"], r["check"])):
        v = _verdict(r["outcome"])
        if r["outcome"] == "skipped" and r.get("reason"):
            v += f" ({r['reason']})"
        table.append((r["check"], r["backend"], str(r["cases"]), _worst_text(r), v))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in table]
    lines.insert(1, "-" * len(lines[0]))
    for backend, t in (timing or {}).items():
        compiled = "no warm-up" if t["compile_s"] is None else \
            f"warm-up {t['compile_s']:.1f} s" + (f" ({t['keys']} kernel keys)" if t["keys"] else "")
        lines += ["", f"time on {backend}: {compiled}, checks {t['check_s']:.1f} s"]
    unreachable = {r["backend"]: {} for r in rows}
    for r in rows:
        unreachable[r["backend"]].update(r.get("unreachable") or {})
    for backend in sorted({r["backend"] for r in rows if r["cases"]} -
                          {r["backend"] for r in rows if r.get("tiles")}):
        lines += ["", f"warning: {backend} declares no tiles: its cases were drawn near the common tile sizes "
                      f"{', '.join(map(str, COMMON_TILES))} (declare tiles = {{'head_group': .., 'query_chunk': .., "
                      "'topk_block': ..} to test yours)"]
    for backend, labels in coverage(rows).items():
        if not labels:
            continue
        lines += ["", f"boundary classes covered on {backend} (cases that make the boundary matter / cases in the "
                      "class, worst ratio over its checks):"]
        cells = [f"{k}: {v.get('effective', v['n'])}/{v['n']}"
                 + (f" ({v['max_ratio']:.2f})" if v["max_ratio"] is not None else "")
                 + (" FAIL" if v.get("failed") else "") for k, v in sorted(labels.items())]
        width = max(map(len, cells)) + 2
        for i in range(0, len(cells), 3):
            lines.append("  " + "".join(c.ljust(width) for c in cells[i:i + 3]).rstrip())
        for label, reason in sorted(unreachable.get(backend, {}).items()):
            lines.append(f"  not reachable in its domain: {label} ({reason})")
        rejected = sorted({x for r in rows if r["backend"] == backend for x in r.get("rejected") or []})
        if rejected:  # "<class> into example <n> (...): ..." -> per class, the examples it was kept out of
            into: dict = {}
            for x in rejected:
                label, _, rest = x.partition(" into example ")
                into.setdefault(label, []).append(rest.split(" ", 1)[0])
            lines.append(f"  explicit merges left out because they would cancel a boundary ({len(rejected)}; the "
                         "JSON lists each): " + "; ".join(f"{k} (examples {', '.join(v)})" for k, v in into.items()))
    return "\n".join(lines)
