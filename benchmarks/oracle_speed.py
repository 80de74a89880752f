"""Oracle speed on one core: forward, backward (which recomputes the forward) and examples/s.

Run with one BLAS thread, as the target is stated for one core:

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 python benchmarks/oracle_speed.py

Reports the best (minimum) of several repeats, since the machine may be shared; the median is printed too.
Both wall-clock and process CPU time are measured: with one BLAS thread the CPU time is the single-core work,
and it is what stays meaningful when other jobs share the cores (wall-clock then includes waiting).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from sparse_mqa_testkit import oracle
from sparse_mqa_testkit.cases import Case

# The production-sized target: B1 S128 Skv256 H16 L64 576/512, float32, within 20 ms fwd+bwd on one core.
TARGET = Case(B=1, S=128, Skv=256, H=16, L=64, Dqk=576, Dv=512, sink="finite", seed=0)
# What the CPU property tests typically draw (small dims, a few dozen rows).
TYPICAL = Case(B=2, S=12, Skv=24, H=8, L=20, Dqk=16, Dv=8, sink="mixed", topk="random", invalid="mixed",
               duplicates=True, seed=1)


def _times(fns, repeats: int, warmup: int = 2) -> list[dict]:
    """Time each of ``fns`` ``repeats`` times, interleaved (A B A B ...) so that all see the same machine."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    res = [{"wall": [], "cpu": []} for _ in fns]
    for _ in range(repeats):
        for fn, r in zip(fns, res):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            r["cpu"].append(time.process_time() - c0)
            r["wall"].append(time.perf_counter() - t0)
    return res


def _args(case: Case):
    x = case.inputs()
    kw = dict(sm_scale=x["sm_scale"], d_v=x["d_v"], attn_sink=x["attn_sink"], topk_length=x["topk_length"])
    return x, kw


def bench(case: Case, repeats: int, dtype=np.float32, impls=(oracle,)) -> list[dict]:
    """Forward and backward timings per implementation: [{"fwd": {...}, "bwd": {...}}, ...]."""
    x, kw = _args(case)
    fwd = _times([lambda m=m: m.forward(x["q"], x["kv"], x["indices"], dtype=dtype, **kw) for m in impls], repeats)
    bwd = _times([lambda m=m: m.backward(x["q"], x["kv"], x["indices"], x["grad_out"], dtype=dtype, **kw)
                  for m in impls], repeats)
    return [{"fwd": f, "bwd": b} for f, b in zip(fwd, bwd)]


def load_revision(rev: str):
    """The oracle's reference.py as it was at git revision ``rev``, loaded as a module (a peer to compare)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "show", f"{rev}:src/sparse_mqa_testkit/oracle/reference.py"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    src = src.replace("from .. import contract", "from sparse_mqa_testkit import contract")
    path = os.path.join(tempfile.mkdtemp(), "oracle_at_rev.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("oracle_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _line(label: str, r: dict, clock: str) -> float:
    f, b = min(r["fwd"][clock]) * 1e3, min(r["bwd"][clock]) * 1e3
    fm, bm = statistics.median(r["fwd"][clock]) * 1e3, statistics.median(r["bwd"][clock]) * 1e3
    print(f"  {label} {clock:4s}: forward {f:6.2f} ms (median {fm:6.2f}), backward {b:6.2f} ms "
          f"(median {bm:6.2f}), forward+backward {f + b:6.2f} ms (median {fm + bm:6.2f})")
    return f + b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--against", metavar="REV", help="also time the oracle as of this git revision, in the same run")
    a = p.parse_args()
    threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"threads env: {threads}")
    print(f"target case: {TARGET.describe()}")
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)")
    peer = load_revision(a.against) if a.against else None
    for dtype in (np.float32, np.float64):
        name = np.dtype(dtype).name
        r, *rest = bench(TARGET, a.repeats, dtype, (oracle, peer) if peer else (oracle,))
        rp = rest[0] if rest else None
        for clock in ("cpu", "wall"):
            now = _line(name, r, clock)
            if rp:
                then = _line(f"{name} at {a.against}", rp, clock)
                print(f"  -> {then / now:.2f}x faster than {a.against} ({clock}, best of {a.repeats})")
    print(f"typical CPU-test case: {TYPICAL.describe()}")
    impls = (oracle, peer) if peer else (oracle,)
    labels = ("float32", f"float32 at {a.against}")
    for label, r in zip(labels, bench(TYPICAL, max(a.repeats * 10, 100), impls=impls)):
        for clock in ("cpu", "wall"):
            per = statistics.median(r["fwd"][clock]) + statistics.median(r["bwd"][clock])
            print(f"  {label} {clock:4s} forward+backward {per * 1e3:6.3f} ms (median) -> {1.0 / per:8.0f} "
                  "examples/s")
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
