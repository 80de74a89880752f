"""``sparse-mqa-check --isolate SECONDS``: a backend's explicit boundary examples in a child process, each case with
a time limit, so that a kernel that hangs (a length <= 0 once deadlocked a shipped kernel on a one-sided barrier)
fails that case and the run goes on with the next one in a fresh child.

The child prints a line per case as it starts and as it ends; the parent reads them with a deadline per case.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..backends import get_backend
from ..backends.spec import BackendSpec
from ..cases import Case
from ..checks.registry import get_check

MARK = "[smqa-isolate] "


def child(backend_name: str, cases_json: str, start: int, checks: str) -> int:
    """Run ``checks`` on each case from ``start`` on, with a line as each begins and ends."""
    spec = BackendSpec.of(get_backend(backend_name))
    cases = [Case(**c) for c in json.loads(Path(cases_json).read_text())]
    for i in range(start, len(cases)):
        print(f"{MARK}start {i}", flush=True)
        spec.warmup([cases[i]])
        verdicts = []
        for name in checks.split(","):
            check = get_check(name)
            if check.applies_to(spec):
                continue
            res = check.function(spec, cases[i])
            first = res.message.splitlines()[1] if not res.passed and len(res.message.splitlines()) > 1 else ""
            verdicts.append({"check": name, "passed": res.passed, "ratio": res.ratio, "problem": first})
        print(f"{MARK}done {i} {json.dumps(verdicts)}", flush=True)
    return 0


def run(backend_name: str, cases, checks, *, timeout: float, out=sys.stdout) -> int:
    """Every case under ``checks``, each within ``timeout`` seconds (its warm-up included); 0 when all pass."""
    cases = list(cases)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps([dataclasses.asdict(c) for c in cases]))
        start = 0
        while start < len(cases):
            cmd = [sys.executable, "-m", "sparse_mqa_testkit.tools.isolate", backend_name, str(spec), str(start),
                   ",".join(checks)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
            sel = selectors.DefaultSelector()
            sel.register(proc.stdout, selectors.EVENT_READ)
            current, following, tail = None, start, []  # the case running; the one the child reaches next
            deadline = time.monotonic() + timeout
            while True:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    proc.kill()
                    proc.wait()
                    i = following if current is None else current
                    print(f"isolate {backend_name}: HANG: case {i} ran past {timeout:.0f} s: {cases[i].repro()}",
                          file=out, flush=True)
                    failed, start = failed + 1, i + 1
                    break
                line = proc.stdout.readline()
                if not line:  # the child ended: done with every case, or crashed in one
                    code = proc.wait()
                    if current is None and code == 0:
                        start = len(cases)
                    else:
                        i = following if current is None else current
                        print(f"isolate {backend_name}: CRASH (exit {code}) in case {i}: {cases[i].repro()}\n"
                              + "".join(tail[-8:]), file=out, flush=True)
                        failed, start = failed + 1, i + 1
                    break
                tail.append(line)
                if line.startswith(MARK + "start "):  # the clock is per case: other output does not reset it
                    current, deadline = int(line.split()[2]), time.monotonic() + timeout
                elif line.startswith(MARK + "done "):
                    _, _, i, verdicts = line.split(" ", 3)
                    current, following = None, int(i) + 1
                    deadline = time.monotonic() + timeout
                    for v in json.loads(verdicts):
                        failed += not v["passed"]
                        print(f"isolate {backend_name}: {'PASS' if v['passed'] else 'FAIL'} {v['check']} case {i} "
                              f"ratio {v['ratio']:.3g}" + (f": {v['problem']}" if v["problem"] else "")
                              + f"  {cases[int(i)].repro()}", file=out, flush=True)
    print(f"isolate {backend_name}: {len(cases)} cases, {failed} failed or hung", file=out)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(child(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
