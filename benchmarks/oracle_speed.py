"""Oracle speed on one core: forward, backward (which recomputes the forward) and examples/s.

Run with one BLAS thread, as the target is stated for one core:

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 python benchmarks/oracle_speed.py

Reports the best (minimum) of several repeats, since the machine may be shared; the median is printed too.
Both wall-clock and process CPU time are measured: with one BLAS thread the CPU time is the single-core work,
and it is what stays meaningful when other jobs share the cores (wall-clock then includes waiting).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from sparse_mqa_testkit import oracle
from sparse_mqa_testkit.cases import Case

# The production-sized target: B1 S128 Skv256 H16 L64 576/512, float32, within 20 ms fwd+bwd on one core.
TARGET = Case(B=1, S=128, Skv=256, H=16, L=64, Dqk=576, Dv=512, sink="finite", seed=0)
# What the CPU property tests typically draw (small dims, a few dozen rows).
TYPICAL = Case(B=2, S=12, Skv=24, H=8, L=20, Dqk=16, Dv=8, sink="mixed", topk="random", invalid="mixed",
               duplicates=True, seed=1)


def _times(fn, repeats: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return {"wall": wall, "cpu": cpu}


def _args(case: Case):
    x = case.inputs()
    kw = dict(sm_scale=x["sm_scale"], d_v=x["d_v"], attn_sink=x["attn_sink"], topk_length=x["topk_length"])
    return x, kw


def bench(case: Case, repeats: int, dtype=np.float32) -> dict:
    x, kw = _args(case)
    fwd = _times(lambda: oracle.forward(x["q"], x["kv"], x["indices"], dtype=dtype, **kw), repeats)
    bwd = _times(lambda: oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], dtype=dtype, **kw),
                 repeats)
    return {"fwd": fwd, "bwd": bwd}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    threads = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    print(f"threads env: {threads}")
    print(f"target case: {TARGET.describe()}")
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min)")
    for dtype in (np.float32, np.float64):
        r = bench(TARGET, a.repeats, dtype)
        for clock in ("cpu", "wall"):
            f, b = min(r["fwd"][clock]) * 1e3, min(r["bwd"][clock]) * 1e3
            fm, bm = statistics.median(r["fwd"][clock]) * 1e3, statistics.median(r["bwd"][clock]) * 1e3
            print(f"  {np.dtype(dtype).name} {clock:4s}: forward {f:6.2f} ms (median {fm:6.2f}), backward {b:6.2f} ms "
                  f"(median {bm:6.2f}), forward+backward {f + b:6.2f} ms (median {fm + bm:6.2f})")
    print(f"typical CPU-test case: {TYPICAL.describe()}")
    r = bench(TYPICAL, max(a.repeats * 10, 100))
    for clock in ("cpu", "wall"):
        per = statistics.median(r["fwd"][clock]) + statistics.median(r["bwd"][clock])
        print(f"  float32 {clock:4s} forward+backward {per * 1e3:6.3f} ms (median) -> {1.0 / per:8.0f} examples/s")
    print(f"load average after: {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
