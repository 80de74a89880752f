"""Nightly fuzzing on HypoFuzz (``sparse-mqa-check --engine hypofuzz``, ``SMQA_ENGINE=hypofuzz bash ci/nightly``):
the suite's fuzz entry (``harness.fuzzing``) under ``hypothesis fuzz`` for a time budget, then our reproducers
and ledger from what it found. HypoFuzz is optional: ``pip install 'sparse-mqa-testkit[fuzz]'`` (HypoFuzz
25.4.8, AGPL-3.0, which runs only with ``hypothesis<6.133.2``).

- Without a GPU: one ``hypothesis fuzz -n N --no-dashboard`` (N: $SMQA_FUZZ_WORKERS, else the CPU count; HypoFuzz
  uses at most one process per test). With GPUs: one ``-n 1`` process per visible GPU, each with its own
  ``CUDA_VISIBLE_DEVICES`` (HypoFuzz's workers all inherit their process's environment).
- One dashboard (``--dashboard-only``) on 127.0.0.1, port $SMQA_DASHBOARD_PORT (else a free one; ``off``: none).
- Every process reads and writes one example database (directories and Redis URLs, as ``--smqa-database``), so
  a fleet pointed at one Redis shares its finds, and ``pytest --smqa-fuzz --smqa-database ...`` replays them.
- HypoFuzz runs until stopped: each process runs under ``timeout`` for the budget, in a session of its own that is
  killed afterwards (its workers with it).
- Afterwards the suite replays the database in pytest (the same profile, so the same draw plans): each failing
  check becomes a reproducer file (replay line, ``@example``, Hypothesis's patch), and the ledger gets the worst
  ratio per check and boundary class that HypoFuzz's processes saw (``fuzzing.RECORD_ENV``) and the replay saw.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..harness import gpu_workers, profiles
from ..harness.fuzzing import RECORD_ENV
from .nightly import append_ledger, merge_rows, prepare, report_failures, suite_failure
from .runner import SUITE, run_suite

# HypoFuzz releases up to this one -> the first Hypothesis they break with (25.4.8 builds a BuildContext without
# the wrapped_test 6.133.2 requires; the later ones read slice_comments, renamed in 6.157.1)
BREAKS_WITH = {(25, 4, 8): (6, 133, 2), (25, 11, 1): (6, 157, 1)}
WORKERS_ENV = "SMQA_FUZZ_WORKERS"
PORT_ENV = "SMQA_DASHBOARD_PORT"
INSTALL = "pip install 'sparse-mqa-testkit[fuzz]' (hypofuzz 25.4.8 and hypothesis>=6.130.7,<6.133.2)"
STOP_GRACE = 10  # seconds between timeout's SIGTERM and its SIGKILL
RECORD_DIR = "hypofuzz-record"  # in the output folder: what HypoFuzz's processes ran (fuzzing.RECORD_ENV)


def _version(dist: str) -> tuple[int, ...] | None:
    try:
        raw = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(x) for x in raw.split(".")[:3] if x.isdigit())


def engine_problem() -> str | None:
    """Why HypoFuzz cannot run the suite here (not installed, or beside a Hypothesis it breaks with), or None."""
    hf, hyp = _version("hypofuzz"), _version("hypothesis")
    if hf is None:
        return f"the HypoFuzz engine needs HypoFuzz: {INSTALL}"
    limit = next((h for v, h in sorted(BREAKS_WITH.items()) if hf <= v), None)
    if limit is not None and hyp >= limit:
        fmt = ".".join
        return (f"hypofuzz {fmt(map(str, hf))} breaks with hypothesis {fmt(map(str, hyp))} (it needs < "
                f"{fmt(map(str, limit))}): {INSTALL}, in a virtual environment of its own if the rest must keep "
                "a newer Hypothesis")
    return None


def hypothesis_cli() -> list[str]:
    """The ``hypothesis`` command of this interpreter's environment (HypoFuzz adds ``fuzz`` to it)."""
    beside = Path(sys.executable).with_name("hypothesis")
    return [str(beside) if beside.exists() else shutil.which("hypothesis") or "hypothesis"]


