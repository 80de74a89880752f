"""Lead 3 of the deterministic backward's speed work, sized on CPU: how many dkv terms are left when a thread block
serves G neighbouring queries and adds their contributions to a KV row in shared memory before sending it.

    python benchmarks/study_merged_terms.py [--preset anchor] [--groups 1,2,4,8] [--seed 0]

Today every (query, valid slot) sends one dkv row (per head group), S * L rows at the anchor. A block of G
consecutive queries sends one row per distinct KV row its queries name: the union of their slots. The ratio of the
two is the reduction traffic left, per index pattern of ``sparse-mqa-bench --indices`` (the testkit's
``random``, ``local`` and ``hot``; the bench draws ``random`` itself, distinct per row, as here). The union is also
what such a block's dkv product runs over (G x heads rows of dS, zero where a query does not name the row, against
the union's KV rows), so the dkv product grows by union / L per query: ``x`` in the table.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from sparse_mqa_kernels.bench.shapes import PRESETS
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.draws import NumpyDraws, draw_indices


def indices(preset: str, pattern: str, seed: int) -> np.ndarray:
    """[S, L] int64 for B = 1; -1 marks an invalid slot."""
    sh = PRESETS[preset]
    rng = np.random.default_rng(seed)
    if pattern == "random":  # distinct, uniform: as the bench draws them
        return np.stack([rng.permutation(sh.Skv)[:sh.L] for _ in range(sh.S)]).astype(np.int64)
    case = Case(B=1, S=sh.S, Skv=sh.Skv, H=sh.H, L=sh.L, Dqk=sh.Dqk, Dv=sh.Dv, pattern=pattern, seed=seed)
    return np.asarray(draw_indices(case, NumpyDraws(rng)))[0].astype(np.int64)


def merged_terms(idx: np.ndarray, group: int) -> tuple[int, int]:
    """(terms sent one per query and valid slot, terms sent one per distinct row of each group of ``group``
    consecutive queries)."""
    S, _ = idx.shape
    valid = idx >= 0
    per_query = int(valid.sum())
    g = np.arange(S) // group
    keys = g[:, None] * (int(idx.max()) + 1) + idx
    return per_query, int(np.unique(keys[valid]).size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="anchor", choices=sorted(PRESETS))
    ap.add_argument("--groups", default="1,2,4,8")
    ap.add_argument("--patterns", default="random,local,hot")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    sh = PRESETS[a.preset]
    groups = [int(x) for x in a.groups.split(",")]
    print(f"preset {a.preset}: S {sh.S} Skv {sh.Skv} L {sh.L}; terms left / terms today, x the dkv product")
    print(f"{'pattern':8s} " + " ".join(f"{'G=' + str(G):>16s}" for G in groups))
    for pattern in a.patterns.split(","):
        idx = indices(a.preset, pattern, a.seed)
        cols = []
        for G in groups:
            today, left = merged_terms(idx, G)
            cols.append(f"{left / today:7.3f} x{G * left / (sh.S * sh.L):4.2f}")
        print(f"{pattern:8s} " + " ".join(f"{c:>16s}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
