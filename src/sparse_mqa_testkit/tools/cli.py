"""``sparse-mqa-check`` / ``python -m sparse_mqa_testkit``: the conformance suite on a backend, as a table.

    sparse-mqa-check [--backend NAME|module:attr] [--profile dev|ci|nightly] [--json PATH] [--database DIR]
    sparse-mqa-check --backend NAME --check CHECK --replay "Case(...)"     # replay one failure
    sparse-mqa-check --backend NAME --check repeats --repeats 1000 --replay "Case(...)"
    sparse-mqa-check --precompile DIR [--backend NAME]                    # fill kernel caches ahead
    sparse-mqa-check --backend NAME --sanitize [memcheck,racecheck,...]   # boundary cases under compute-sanitizer
    sparse-mqa-check --profile nightly --budget SECONDS --out DIR         # nightly fuzzing (see nightly.py)
    sparse-mqa-check --budget SECONDS --engine hypofuzz                   # ... on HypoFuzz (hypofuzz_nightly.py)

The suite is ``sparse_mqa_testkit.property_tests`` run by pytest in a child process (a crashing kernel cannot
take the report with it); the plugin prints the table (check, backend, cases, worst error vs allowed, verdict)
and the boundary classes covered. Exit status: 0 when every check passed, non-zero otherwise. Arguments after
``--`` go to pytest (e.g. ``-- -n auto`` on a multi-GPU runner).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
from pathlib import Path

from ..backends import BackendNotFound, MissingDependency, available_backends, default_backend_name, get_backend
from ..backends.registry import describe_backends
from ..backends.spec import BackendSpec
from ..cases import Case
from ..cases.planning import compile_budget, plan_backend
from ..checks.registry import CHECKS, get_check
from ..checks.result import exception_summary
from ..harness.profiles import PROFILES, profile_name
from ..harness.table import merged
from . import isolate as isolation
from . import sanitize as san
from .hypofuzz_nightly import run_hypofuzz_nightly
from .nightly import run_nightly
from .runner import run_suite
from .sanitize import TOOLS

ENGINES = ("ours", "hypofuzz")
ENGINE_ENV = "SMQA_ENGINE"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparse-mqa-check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", metavar="NAME|module:attr",
                    help="backend to check (repeatable; default: the installed backend that is the default on "
                         "this machine's GPU, else reference)")
    ap.add_argument("--profile", choices=PROFILES, help="Hypothesis profile (default $SMQA_PROFILE or dev)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--database", metavar="DIR|redis://HOST:PORT[/DB]",
                    help="Hypothesis example database: directories and Redis URLs, comma-separated, all read and "
                         "written (default $SMQA_DATABASE, else ./.hypothesis/smqa)")
    ap.add_argument("--check", metavar="NAME", choices=list(CHECKS),
                    help=f"only this check ({', '.join(CHECKS)}); with --replay, the check to replay")
    ap.add_argument("--replay", metavar='"Case(...)"', help="run --check once on this case and print the result")
    ap.add_argument("--repeats", type=int, metavar="N", help="with --check repeats --replay: calls per case (a "
                    "failure's message says how many it made)")
    ap.add_argument("--sanitize", nargs="?", const=",".join(TOOLS), metavar="TOOLS",
                    help="run the backend's explicit boundary cases (or --replay's case) under compute-sanitizer, one "
                         f"child process per tool (default {','.join(TOOLS)}); any finding fails")
    ap.add_argument("--isolate", type=float, metavar="SECONDS",
                    help="run the backend's explicit boundary cases (or --replay's case) one at a time in a child "
                         "process, each within SECONDS (a hang fails its case, the run goes on): --check's check, "
                         "else tolerance, forward_tolerance and guards")
    ap.add_argument("--list-backends", action="store_true",
                    help="list the backends this machine knows: name, origin, device, and whether each loads here")
    ap.add_argument("--allow-missing", action="store_true",
                    help="skip a backend whose optional packages are not installed instead of failing")
    ap.add_argument("--limits", metavar="SIZE=N,...", help="drawn size limits, e.g. L=130,H=20 (B, S, Skv, H, "
                    "L, work)")
    ap.add_argument("--compile-budget", type=int, metavar="N",
                    help="kernel keys a backend that declares compile_keys may compile in the run")
    ap.add_argument("--precompile", metavar="DIR",
                    help="compile every kernel variant of the named backends (default: every installed backend "
                         "that can) into the cache directory DIR")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="--precompile: compile with N processes, for a backend whose precompile takes jobs")
    ap.add_argument("--budget", type=float, metavar="SECONDS", help="nightly: search for this long")
    ap.add_argument("--out", metavar="DIR", help="nightly: reproducers, round logs and the ledger go here")
    ap.add_argument("--engine", choices=ENGINES,
                    help=f"nightly: who searches, our rounds of pytest or HypoFuzz (default ${ENGINE_ENV}, else ours)")
    ap.add_argument("--ledger", metavar="PATH", help="nightly: JSON ledger of ratios per boundary class "
                    "(default OUT/ledger.json; runs are appended)")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments")
    return ap


def _working_directory_on_path() -> None:
    """The working directory on ``sys.path`` (last, so it shadows nothing installed), as ``python -m`` has it: a
    ``--backend module:attr`` living where a failure printed its repro line then resolves when that line runs as
    the ``sparse-mqa-check`` console script, which would not look there."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    _working_directory_on_path()
    extra = [a for a in args.pytest_args if a != "--"]
    if args.list_backends:
        return list_backends()
    if args.allow_missing:
        extra = ["--smqa-allow-missing", *extra]
    if args.limits:
        extra = ["--smqa-limits", args.limits, *extra]
    if args.compile_budget is not None:
        extra = ["--smqa-compile-budget", str(args.compile_budget), *extra]
    if args.precompile:
        return precompile(args.precompile, args.backend, args.jobs)
    backends = args.backend or [_default_backend()]
    if args.isolate:
        return isolate(backends, args.isolate, args.check, args.profile, args.replay)
    if args.sanitize:
        return sanitize(backends, args.sanitize, args.profile, args.replay)
    if args.repeats is not None and (args.check != "repeats" or not args.replay):
        print("sparse-mqa-check: --repeats goes with --check repeats --replay", file=sys.stderr)
        return 2
    if args.replay:
        if not args.check:
            print("sparse-mqa-check: --replay needs --check NAME", file=sys.stderr)
            return 2
        return replay(backends[0], args.check, args.replay, args.repeats)
    engine = args.engine or os.environ.get(ENGINE_ENV) or ENGINES[0]
    if args.budget is not None and engine not in ENGINES:
        print(f"sparse-mqa-check: {ENGINE_ENV} must be one of {', '.join(ENGINES)}, got {engine!r}", file=sys.stderr)
        return 2
    if args.budget is not None and engine == "hypofuzz":
        return run_hypofuzz_nightly(backends, budget=args.budget, out=args.out, database=args.database,
                                    ledger=args.ledger, profile=args.profile or "nightly", extra=extra)
    if args.budget is not None:
        return run_nightly(backends, budget=args.budget, out=args.out, database=args.database,
                           ledger=args.ledger, profile=args.profile or "nightly", extra=extra)
    if args.check:
        extra = ["--smqa-check", args.check, *extra]
    t0 = time.monotonic()
    rc, data = run_suite(backends, profile=args.profile, database=args.database, json_path=args.json,
                         extra=extra)
    rows = merged(data.get("rows", []))
    failed = [r for r in rows if r["outcome"] in ("failed", "error")]
    if rc == 0 and all(r["outcome"] == "skipped" for r in rows):
        reasons = sorted({r.get("reason", "") for r in rows}) or ["no suite test was collected"]
        print(f"sparse-mqa-check: nothing was checked: {'; '.join(reasons)}")
        rc = 1
    verdict = "FAIL" if rc != 0 else "PASS"
    if data.get("status") == "interrupted":
        verdict = f"INTERRUPTED (by {data.get('stopped_by', 'a signal')}; what finished is above"
        verdict += f" and in {args.json})" if args.json else ")"
    if not data:  # the suite never started (a usage error, a backend that did not load): the child said why
        print(f"sparse-mqa-check: {verdict}: the suite did not run on backend {', '.join(backends)} (pytest exit "
              f"status {rc}, see above), {time.monotonic() - t0:.0f} s")
        return rc or 1
    timing = data.get("timing") or {}
    split = "".join(f", {b}: warm-up {t['compile_s']:.0f} s, checks {t['check_s']:.0f} s"
                    for b, t in timing.items() if t.get("compile_s") is not None)
    print(f"sparse-mqa-check: {verdict}: backend {', '.join(backends)}, profile {data.get('profile', '?')}, "
          f"{sum(r['cases'] for r in rows)} cases in {len(rows)} checks, {len(failed)} failed, "
          f"{time.monotonic() - t0:.0f} s{split}")
    for r in failed:
        if r.get("failure"):
            print(f"  replay: {r['failure']['repro']}{_ratios(r['failure'])}")
    if data.get("status") == "interrupted":
        unfinished = [n.rpartition("::")[2] for n in data.get("unfinished", [])]
        print(f"  unfinished ({len(unfinished)}): {', '.join(unfinished) or 'none'}")
    return rc


