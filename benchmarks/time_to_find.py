"""Time to find a planted bug: our nightly loop against HypoFuzz, drawn search only, on CPU.

    python benchmarks/time_to_find.py --hypofuzz-venv VENV [--bugs topk_ignored,flipped_sink,head_group_dropped]
        [--repeats 3] [--cap 300] [--workers 2] [--json PATH]

VENV: a venv with the `fuzz` extra, built with --system-site-packages so it sees this checkout's packages
(tests/testkit/test_hypofuzz.py builds one under ~/.cache/sparse-mqa-testkit). A bug is a name in
tests/support.py's BROKEN or CLASS_BUGS.

Each run starts one engine on a fresh example database with the bug's backend and times, from the engine's
launch, the first failure saved to the database (polled every 0.5 s); it then stops the engine. Both engines run
the suite's fuzz entry only (`--smqa-fuzz -k test_fuzz`: every drawn check of the backend, no explicit boundary
example, the same keys for both) in the `nightly` profile with `--workers` processes: ours as
`sparse-mqa-check --budget` rounds with that many xdist workers, HypoFuzz as `sparse-mqa-check --engine hypofuzz`
(`hypothesis fuzz -n W`, dashboard off). Start-up (imports, collection) counts for both. A run that finds nothing
within the cap counts as the cap and is marked '>'. Ours runs on this interpreter's Hypothesis, HypoFuzz on the
venv's (the older one it needs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import support  # noqa: E402 (the planted bugs)
from sparse_mqa_testkit.harness import hypothesis_compat, profiles  # noqa: E402
from sparse_mqa_testkit.harness.fuzzing import fuzz_test  # noqa: E402

BUGS = {**support.BROKEN, **{k.replace(" ", "_"): v for k, v in support.CLASS_BUGS.items()}}


def backend_ref(bug: str) -> str:
    return f"support:{BUGS[bug].__name__}"


def env_for(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMQA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    return {**env, **(extra or {})}


def fuzz_keys(ref: str, cwd: Path) -> list[bytes]:
    """The database keys of the backend's fuzz items, as collected from ``cwd``."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "sparse_mqa_testkit.property_tests", "-p", "no:cacheprovider",
           "--rootdir", str(cwd), "-c", os.devnull, "-p", "sparse_mqa_testkit.plugin", "--smqa-fuzz",
           "--smqa-profile", "nightly", "--smqa-backend", ref, "-k", "test_fuzz", "--collect-only", "-q"]
    out = subprocess.run(cmd, cwd=cwd, env=env_for(), capture_output=True, text=True, check=True).stdout
    ids = [n for n in out.splitlines() if "::test_fuzz[" in n]
    assert ids, out
    return [hypothesis_compat.example_key(fuzz_test(n.encode())) for n in ids]


def engine_command(engine: str, ref: str, run: Path, cap: float, workers: int, venv: Path) -> tuple[list, dict]:
    common = ["--backend", ref, "--profile", "nightly", "--budget", str(cap + 120), "--database", str(run / "db"),
              "--out", str(run / "out")]
    if engine == "ours":
        return ([sys.executable, "-m", "sparse_mqa_testkit", "--engine", "ours", *common, "--",
                 "--smqa-fuzz", "-k", "test_fuzz", "-n", str(workers)], {})
    return ([str(venv / "bin" / "python"), "-m", "sparse_mqa_testkit", "--engine", "hypofuzz", *common, "--",
             "-k", "test_fuzz"], {"SMQA_FUZZ_WORKERS": str(workers), "SMQA_DASHBOARD_PORT": "off"})


def time_one(engine: str, bug: str, base: Path, rep: int, cap: float, workers: int, venv: Path,
             keys: list[bytes]) -> float | None:
    run = base / f"{engine}-{rep}"
    run.mkdir(parents=True)
    cmd, extra = engine_command(engine, backend_ref(bug), run, cap, workers, venv)
    db = profiles.example_database(run / "db")
    with open(run / "log.txt", "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=base, env=env_for(extra), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        found = None
        while time.monotonic() - t0 < cap and proc.poll() is None:
            time.sleep(0.5)
            if any(list(db.fetch(k)) for k in keys):
                found = time.monotonic() - t0
                break
        if found is None and proc.poll() is not None and any(list(db.fetch(k)) for k in keys):
            found = time.monotonic() - t0  # it ended (a failing round) between two polls
        stop(proc)
    return found


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the engine's session (the HypoFuzz campaign then stops the sessions of its own processes), then
    SIGKILL to what is left of it."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hypofuzz-venv", type=Path, required=True)
    ap.add_argument("--bugs", default="topk_ignored,flipped_sink,head_group_dropped")
    ap.add_argument("--engines", default="ours,hypofuzz")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap", type=float, default=300.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/smqa-time-to-find"))
    args = ap.parse_args(argv)
    bugs, engines = args.bugs.split(","), args.engines.split(",")
    unknown = [b for b in bugs if b not in BUGS]
    if unknown:
        ap.error(f"unknown bugs {unknown}; choose from {', '.join(BUGS)}")
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    results: dict = {}
    work = args.work / f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}"
    for bug in bugs:
        base = work / bug  # every run of the bug from here, so its node ids (and keys) are the collected ones
        base.mkdir(parents=True)
        keys = fuzz_keys(backend_ref(bug), base)
        for rep in range(args.repeats):
            for engine in engines:  # interleaved, so a change in the machine's load hits both
                t = time_one(engine, bug, base, rep, args.cap, args.workers, args.hypofuzz_venv, keys)
                results.setdefault(bug, {}).setdefault(engine, []).append(t)
                shown = f">{args.cap:.0f}" if t is None else f"{t:.1f}"
                print(f"{bug} {engine} repeat {rep + 1}: {shown} s", flush=True)
    print("\n| bug (backend) | " + " | ".join(f"{e}: runs, median" for e in engines) + " |")
    print("|---|" + "---|" * len(engines))
    for bug, by_engine in results.items():
        cells = []
        for e in engines:
            ts = by_engine[e]
            runs = ", ".join(f">{args.cap:.0f}" if t is None else f"{t:.1f}" for t in ts)
            med = statistics.median(args.cap if t is None else t for t in ts)
            cells.append(f"{runs}; **{'>' if sum(t is None for t in ts) * 2 > len(ts) else ''}{med:.1f} s**")
        print(f"| {bug} (`{backend_ref(bug)}`) | " + " | ".join(cells) + " |")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps({"cap": args.cap, "workers": args.workers, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
