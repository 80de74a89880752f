"""An executable NumPy model of the deterministic TileLang backward (CPU, any dims; backend ``tilelang-model``).

It runs the algorithm of ``backward`` step for step on the same ``bwd_plan``: the same head groups (padding heads
carry q = dO = Delta = 0 and lse = +inf), the same top-k blocks (padded slots invalid, never read), the same query
chunks, the same numerics where they matter for the result (fp32 scores and GEMMs on bf16 operands, P and dS rounded
to bf16 before the dq / dkv GEMMs, as the kernel's shared-memory tiles are) and the same accumulation scheme: 16-
and 32-head groups round every dkv contribution to an int64 multiple of 2**-F, F from the same cheap bound; 64-head
groups to an int32 multiple of 2**-F_j, F_j from the bound pass's per-row bound counted in octaves
(``row_scaled_dkv``); summed exactly, converted once. So the host plan and both fixed-point schemes are tested end
to end in CPU CI, and a bound that let a row's int32 sum wrap (which the kernel would do silently) raises here. GEMM
summation order inside a tile differs from the tensor cores', so results agree with the kernel to fp32 rounding, not
to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.oracle import round_bf16, to_numpy

from . import bwd_plan

# The model launches small chunks so that CPU cases cross query-chunk boundaries too.
MODEL_QUERY_CHUNK = 8


def _f32(x):
    return np.asarray(x, dtype=np.float32)


def dkv_bound(q, kv, grad_out, sm_scale, d_v, mass, referenced) -> float:
    """G: a bound on |any partial sum of dkv| from cheap maxima (fp32, as the kernel's host code computes it).

    Per (query, head): sum_t P_t = m (``bwd_plan.slot_mass``, 1 without a sink) and sum_t |dS_t| <= 2 m |dO| Vmax,
    so a query adds at most m (sm_scale * DS_BOUND_FACTOR * |dO|_2 * Vmax * max|q| + max|dO|) to any element of
    any row. Vmax is the largest finite ||kv[:Dv]|| over the ``referenced`` rows (``contract.referenced_rows``):
    what a row no slot names holds changes nothing; a non-finite row makes the result garbage anyway.
    """
    q, kv, go = _f32(q), _f32(kv), _f32(grad_out)
    with np.errstate(over="ignore", invalid="ignore"):
        vnorm = np.sqrt((kv[..., :d_v] * kv[..., :d_v]).sum(-1, dtype=np.float32))
    vnorm = np.where(np.isfinite(vnorm) & referenced, vnorm, np.float32(0))
    vmax = np.float32(vnorm.max())
    qmax = np.abs(q).max(-1)
    gnorm = np.sqrt((go * go).sum(-1, dtype=np.float32))
    gmax = np.abs(go).max(-1)
    c = np.float32(abs(sm_scale) * bwd_plan.DS_BOUND_FACTOR) * vmax
    with np.errstate(over="ignore", invalid="ignore"):
        per = _f32(mass) * (c * qmax * gnorm + gmax)
        return float(per.sum(dtype=np.float32))


def accumulate_fixed(acc, rows, contrib, to_fixed):
    """acc[rows] += rint(contrib * 2**F) in int64, as the kernel's integer bulk reductions add: exact, so order-free."""
    ints = np.rint(np.asarray(contrib, dtype=np.float32) * np.float32(to_fixed)).astype(np.int64)
    np.add.at(acc, rows, ints)


def from_fixed(acc, F):
    """int64 accumulator at 2**-F -> float64 (the kernel's final conversion before bf16); F may be an array that
    broadcasts against ``acc`` (a scale per KV row)."""
    return np.asarray(acc).astype(np.float64) * 2.0**-F


@dataclass
class Prepared:
    """What the model's preprocessing gives (the kernel: ``bwd_prep`` and torch, float32 too)."""

    plan: bwd_plan.BwdPlan
    delta: np.ndarray  # [B, S, H]
    mass: np.ndarray  # [B, S, H]: the slot mass, 1 without a sink
    F: int  # the fixed-point exponent from ``dkv_bound``


@dataclass
class Block:
    """One top-k block of one query chunk and head group: its valid slots' dkv contributions, flattened. rows:
    (batch, kv row) per valid slot; contrib [n, Dqk] fp32. What a per-slot bound needs is gathered only when asked
    for (the model's own sum does not): ``p`` [n, hg] fp32 (P before its bf16 rounding), ``q`` [n, hg, Dqk] and
    ``grad_out`` [n, hg, Dv] of the slot's query (padding heads zero), ``delta`` [n, hg]."""

    rows: tuple
    contrib: np.ndarray
    _valid: np.ndarray  # [B, C, BI]
    _tile: tuple  # the block's P [B, C, hg, BI], q and dO [B, C, hg, *], Delta [B, C, hg, 1]

    def _per_slot(self, x):
        b, c, _ = np.nonzero(self._valid)
        return x[b, c]

    @property
    def p(self) -> np.ndarray:
        return np.swapaxes(self._tile[0], -1, -2)[self._valid]

    @property
    def q(self) -> np.ndarray:
        return self._per_slot(self._tile[1])

    @property
    def grad_out(self) -> np.ndarray:
        return self._per_slot(self._tile[2])

    @property
    def delta(self) -> np.ndarray:
        return self._per_slot(self._tile[3][..., 0])


def prepare(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=None,
            max_query_chunk: int = MODEL_QUERY_CHUNK) -> Prepared:
    """Delta, the slot mass and F, on NumPy arrays (``to_numpy``)."""
    B, S, H, Dqk = q.shape
    Skv, L, Dv = kv.shape[1], indices.shape[2], out.shape[-1]
    plan = bwd_plan.make_plan(B, S, Skv, H, L, Dqk, Dv, max_query_chunk=max_query_chunk)
    delta = (_f32(out) * _f32(grad_out)).sum(-1, dtype=np.float32)
    sink = None if attn_sink is None else _f32(attn_sink)
    mass = bwd_plan.slot_mass(_f32(lse), sink)
    referenced = contract.referenced_rows(indices, topk_length, Skv)
    F = bwd_plan.fixed_point_exponent(dkv_bound(q, kv, grad_out, sm_scale, Dv, mass, referenced))
    return Prepared(plan, delta, mass, F)


def blocks(q, kv, grad_out, lse, attn_sink, indices, sm_scale, topk_length, prep: Prepared, dq):
    """The kernel's loop over query chunks, head groups and top-k blocks: fills ``dq`` [B, S, padded heads, Dqk]
    and yields each block's ``Block`` of dkv contributions, in launch order."""
    B, S, H, Dqk = q.shape
    Skv, L, Dv = kv.shape[1], indices.shape[2], grad_out.shape[-1]
    plan, hg = prep.plan, prep.plan.head_group
    qf, kvf, gof, idx, tl = _f32(q), _f32(kv), _f32(grad_out), indices, topk_length
    lse2 = contract.lse_to_base2(_f32(lse), None if attn_sink is None else _f32(attn_sink))
    c_log2 = np.float32(sm_scale * contract.LOG2E)
    scale = np.float32(sm_scale)

    # padded head axis: q = dO = Delta = 0 and lse = +inf beyond H
    pad = ((0, 0), (0, 0), (0, plan.padded_heads - H))
    qp = np.pad(qf, pad + ((0, 0),))
    gop = np.pad(gof, pad + ((0, 0),))
    deltap = np.pad(prep.delta, pad)
    lse2p = np.pad(lse2, pad, constant_values=np.inf)
    bidx = np.arange(B)[:, None, None]
    for chunk in plan.chunks():
        s0, s1 = chunk.start, chunk.stop
        for g in range(plan.n_groups):
            hs = slice(g * hg, (g + 1) * hg)
            qg, dog = qp[:, s0:s1, hs], gop[:, s0:s1, hs]  # [B, C, hg, *]
            lg, dg = lse2p[:, s0:s1, hs, None], deltap[:, s0:s1, hs, None]
            dq_acc = np.zeros(qg.shape, dtype=np.float32)
            for blk in plan.topk_blocks():
                t = np.arange(blk.start, blk.stop)
                in_l = t < L  # padded slots: the index is not even read
                ti = np.where(in_l, t, 0)
                raw = np.where(in_l, idx[:, s0:s1][..., ti], -1).astype(np.int64)
                valid = in_l & (raw >= 0) & (raw < Skv)
                if tl is not None:
                    valid &= t < tl[:, s0:s1, None]
                safe = np.where(valid, raw, 0)
                kvb = np.where(valid[..., None], kvf[bidx, safe], np.float32(0))  # [B, C, BI, Dqk]
                s = np.matmul(qg, np.swapaxes(kvb, -1, -2))  # [B, C, hg, BI]
                with np.errstate(invalid="ignore", over="ignore"):
                    p = np.exp2(s * c_log2 - lg).astype(np.float32)
                p = np.where(valid[:, :, None, :], p, np.float32(0))
                dp = np.matmul(dog, np.swapaxes(kvb[..., :Dv], -1, -2))
                ds = (p * (dp - dg) * scale).astype(np.float32)
                pb, dsb = round_bf16(p).astype(np.float32), round_bf16(ds).astype(np.float32)
                dq_acc += np.matmul(dsb, kvb)
                contrib = np.matmul(np.swapaxes(dsb, -1, -2), qg)  # [B, C, BI, Dqk]
                contrib[..., :Dv] += np.matmul(np.swapaxes(pb, -1, -2), dog)
                b_of = np.broadcast_to(bidx, valid.shape)
                yield Block((b_of[valid], safe[valid]), contrib[valid], valid, (p, qg, dog, dg))
            dq[:, s0:s1, hs] = dq_acc


def slot_bounds(blk: Block, kv, d_v: int, sm_scale: float, margin: float = bwd_plan.BOUND_MARGIN) -> np.ndarray:
    """Per valid slot of a block, the bound pass's bound on |each element| of its dkv term: sum over the group's heads
    of P (|sm_scale| max|q| |dP - Delta| + max|dO|), dP = dO . v_j, times 1 + ``margin`` (float32)."""
    v = np.asarray(kv, dtype=np.float32)[blk.rows][:, :d_v]
    with np.errstate(over="ignore", invalid="ignore"):
        dp = np.abs(np.einsum("nhd,nd->nh", blk.grad_out, v).astype(np.float32) - blk.delta)
        per_head = blk.p * (np.float32(abs(sm_scale)) * dp * np.abs(blk.q).max(-1) + np.abs(blk.grad_out).max(-1))
        return per_head.sum(-1, dtype=np.float32) * np.float32(1.0 + margin)


def row_scaled_dkv(blks: list, kv, d_v: int, sm_scale: float, terms=None):
    """The 64-head path's dkv: each row's bound from its slots' bounds counted in octaves, F_j, each term rounded to an
    int32 multiple of 2**-F_j, the integers summed, then bf16. Returns (dkv float64 before its bf16 rounding, F_j);
    raises AssertionError where a term or a row's sum leaves int32. ``terms(blk)``: what each valid slot adds to its
    row's bound, the bound pass's (``slot_bounds`` up to a power of two) unless given."""
    B, Skv, Dqk = np.shape(kv)
    if terms is None:
        def terms(blk):
            return bwd_plan.octave_ceil(slot_bounds(blk, kv, d_v, sm_scale))
    bound = np.zeros((B, Skv), dtype=np.float64)
    for blk in blks:
        np.add.at(bound, blk.rows, terms(blk))
    F = bwd_plan.row_exponent(bound)
    scale = np.where(bound > 0, np.exp2(F.astype(np.float64)), 0.0).astype(np.float32)
    acc = np.zeros((B, Skv, Dqk), dtype=np.int64)
    for blk in blks:
        with np.errstate(over="ignore", invalid="ignore"):
            ints = np.rint(np.asarray(blk.contrib, dtype=np.float32) * scale[blk.rows][:, None])
        if not np.all(np.abs(ints) < 2.0**31):
            raise AssertionError(f"a dkv term leaves int32 at its row's scale (largest {np.abs(ints).max():.3e})")
        np.add.at(acc, blk.rows, ints.astype(np.int64))
    if not np.all(np.abs(acc) < 2**31):
        b, j = np.unravel_index(np.abs(acc).max(-1).argmax(), acc.shape[:2])
        raise AssertionError(f"row ({b}, {j})'s dkv sum leaves int32 (bound {bound[b, j]:.3e}, F {F[b, j]})")
    return from_fixed(acc, F[..., None]), F


def model_backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None,
                   max_query_chunk: int = MODEL_QUERY_CHUNK):
    """The kernel's algorithm in NumPy. Returns (dq bf16-valued fp32, dkv bf16-valued fp32, d_sink fp32|None, F):
    F the call's exponent, or [B, Skv] int64 per KV row on the 64-head path."""
    q, kv, out, go, lse, sink, idx, tl = map(to_numpy, (q, kv, out, grad_out, lse, attn_sink, indices,
                                                        topk_length))
    B, S, H, Dqk = q.shape
    prep = prepare(q, kv, out, go, lse, sink, idx, sm_scale, tl, max_query_chunk)
    dq = np.zeros((B, S, prep.plan.padded_heads, Dqk), dtype=np.float32)
    blks = blocks(q, kv, go, lse, sink, idx, sm_scale, tl, prep, dq)
    if prep.plan.row_scaled():
        exact, F = row_scaled_dkv(list(blks), kv, out.shape[-1], sm_scale)
    else:
        F, to_fixed = prep.F, np.float32(2.0**prep.F)
        acc = np.zeros((B, kv.shape[1], Dqk), dtype=np.int64)
        for blk in blks:
            accumulate_fixed(acc, blk.rows, blk.contrib, to_fixed)
        exact = from_fixed(acc, F)
    dq = round_bf16(dq[:, :, :H]).astype(np.float32)
    dkv = round_bf16(exact).astype(np.float32)
    d_sink = None
    if sink is not None:
        ps = contract.sink_probability(_f32(lse), _f32(sink))
        d_sink = -(ps * prep.delta).sum((0, 1), dtype=np.float32)  # one sum over the call, as the kernels' host code
    return dq, dkv, d_sink, F
