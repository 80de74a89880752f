"""Nightly fuzzing: the suite in the ``nightly`` profile for a time budget, turning what it finds into regressions.

Runs the suite in rounds (each a child pytest), sizing each round's examples per test from the last round's
speed so the budget is kept, with a persistent example database (a failure found here replays first in any
later run pointed at the same database: ``pytest --smqa-database DIR``). Progress lines show examples,
failures and time left. On a failure it writes, per failing check, a reproducer to the output folder (the
one-line replay command, an ``@example(case=Case(...))`` decorator, and Hypothesis's own patch under
``OUT/hypothesis/patches``) and exits non-zero. Every run appends the worst observed error-to-tolerance ratio
per check and boundary class to a JSON ledger, so a slow creep toward the tolerance shows before it fails.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from ..harness import hypothesis_compat, profiles
from ..harness.recording import DEADLINE_ENV, PROGRESS_ENV, merge_coverage
from .runner import run_suite

FIRST_ROUND = 20  # examples per test in the first round, to measure speed
MAX_ROUND = 5000


def run_nightly(backends, *, budget: float, out=None, database=None, ledger=None, profile="nightly",
                extra=()) -> int:
    out, database = prepare(out, database)
    ledger = Path(ledger or out / "ledger.json")
    start = time.monotonic()
    deadline = start + budget
    n, rounds, examples, failed_rows, last_round, stopped = FIRST_ROUND, 0, 0, [], 0.0, 0
    classes: dict = {}  # backend -> check -> label -> {"n", "max_ratio"}
    print(f"[nightly] backends {', '.join(backends)}; budget {budget:.0f} s; database {database}; out {out}",
          flush=True)
    while True:
        left = deadline - time.monotonic()
        if left <= 1 or (rounds and left < 0.5 * last_round):
            break
        rounds += 1
        env = dict(os.environ, **{profiles.MAX_EXAMPLES_ENV: str(n), PROGRESS_ENV: "30",
                                  DEADLINE_ENV: str(time.time() + left),
                                  "HYPOTHESIS_STORAGE_DIRECTORY": str(out / "hypothesis")})
        t0 = time.monotonic()
        rc, data = run_suite(backends, profile=profile, database=database, json_path=out / f"round-{rounds}.json",
                             extra=extra, env=env, timeout=left + 300)
        last_round = time.monotonic() - t0
        rows = data.get("rows", [])
        cases = sum(r["cases"] for r in rows)
        examples += cases
        merge_rows(classes, rows)
        failed_rows = [r for r in rows if r["outcome"] in ("failed", "error")]
        print(f"[nightly] round {rounds}: {n} examples/test, {cases} cases in {last_round:.0f} s; total "
              f"{examples} cases, {len(failed_rows)} failures, {max(0.0, deadline - time.monotonic()):.0f} s left",
              flush=True)
        if data.get("status") == "interrupted":  # a signal or the time limit: what finished still counts
            stopped = rc
            print(f"[nightly] round {rounds} interrupted ({data.get('stopped_by', 'a signal')}): "
                  f"{len(data.get('unfinished', []))} tests unfinished", flush=True)
            break
        if rc != 0:
            if not failed_rows:  # pytest itself failed (usage error, crash): report it as a failure
                failed_rows = [suite_failure(backends, f"pytest exit status {rc}")]
            break
        per_example = last_round / max(1, n)
        n = int(max(FIRST_ROUND, min(MAX_ROUND, 0.8 * (deadline - time.monotonic()) / per_example)))
    elapsed = time.monotonic() - start
    report_failures(out, failed_rows)
    append_ledger(ledger, classes, backends=backends, profile=profile, budget=budget, elapsed=elapsed,
                  rounds=rounds, examples=examples, failures=len(failed_rows))
    verdict = "FAIL" if failed_rows else "INTERRUPTED" if stopped else "PASS"
    print(f"[nightly] {verdict}: {rounds} rounds, {examples} cases, "
          f"{len(failed_rows)} failures in {elapsed:.0f} s; ledger {ledger}", flush=True)
    return 1 if failed_rows else stopped


def nightly_database(spec, out: Path) -> str:
    """The nightly's example database: the spec's directories (else OUT/examples) and its Redis URLs, shared by
    every runner pointed at the same server."""
    parts = [x.strip() for x in str(spec or "").split(",") if x.strip()]
    urls = [x for x in parts if "://" in x]
    dirs = [str(Path(x).resolve()) for x in parts if x not in urls] or [str((out / "examples").resolve())]
    return ",".join(dirs + urls)


def prepare(out, database) -> tuple[Path, str]:
    """The output folder (made) and the example database of a nightly run, either engine."""
    out = Path(out or "nightly-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out, nightly_database(database or os.environ.get(profiles.DATABASE_ENV), out)


def merge_rows(classes: dict, rows: list[dict]) -> None:
    """Each row's coverage (a table row, or a record with backend, check and coverage) into classes: backend ->
    check -> boundary class."""
    for r in rows:
        merge_coverage(classes.setdefault(r["backend"], {}).setdefault(r["check"], {}), r.get("coverage") or {})


def suite_failure(backends, why: str) -> dict:
    """A failed row for the run as a whole (pytest or the fuzzer failed without a failing test)."""
    return {"check": "suite", "backend": ",".join(backends), "nodeid": "-", "failure": None, "outcome": why}


def report_failures(out: Path, rows: list[dict]) -> None:
    """A reproducer for each failed row, and a line naming it."""
    for row in rows:
        print(f"[nightly] FAILURE {row['check']} on {row['backend']}: reproducer {write_reproducer(out, row)}",
              flush=True)


def write_reproducer(out: Path, row: dict) -> Path:
    """A text file with the replay command, the ``@example`` decorator and the failure message."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{row['backend']}-{row['check']}")
    path = out / f"reproducer-{slug}.txt"
    fail = row.get("failure")
    patches = sorted((out / "hypothesis" / "patches").glob("*.patch"))
    lines = [f"# {row['check']} failed on backend {row['backend']} "
             f"({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC), test {row.get('nodeid', '-')}"]
    if fail:
        top = fail.get("highest_ratio")
        lines += ["", "# replay (one line):", fail["repro"]]
        if top is not None and fail.get("ratio") is not None and top > fail["ratio"]:
            lines.append(f"# this shrunk case scores {fail['ratio']:.3g}; the search saw up to {top:.3g}")
        lines += ["",
                  "# regression: add above the failing @given test (sparse_mqa_testkit.property_tests or your own),",
                  "# with `from hypothesis import example` and `from sparse_mqa_testkit import Case`:",
                  f"@example(case={fail['case']})", "", "# failure:", fail["message"]]
    else:
        lines += ["", f"# no check result was recorded ({row.get('outcome')}); see the round log above"]
    patch = suite_patch(row, out) if fail else None
    if patch:
        lines += ["", f"# Hypothesis's patch adding the @example to the suite (git apply): {patch}"]
    if patches:
        lines += ["", "# patches Hypothesis wrote itself:"] + [f"#   {p}" for p in patches]
    path.write_text("\n".join(lines) + "\n")
    return path


