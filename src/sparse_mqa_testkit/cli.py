"""Command line: ``sparse-mqa-check`` / ``python -m sparse_mqa_testkit``.

For now it checks the oracle itself on drawn cases (float32 against float64) and prints a summary.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from hypothesis import HealthCheck, given, settings

from . import oracle
from .strategies import cases


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    fin = np.isfinite(b)
    den = np.linalg.norm(b[fin]) or 1.0
    return float(np.linalg.norm((a - b)[fin]) / den)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sparse-mqa-check", description=__doc__)
    ap.add_argument("--examples", type=int, default=50)
    args = ap.parse_args(argv)
    worst = {}

    @settings(max_examples=args.examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def run(case):
        x = case.inputs()
        kw = dict(sm_scale=x["sm_scale"], d_v=x["d_v"], attn_sink=x["attn_sink"], topk_length=x["topk_length"])
        res = {}
        for dt in (np.float32, np.float64):
            out, lse = oracle.forward(x["q"], x["kv"], x["indices"], dtype=dt, **kw)
            dq, dkv, ds = oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], dtype=dt, **kw)
            res[dt] = dict(out=out, lse=lse, dq=dq, dkv=dkv, d_sink=ds)
        for k, v in res[np.float32].items():
            if v is not None:
                worst[k] = max(worst.get(k, 0.0), _rel(v, res[np.float64][k]))

    run()
    print(f"{'tensor':8} worst rel-L2 float32 vs float64 over {args.examples} cases")
    bad = False
    for k, v in worst.items():
        ok = v < 1e-5
        bad |= not ok
        print(f"{k:8} {v:.3e}  {'ok' if ok else 'FAIL'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