def _ratios(failure: dict) -> str:
    """The shrunk case's ratio beside the highest the search saw: shrinking keeps a failure, not its size."""
    shrunk, top = failure.get("ratio"), failure.get("highest_ratio")
    if top is None or shrunk is None or top <= shrunk:
        return ""
    return f"  (ratio {shrunk:.3g}; the search saw up to {top:.3g})"


def _default_backend() -> str:
    return default_backend_name()


def replay(backend_name: str, check: str, expr: str, repeats: int | None = None) -> int:
    """Run one check on one case (the line a failure message prints) and show its result; a check that does not
    apply to the backend says why (exit status 1: nothing was checked)."""
    case = _case(expr)
    if case is None:
        return 2
    spec = load(backend_name)
    if spec is None:
        return 2
    spec.warmup([case])
    result = get_check(check).function(spec, case, **({"repeats": repeats} if repeats else {}))
    if result.skipped:
        print(f"SKIP: {check} on backend {backend_name}: {result.skipped}\ncase: {case.describe()}")
        return 1
    result = result.replayed_as(backend_name)
    if result.passed:
        print(f"PASS: {check} on backend {backend_name}: worst ratio {result.ratio:.3g}\ncase: {case.describe()}")
        return 0
    print(result.message)
    return 1


def load(name: str) -> BackendSpec | None:
    """The backend ``--backend`` names, or None after saying in one line why it cannot be loaded (with the last
    frames when its own module raised)."""
    try:
        spec = BackendSpec.of(get_backend(name))
        spec.require()
        return spec
    except (BackendNotFound, MissingDependency) as e:
        print(f"sparse-mqa-check: --backend {name}: {e}", file=sys.stderr)
    except Exception as e:
        print(f"sparse-mqa-check: --backend {name}: loading it raised {exception_summary(e)}", file=sys.stderr)
    return None