def suite_patch(row: dict, out: Path) -> Path | None:
    """Hypothesis's own ``@example`` patch for the test that failed, the one the row's ``test`` names (the suite's
    or the user's own), or None (best effort, saying why).

    Written here because Hypothesis cannot write it itself: the falsifying example it prints includes the
    ``smqa_backend`` fixture, whose repr is not Python.
    """
    try:
        func = named_test(row.get("test") or "")
        if func is None:
            print(f"[nightly] no Hypothesis patch for {row['check']}: its row names no test file "
                  f"({row.get('nodeid')!r})", flush=True)
            return None
        patch = hypothesis_compat.example_patch(func, f"{func.__name__}(case={row['failure']['case']})")
        if patch is None:
            print(f"[nightly] no Hypothesis patch for {row['check']}: it could not locate {func.__name__} in "
                  f"{getattr(sys.modules.get(func.__module__), '__file__', func.__module__)}", flush=True)
            return None
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{row['backend']}-{row['check']}")
        path = out / f"reproducer-{slug}.patch"
        path.write_text(patch)
        return path
    except Exception as e:  # a private Hypothesis helper: never let it hide the failure itself
        print(f"[nightly] no Hypothesis patch for {row['check']}: {type(e).__name__}: {e}", flush=True)
        return None


def named_test(test: str):
    """The function ``FILE::[Class::]name`` names (a row's ``test``), importing its file as pytest does by default
    (the first directory up without ``__init__.py`` on sys.path, the module named from there); None when it
    names no file."""
    path, _, rest = test.partition("::")
    file = Path(path).resolve()
    if not path or not rest or not file.is_file():
        return None
    module = next((m for m in list(sys.modules.values())
                   if getattr(m, "__file__", None) and Path(m.__file__).resolve() == file), None)
    if module is None:
        parts, base = [file.stem], file.parent
        while (base / "__init__.py").exists():
            parts.insert(0, base.name)
            base = base.parent
        if str(base) not in sys.path:
            sys.path.insert(0, str(base))
        module = importlib.import_module(".".join(parts))
    obj = module
    for name in rest.split("::"):
        obj = getattr(obj, name)
    return obj


def append_ledger(path: Path, classes: dict, **meta) -> None:
    """Append this run to the ledger (a JSON list) and print each class's worst ratio next to the last run's."""
    runs = json.loads(path.read_text()) if path.exists() else []
    previous = runs[-1]["ratios"] if runs else {}
    entry = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), **meta, "ratios": classes}
    runs.append(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(runs, indent=1))
    for backend, checks in classes.items():
        for check, labels in checks.items():
            worst = [(v["max_ratio"], k) for k, v in labels.items() if v["max_ratio"] is not None]
            if not worst:
                continue
            r, label = max(worst)
            if r == 0:
                continue
            prev = previous.get(backend, {}).get(check, {}).get(label, {}).get("max_ratio")
            was = f" (last run {prev:.3f})" if prev is not None else ""
            print(f"[nightly] ledger {backend} {check}: worst ratio {r:.3f} at '{label}'{was}", flush=True)
