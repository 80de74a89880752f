"""Design (a)'s precision on drawn cases (CPU): each case the suite's strategy draws for a backend (or, ``--grid``,
each of a grid of hot rows: one to four KV rows named by 64-256 queries, peaky / spread / unit magnitudes) is judged for
today's model (``tilelang-model``, int64 with one F a call) and for design (a)'s model with each bound
(``rows_backend.RowsModelBackend``: |dP| <= |dO_h| |V_j|, as ``lean4``; ``RowsModelExactBackend``: dP itself;
``RowsModelOctaveBackend``: dP itself, each term up to a power of two, as ``octave`` counts it), and
the cases where design (a) fails and today's model passes are listed: what int32 per row costs, apart from what
both share.

    python benchmarks/rows_drawn.py [--n 2000] [--seed S] [--large] [--grid]
"""
import argparse
import itertools
import pathlib
import sys
import time

from sparse_mqa_kernels.backends import TileLangModelBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.strategies import GPU_LIMITS, cases_for, draw_examples
from sparse_mqa_testkit.checks import check_backward_tolerance
from sparse_mqa_testkit.compare import Expected


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--seed", type=int, default=None, help="default: derandomized")
    p.add_argument("--large", action="store_true", help="the GPU backends' size limits (more terms a row)")
    p.add_argument("--grid", action="store_true", help="the hot-row grid instead of drawn cases")
    a = p.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import rows_backend

    today = TileLangModelBackend()
    rows = {"norms": rows_backend.RowsModelBackend(), "exact": rows_backend.RowsModelExactBackend(),
            "octave": rows_backend.RowsModelOctaveBackend()}
    fails = {k: 0 for k in ("today", *rows)}
    only = {k: [] for k in rows}
    t0 = time.time()
    if a.grid:
        drawn = [Case(S=S, Skv=skv, H=H, L=L, Dqk=24, Dv=16, magnitude=mag, sink=sink, seed=1000 + k)
                 for S, skv, L, mag, sink, H, k in itertools.product((64, 127, 256), (1, 2, 4), (8, 15, 32),
                                                                      ("peaky", "spread", "unit"), ("none", "finite"),
                                                                      (4, 16), range(2))]
    else:
        drawn = draw_examples(cases_for(rows["norms"], **(GPU_LIMITS if a.large else {})), a.n, a.seed)
    for c in drawn:
        e = Expected(c)
        r_today = check_backward_tolerance(today, c, expected=e)
        fails["today"] += not r_today.passed
        for name, b in rows.items():
            r = check_backward_tolerance(b, c, expected=e)
            fails[name] += not r.passed
            if not r.passed and r_today.passed:
                only[name].append((c, round(r.ratio, 3), round(r_today.ratio, 3)))
    print(f"{len(drawn)} cases in {time.time() - t0:.0f} s; failing: {fails}")
    for name, lst in only.items():
        print(f"design (a), dP {name}: {len(lst)} cases fail where today's model passes")
        for c, ratio, ratio_today in lst:
            print(f"  {c!r}: ratio {ratio} (today's {ratio_today})")


if __name__ == "__main__":
    main()
