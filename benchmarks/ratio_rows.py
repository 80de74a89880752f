"""The error model's ratio per result (dq, dkv, d_sink) of the ``tilelang`` backward (design (a) with the octave
bound at 64 heads) and of design (a) with the earlier bound passes (``rows_backend``) on the same cases against the
same float64 oracle: the scale tier's fixed cases and the anchor with each index pattern (issue 26's bar: dkv's ratio
against the int64 backward's, BENCHMARKS, grows by 10 % at most).

    python benchmarks/ratio_rows.py      # on a GPU; each case's oracle is built once, every backend judged on it
"""
import pathlib
import sys
import time

import torch

from sparse_mqa_testkit.backends import get_backend
from sparse_mqa_testkit.backends.spec import BackendSpec
from sparse_mqa_testkit.cases.case import Case
from sparse_mqa_testkit.cases.scale import FIXED
from sparse_mqa_testkit.checks.tolerance import check_backward_tolerance
from sparse_mqa_testkit.compare import Expected

ANCHOR = dict(B=1, S=4096, Skv=8192, H=64, L=2048, Dqk=576, Dv=512, sink="finite")
CASES = (*FIXED, *(Case(**ANCHOR, pattern=p, seed=10 + i) for i, p in enumerate(("random", "hot", "local"))),
         Case(**ANCHOR, pattern="hot", magnitude="spread", seed=20),
         Case(**ANCHOR, pattern="random", magnitude="peaky", seed=21))


def main() -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import rows_backend

    backends = {"tilelang": get_backend("tilelang"), "rows": rows_backend.RowsBackend(),
                "rows-exact": rows_backend.RowsExactBackend()}
    for b in backends.values():
        b.warmup(CASES)  # the variants these cases need (tilelang compiles every variant without them)
    for c in CASES:
        t0 = time.time()
        expected = Expected.for_backend(BackendSpec.of(backends["tilelang"]), c)
        lines = []
        for name, b in backends.items():
            r = check_backward_tolerance(b, c, expected=expected)
            ratios = {k: round(float(v["ratio"]), 4) for k, v in r.per_tensor.items()}
            lines.append(f"{name}: {'PASS' if r.passed else 'FAIL'} {ratios}")
        print(f"{c}\n  " + "\n  ".join(lines) + f"  ({time.time() - t0:.0f} s)", flush=True)
        del expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