def list_backends() -> int:
    rows = describe_backends()
    head = ("name", "origin", "device", "loads here")
    cells = [head] + [(r["name"], r["origin"], r["device"], "yes" if r["loads"] else f"no: {r['reason']}")
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c[:3], widths)) + "  " + c[3])
    return 0


def _case(expr: str):
    """A ``Case(...)`` expression as a Case, or None after saying why not."""
    try:
        case = eval(expr, {"__builtins__": {}}, {"Case": Case, "inf": math.inf, "nan": math.nan})
    except Exception as e:
        print(f"sparse-mqa-check: --replay must be a Case(...) expression: {e}", file=sys.stderr)
        return None
    if not isinstance(case, Case):
        print(f"sparse-mqa-check: --replay must build a Case, got {type(case).__name__}", file=sys.stderr)
        return None
    return case


def _cases(backend, profile, replay_expr):
    """The replayed case, else the backend's explicit boundary examples (no drawing); None after saying why a
    replay expression is bad."""
    if replay_expr:
        case = _case(replay_expr)
        return None if case is None else [case]
    prof = profile_name(profile)
    return list(plan_backend(backend, profile=prof, budget=compile_budget(None, prof), draws=0).boundaries.examples)


def sanitize(backends, tools: str, profile, replay_expr=None) -> int:
    """Each GPU backend's explicit boundary cases (or one replayed case) under compute-sanitizer."""
    chosen = [t.strip() for t in tools.split(",") if t.strip()]
    unknown = sorted(set(chosen) - set(san.TOOLS))
    if unknown:
        print(f"sparse-mqa-check: --sanitize {', '.join(unknown)}: choose from {', '.join(san.TOOLS)}",
              file=sys.stderr)
        return 2
    rc = 0
    budget = san.Budget.from_env(len(backends) * len(chosen))
    for name in backends:  # a backend that cannot run leaves the others theirs; a finding outranks "not run"
        backend = load(name)
        if backend is None or backend.device == "cpu":
            if backend is not None:
                print(f"sanitize {name}: runs on the CPU: nothing for compute-sanitizer to check: NOT sanitized")
            budget.skip(len(chosen))
            status = san.NOT_RUN
        else:
            cases = _cases(backend, profile, replay_expr)
            if cases is None:
                return 2
            status = san.run(name, cases, chosen, budget=budget)
        rc = 1 if 1 in (rc, status) else max(rc, status)
    return rc


