"""Probe (issue 26): design (a)'s earlier pieces, kept beside the ``tilelang`` backend's for comparison: its prep pass
(``prepw``), its bound passes (``lean4``: |dP| <= |dO_h| |V_j|, one product; ``exact``: dP itself, with ``vnorms``,
``qvmax`` and ``scales1`` for its fixed point), its row scales (``scales``), and (``--pipeline``) the whole design
timed as one call beside the int64 backward and cuDNN's. The conversion and the main kernel (``convert``,
``probe_wide_backward.py``'s ``48/ws``) are ``sparse_mqa_kernels``' own (``bwd_rows``, ``backward_ws``); the backend's
own bound pass is timed and traced by ``ab_kernels.py bound`` and ``trace_backward.py``.

    PYTHONUNBUFFERED=1 python benchmarks/probe_split_backward.py --bound [--kernels lean4,exact] [anchor ...]
    python benchmarks/probe_split_backward.py --pipeline [--cudnn] [--pipe-main 48/ws] [--pipe-tail kernels]
    python benchmarks/probe_split_backward.py --bound   # no GPU: compile the kernels for sm_90a only

Design (b), the backward split in two kernels (A: dq, P and dS to memory and the row bounds; B: dkv from them), ran
on the H200 at 17:53 UTC on 2026-12-01 (BENCHMARKS.md): correct and slower than the int64 backward, dropped; its
kernels are in this file's history (commit 66437d0 and before).
"""
import argparse
import importlib.util
import pathlib
import statistics

import torch

from sparse_mqa_kernels import bwd_plan, bwd_rows
from sparse_mqa_testkit import contract