def fuzz_args(backends, *, profile: str, database: str, extra=()) -> list[str]:
    """The pytest arguments every HypoFuzz process collects with (and the replay uses): the installed suite from
    the working directory as rootdir, so node ids, and with them the example keys, are the same in every run."""
    args = ["--pyargs", SUITE, "-p", "no:cacheprovider", "--rootdir", os.getcwd(), "-c", os.devnull,
            "-p", "sparse_mqa_testkit.plugin", "--smqa-fuzz", "--smqa-profile", profile, "--smqa-database", database]
    for b in backends:
        args += ["--smqa-backend", b]
    return args + list(extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_port() -> int | None:
    raw = os.environ.get(PORT_ENV, "").strip()
    if raw == "off":
        return None
    if raw and not raw.isdigit():
        raise ValueError(f"{PORT_ENV} must be a port number or 'off', got {raw!r}")
    return int(raw) if raw else free_port()


def fuzz_processes(args: list[str]) -> list[tuple[str, list[str], dict]]:
    """(name, command, environment changes) of each fuzzing process: one per visible GPU, else one on the CPUs."""
    hyp = hypothesis_cli()
    gpus = gpu_workers.visible_gpus()
    if gpus:
        return [(f"gpu{g}", [*hyp, "fuzz", "--no-dashboard", "-n", "1", "--", *args], {gpu_workers.ENV: g})
                for g in gpus]
    workers = os.environ.get(WORKERS_ENV, "").strip() or str(os.cpu_count() or 1)
    if not workers.isdigit() or int(workers) < 1:
        raise ValueError(f"{WORKERS_ENV} must be a positive integer (HypoFuzz worker processes), got {workers!r}")
    return [("cpu", [*hyp, "fuzz", "--no-dashboard", "-n", workers, "--", *args], {})]


def launch(cmd: list[str], env: dict, log: Path, budget: float | None) -> subprocess.Popen:
    """``cmd`` in a session of its own (so it can be killed with every worker it forked), under ``timeout``
    when given a budget, its output to ``log``."""
    if budget is not None:
        cmd = ["timeout", "-k", str(STOP_GRACE), f"{max(1.0, budget):.0f}", *cmd]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s session: HypoFuzz's hub leaves its workers running when it is killed alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _exit(signum, frame):
    raise SystemExit(128 + signum)


def _on_sigterm(handler):
    """Install ``handler`` for SIGTERM (in the main thread only); returns the previous one."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def run_hypofuzz_nightly(backends, *, budget: float, out=None, database=None, ledger=None, profile="nightly",
                         extra=()) -> int:
    """HypoFuzz on the suite for ``budget`` seconds, then the replay, reproducers and ledger; 1 on a failure, 2
    when HypoFuzz cannot run here."""
    problem = engine_problem()
    if problem:
        print(f"[nightly] {problem}", file=sys.stderr, flush=True)
        return 2
    out, database = prepare(out, database)
    args = fuzz_args(backends, profile=profile, database=database, extra=extra)
    try:
        port = dashboard_port()
        fuzzers = fuzz_processes(args)
    except ValueError as e:
        print(f"[nightly] {e}", file=sys.stderr, flush=True)
        return 2
    start = time.monotonic()
    print(f"[nightly] engine hypofuzz {importlib.metadata.version('hypofuzz')}: backends {', '.join(backends)}; "
          f"budget {budget:.0f} s; {len(fuzzers)} fuzzing process(es) ({', '.join(n for n, _, _ in fuzzers)}); "
          f"database {database}; out {out}", flush=True)
    early = search(fuzzers, args, port=port, budget=budget, out=out)
    searched = time.monotonic() - start
    print(f"[nightly] hypofuzz stopped after {searched:.0f} s; replaying the database", flush=True)
    rc, data = run_suite(backends, profile=profile, database=database, json_path=out / "replay.json",
                         extra=["--smqa-fuzz", "-k", "test_fuzz", *extra],
                         env=dict(os.environ, **{profiles.MAX_EXAMPLES_ENV: "1",
                                                 "HYPOTHESIS_STORAGE_DIRECTORY": str(out / "hypothesis")}),
                         timeout=max(600.0, budget))
    rows = data.get("rows", [])
    failed = [r for r in rows if r["outcome"] in ("failed", "error")]
    if not failed and (rc != 0 or early):
        why = f"pytest exit status {rc}" if rc != 0 else "; ".join(
            f"hypothesis fuzz ({n}) ended after {searched:.0f} s with status {c}: see {out / f'hypofuzz-{n}.log'}"
            for n, c in early)
        failed = [suite_failure(backends, why)]
    report_failures(out, failed)
    classes, examples = searched_classes(out / RECORD_DIR)
    merge_rows(classes, rows)
    ledger = Path(ledger or out / "ledger.json")
    elapsed = time.monotonic() - start
    append_ledger(ledger, classes, engine="hypofuzz", backends=backends, profile=profile, budget=budget,
                  elapsed=elapsed, examples=examples, failures=len(failed))
    print(f"[nightly] {'FAIL' if failed else 'PASS'}: hypofuzz ran {examples} cases (as last recorded by its "
          f"processes), {len(failed)} failures in {elapsed:.0f} s; ledger {ledger}", flush=True)
    return 1 if failed else 0


def search(fuzzers, args: list[str], *, port: int | None, budget: float, out: Path) -> list[tuple[str, int]]:
    """The fuzzing processes for the budget, beside the dashboard; the (name, exit status) of those that ended
    before it."""
    record = out / RECORD_DIR
    shutil.rmtree(record, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    dash = None
    if port is not None:
        dash = launch([*hypothesis_cli(), "fuzz", "--dashboard-only", "--host", "127.0.0.1", "--port", str(port),
                       "--", *args], env, out / "hypofuzz-dashboard.log", None)
        print(f"[nightly] dashboard: http://127.0.0.1:{port}/ (for the run; log {out / 'hypofuzz-dashboard.log'})",
              flush=True)
    procs = [(name, launch(cmd, dict(env, **{RECORD_ENV: str(record)}, **more), out / f"hypofuzz-{name}.log",
                           budget)) for name, cmd, more in fuzzers]
    previous = _on_sigterm(_exit)  # a cancelled job must still stop the sessions, which outlive it otherwise
    try:
        for _, p in procs:
            p.wait()
    finally:
        for _, p in procs:
            stop(p)
        if dash is not None:
            stop(dash)
        _on_sigterm(previous)
    ended = time.monotonic() - start < budget - 1
    return [(n, p.returncode) for n, p in procs if ended and p.returncode not in (124, 137)]


def searched_classes(record: Path) -> tuple[dict, int]:
    """backend -> check -> boundary class -> worst ratio, from what each HypoFuzz process recorded; and the
    number of cases they ran."""
    classes: dict = {}
    cases = 0
    for path in sorted(record.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a process stopped while writing: its previous record is lost too, not the run
        cases += rec.get("cases", 0)
        merge_rows(classes, [rec])
    return classes, cases