def isolate(backends, seconds: float, check, profile, replay_expr=None) -> int:
    """Each backend's explicit boundary cases (or one replayed case), one per child process in turn, each within
    ``seconds``."""
    checks = [check] if check else ["tolerance", "forward_tolerance", "guards"]
    rc = 0
    for name in backends:
        cases = _cases(get_backend(name), profile, replay_expr)
        if cases is None:
            return 2
        rc = max(rc, isolation.run(name, cases, checks, timeout=seconds))
    return rc


def precompile(directory, names=None, jobs: int = 1) -> int:
    """Compile every kernel variant of each backend (``names``, else every installed one that has a
    ``precompile(directory)``) into the cache ``directory``, by ``jobs`` processes where the backend takes them;
    works on a machine without a GPU."""
    where = Path(directory).resolve()
    where.mkdir(parents=True, exist_ok=True)
    rc, total = 0, 0
    for name in names or available_backends():
        try:
            spec = BackendSpec.of(get_backend(name))
            fn = spec.precompile
        except Exception as e:
            print(f"{name}: cannot be loaded ({type(e).__name__}: {e}); its kernels were NOT precompiled")
            rc = 1
            continue
        if fn is None:
            if names:
                print(f"{name}: has no precompile(): nothing to compile ahead")
            continue
        t0 = time.monotonic()
        try:
            variants = spec.precompile_into(where, jobs)
        except Exception as e:  # one backend's failure must not stop the others' caches from filling
            print(f"{name}: precompile() failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}")
            rc = 1
            continue
        total += len(variants)
        by = f" by {jobs} processes" if jobs > 1 and "jobs" in inspect.signature(fn).parameters else ""
        print(f"{name}: {len(variants)} kernel variants compiled in {time.monotonic() - t0:.1f} s{by}")
        for v in variants:
            print(f"  {v}")
    print(f"cache {where}: {total} variants{'' if rc == 0 else ' (incomplete, see above)'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