def _sibling(name: str):
    """A probe beside this file, by path (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# its prelude, tile loads, timing, inputs and check helpers are this probe's too
WIDE = _sibling("probe_wide_backward")

ROW_HEADROOM = bwd_plan.ROW_HEADROOM  # F_j = 29 - ceil(log2 B_j): two bits below int32's 2**31


def build_bound(BI=64, dqk=576):
    """Design (a)'s bound pass (``lean4``): each KV row's bound on |its dkv sum|, with |dP| <= |dO_h| |V_j|
    as two int64 sums U_j = sum P A_h and W_j = sum P B_h, each with its own fixed point (Ex, fixed by the sums of A_h
    and of B_h over the call), so that B_j = |V_j| U_j + W_j is formed per row afterwards (``scales``): A_h = |scale|
    max|q_h| |dO_h| and B_h = |scale| max|q_h| |Delta_h| + max|dO_h| from ``prepw``, bf16 P and dS covered by a 2**-7
    margin. S^T = K Q^T as [BI slots x 64 heads] tiles (slots as wgmma's M, so a slot's sum over heads stays within a
    quad of lanes). Two warpgroups take alternate top-k blocks, each with its own KV tile: a warpgroup issues the
    copies of its next block as soon as its product has read the tile, and loads the indices of the block after
    that meanwhile; both warpgroups' first copies go out before the q tile loads. A slot no row backs keeps whatever
    its tile row gives and is never sent, so the arithmetic selects nothing per element.

    Measured on the way (BENCHMARKS.md, 2026-12-01, at commit d55f5f5): ``lean`` (the previous session's, each block's
    indices and |V_j| loaded before its copies), ``lean2`` (indices a block ahead), its halves ``lean2g`` / ``lean2c``,
    ``lean3`` (pipelined copies, |V_j| read in the kernel)."""
    import tilelang.language as T

    HG = 64
    ROWS = 128 // 8  # rows a gather pass: 8 threads a row, 16 bytes each
    PASSES = BI // ROWS
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32, i64 = T.bfloat16, T.float32, T.int32, T.int64
    log2e = contract.LOG2E
    load_query, _ = WIDE.query_tiles(T, dqk, 0, HG)  # q only

    prefetch_rows, issue, _ = bwd_rows.gather_macros(T, BI, ROWS, dqk, ahead=2)  # a warpgroup's next block: 2 ahead

    @T.macro
    def publish(idx3, jr, w, p, t):
        # the rows issue() copied, for the bound arithmetic of that block (buffer p)
        for r in T.unroll(PASSES):
            if t % 8 == 0:
                idx3[w, p, r * ROWS + t // 8] = jr[r]

    @T.macro
    def step(Q_shared, KVt, idx3, bs_s, acc, accw, bsum, bsumw, lse_f, a_f, b_f, KV, Indices, RowU, RowW, b_i, s_i,
              i, n_valid, seq_kv, t, w, c2, exu, exw, nxt, jr):
        # this warpgroup's i-th block (kb = 2 i + w; its copies were issued one step earlier)
        kb = 2 * i + w
        p = i % 2
        if i > 0:
            T.ptx_wait_group(0)
            T.fence_proxy_async()
            T.sync_threads(14 + w, 128)
        T.gemm(KVt, Q_shared, acc, transpose_B=True, clear_accum=True)
        T.sync_threads(14 + w, 128)
        issue(KVt, KVt, (0, 0), KV, nxt, jr, Indices, b_i, s_i, kb + 2, n_valid, seq_kv, t)
        for j, h in T.Parallel(BI, HG):
            acc[j, h] = T.exp2(acc[j, h] * c2 - lse_f[h])
            accw[j, h] = acc[j, h] * b_f[h]
            acc[j, h] = acc[j, h] * a_f[h]
        T.reduce_sum(acc, bsum, dim=1)
        T.reduce_sum(accw, bsumw, dim=1)
        T.copy(bsum, bs_s[w, 0, :])
        T.copy(bsumw, bs_s[w, 1, :])
        T.sync_threads(14 + w, 128)
        if t < BI:
            if idx3[w, p, t] >= 0:
                T.call_extern("handle", "smqa_red_u64", T.address_of(RowU[b_i, idx3[w, p, t]]),
                              T.cast(T.ceil(bs_s[w, 0, t] * (1.0 + 2.0 ** -7) * exu), i64))
                T.call_extern("handle", "smqa_red_u64", T.address_of(RowW[b_i, idx3[w, p, t]]),
                              T.cast(T.ceil(bs_s[w, 1, t] * (1.0 + 2.0 ** -7) * exw), i64))
        publish(idx3, jr, w, 1 - p, t)

    @T.macro
    def heads_init(lse_f, a_f, b_f, Lse2, A, Bc, b_i, s_i, h0, heads):
        # this warpgroup's copy of the group's per-head LSE and bound factors (padded heads: P = 0, factors 0)
        for h in T.Parallel(HG):
            hh = T.min(h0 + h, heads - 1)
            lse_f[h] = T.if_then_else(h0 + h < heads, Lse2[b_i, s_i, hh], T.infinity(f32))
            a_f[h] = T.if_then_else(h0 + h < heads, A[b_i, s_i, hh], 0.0)
            b_f[h] = T.if_then_else(h0 + h < heads, Bc[b_i, s_i, hh], 0.0)

    @T.prim_func
    def lean_bound4(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        Lse2: T.Tensor([batch, seq_len, heads], f32),
        A: T.Tensor([batch, seq_len, heads], f32),
        Bc: T.Tensor([batch, seq_len, heads], f32),
        Rows: T.Tensor([n_rows], i32),
        Ex: T.Tensor([2], f32),
        RowU: T.Tensor([batch, seq_kv], i64),
        RowW: T.Tensor([batch, seq_kv], i64),
        sm_scale: f32,
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=256,
                      prelude=bwd_rows.CP_ROW_PRELUDE + WIDE.PRELUDE) as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, dqk], bf16)
            KV0 = T.alloc_shared([BI, dqk], bf16)
            KV1 = T.alloc_shared([BI, dqk], bf16)
            idx3 = T.alloc_shared([2, 2, BI], i32)
            bs_s = T.alloc_shared([2, 2, BI], f32)
            acc0, acc1 = T.alloc_fragment([BI, HG], f32), T.alloc_fragment([BI, HG], f32)
            accw0, accw1 = T.alloc_fragment([BI, HG], f32), T.alloc_fragment([BI, HG], f32)
            bsum0, bsum1 = T.alloc_fragment([BI], f32), T.alloc_fragment([BI], f32)
            bsumw0, bsumw1 = T.alloc_fragment([BI], f32), T.alloc_fragment([BI], f32)
            lse0, lse1 = T.alloc_fragment([HG], f32), T.alloc_fragment([HG], f32)
            a0, a1 = T.alloc_fragment([HG], f32), T.alloc_fragment([HG], f32)
            b0, b1 = T.alloc_fragment([HG], f32), T.alloc_fragment([HG], f32)
            nxt = T.alloc_local([PASSES], i32)
            jr = T.alloc_local([PASSES], i32)
            tx = T.get_thread_binding()
            b_i, s_i, h0 = by, Rows[bx], bz * HG
            c2 = sm_scale * log2e
            exu, exw = Ex[0], Ex[1]
            n_valid = T.max(T.min(TopkLen[b_i, s_i], topk), 0)
            n_blk = T.ceildiv(n_valid, BI)
            prefetch_rows(nxt, Indices, b_i, s_i, tx // 128, n_valid, tx % 128)
            if tx < 128:
                issue(KV0, KV0, (0, 0), KV, nxt, jr, Indices, b_i, s_i, 0, n_valid, seq_kv, tx)
            else:
                issue(KV1, KV1, (0, 0), KV, nxt, jr, Indices, b_i, s_i, 1, n_valid, seq_kv, tx - 128)
            load_query(Q, None, Q_shared, None, b_i, s_i, h0, heads, tx)
            publish(idx3, jr, tx // 128, 0, tx % 128)
            T.ptx_wait_group(0)
            T.fence_proxy_async()
            T.sync_threads()
            if tx < 128:
                heads_init(lse0, a0, b0, Lse2, A, Bc, b_i, s_i, h0, heads)
                for i in T.serial(T.ceildiv(n_blk, 2)):
                    step(Q_shared, KV0, idx3, bs_s, acc0, accw0, bsum0, bsumw0, lse0, a0, b0, KV, Indices, RowU,
                          RowW, b_i, s_i, i, n_valid, seq_kv, tx, 0, c2, exu, exw, nxt, jr)
            else:
                heads_init(lse1, a1, b1, Lse2, A, Bc, b_i, s_i, h0, heads)
                for i in T.serial(n_blk // 2):
                    step(Q_shared, KV1, idx3, bs_s, acc1, accw1, bsum1, bsumw1, lse1, a1, b1, KV, Indices, RowU,
                          RowW, b_i, s_i, i, n_valid, seq_kv, tx - 128, 1, c2, exu, exw, nxt, jr)

    return lean_bound4


# the backend's bound pass until 9e4dfcc (S^T and dP^T as [64 slots x 32 heads] tiles, one KV tile), which ``exact``
# builds on
def bound_macros(T, BI: int, HW: int, dv: int, issue, publish, add):
    """The dP-exact bound's pieces, as T.macro: ``products`` runs a warpgroup's S^T and dP^T on the block; ``bounds``
    turns them into each slot's bound over the warpgroup's heads, in shared memory; ``block_loop`` runs the blocks
    (``issue`` and ``publish`` from ``bwd_rows.gather_macros``), ``add`` (a T.macro: dest, batch, row, bound, ex)
    putting each valid slot's bound, times 1 + BOUND_MARGIN, into its KV row."""
    margin = 1.0 + bwd_plan.BOUND_MARGIN

    @T.macro
    def products(Q_shared, dO_shared, KVt, acc, accp, w):
        # this warpgroup's heads [HW w, HW w + HW) of the block: S^T and dP^T
        T.gemm(KVt, Q_shared[w * HW:(w + 1) * HW, :], acc, transpose_B=True, clear_accum=True)
        T.gemm(KVt[:, 0:dv], dO_shared[w * HW:(w + 1) * HW, :], accp, transpose_B=True, clear_accum=True)

    @T.macro
    def bounds(acc, accp, bsum, bs_s, lse_f, c_f, g_f, d_f, c2, w):
        # each slot's bound over this warpgroup's heads (an invalid slot's, on whatever its tile row holds, is never
        # added)
        for j, h in T.Parallel(BI, HW):
            acc[j, h] = T.exp2(acc[j, h] * c2 - lse_f[h]) * (c_f[h] * T.abs(accp[j, h] - d_f[h]) + g_f[h])
        T.reduce_sum(acc, bsum, dim=1)
        T.copy(bsum, bs_s[w, :])

    @T.macro
    def block_loop(Q_shared, dO_shared, KVt, KV, Indices, idx2, bs_s, nxt, jr, wg0, wg1, dest, ex, b_i, s_i, n_blk,
                   n_valid, seq_kv, c2, tx, kb0=0):
        # n_blk blocks from block kb0 (its copies issued and published to buffer 0 already): both warpgroups' products,
        # the next block's copies under the bound arithmetic, each valid slot's bound handed to ``add``. wg0, wg1: a
        # warpgroup's (acc, accp, bsum, lse, C, G, Delta) fragments
        for i in T.serial(n_blk):
            kb = kb0 + i
            if i > 0:
                T.ptx_wait_group(0)
                T.fence_proxy_async()
                T.sync_threads()
            if tx < 128:
                products(Q_shared, dO_shared, KVt, wg0[0], wg0[1], 0)
            else:
                products(Q_shared, dO_shared, KVt, wg1[0], wg1[1], 1)
            T.sync_threads()  # both halves have read the tile: the next block's copies run under the arithmetic
            issue(KVt, KVt, (0, 0), KV, nxt, jr, Indices, b_i, s_i, kb + 1, n_valid, seq_kv, tx)
            if tx < 128:
                bounds(wg0[0], wg0[1], wg0[2], bs_s, wg0[3], wg0[4], wg0[5], wg0[6], c2, 0)
            else:
                bounds(wg1[0], wg1[1], wg1[2], bs_s, wg1[3], wg1[4], wg1[5], wg1[6], c2, 1)
            T.sync_threads()
            if tx < BI:
                if idx2[i % 2, tx] >= 0:
                    add(dest, b_i, idx2[i % 2, tx], (bs_s[0, tx] + bs_s[1, tx]) * margin, ex)
            publish(idx2, jr, 1 - i % 2, tx)

    return products, bounds, block_loop


