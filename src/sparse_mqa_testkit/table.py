"""The conformance table: one row per suite test from pytest's reports, printed and written as JSON.

check | backend | cases | worst error vs allowed | verdict, then the boundary classes covered per backend.
"""

from __future__ import annotations

import json
from pathlib import Path

from .recording import PROPERTY, merge_coverage


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


def coverage(rows: list[dict]) -> dict:
    """backend -> label -> {"n", "max_ratio"} summed over a run's tests."""
    out: dict = {}
    for r in rows:
        merge_coverage(out.setdefault(r["backend"], {}), r.get("coverage") or {})
    return out


def write_json(path, rows: list[dict], **meta) -> None:
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
