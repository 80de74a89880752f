"""Lead 1 of the deterministic backward's speed work, its numerics on CPU: int32 fixed point with a scale per KV row
against today's int64 with one scale per call, and against float32 atomics.

    python benchmarks/study_fixed_point.py [--cases unit,spread,hot,hot1k,hot4k,peaky,far,huge,mixed] [--seed 0]

The deterministic backward sends each dkv contribution rounded to an integer multiple of 2**-F and adds the
integers, so the sum is exact and order-free. Today F is one number per call (``backward_model.dkv_bound``: a bound
G on any partial sum of any row, F = 60 - ceil(log2 G)) and the integers are int64: 8 bytes a term. Lead 1 halves
the bytes: int32, with F_j per KV row from a bound B_j on that row's total |contribution|, formed per
(query, slot) from what a prep pass can read: P (one QK^T), |dO|, |q|, the row norms |v_j| and Delta,

    |contribution[d]| <= P (sm_scale (|dO|_2 |v_j|_2 + |Delta|) max|q| + max|dO|)   (per head, summed over heads),

summed over the queries naming row j; F_j = HEADROOM - ceil(log2 B_j), so no partial sum reaches 2**31. "dP exact"
replaces |dO|_2 |v_j|_2 + |Delta| by |dO . v_j - Delta| (a second product in the prep pass, dO V^T): how many of the
bits the bound's slack costs come back that way.

Every scheme here sums the same float32 contributions (``backward_model.blocks``: the kernel's P and dS, rounded to
bf16 as its tiles are); the exact float64 sum of those terms is what each scheme's accumulation error is measured
against (``acc``: the worst row's relative L2 error, and its log2), and the result after the bf16 rounding is judged
by the suite's error model against the float64 oracle (``ratio``, < 1 passes). ``int32 use`` is the largest sum
of |integer terms| in a row over 2**31: it must stay below 1, and how far below is the bound's slack.
``fp32 atomics`` adds the same terms in float32 in a random order, as an atomic backward does.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import torch

from sparse_mqa_kernels import backward_model as bm
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.compare import Expected, compare_tensor
from sparse_mqa_testkit.oracle import round_bf16, to_numpy

HEADROOM = 29  # B_j 2**F_j <= 2**29: two bits below int32's 2**31 for what the bound leaves out (P and dS rounded
# to bf16, 2**-8 each; the bound's own float32 rounding) and the terms' rounding (n/2 units for n terms)
SHAPE = dict(B=1, S=64, Skv=256, H=64, L=64, Dqk=576, Dv=512, sink="finite", topk="none", invalid="none")
CASES = {
    "unit": dict(),
    "spread": dict(magnitude="spread", pattern="local"),  # dO spans 2**+-20 along the queries, rows too
    "hot": dict(S=128, Skv=64, pattern="hot"),  # a few rows named by every query: many terms, heavy cancellation
    "hot1k": dict(S=1024, Skv=64, pattern="hot"),  # the same, 8x the terms a row
    "hot4k": dict(S=4096, Skv=64, pattern="hot"),  # 4096 terms a row: a hot row's count per head group at the anchor
    "peaky": dict(magnitude="peaky"),  # logits of a few hundred, a near one-hot softmax
    "far": dict(sink="far"),  # the sink holds all but ~e**-400 of the mass
    "huge": dict(sink="huge"),  # finite sinks past 2.3e38
    "mixed": dict(sink="mixed", invalid="mixed", topk="random"),
}
NAMES = ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices", "sm_scale")


def row_bound(blk: bm.Block, kv, d_v: int, sm_scale: float, dp: str = "norms") -> np.ndarray:
    """Per valid slot of a block, the bound on |each element| of its dkv contribution (float32, summed over heads).
    dp="norms" bounds |dP| by |dO|_2 |v|_2 (a prep pass with one product, QK^T); "exact" uses dP = dO . v itself (a
    second product, dO V^T: the tilelang backend's bound pass, ``backward_model.slot_bounds``, without its margin)."""
    if dp == "exact":
        return bm.slot_bounds(blk, kv, d_v, sm_scale, margin=0.0)
    v = kv[blk.rows][:, :d_v].astype(np.float32)  # [n, Dv]
    vnorm = np.sqrt((v * v).sum(-1, dtype=np.float32))  # [n]
    gnorm = np.sqrt((blk.grad_out * blk.grad_out).sum(-1, dtype=np.float32))  # [n, hg]
    dS = gnorm * vnorm[:, None] + np.abs(blk.delta)
    qmax, gmax = np.abs(blk.q).max(-1), np.abs(blk.grad_out).max(-1)
    per_head = blk.p * (np.float32(abs(sm_scale)) * dS * qmax + gmax)
    return per_head.sum(-1, dtype=np.float32)


BOUNDS = ("norms", "exact")


def contributions(case: Case):
    """The case's float32 dkv terms as the model's kernel loop makes them: (Expected, Prepared, rows, terms [n, Dqk],
    {dp: per-row bound [B, Skv] float32} for each way of bounding dP)."""
    e = Expected(case)
    x = e.call()
    q, kv, out, go, lse, sink, idx, scale = [to_numpy(x[n]) if n != "sm_scale" else float(x[n]) for n in NAMES]
    tl = to_numpy(x.get("topk_length"))
    B, S, H, Dqk = q.shape
    Skv, Dv = kv.shape[1], out.shape[-1]
    prep = bm.prepare(q, kv, out, go, lse, sink, idx, scale, tl)
    dq = np.zeros((B, S, prep.plan.padded_heads, Dqk), dtype=np.float32)
    blocks = list(bm.blocks(q, kv, go, lse, sink, idx, scale, tl, prep, dq))
    rows = tuple(np.concatenate([b.rows[i] for b in blocks]) for i in range(2))
    terms = np.concatenate([b.contrib for b in blocks])
    bounds = {}
    for dp in BOUNDS:
        bounds[dp] = np.zeros((B, Skv), dtype=np.float32)
        np.add.at(bounds[dp], rows, np.concatenate([row_bound(b, kv, Dv, scale, dp) for b in blocks]))
    return e, prep, rows, terms, bounds


def int32_rows(rows, terms, bound):
    """Lead 1's sum: each term rounded to an int32 multiple of 2**-F_j of its row. Returns (the sums as float64,
    the largest sum of |integer terms| in a row over 2**31, (min F_j, max F_j))."""
    B, Skv, Dqk = *bound.shape, terms.shape[-1]
    with np.errstate(divide="ignore"):
        F_j = np.where(bound > 0, HEADROOM - np.ceil(np.log2(bound.astype(np.float64))), 0).astype(np.int64)
    ints = np.rint(np.ldexp(terms, F_j[rows][:, None].astype(np.int32))).astype(np.int64)
    acc, mag = np.zeros((B, Skv, Dqk), dtype=np.int64), np.zeros((B, Skv, Dqk), dtype=np.int64)
    np.add.at(acc, rows, ints)
    np.add.at(mag, rows, np.abs(ints))
    used = F_j[bound > 0]
    return np.ldexp(acc.astype(np.float64), -F_j[..., None]), float(mag.max()) / 2**31, (int(used.min()),
                                                                                         int(used.max()))


def schemes(case: Case, rng) -> dict:
    """{scheme: (worst row's relative accumulation error, the error model's ratio after bf16, int32 use, F)} and
    "terms per row" (the most terms one row sums)."""
    e, prep, rows, terms, bounds = contributions(case)
    B, Skv, Dqk = *bounds["norms"].shape, terms.shape[-1]
    exact = np.zeros((B, Skv, Dqk))
    np.add.at(exact, rows, terms.astype(np.float64))

    acc64 = np.zeros((B, Skv, Dqk), dtype=np.int64)  # today: int64 at one 2**-F per call
    bm.accumulate_fixed(acc64, rows, terms, np.float32(2.0**prep.F))
    got = {"int64, F per call": (bm.from_fixed(acc64, prep.F), None, prep.F)}
    for dp in BOUNDS:
        got[f"int32, F per row, dP {dp}"] = int32_rows(rows, terms, bounds[dp])
    order = rng.permutation(len(terms))  # float32 atomics: the same terms in a random order
    acc_f = np.zeros((B, Skv, Dqk), dtype=np.float32)
    np.add.at(acc_f, tuple(r[order] for r in rows), terms[order])
    got["fp32 atomics"] = (acc_f.astype(np.float64), None, None)

    res = {"terms per row": int(np.bincount(rows[0] * Skv + rows[1], minlength=B * Skv).max())}
    norm = np.linalg.norm(exact, axis=-1)
    for name, (v, use, F) in got.items():
        rel = np.linalg.norm(v - exact, axis=-1)
        worst = float(np.max(np.where(norm > 0, rel / np.where(norm > 0, norm, 1), np.where(rel > 0, np.inf, 0))))
        dkv = torch.from_numpy(round_bf16(v).astype(np.float32))
        entry, _ = compare_tensor("dkv", dkv, e.exact["dkv"], e.rounded["dkv"], terms=e.terms.get("dkv"))
        res[name] = (worst, entry["ratio"], use, F)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    print(f"shape {SHAPE}; HEADROOM {HEADROOM}")
    print(f"{'case':8s} {'terms/row':>9s} {'scheme':30s} {'acc error':>10s} {'(log2)':>7s} {'ratio':>6s} "
          f"{'int32 use':>9s}  F")
    for name in a.cases.split(","):
        r = schemes(Case(**{**SHAPE, **CASES[name], "seed": a.seed}), rng)
        for scheme, (err, ratio, use, F) in ((k, v) for k, v in r.items() if k != "terms per row"):
            bits = f"{math.log2(err):7.1f}" if 0 < err < math.inf else f"{err:>7}"
            print(f"{name:8s} {r['terms per row']:9d} {scheme:30s} {err:10.2e} {bits} {ratio:6.3f} "
                  f"{'' if use is None else f'{use:.4f}':>9s}  {'' if F is None else F}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