def build_bound_exact(BI=64, dqk=576, dv=512):
    """Design (a)'s bound pass with dP itself (``exact``): per valid slot, sum over heads of
    P (|scale| max|q_h| |dP - Delta_h| + max|dO_h|), bf16 P and dS covered by a 2**-7 margin, added to its KV row as
    one int64 integer (fixed point Ex from ``exact_fixed_point``). S^T = K Q^T and dP^T = V dO^T as [BI slots x 32
    heads] tiles: both warpgroups work on the same block, each on half the heads, since q and dO in shared memory
    leave room for one 64-slot KV tile; the two halves' sums meet in shared memory. The next block's copies go out
    once both products have read the tile, under the bound arithmetic; its indices were loaded a block earlier."""
    import tilelang.language as T

    HG, HW = 64, 32
    ROWS = 256 // 8  # rows a gather pass: 8 threads a row, 16 bytes each, all 256 threads
    PASSES = BI // ROWS
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32, i64 = T.bfloat16, T.float32, T.int32, T.int64
    log2e = contract.LOG2E
    load_query, _ = WIDE.query_tiles(T, dqk, dv, HG)

    prefetch_rows, issue, publish = bwd_rows.gather_macros(T, BI, ROWS, dqk, ahead=1)

    @T.macro
    def add(RowB, b_i, row, bound, ex):  # one int64 at the call's fixed point
        T.call_extern("handle", "smqa_red_u64", T.address_of(RowB[b_i, row]), T.cast(T.ceil(bound * ex), i64))

    products, bounds, block_loop = bound_macros(T, BI, HW, dv, issue, publish, add)

    @T.macro
    def heads_init(lse_f, c_f, g_f, d_f, Lse2, C, Gm, Delta, b_i, s_i, h0, heads):
        for h in T.Parallel(HW):
            hh = T.min(h0 + h, heads - 1)
            lse_f[h] = T.if_then_else(h0 + h < heads, Lse2[b_i, s_i, hh], T.infinity(f32))
            c_f[h] = T.if_then_else(h0 + h < heads, C[b_i, s_i, hh], 0.0)
            g_f[h] = T.if_then_else(h0 + h < heads, Gm[b_i, s_i, hh], 0.0)
            d_f[h] = T.if_then_else(h0 + h < heads, Delta[b_i, s_i, hh], 0.0)

    @T.prim_func
    def bound_exact(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        Lse2: T.Tensor([batch, seq_len, heads], f32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        C: T.Tensor([batch, seq_len, heads], f32),
        Gm: T.Tensor([batch, seq_len, heads], f32),
        Rows: T.Tensor([n_rows], i32),
        Ex: T.Tensor([1], f32),
        RowB: T.Tensor([batch, seq_kv], i64),
        sm_scale: f32,
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=256,
                      prelude=bwd_rows.CP_ROW_PRELUDE + WIDE.PRELUDE) as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, dqk], bf16)
            dO_shared = T.alloc_shared([HG, dv], bf16)
            KVt = T.alloc_shared([BI, dqk], bf16)
            idx2 = T.alloc_shared([2, BI], i32)
            bs_s = T.alloc_shared([2, BI], f32)
            acc0, acc1 = T.alloc_fragment([BI, HW], f32), T.alloc_fragment([BI, HW], f32)
            accp0, accp1 = T.alloc_fragment([BI, HW], f32), T.alloc_fragment([BI, HW], f32)
            bsum0, bsum1 = T.alloc_fragment([BI], f32), T.alloc_fragment([BI], f32)
            lse0, lse1 = T.alloc_fragment([HW], f32), T.alloc_fragment([HW], f32)
            c0, c1 = T.alloc_fragment([HW], f32), T.alloc_fragment([HW], f32)
            g0, g1 = T.alloc_fragment([HW], f32), T.alloc_fragment([HW], f32)
            d0, d1 = T.alloc_fragment([HW], f32), T.alloc_fragment([HW], f32)
            nxt = T.alloc_local([PASSES], i32)
            jr = T.alloc_local([PASSES], i32)
            tx = T.get_thread_binding()
            b_i, s_i, h0 = by, Rows[bx], bz * HG
            c2 = sm_scale * log2e
            ex = Ex[0]
            n_valid = T.max(T.min(TopkLen[b_i, s_i], topk), 0)
            n_blk = T.ceildiv(n_valid, BI)
            prefetch_rows(nxt, Indices, b_i, s_i, 0, n_valid, tx)
            issue(KVt, KVt, (0, 0), KV, nxt, jr, Indices, b_i, s_i, 0, n_valid, seq_kv, tx)
            load_query(Q, dO, Q_shared, dO_shared, b_i, s_i, h0, heads, tx)
            publish(idx2, jr, 0, tx)
            if tx < 128:
                heads_init(lse0, c0, g0, d0, Lse2, C, Gm, Delta, b_i, s_i, h0, heads)
            else:
                heads_init(lse1, c1, g1, d1, Lse2, C, Gm, Delta, b_i, s_i, h0 + HW, heads)
            T.ptx_wait_group(0)
            T.fence_proxy_async()
            T.sync_threads()
            block_loop(Q_shared, dO_shared, KVt, KV, Indices, idx2, bs_s, nxt, jr,
                       (acc0, accp0, bsum0, lse0, c0, g0, d0), (acc1, accp1, bsum1, lse1, c1, g1, d1), RowB, ex,
                       b_i, s_i, n_blk, n_valid, seq_kv, c2, tx)

    return bound_exact


