"""``sparse-mqa-check`` / ``python -m sparse_mqa_testkit``: the conformance suite on a backend, as a table.

    sparse-mqa-check [--backend NAME|module:attr] [--profile dev|ci|nightly] [--json PATH] [--database DIR]
    sparse-mqa-check --backend NAME --check CHECK --replay "Case(...)"     # replay one failure
    sparse-mqa-check --precompile DIR                                     # fill a TileLang cache (sm_90a)
    sparse-mqa-check --profile nightly --budget SECONDS --out DIR         # nightly fuzzing (see nightly.py)

The suite is ``sparse_mqa_testkit.property_tests`` run by pytest in a child process (a crashing kernel cannot
take the report with it); the plugin prints the table (check, backend, cases, worst error vs allowed, verdict)
and the boundary classes covered. Exit status: 0 when every check passed, non-zero otherwise. Arguments after
``--`` go to pytest (e.g. ``-- -n auto`` on a multi-GPU runner).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .profiles import PROFILES

SUITE = "sparse_mqa_testkit.property_tests"
PRECOMPILE_MODULES = ("sparse_mqa_testkit.kernels.forward", "sparse_mqa_testkit.kernels.backward")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparse-mqa-check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", metavar="NAME|module:attr",
                    help="backend to check (repeatable; default: the deterministic GPU backend when CUDA is "
                         "available, else reference)")
    ap.add_argument("--profile", choices=PROFILES, help="Hypothesis profile (default $SMQA_PROFILE or dev)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--database", metavar="DIR", help="Hypothesis example database directory")
    ap.add_argument("--check", metavar="NAME", help="only this check (tolerance, forward_tolerance, "
                    "determinism, rejection, guards); with --replay, the check to replay")
    ap.add_argument("--replay", metavar='"Case(...)"', help="run --check once on this case and print the result")
    ap.add_argument("--precompile", metavar="DIR", help="compile every kernel variant into the TileLang cache DIR")
    ap.add_argument("--budget", type=float, metavar="SECONDS", help="nightly: search for this long")
    ap.add_argument("--out", metavar="DIR", help="nightly: reproducers, round logs and the ledger go here")
    ap.add_argument("--ledger", metavar="PATH", help="nightly: JSON ledger of ratios per boundary class "
                    "(default OUT/ledger.json; runs are appended)")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    extra = [a for a in args.pytest_args if a != "--"]
    if args.precompile:
        return precompile(args.precompile)
    backends = args.backend or [_default_backend()]
    if args.replay:
        if not args.check:
            print("sparse-mqa-check: --replay needs --check NAME", file=sys.stderr)
            return 2
        return replay(backends[0], args.check, args.replay)
    if args.budget is not None:
        from .nightly import run_nightly

        return run_nightly(backends, budget=args.budget, out=args.out, database=args.database,
                           ledger=args.ledger, profile=args.profile or "nightly", extra=extra)
    if args.check:
        extra = ["--smqa-check", args.check, *extra]
    t0 = time.monotonic()
    rc, data = run_suite(backends, profile=args.profile, database=args.database, json_path=args.json,
                         extra=extra)
    rows = data.get("rows", [])
    failed = [r for r in rows if r["outcome"] in ("failed", "error")]
    if rc == 0 and all(r["outcome"] == "skipped" for r in rows):
        reasons = sorted({r.get("reason", "") for r in rows}) or ["no suite test was collected"]
        print(f"sparse-mqa-check: nothing was checked: {'; '.join(reasons)}")
        rc = 1
    verdict = "FAIL" if rc != 0 else "PASS"
    print(f"sparse-mqa-check: {verdict}: backend {', '.join(backends)}, profile {data.get('profile', '?')}, "
          f"{sum(r['cases'] for r in rows)} cases in {len(rows)} checks, {len(failed)} failed, "
          f"{time.monotonic() - t0:.0f} s")
    for r in failed:
        if r.get("failure"):
            print(f"  replay: {r['failure']['repro']}")
    return rc


def _default_backend() -> str:
    from .backends import default_backend_name

    return default_backend_name()


def suite_command(backends, *, profile=None, database=None, json_path=None, extra=()) -> list[str]:
    """The pytest command line the main job runs (in the working directory, as its rootdir)."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", SUITE, "-q", "-p", "no:cacheprovider",
           "--rootdir", os.getcwd(), "-c", os.devnull, "-p", "sparse_mqa_testkit.plugin"]
    for b in backends:
        cmd += ["--smqa-backend", b]
    if profile:
        cmd += ["--smqa-profile", profile]
    if database:
        cmd += ["--smqa-database", str(database)]
    if json_path:
        cmd += ["--smqa-json", str(json_path)]
    return cmd + list(extra)


def run_suite(backends, *, profile=None, database=None, json_path=None, extra=(), env=None, timeout=None):
    """Run the suite in a child pytest; returns (exit status, the JSON the plugin wrote, or {})."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(json_path or Path(tmp) / "smqa.json")
        cmd = suite_command(backends, profile=profile, database=database, json_path=path, extra=extra)
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"sparse-mqa-check: the suite ran past {timeout:.0f} s and was stopped", file=sys.stderr)
            rc = 124
        data = json.loads(path.read_text()) if path.exists() else {}
    return rc, data


def replay(backend_name: str, check: str, expr: str) -> int:
    """Run one check on one case (the line a failure message prints) and show its result."""
    from .backends import get_backend
    from .cases import Case
    from .suite import check_function

    try:
        case = eval(expr, {"__builtins__": {}}, {"Case": Case, "inf": math.inf, "nan": math.nan})
    except Exception as e:
        print(f"sparse-mqa-check: --replay must be a Case(...) expression: {e}", file=sys.stderr)
        return 2
    if not isinstance(case, Case):
        print(f"sparse-mqa-check: --replay must build a Case, got {type(case).__name__}", file=sys.stderr)
        return 2
    backend = get_backend(backend_name)
    if callable(getattr(backend, "warmup", None)):
        backend.warmup()
    result = check_function(check)(backend, case)
    if result.passed:
        print(f"PASS: {check} on backend {backend_name}: worst ratio {result.ratio:.3g}\ncase: {case.describe()}")
        return 0
    print(result.message)
    return 1


def precompile(directory) -> int:
    """Fill TileLang's cache in ``directory`` with every kernel variant the suite can draw (target sm_90a)."""
    where = Path(directory).resolve()
    where.mkdir(parents=True, exist_ok=True)
    os.environ["TILELANG_CACHE_DIR"] = str(where)  # read by TileLang when it is imported, below
    if "tilelang" in sys.modules:
        print("sparse-mqa-check: warning: tilelang was imported before TILELANG_CACHE_DIR was set",
              file=sys.stderr)
    rc, total = 0, 0
    for name in PRECOMPILE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            print(f"{name}: cannot be imported ({e}); its kernels were NOT precompiled")
            rc = 1
            continue
        fn = getattr(module, "precompile", None)
        if not callable(fn):
            print(f"{name}: has no precompile(); its kernels were NOT precompiled")
            rc = 1
            continue
        t0 = time.monotonic()
        try:
            variants = list(fn())
        except Exception as e:  # one module's failure must not stop the other's cache from filling
            print(f"{name}: precompile() failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
            rc = 1
            continue
        total += len(variants)
        print(f"{name}: {len(variants)} kernel variants compiled in {time.monotonic() - t0:.1f} s")
        for v in variants:
            print(f"  {v}")
    print(f"TileLang cache {where}: {total} variants{'' if rc == 0 else ' (incomplete, see above)'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
