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
    ap.add_argument("--precision", action="store_true",
                    help="our kernel against the float64 oracle at a production-like size (conformance error model)")
    ap.add_argument("--compare", action="store_true",
                    help="time our kernel's configurations (CONFIGS) against each other and exit")
    a = ap.parse_args(argv)
    if a.precision:
        return precision()
    if a.compare:
        return compare_configs([SHAPES[s] for s in a.shapes.split(",")], a.iters, a.warmup)
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


def precision() -> int:
    """check_backward_tolerance at B1 S256 Skv2048 H64 L512 576/512: error / allowed per output."""
    from sparse_mqa_testkit.backends.registry import get_backend
    from sparse_mqa_testkit.cases import Case
    from sparse_mqa_testkit.checks import check_backward_tolerance

    for sink in ("finite", "none"):
        case = Case(B=1, S=256, Skv=2048, H=64, L=512, Dqk=576, Dv=512, sink=sink, seed=11)
        r = check_backward_tolerance(get_backend("tilelang"), case)
        print(f"{case.describe()}: passed {r.passed}")
        for name, e in r.per_tensor.items():
            print(f"  {name}: relative L2 error {e['error']:.3e}, allowed {e['allowed']:.3e} "
                  f"(bf16-rounded oracle {e['reference_error']:.3e}), ratio {e['ratio']:.2f}")
    return 0


# kernel configurations timed against each other by --compare (the first is the reference for agreement)
CONFIGS = (
    dict(),  # the default: warp-specialised body, 8 staging rows x 1 buffer per consumer, both rounds deferred
    dict(defer=0),  # a block's staging rounds sent right after its dkv product
    dict(stage_rows=4, stage_bufs=2),  # more, smaller staging rounds
    dict(ws=False),  # single-role body: every thread does every step in turn
)


def compare_configs(shapes, iters, warmup) -> int:
    """Median ms of ``sparse_mla_backward`` per kernel configuration, and how far each is from the first."""
    import statistics

    import torch

    from sparse_mqa_testkit.kernels.backward import sparse_mla_backward

    for shape in shapes:
        x = bench.make_inputs(shape, "cuda", seed=0, sink=True)
        out, lse = bench.contract_forward(x["q"], x["kv"], x["indices"], x["sm_scale"], x["d_v"],
                                          attn_sink=x["attn_sink"])
        ref = prev = None
        for cfg in CONFIGS:
            def call():
                return sparse_mla_backward(x["q"], x["kv"], out, x["grad_out"], lse, x["attn_sink"],
                                           x["indices"], x["sm_scale"], **cfg)
            try:
                got = call()
                again = call()
            except Exception as exc:  # a configuration not compiled here is reported, not fatal
                print(f"{cfg} {shape.label}: {type(exc).__name__}: {exc}")
                continue
            stable = all(torch.equal(a, b) for a, b in zip(got, again))
            times = bench.time_calls(lambda k: call(), 1, warmup, iters, "cuda")
            ms = statistics.median(times)
            if ref is None:
                ref = [t.clone() for t in got]
            diff = {n: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                    for n, a, b in zip(("dq", "dkv", "d_sink"), got, ref)}
            same = prev is not None and all(torch.equal(a, b) for a, b in zip(got, prev))
            prev = [t.clone() for t in got]
            print(f"{cfg} {shape.label}: {ms:8.3f} ms {bench.tflops(shape, 'backward', ms):6.1f} TFLOP/s "
                  f"bitwise stable {stable}; same bits as the previous config {same}; "
                  f"rel. L2 vs first config {diff}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