def build_vnorms(dqk=576, dv=512, WPB=8):
    """``vnorms``: |V_j| (float32) of every KV row, one warp a row (16-byte loads, the warp's butterfly)."""
    import tilelang.language as T

    batch, seq_kv = T.dynamic("batch, seq_kv")
    bf16, f32 = T.bfloat16, T.float32
    OV = dv // 8

    @T.prim_func
    def vnorms(KV: T.Tensor([batch, seq_kv, dqk], bf16), VNorm: T.Tensor([batch, seq_kv], f32)):
        with T.Kernel(T.ceildiv(seq_kv, WPB), batch, threads=32 * WPB) as (bx, by):
            vb = T.alloc_local([8], bf16)
            n2 = T.alloc_var(f32)
            tx = T.get_thread_binding()
            j, lane = bx * WPB + tx // 32, tx % 32
            jj = T.min(j, seq_kv - 1)
            n2 = 0.0
            for c in T.unroll(OV // 32):
                for v in T.vectorized(8):
                    vb[v] = KV[by, jj, (c * 32 + lane) * 8 + v]
                for v in T.unroll(8):
                    n2 += T.cast(vb[v], f32) * T.cast(vb[v], f32)
            n2 = T.warp_reduce_sum(n2)
            if T.And(lane == 0, j < seq_kv):
                VNorm[by, j] = T.sqrt(n2)

    return vnorms


def build_qvmax(WPB=8):
    """``qvmax``: per query, the largest |V_j| over the KV rows its valid slots name (0 for none), one warp a query:
    what the dP-exact bound's fixed point needs instead of a maximum over every row, which a row no slot names
    could inflate."""
    import tilelang.language as T

    batch, seq_len, seq_kv, topk = T.dynamic("batch, seq_len, seq_kv, topk")
    f32, i32 = T.float32, T.int32

    @T.prim_func
    def qvmax(
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        VNorm: T.Tensor([batch, seq_kv], f32),
        VMax: T.Tensor([batch, seq_len], f32),
    ):
        with T.Kernel(T.ceildiv(seq_len, WPB), batch, threads=32 * WPB) as (bx, by):
            m = T.alloc_var(f32)
            tx = T.get_thread_binding()
            s, lane = bx * WPB + tx // 32, tx % 32
            ss = T.min(s, seq_len - 1)
            n_valid = T.max(T.min(TopkLen[by, ss], topk), 0)
            m = 0.0
            for c in T.serial(T.ceildiv(topk, 32)):
                if c * 32 + lane < n_valid:
                    j = Indices[by, ss, c * 32 + lane]
                    if T.And(j >= 0, j < seq_kv):
                        m = T.max(m, VNorm[by, j])
            m = T.warp_reduce_max(m)
            if T.And(lane == 0, s < seq_len):
                VMax[by, s] = m

    return qvmax


def build_prepw(dqk=576, dv=512, WPB=8):
    """``prepw``, design (a)'s prep pass over q, out and dO, one warp a (query, head), WPB heads a block: Delta and
    the bound's per-head factors A_h = |scale| max|q_h| |dO_h| and B_h = |scale| max|q_h| |Delta_h| + max|dO_h|
    (``lean4``), C_h = |scale| max|q_h| and G_h = max|dO_h| (``exact``), and per block its heads' A_h and B_h summed
    in head order (Sums [2, B, S, head blocks]; the host sums those for the fixed points). Each lane loads 16 bytes
    at a time and sums its columns in order, then the warp's butterfly (``warp_reduce_*``) finishes, so no shared
    memory or barrier sits between a row's loads and its sums. Delta's summation order is not ``bwd_prep``'s.
    (It replaced ``prepab``, one block a query and four heads a step: 0.48 ms at the anchor against 0.27.)"""
    import tilelang.language as T

    batch, seq_len, heads = T.dynamic("batch, seq_len, heads")
    bf16, f32 = T.bfloat16, T.float32
    OV, QV = dv // 8, dqk // 8  # 16-byte chunks a row
    assert OV % 32 == 0

    @T.prim_func
    def prep_w(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        O: T.Tensor([batch, seq_len, heads, dv], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        A: T.Tensor([batch, seq_len, heads], f32),
        Bc: T.Tensor([batch, seq_len, heads], f32),
        C: T.Tensor([batch, seq_len, heads], f32),
        Gm: T.Tensor([batch, seq_len, heads], f32),
        Sums: T.Tensor([2, batch, seq_len, T.ceildiv(heads, WPB)], f32),
        sm_scale: f32,
    ):
        with T.Kernel(seq_len, T.ceildiv(heads, WPB), batch, threads=32 * WPB) as (bx, by, bz):
            ob = T.alloc_local([8], bf16)
            gb = T.alloc_local([8], bf16)
            qb = T.alloc_local([8], bf16)
            d = T.alloc_var(f32)
            g2 = T.alloc_var(f32)
            gm = T.alloc_var(f32)
            qm = T.alloc_var(f32)
            terms = T.alloc_shared([2, WPB], f32)
            tx = T.get_thread_binding()
            w, lane = tx // 32, tx % 32
            h = by * WPB + w
            hh = T.min(h, heads - 1)
            d, g2, gm, qm = 0.0, 0.0, 0.0, 0.0
            for c in T.unroll(OV // 32):
                for v in T.vectorized(8):
                    ob[v] = O[bz, bx, hh, (c * 32 + lane) * 8 + v]
                    gb[v] = dO[bz, bx, hh, (c * 32 + lane) * 8 + v]
                for v in T.unroll(8):
                    d += T.cast(ob[v], f32) * T.cast(gb[v], f32)
                    g2 += T.cast(gb[v], f32) * T.cast(gb[v], f32)
                    gm = T.max(gm, T.abs(T.cast(gb[v], f32)))
            for c in T.unroll(T.ceildiv(QV, 32)):
                if c * 32 + lane < QV:
                    for v in T.vectorized(8):
                        qb[v] = Q[bz, bx, hh, (c * 32 + lane) * 8 + v]
                    for v in T.unroll(8):
                        qm = T.max(qm, T.abs(T.cast(qb[v], f32)))
            d = T.warp_reduce_sum(d)
            g2 = T.warp_reduce_sum(g2)
            gm = T.warp_reduce_max(gm)
            qm = T.warp_reduce_max(qm)
            if lane == 0:
                a = T.abs(sm_scale) * qm * T.sqrt(g2)
                b = T.abs(sm_scale) * qm * T.abs(d) + gm
                terms[0, w] = T.if_then_else(h < heads, a, 0.0)
                terms[1, w] = T.if_then_else(h < heads, b, 0.0)
                if h < heads:
                    Delta[bz, bx, h] = d
                    A[bz, bx, h] = a
                    Bc[bz, bx, h] = b
                    C[bz, bx, h] = T.abs(sm_scale) * qm
                    Gm[bz, bx, h] = gm
            T.sync_threads()
            if tx < 2:
                total = T.alloc_var(f32)
                total = 0.0
                for i in T.serial(WPB):
                    total += terms[tx, i]
                Sums[tx, bz, bx, by] = total

    return prep_w


def build_scales(dqk=576, dv=512, WPB=8):
    """``scales``: per KV row, |V_j| (one warp a row, as ``prepw`` sums), B_j = |V_j| U_j / Ex[0] + W_j / Ex[1] from
    ``lean4``'s two int64 sums, F_j = 29 - ceil(log2 B_j) clamped to [-120, 120], and the row's scale 2**F_j and
    inverse 2**-F_j (0 and 1 for a row no slot names, B_j = 0)."""
    import tilelang.language as T

    batch, seq_kv = T.dynamic("batch, seq_kv")
    bf16, f32, i64 = T.bfloat16, T.float32, T.int64
    OV = dv // 8

    @T.prim_func
    def row_scale(
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        RowU: T.Tensor([batch, seq_kv], i64),
        RowW: T.Tensor([batch, seq_kv], i64),
        Ex: T.Tensor([2], f32),
        Scale: T.Tensor([batch, seq_kv], f32),
        Inv: T.Tensor([batch, seq_kv], f32),
    ):
        with T.Kernel(T.ceildiv(seq_kv, WPB), batch, threads=32 * WPB) as (bx, by):
            vb = T.alloc_local([8], bf16)
            n2 = T.alloc_var(f32)
            tx = T.get_thread_binding()
            j, lane = bx * WPB + tx // 32, tx % 32
            jj = T.min(j, seq_kv - 1)
            n2 = 0.0
            for c in T.unroll(OV // 32):
                for v in T.vectorized(8):
                    vb[v] = KV[by, jj, (c * 32 + lane) * 8 + v]
                for v in T.unroll(8):
                    n2 += T.cast(vb[v], f32) * T.cast(vb[v], f32)
            n2 = T.warp_reduce_sum(n2)
            if T.And(lane == 0, j < seq_kv):
                bnd = T.sqrt(n2) * (T.cast(RowU[by, j], f32) / Ex[0]) + T.cast(RowW[by, j], f32) / Ex[1]
                f = T.max(T.min(29.0 - T.ceil(T.log2(bnd)), 120.0), -120.0)
                Scale[by, j] = T.if_then_else(bnd > 0.0, T.exp2(f), 0.0)
                Inv[by, j] = T.if_then_else(bnd > 0.0, T.exp2(-f), 1.0)

    return row_scale


def build_scales1(BJ=256):
    """``scales1``: the dP-exact bound's row scales: B_j = RowB_j / Ex, F_j = 29 - ceil(log2 B_j) clamped to
    [-120, 120], the scale 2**F_j and its inverse (0 and 1 where B_j is 0), one thread a KV row."""
    import tilelang.language as T

    batch, seq_kv = T.dynamic("batch, seq_kv")
    f32, i64 = T.float32, T.int64

    @T.prim_func
    def row_scale1(
        RowB: T.Tensor([batch, seq_kv], i64),
        Ex: T.Tensor([1], f32),
        Scale: T.Tensor([batch, seq_kv], f32),
        Inv: T.Tensor([batch, seq_kv], f32),
    ):
        with T.Kernel(T.ceildiv(seq_kv, BJ), batch, threads=BJ) as (bx, by):
            j = bx * BJ + T.get_thread_binding()
            if j < seq_kv:
                bnd = T.cast(RowB[by, j], f32) / Ex[0]
                f = T.max(T.min(29.0 - T.ceil(T.log2(bnd)), 120.0), -120.0)
                Scale[by, j] = T.if_then_else(bnd > 0.0, T.exp2(f), 0.0)
                Inv[by, j] = T.if_then_else(bnd > 0.0, T.exp2(-f), 1.0)

    return row_scale1


def prep_w(kp, t, exact=None):
    """``prepw`` and the rest of the bound pass's inputs: (Delta, A, Bc, Lse2, Ex), Ex the fixed points of U and W;
    with ``exact`` (the ``vnorms`` and ``qvmax`` kernels), (Delta, C, Gm, Lse2, Ex) for the dP-exact bound, Ex from
    ``exact_fixed_point``."""
    B, S, H, _ = t.q.shape
    delta, A, Bc, C, Gm = (torch.empty(B, S, H, dtype=torch.float32, device="cuda") for _ in range(5))
    sums = torch.empty(2, B, S, -(-H // 8), dtype=torch.float32, device="cuda")
    kp(t.q, t.out, t.go, delta, A, Bc, C, Gm, sums, t.sm)
    lse2 = contract.lse_to_base2(t.lse, t.sink).contiguous()
    if exact is None:
        return delta, A, Bc, lse2, uw_fixed_points(sums)
    vnorm = torch.empty(B, t.Skv, dtype=torch.float32, device="cuda")
    vmax = torch.empty(B, S, dtype=torch.float32, device="cuda")
    exact[0](t.kv, vnorm)
    exact[1](t.idx, t.tl, vnorm, vmax)
    return delta, C, Gm, lse2, exact_fixed_point(sums, vmax)


def exact_fixed_point(sums, vmax):
    """float32 [1]: 2**(62 - ceil(log2 G)) for G = sum over queries of VMax_i sum_h A_h + sum_h B_h, which bounds
    the sum of every slot's dP-exact bound (|dP_h| <= |dO_h| |V_j| <= |dO_h| VMax_i; each query's P sums to 1 at
    most); 1 where G is 0."""
    return fixed_point((sums[0] * vmax[..., None]).sum() + sums[1].sum()).reshape(1)


def uw_fixed_points(sums):
    """float32 [2]: 2**(62 - ceil(log2 G)) for G the sum of A_h (of B_h) over every query and head (1 where G is
    0), so neither int64 row sum can pass 2**62."""
    return fixed_point(sums.flatten(1).sum(1))


def fixed_point(g):
    """2**(62 - ceil(log2 G)) elementwise (1 where G is 0): integers of G's units stay below 2**62."""
    return torch.where(g > 0, torch.exp2(62 - torch.ceil(torch.log2(g))), torch.ones_like(g))


def row_scales_uw(U, W, ex, vnorm):
    """lean4's per-row scales: B_j = |V_j| U_j + W_j (the int64 sums over their fixed points), then ``row_scales``."""
    b = vnorm.double() * (U.double() / ex[0].double()) + W.double() / ex[1].double()
    return scales_of(b), b


BUILDERS = {
    "prepw": lambda dqk, dv: build_prepw(dqk, dv), "lean4": lambda dqk, dv: build_bound(dqk=dqk),
    "scales": lambda dqk, dv: build_scales(dqk, dv), "exact": lambda dqk, dv: build_bound_exact(dqk=dqk, dv=dv),
    "vnorms": lambda dqk, dv: build_vnorms(dqk, dv), "qvmax": lambda dqk, dv: build_qvmax(),
    "scales1": lambda dqk, dv: build_scales1(),
    # the tilelang backend's own
    "convert": lambda dqk, dv: bwd_rows.build_convert(dqk),
}


def compiled(which: str, dims=(576, 512)):
    """One of ``BUILDERS``' kernels for head dims ``dims``, compiled for sm_90a."""
    import tilelang

    from sparse_mqa_kernels.target import EXECUTION_BACKEND, TARGET
    if which not in BUILDERS:
        raise ValueError(f"kernel {which!r}: one of {', '.join(BUILDERS)}")
    return tilelang.compile(BUILDERS[which](*dims), out_idx=None, target=TARGET, execution_backend=EXECUTION_BACKEND)


def row_scales(row_bound, ex):
    """``scales_of`` the rows' bounds B_j = row_bound / ex."""
    return scales_of(row_bound.double() / ex.double())


def scales_of(b):
    """Per KV row, 2**F_j with F_j = ROW_HEADROOM - ceil(log2 B_j) (float32), and 2**-F_j (float64); 0 and 1 for a
    row no valid slot names (its terms are all zero)."""
    f = torch.clamp(ROW_HEADROOM - torch.ceil(torch.log2(b.clamp_min(1e-300))), -120, 120)
    named = b > 0
    return (torch.where(named, torch.exp2(f), torch.zeros_like(f)).float(),
            torch.where(named, torch.exp2(-f), torch.ones_like(f)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", default=["anchor", "l512", "h128"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--bound", action="store_true", help="the bound kernels (--kernels) and design (a)'s prep alone, "
                   "and their per-row bounds against today's exact dkv")
    p.add_argument("--sweep", default="", help="--bound: each kernel also timed at these valid slots a query "
                   "(probe_wide_backward.py's --sweep)")
    p.add_argument("--kernels", default="lean4", help="--bound's kernels: lean4, exact")
    p.add_argument("--pipeline", action="store_true", help="design (a) end to end (prep, bound pass, main kernel, "
                   "conversion) beside today's call")
    p.add_argument("--pipe-tail", default="kernels", choices=("torch", "kernels"), help="--pipeline's row scales and "
                   "conversion")
    p.add_argument("--pipe-bound", default="lean4", choices=("lean4", "exact"), help="--pipeline's bound pass: "
                   "|dP| <= |dO_h| |V_j| (lean4) or dP itself (exact, with the kernels scales1 and convert)")
    p.add_argument("--cudnn", action="store_true", help="--pipeline: time cuDNN's backward in the same process")
    p.add_argument("--pipe-main", default="48/ws", help="--pipeline's main kernel (probe_wide_backward.py's variant; "
                   "48/ws: the tilelang backend's)")
    a = p.parse_args(argv)
    if not (a.bound or a.pipeline):
        p.error("choose --bound or --pipeline")
    names = ["prepw", *a.kernels.split(",")]
    names += ["vnorms", "qvmax"] if "exact" in names else []
    kbs = {m: compiled(m) for m in names} if a.bound else {}
    if a.pipeline:
        exact = (tuple(compiled(k) for k in ("vnorms", "qvmax", "scales1")) if a.pipe_bound == "exact"
                 else None)
        tail = ((None if exact else compiled("scales"), compiled("convert"))
                if exact or a.pipe_tail == "kernels" else None)
        pipe = (compiled("prepw"), compiled(a.pipe_bound), WIDE.compiled(a.pipe_main), tail, exact)
    if torch.cuda.is_available():
        for name in a.shapes:
            t = WIDE.today(name)
            if a.pipeline:
                pipeline(*pipe, t, name, a)
            if a.bound:
                bound_only(dict(kbs), t, name, a)
    else:
        print(f"compiled {', '.join(kbs)} for sm_90a (no GPU here: nothing timed)")


def bound_only(kbs, t, name, a):
    """Design (a)'s prep pass and bound passes, timed alone on the inputs they read, and how far each row's bound B_j
    sits above that row's largest exact |dkv| entry (log2; the bits a per-row int32 scale gives away), against the
    int64 backward's exact dkv; its prep pass timed beside them."""
    B, S, H, _ = t.q.shape
    from sparse_mqa_kernels import backward
    prep_ms = WIDE.time_ms(lambda: backward._prep(t.q, t.kv, t.out, t.go, t.lse, t.sink, t.idx, t.tl, t.sm, 512),
                           a.iters)
    kp = kbs.pop("prepw")
    exact = (kbs.pop("vnorms"), kbs.pop("qvmax")) if "exact" in kbs else None
    prepw_ms = WIDE.time_ms(lambda: prep_w(kp, t), a.iters)
    delta, A, Bc, lse2, ex = prep_w(kp, t)
    if exact:
        _, C, Gm, _, ex1 = prep_w(kp, t, exact)
    print(f"{name}: today's prep {prep_ms:.3f} ms; prepw (with the kernel LSE and the fixed points) {prepw_ms:.3f} "
          f"ms; its Delta against today's: max rel. {((delta - t.delta).abs().max() / t.delta.abs().max()).item():.1e}",
          flush=True)
    vnorm = t.kv[..., :512].float().norm(dim=-1).contiguous()
    rmax = t.exact.abs().amax(-1)
    named = rmax > 0
    bounds = {}
    for mode, k in kbs.items():
        row_u = torch.zeros(B, t.Skv, dtype=torch.int64, device="cuda")
        row_w = torch.zeros_like(row_u)

        def call():
            if mode == "lean4":
                k(t.q, t.kv, t.idx, t.tl, lse2, A, Bc, t.rows, ex, row_u, row_w, t.sm)
            else:
                k(t.q, t.go, t.kv, t.idx, t.tl, lse2, delta, C, Gm, t.rows, ex1, row_u, t.sm)
        ms = WIDE.time_ms(call, a.iters)
        if a.sweep:
            WIDE.sweep(mode, call, t, [int(n) for n in a.sweep.split(",")], 64, a.iters)
        row_u.zero_()
        row_w.zero_()
        call()
        bj = bounds[mode] = (row_scales_uw(row_u, row_w, ex, vnorm)[1] if mode == "lean4"
                             else row_u.double() / ex1.double())
        gap = torch.log2(bj[named] / rmax[named])
        q = torch.quantile(gap.float(), torch.tensor([0.5, 0.99], device="cuda"))
        print(f"  {mode}: {ms:.3f} ms; log2(B_j / max|dkv_j|) min {gap.min().item():.2f} median {q[0].item():.2f} "
              f"p99 {q[1].item():.2f} max {gap.max().item():.2f} over {int(named.sum())} named rows", flush=True)
    if "exact" in bounds and "lean4" in bounds:  # dP itself against |dO_h| |V_j|
        r = torch.log2(bounds["exact"][named] / bounds["lean4"][named])
        print(f"  exact against lean4: log2 ratio {r.min().item():.4f} .. {r.max().item():.4f}", flush=True)


def pipeline(kp, kl, ks, tail, exact, t, name, a):
    """Design (a) end to end: the ``prepw`` pass and the fixed points of the bound's two sums, the ``lean4`` bound
    pass (or, with ``exact`` = the ``vnorms``, ``qvmax`` and ``scales1`` kernels, ``kl`` the ``exact`` bound pass:
    its own fixed point and one sum a row), the row scales, the main kernel (``--pipe-main``, a
    ``probe_wide_backward.py`` variant: int32 per KV row) and the conversion to bf16, the last two steps in torch or
    as the ``scales`` and ``convert`` kernels (``--pipe-tail``). The whole call is timed as today's call (and
    cuDNN's, ``--cudnn``) is, in the same process; each stage's GPU time is taken with CUDA events on calls queued
    behind a sleep, so the host's launches stay ahead. dq is compared bit for bit with today's, dkv with today's
    exact sum."""
    from sparse_mqa_kernels import backward
    B, S, H, Dqk = t.q.shape
    keep = torch.zeros((B, Dqk), dtype=torch.float32, device="cuda")

    def call(ev=None):
        mark = (lambda k: ev[k].record()) if ev else (lambda k: None)
        mark(0)
        delta, A, Bc, lse2, ex = prep_w(kp, t, exact)  # (A, Bc are C, Gm with exact)
        mark(1)
        row_u = torch.zeros(B, t.Skv, dtype=torch.int64, device="cuda")
        row_w = torch.zeros_like(row_u)
        if exact:
            kl(t.q, t.go, t.kv, t.idx, t.tl, lse2, delta, A, Bc, t.rows, ex, row_u, t.sm)
        else:
            kl(t.q, t.kv, t.idx, t.tl, lse2, A, Bc, t.rows, ex, row_u, row_w, t.sm)
        mark(2)
        if exact:
            scale, inv = torch.empty(B, t.Skv, device="cuda"), torch.empty(B, t.Skv, device="cuda")
            exact[2](row_u, ex, scale, inv)
        elif tail:
            scale, inv = torch.empty(B, t.Skv, device="cuda"), torch.empty(B, t.Skv, device="cuda")
            tail[0](t.kv, row_u, row_w, ex, scale, inv)
        else:
            scale, inv = row_scales_uw(row_u, row_w, ex, t.kv[..., :512].float().norm(dim=-1))[0]
        mark(3)
        acc = torch.zeros(B, t.Skv, Dqk, dtype=torch.int32, device="cuda")
        dq = torch.empty_like(t.q)
        ks(t.q, t.kv, t.go, t.idx, t.tl, lse2, delta, t.rows, dq, keep, scale, acc, t.sm)
        mark(4)
        if tail:
            dkv = torch.empty(B, t.Skv, Dqk, dtype=torch.bfloat16, device="cuda")
            tail[1](acc, inv, dkv)
        else:
            dkv = (acc.double() * inv[..., None]).to(torch.bfloat16)
        mark(5)
        return dq, dkv, acc, inv

    today = WIDE.time_ms(lambda: backward.sparse_mqa_backward(t.q, t.kv, t.out, t.go, t.lse, t.sink, t.idx, t.sm),
                         a.iters)
    ours = WIDE.time_ms(call, a.iters)
    peer = ""
    if a.cudnn:
        from sparse_mqa_kernels.bench.cli import _load
        from sparse_mqa_testkit.calls import Call
        cudnn, reason = _load("cudnn", "cuda")
        if cudnn is None:
            peer = f"; cuDNN not timed: {reason}"
        else:
            args, kw = Call({"q": t.q, "kv": t.kv, "grad_out": t.go, "indices": t.idx, "attn_sink": t.sink,
                             "sm_scale": t.sm, "out": t.out, "lse": t.lse}).for_("backward")
            cudnn.backward(*args, **kw)  # its JIT, outside the timing
            ms = WIDE.time_ms(lambda: cudnn.backward(*args, **kw), a.iters)
            peer = f"; cuDNN {ms:.3f} ms: today {today / ms:.2f}x, design (a) {ours / ms:.2f}x"
    stages = ("prep", "bound", "scales", "kernel", "conversion")
    times = {k: [] for k in stages}
    for it in range(a.iters + 2):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        torch.cuda._sleep(50_000_000)  # about 25 ms: the host queues the whole call meanwhile
        dq, dkv, acc, inv = call(ev)
        torch.cuda.synchronize()
        if it >= 2:
            for k, (e0, e1) in zip(stages, zip(ev, ev[1:])):
                times[k].append(e0.elapsed_time(e1))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{name}: today's call {today:.3f} ms; design (a)'s call {ours:.3f} ms{peer}", flush=True)
    print(f"  its GPU time, queued: {sum(med.values()):.3f} ms = " + " + ".join(f"{k} {v:.3f}" for k, v in med.items()),
          flush=True)
    dq_ref, dkv_today, _ = backward.sparse_mqa_backward(t.q, t.kv, t.out, t.go, t.lse, t.sink, t.idx, t.sm)
    if tail:
        from sparse_mqa_testkit.oracle import round_bf16  # one rounding (torch's float64-to-bf16 may round twice)

        once = round_bf16((acc.double() * inv.double()[..., None]).cpu().numpy()).astype("float32")
        once = torch.from_numpy(once).to(dkv.device).to(torch.bfloat16)  # exact: the values are bf16's
        print(f"  convert against float64 rounded once to bf16 (the oracle's round_bf16): {int((dkv != once).sum())} "
              f"of {dkv.numel()} elements differ", flush=True)
    dq_diff = ((dq.float() - dq_ref.float()).norm() / dq_ref.float().norm()).item()
    print(f"  dq bitwise equal to today's {torch.equal(dq, dq_ref)} (rel. L2 {dq_diff:.1e}); dkv against the exact "
          "sum: "
          f"{WIDE.dkv_error(dkv.double(), t.exact)} (today's bf16: {WIDE.dkv_error(dkv_today.double(), t.exact)}); "
          f"int32 exact against the exact sum: {WIDE.dkv_error(acc.double() * inv[..., None], t.exact)}", flush=True)


if __name__ == "__main__":
    main()
