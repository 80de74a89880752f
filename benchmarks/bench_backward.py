"""Deterministic TileLang backward vs cuDNN's DSA backward, in one process (``sparse_mqa_testkit.bench``).

    PYTHONUNBUFFERED=1 python benchmarks/bench_backward.py [--shapes anchor,h128,l512] [--backends cudnn,tilelang]
        [--json out.json]

Inputs: q, kv, dO ~ N(0, 1) bf16, distinct random top-k per row, a finite sink per head (N(0, 1)); out and lse
from the contract's float32 torch forward. Timing: CUDA events after warm-up, median over rotated input sets;
the rows also say whether every output was bitwise equal over repeats. FLOPs: 2 H L (3 Dqk + 2 Dv) S.
Backends that cannot load (cuDNN not installed) are reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys

from sparse_mqa_testkit import bench

SHAPES = {
    "anchor": bench.Shape(S=4096, Skv=8192, H=64, L=2048),
    "h128": bench.Shape(S=4096, Skv=8192, H=128, L=2048),
    "l512": bench.Shape(S=4096, Skv=8192, H=64, L=512),
    "small": bench.Shape(S=512, Skv=2048, H=64, L=512),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="anchor,h128,l512")
    ap.add_argument("--backends", default="cudnn,tilelang")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    shapes = [(SHAPES[s], {s}) for s in a.shapes.split(",")]
    res = bench.run(shapes, backward=tuple(a.backends.split(",")), forward=(), sets=a.sets, warmup=a.warmup,
                    iters=a.iters, repeats=3, sink=True)
    print(f"device: {res['device']}  torch {res['torch']}  date {res['date']}")
    print(f"{'backend':10s} {'shape':32s} {'ms':>8s} {'min':>8s} {'TFLOP/s':>8s} {'vs cudnn':>8s} stable")
    for r in res["rows"]:
        if r["status"] != "ok":
            print(f"{r['backend']:10s} {r['shape']:32s} {r['status']}: {r['reason']}")
            continue
        ratio = f"{r['vs_cudnn']:.2f}x" if r["vs_cudnn"] else "-"
        print(f"{r['backend']:10s} {r['shape']:32s} {r['ms']:8.3f} {r['ms_min']:8.3f} {r['tflops']:8.1f} "
              f"{ratio:>8s} {r['stable']} {r['drift'] or ''}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
