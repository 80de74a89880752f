"""Deterministic sparse-MLA backward on Hopper (TileLang, sm_90a): dq, dkv and d_sink, bitwise stable.

Algorithm
    One thread block serves one query row and one head group (``bwd_plan``: 16, 32 or 64 heads; padded heads
    load q = dO = Delta = 0 and lse = +inf, so P = dS = 0 there, and no row h >= H is read or written). It
    walks the row's valid top-k prefix ``min(L, topk_length)`` ``topk_block`` slots at a time: gathers the
    valid KV rows (an invalid slot's index is never used as an address; its tile row is zero), recomputes
    P = exp2(s sm_scale log2e - lse2) with the sink folded into lse2, dP = dO V^T, dS = P (dP - Delta) sm_scale,
    and runs dq += dS K and dkv_blk = dS^T Q + P^T [dO; 0] on tensor cores (bf16 operands, fp32 accumulators,
    a fixed instruction order).

Determinism by construction
    dq has one writer per element (its block, in a fixed loop order). dkv rows get contributions from every
    (query, slot, head group) naming them, in an order the scheduler picks; so each fp32 contribution is
    rounded once to an integer multiple of 2**-F and summed in int64 (issue 6, lead (a)). Integer addition
    is associative: the accumulator holds the exact sum of the rounded terms whatever the order, and one
    final pass turns accumulator * 2**-F into bf16. Delta, the kernel LSE, the bound for F and
    d_sink = -sum p_sink Delta are torch reductions on fixed shapes (tree reductions, no atomics); d_sink is
    summed per query chunk, then over chunks in order. No floating-point atomic is issued anywhere
    (tests/test_backward_compile.py reads the generated CUDA).

How the int64 sums reach memory (``REDUCE``)
    "bulk" (default): a block's [topk_block, Dqk] int64 contributions are staged in shared memory
    ``STAGE_ROWS`` rows at a time (two buffers) and each valid KV row goes out as ONE
    ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64`` of Dqk * 8 bytes (two's complement, so
    u64 addition is signed addition); a small inline-PTX prelude supplies it (TileLang 0.1.15 has only the
    .f32 flavour). "atomic": one int64 atomicAdd per element from registers. On one H200 at the anchor shape
    (B1 S4096 Skv8192 H64 L2048, finite sink; BENCHMARKS.md) "bulk" is 34.1 ms against 41.2 ms for "atomic"
    (topk_block 16), and 37.4 against 43.9 ms at topk_block 32; all configurations give the same bits.

Fixed point and precision
    F comes from a cheap bound G on any partial sum of dkv (``model.dkv_bound``: per query and head
    sum_t P <= 1 and sum_t |dS| <= 2 |dO| Vmax, summed over queries): F = 60 - ceil(log2 G), computed on the
    device (no host sync) and read by the kernel from a tensor. The resolution 2**-F sits 2**60 below G, so a
    term loses at most 2**-61 G: a row 2**30 below G summing 1024 terms keeps 2**-21 relative accuracy, one
    2**40 below keeps 2**-11, still under its own bf16 output rounding (2**-9). tests/test_tilelang_model.py
    measures the int64 sum against float32 accumulation of the same terms spanning 2**0, 2**20 and 2**40:
    never worse. The bound is loose by the ratio of
    all queries to the queries that name a row (S L / Skv at most), which costs bits, not correctness; a
    two-word split (issue 6) would buy 31 more bits at twice the reduction bytes and was not needed by any
    case measured here.

Tiles and what was measured (one H200, anchor shape B1 S4096 Skv8192 H64 L2048, finite sink; BENCHMARKS.md)
    topk_block 32 (255 registers, 300 B spilled): 37.4 ms (bulk) / 43.9 ms (atomic). topk_block 16 (248
    registers, no spill): 34.1-34.3 ms (bulk, the default: 86 TFLOP/s), 41.2 ms (atomic). Prefetching block
    kb + 1 with cp.async during block kb (``PREFETCH``; needs the shared-memory merge off): 37.8 ms, slower,
    so off. H128: 67.5 ms; L512: 12.0 ms. cuDNN's non-deterministic backward takes 6.76 / 13.8 / 1.91 ms at
    these shapes (the `sparse-mqa-bench` run of 2026-11-30, not the same process): this kernel is 4.9-6.3x slower,
    short of the issue's 2x. Where the time goes: each block iteration runs five small GEMMs ([64 x 16]
    scores on n8 wgmma tiles, a 16-row mma for dkv) separated by barriers and stages 16 int64 rows through
    shared memory (the first reading; the measurements below correct it).

Other configurations and where the time goes (three H200 runs, BENCHMARKS.md)
    Selectable, all bitwise stable and bit-identical to the default on the H200 (same dq, dkv, d_sink bits at
    every shape measured); fused, fused + drain=False, warp_stage and 2 x 5 staging each passed
    tests/gpu/test_backward_gpu.py (24 tests, via SMQA_BWD_KW):
    ``fused=True``: scores and dP as ONE [2 HG x BI] product ([Q; dO] stacked in shared memory, each
    warpgroup one m64n16 wgmma half instead of both products split into n8 tiles), dkv as ONE K = 2 HG product
    [dS; P]^T [Q; dO]; ``drain=False`` lets block kb's last bulk group overlap block kb + 1 (the staging is
    the last buffer of shared memory, checked in tests/test_backward_compile.py); ``warp_stage=True``: each
    warp stages only the dkv columns its own mma fragment holds and its lanes send them (512 B + 64 B bulk
    ops per row), warp barriers only, no block barrier in the reduction; ``stage_rows`` x ``stage_bufs``: a
    deeper staging ring. Anchor / L512 / H128 in ms: default 34.1-34.4 / 12.0-12.1 / 66.8-68.7; fused
    34.6-34.9 / 12.4-12.5 / 69.0-69.3; fused, drain=False 33.9-34.2 / 12.2-12.4 / 66.3-68.0; warp_stage
    34.1 / 12.4 / 66.8; 2 rows x 5 buffers 41.2 (more rounds, slower); fused with int64 atomics 43.3.
    None is faster beyond run-to-run noise, so the default stays.
    Ablations (``_ablate``, wrong results, timing only; fused, anchor): no bulk issue 29.7 ms (per-warp
    staging: 24.9); no dkv at all (products, staging, reduction) 18.5; no gather 27.6; neither gather nor
    dkv 13.8. So the five-vs-two products make no difference, the block-wide staging rounds cost ~5 ms
    (29.7 vs 24.9) and the reduction itself ~9 ms on top (34.1 vs 24.9): everything converges to ~34 ms as
    soon as the bulk reductions run: the kernel waits on its own 74 KB of int64 rows per top-k block (38.7 GB
    at the anchor moves at ~1.1 TB/s, a third of the issue's microbenchmark). Our reading, not measured
    directly: 37 KB of staging lets only half a block's rows be in flight while the next block computes, so
    the other half is waited for. Next steps: staging for a whole block (74 KB: free shared memory, e.g. Q's
    rope tail or the score tile out of shared memory, or split heads over a 2-CTA cluster), then fewer bytes
    (one int64 row per query for all heads, merging queries that share rows), then the gather (~6.5 ms: a
    producer warp with cp.async, as the forward).

Why not (b) buffer + CSR + ordered reduction, or (c) shards: both move the [S, L, Dqk] fp32 contributions
    through memory at least twice (write, then read to reduce); the bulk int64 reduction moves them once, at
    twice fp32's width, and needs no sort.

The NumPy model ``kernels.model`` runs this algorithm on CPU (same plan, padding and fixed-point scheme).
"""

import functools

from .. import contract
from ..backends.validate import check_backward_args
from . import bwd_plan

TARGET = {"kind": "cuda", "arch": "sm_90a"}

# How dkv contributions reach the int64 accumulator:
#   "bulk":   rows staged in shared memory as int64, one cp.reduce.async.bulk .add.u64 per KV row (TMA engine)
#   "atomic": one int64 atomicAdd per element, straight from registers (the first, simpler version)
REDUCE_MODES = ("bulk", "atomic")
REDUCE = "bulk"
THREADS = {64: 256, 32: 128, 16: 128}  # per head group
PREFETCH = False  # gather top-k block kb + 1 with cp.async while block kb computes
# One [2 HG x BI] product gives scores and dP together (Q and dO stacked in one shared tile, each warpgroup
# owns one half) and one K = 2 HG product gives dkv = [dS; P]^T [Q; dO]: fewer, wider tensor-core products.
# Measured no faster than the five products (the reduction bounds the kernel), so off by default.
FUSED = False
# Wait for the last bulk group's shared-memory reads at the end of every top-k block. Needed only when the
# staging shares memory with other tiles; without it, block kb's last reduction overlaps block kb + 1's gather
# (the round structure already orders every reuse of a staging buffer). FUSED only.
DRAIN = True
STAGE_ROWS = 4  # KV rows per bulk round; two rounds in flight (double-buffered int64 staging)

# Inline PTX the bulk mode needs (TileLang 0.1.15 has only the .f32 flavour of the bulk reduction).
_PRELUDE = r"""
__device__ __forceinline__ void smqa_bulk_add_u64(void const* smem, void* gmem, int bytes) {
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
__device__ __forceinline__ void smqa_bulk_commit_wait_read1() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}
__device__ __forceinline__ void smqa_bulk_wait_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void smqa_bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


# wait until at most N bulk groups still read their staging (N = staging buffers - 1)
_PRELUDE_N = r"""
template <int N> __device__ __forceinline__ void smqa_bulk_commit_wait_read_n() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
"""

_PRELUDE_COMMIT = r"""
__device__ __forceinline__ void smqa_bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
"""

ABLATIONS = ("noreduce", "nodkv", "nogather")  # timing attribution only: the results are wrong


def _pass_configs(prefetch: bool = False, manual_sync: bool = False):
    import tilelang

    # with prefetch, tiles are written by cp.async while others are in use: no liveness-based aliasing
    cfg = {
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        tilelang.PassConfigKey.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE: not prefetch,
    }
    if manual_sync:
        # warp_stage: the kernel places every barrier itself (the automatic ones would be block-wide)
        cfg[tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC] = True
    return cfg


def build_program(variant: tuple, reduce: str = REDUCE, stage_rows: int = STAGE_ROWS, threads: int | None = None,
                  prefetch: bool = PREFETCH, fused: bool = FUSED, drain: bool = DRAIN, stage_bufs: int = 2,
                  _ablate: str = "", warp_stage: bool = False):
    """The TileLang prim_func of one variant (Dqk, Dv, head_group, topk_block); sizes are symbolic."""
    import tilelang.language as T

    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce must be one of {REDUCE_MODES}, got {reduce!r}")
    if fused:
        if stage_bufs < 2:
            raise ValueError(f"stage_bufs must be >= 2, got {stage_bufs}")
        if _ablate and set(_ablate.split(",")) - set(ABLATIONS):
            raise ValueError(f"_ablate must name some of {ABLATIONS}, got {_ablate!r}")
        return _build_fused(variant, reduce, stage_rows, threads, drain, stage_bufs, _ablate, warp_stage)
    for name, value, default in (("drain", drain, True), ("stage_bufs", stage_bufs, 2), ("_ablate", _ablate, ""),
                                 ("warp_stage", warp_stage, False)):
        if value != default:
            raise ValueError(f"{name} applies to fused=True only, got {name}={value!r} with fused=False")
    bulk = reduce == "bulk"
    dqk, dv, HG, BI = variant
    R = stage_rows
    assert BI % R == 0
    D = dv
    tail = dqk - dv
    TA = max(tail, 16)
    if threads is None:
        threads = THREADS.get(HG, 128)
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32, i64 = T.bfloat16, T.float32, T.int32, T.int64
    log2e = contract.LOG2E

    @T.prim_func
    def sparse_mla_bwd(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        Lse2: T.Tensor([batch, seq_len, heads], f32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        Rows: T.Tensor([n_rows], i32),
        Fx: T.Tensor([1], f32),
        dQ: T.Tensor([batch, seq_len, heads, dqk], bf16),
        Acc: T.Tensor([batch, seq_kv, dqk], i64),
        sm_scale: f32,
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=threads, prelude=_PRELUDE if bulk else None) as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, D], bf16)
            dO_shared = T.alloc_shared([HG, D], bf16)
            NB = 2 if prefetch else 1  # KV tiles: with prefetch, block kb + 1 is gathered during block kb
            KV_shared = T.alloc_shared([NB, BI, D], bf16)
            P_shared = T.alloc_shared([HG, BI], bf16)
            dS_shared = T.alloc_shared([HG, BI], bf16)
            idx_shared = T.alloc_shared([NB, BI], i32)
            # the rope tail (Dqk - Dv columns); allocated at a dummy size when there is none
            Qt_shared = T.alloc_shared([HG, TA], bf16)
            KVt_shared = T.alloc_shared([NB, BI, TA], bf16)
            acc_dq_t = T.alloc_fragment([HG, TA], f32)
            acc_dkv_t = T.alloc_fragment([BI, TA], f32)

            acc_p = T.alloc_fragment([HG, BI], f32)
            acc_dp = T.alloc_fragment([HG, BI], f32)
            acc_dq = T.alloc_fragment([HG, D], f32)
            acc_dkv = T.alloc_fragment([BI, D], f32)
            stage = T.alloc_shared([2, R, dqk] if bulk else [1, 1, 2], i64)
            lse_f = T.alloc_fragment([HG], f32)
            delta_f = T.alloc_fragment([HG], f32)

            b_i = by
            s_i = Rows[bx]
            h0 = bz * HG
            fx = Fx[0]
            tx = T.get_thread_binding()
            c2 = sm_scale * log2e
            n_valid = T.min(TopkLen[b_i, s_i], topk)

            # padded heads: zero q and dO, Delta 0, lse +inf -> P = dS = 0; rows h0 + h >= heads never touched
            for h, d in T.Parallel(HG, D):
                Q_shared[h, d] = T.if_then_else(h0 + h < heads, Q[b_i, s_i, h0 + h, d], T.cast(0, bf16))
                dO_shared[h, d] = T.if_then_else(h0 + h < heads, dO[b_i, s_i, h0 + h, d], T.cast(0, bf16))
            if tail > 0:
                for h, d in T.Parallel(HG, tail):
                    Qt_shared[h, d] = T.if_then_else(h0 + h < heads, Q[b_i, s_i, h0 + h, D + d],
                                                     T.cast(0, bf16))
            for h in T.Parallel(HG):
                lse_f[h] = T.if_then_else(h0 + h < heads, Lse2[b_i, s_i, h0 + h], T.infinity(f32))
                delta_f[h] = T.if_then_else(h0 + h < heads, Delta[b_i, s_i, h0 + h], 0.0)
            T.clear(acc_dq)
            if tail > 0:
                T.clear(acc_dq_t)

            n_blk = T.ceildiv(n_valid, BI)
            CH = dqk // 8  # 16-byte chunks per KV row
            if prefetch:
                # stale rows stay finite: zero once, then only valid rows are ever written
                T.fill(KV_shared, 0)
                T.fill(KVt_shared, 0)
                for j in T.Parallel(BI):
                    idx_shared[0, j] = T.if_then_else(j < n_valid, Indices[b_i, s_i, j], -1)
                for j in T.Parallel(BI):
                    idx_shared[0, j] = T.if_then_else(T.And(idx_shared[0, j] >= 0, idx_shared[0, j] < seq_kv),
                                                      idx_shared[0, j], -1)
                T.sync_threads()
                for u in T.serial(T.ceildiv(BI * CH, threads)):
                    c = u * threads + tx
                    if c < BI * CH:
                        if idx_shared[0, c // CH] >= 0:
                            if (c % CH) * 8 < D:
                                T.ptx_cp_async(T.access_ptr(KV_shared[0, c // CH, (c % CH) * 8], "w", 8),
                                               T.access_ptr(KV[b_i, idx_shared[0, c // CH], (c % CH) * 8], "r", 8),
                                               8)
                            else:
                                T.ptx_cp_async(T.access_ptr(KVt_shared[0, c // CH, (c % CH) * 8 - D], "w", 8),
                                               T.access_ptr(KV[b_i, idx_shared[0, c // CH], (c % CH) * 8], "r", 8),
                                               8)
                T.ptx_commit_group()

            for kb in T.serial(n_blk):
                cur = kb % NB
                if prefetch:
                    nxt = 1 - cur
                    for j in T.Parallel(BI):
                        idx_shared[nxt, j] = T.if_then_else((kb + 1) * BI + j < n_valid,
                                                            Indices[b_i, s_i, (kb + 1) * BI + j], -1)
                    for j in T.Parallel(BI):
                        idx_shared[nxt, j] = T.if_then_else(
                            T.And(idx_shared[nxt, j] >= 0, idx_shared[nxt, j] < seq_kv), idx_shared[nxt, j], -1)
                    T.ptx_wait_group(0)
                    T.sync_threads()
                    # gather block kb + 1 while block kb computes (its buffer was released by the last sync)
                    if kb + 1 < n_blk:
                        for u in T.serial(T.ceildiv(BI * CH, threads)):
                            c = u * threads + tx
                            if c < BI * CH:
                                if idx_shared[nxt, c // CH] >= 0:
                                    if (c % CH) * 8 < D:
                                        T.ptx_cp_async(
                                            T.access_ptr(KV_shared[nxt, c // CH, (c % CH) * 8], "w", 8),
                                            T.access_ptr(KV[b_i, idx_shared[nxt, c // CH], (c % CH) * 8], "r", 8), 8)
                                    else:
                                        T.ptx_cp_async(
                                            T.access_ptr(KVt_shared[nxt, c // CH, (c % CH) * 8 - D], "w", 8),
                                            T.access_ptr(KV[b_i, idx_shared[nxt, c // CH], (c % CH) * 8], "r", 8), 8)
                        T.ptx_commit_group()
                else:
                    # validity by the contract's rule; an invalid slot keeps -1 and its row is zero-filled
                    for j in T.Parallel(BI):
                        idx_shared[0, j] = T.if_then_else(kb * BI + j < n_valid, Indices[b_i, s_i, kb * BI + j], -1)
                    for j in T.Parallel(BI):
                        idx_shared[0, j] = T.if_then_else(T.And(idx_shared[0, j] >= 0, idx_shared[0, j] < seq_kv),
                                                          idx_shared[0, j], -1)
                    for j, d in T.Parallel(BI, D):
                        KV_shared[0, j, d] = T.if_then_else(idx_shared[0, j] >= 0, KV[b_i, idx_shared[0, j], d],
                                                            T.cast(0, bf16))
                    if tail > 0:
                        for j, d in T.Parallel(BI, tail):
                            KVt_shared[0, j, d] = T.if_then_else(idx_shared[0, j] >= 0,
                                                                 KV[b_i, idx_shared[0, j], D + d], T.cast(0, bf16))

                T.gemm(Q_shared, KV_shared[cur, :, :], acc_p, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                if tail > 0:
                    T.gemm(Qt_shared, KVt_shared[cur, :, :], acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for h, j in T.Parallel(HG, BI):
                    acc_p[h, j] = T.if_then_else(idx_shared[cur, j] >= 0, T.exp2(acc_p[h, j] * c2 - lse_f[h]), 0.0)
                T.copy(acc_p, P_shared)

                T.gemm(dO_shared, KV_shared[cur, :, :], acc_dp, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                for h, j in T.Parallel(HG, BI):
                    acc_dp[h, j] = acc_p[h, j] * (acc_dp[h, j] - delta_f[h]) * sm_scale
                T.copy(acc_dp, dS_shared)

                T.gemm(dS_shared, KV_shared[cur, :, :], acc_dq, policy=T.GemmWarpPolicy.FullCol)
                if tail > 0:
                    T.gemm(dS_shared, KVt_shared[cur, :, :], acc_dq_t, policy=T.GemmWarpPolicy.FullCol)

                T.gemm(dS_shared, Q_shared, acc_dkv, transpose_A=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                T.gemm(P_shared, dO_shared, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                if tail > 0:
                    T.gemm(dS_shared, Qt_shared, acc_dkv_t, transpose_A=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol)

                # exact, order-free accumulation: one rounding to 2**-F, then int64 adds (valid slots only)
                if bulk:
                    for r in T.serial(BI // R):
                        # buffer r % 2 was last read by the bulk group of round r - 2, retired below
                        for j, d in T.Parallel(BI, D):
                            if j // R == r:
                                stage[r % 2, j % R, d] = T.cast(T.round(acc_dkv[j, d] * fx), i64)
                        if tail > 0:
                            for j, d in T.Parallel(BI, tail):
                                if j // R == r:
                                    stage[r % 2, j % R, D + d] = T.cast(T.round(acc_dkv_t[j, d] * fx), i64)
                        T.fence_proxy_async()
                        T.sync_threads()
                        if tx < R:
                            if idx_shared[cur, r * R + tx] >= 0:
                                T.call_extern("handle", "smqa_bulk_add_u64", T.address_of(stage[r % 2, tx, 0]),
                                              T.address_of(Acc[b_i, idx_shared[cur, r * R + tx], 0]), dqk * 8)
                            T.call_extern("handle", "smqa_bulk_commit_wait_read1")
                        T.sync_threads()
                    # the staging may share memory with the next block's tiles: no read may stay in flight
                    if tx < R:
                        T.call_extern("handle", "smqa_bulk_wait_read0")
                    T.sync_threads()
                else:
                    for j, d in T.Parallel(BI, D):
                        if idx_shared[cur, j] >= 0:
                            T.atomic_add(Acc[b_i, idx_shared[cur, j], d], T.cast(T.round(acc_dkv[j, d] * fx), i64))
                    if tail > 0:
                        for j, d in T.Parallel(BI, tail):
                            if idx_shared[cur, j] >= 0:
                                T.atomic_add(Acc[b_i, idx_shared[cur, j], D + d],
                                             T.cast(T.round(acc_dkv_t[j, d] * fx), i64))

            for h, d in T.Parallel(HG, D):
                if h0 + h < heads:
                    dQ[b_i, s_i, h0 + h, d] = T.cast(acc_dq[h, d], bf16)
            if tail > 0:
                for h, d in T.Parallel(HG, tail):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, D + d] = T.cast(acc_dq_t[h, d], bf16)
            if bulk:
                if tx < R:
                    T.call_extern("handle", "smqa_bulk_wait_all")

    return sparse_mla_bwd


def _build_fused(variant: tuple, reduce: str, stage_rows: int, threads: int | None, drain: bool,
                 stage_bufs: int = 2, ablate: str = "", warp_stage: bool = False):
    """``FUSED``: the same algorithm and accumulation with two wide products per top-k block instead of five.

    QdO_shared stacks [Q[:, :Dv]; dO] (2 HG rows) and QtZ_shared [Q[:, Dv:]; 0], so one product of
    [2 HG x BI] gives the scores (rows < HG) and dP (rows >= HG), each warpgroup owning one half; the halves
    meet in an fp32 shared tile for dS = P (dP - Delta) sm_scale. PdS_shared stacks [dS; P] (bf16), so
    dkv = [dS; P]^T [Q; dO] is one product of K = 2 HG, and its rope tail [dS; P]^T [Qt; 0] = dS^T Qt.
    """
    import tilelang.language as T

    bulk = reduce == "bulk"
    dqk, dv, HG, BI = variant
    R = stage_rows
    assert BI % R == 0
    D = dv
    tail = dqk - dv
    TA = max(tail, 16)
    M2 = 2 * HG
    NBUF = stage_bufs
    NR = BI // R  # staging rounds per top-k block
    abl = set(filter(None, ablate.split(",")))
    assert abl <= set(ABLATIONS), ablate
    do_gather, do_dkv, do_reduce = ("nogather" not in abl), ("nodkv" not in abl), ("noreduce" not in abl)
    WS = warp_stage and bulk
    NW = threads // 32 if threads is not None else THREADS.get(HG, 128) // 32
    WN, WT = D // NW, tail // NW  # dkv columns each warp's mma fragment holds (main, rope tail)
    RW = 8  # rows per per-warp staging round
    SW = WN + WT
    NL = RW * (2 if tail > 0 else 1)  # lanes issuing bulk ops: one per row (main), one per row (tail)
    if WS:
        assert BI % RW == 0 and D % NW == 0 and tail % NW == 0
    wait_fn = "smqa_bulk_commit_wait_read1" if NBUF == 2 else f"smqa_bulk_commit_wait_read_n<{NBUF - 1}>"
    prelude = None
    if bulk:
        prelude = _PRELUDE if NBUF == 2 else _PRELUDE + _PRELUDE_N
        if warp_stage:
            prelude = _PRELUDE + _PRELUDE_COMMIT
    if threads is None:
        threads = THREADS.get(HG, 128)
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32, i64 = T.bfloat16, T.float32, T.int32, T.int64
    log2e = contract.LOG2E

    @T.prim_func
    def sparse_mla_bwd(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        Lse2: T.Tensor([batch, seq_len, heads], f32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        Rows: T.Tensor([n_rows], i32),
        Fx: T.Tensor([1], f32),
        dQ: T.Tensor([batch, seq_len, heads, dqk], bf16),
        Acc: T.Tensor([batch, seq_kv, dqk], i64),
        sm_scale: f32,
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=threads, prelude=prelude) as (bx, by, bz):
            QdO_shared = T.alloc_shared([M2, D], bf16)
            QtZ_shared = T.alloc_shared([M2, TA], bf16)
            KV_shared = T.alloc_shared([BI, D], bf16)
            KVt_shared = T.alloc_shared([BI, TA], bf16)
            SP_shared = T.alloc_shared([M2, BI], f32)  # P (rows < HG) and dP - Delta (rows >= HG)
            PdS_shared = T.alloc_shared([M2, BI], bf16)  # dS (rows < HG) and P (rows >= HG)
            dS_shared = T.alloc_shared([HG, BI], bf16)
            idx_shared = T.alloc_shared([BI], i32)
            stage = T.alloc_shared([NBUF, R, dqk] if (bulk and not WS) else [1, 1, 2], i64)
            stage_w = T.alloc_shared([NW, RW, SW] if WS else [1, 1, 2], i64)

            acc_sp = T.alloc_fragment([M2, BI], f32)
            acc_dq = T.alloc_fragment([HG, D], f32)
            acc_dq_t = T.alloc_fragment([HG, TA], f32)
            acc_dkv = T.alloc_fragment([BI, D], f32)
            acc_dkv_t = T.alloc_fragment([BI, TA], f32)
            bias_f = T.alloc_fragment([M2], f32)  # kernel lse (rows < HG), Delta (rows >= HG)

            b_i = by
            s_i = Rows[bx]
            h0 = bz * HG
            fx = Fx[0]
            tx = T.get_thread_binding()
            c2 = sm_scale * log2e
            n_valid = T.min(TopkLen[b_i, s_i], topk)

            # padded heads: zero q and dO, Delta 0, lse +inf -> P = dS = 0; rows h0 + h >= heads never touched
            for r, d in T.Parallel(M2, D):
                QdO_shared[r, d] = T.if_then_else(
                    h0 + r % HG < heads,
                    T.if_then_else(r < HG, Q[b_i, s_i, h0 + r % HG, d], dO[b_i, s_i, h0 + r % HG, d]),
                    T.cast(0, bf16))
            if tail > 0:
                for r, d in T.Parallel(M2, tail):
                    QtZ_shared[r, d] = T.if_then_else(T.And(r < HG, h0 + r % HG < heads),
                                                      Q[b_i, s_i, h0 + r % HG, D + d], T.cast(0, bf16))
            for r in T.Parallel(M2):
                bias_f[r] = T.if_then_else(
                    h0 + r % HG < heads,
                    T.if_then_else(r < HG, Lse2[b_i, s_i, h0 + r % HG], Delta[b_i, s_i, h0 + r % HG]),
                    T.if_then_else(r < HG, T.infinity(f32), 0.0))
            T.clear(acc_dq)
            if tail > 0:
                T.clear(acc_dq_t)

            n_blk = T.ceildiv(n_valid, BI)
            for kb in T.serial(n_blk):
                if WS:
                    # previous block's readers of idx / KV / SP / dS / PdS are done; first block: q, dO loaded
                    T.sync_threads()
                # validity by the contract's rule; an invalid slot keeps -1 and its row is zero-filled
                for j in T.Parallel(BI):
                    idx_shared[j] = T.if_then_else(kb * BI + j < n_valid, Indices[b_i, s_i, kb * BI + j], -1)
                for j in T.Parallel(BI):
                    idx_shared[j] = T.if_then_else(T.And(idx_shared[j] >= 0, idx_shared[j] < seq_kv),
                                                   idx_shared[j], -1)
                if WS:
                    T.sync_threads()
                if do_gather:
                    for j, d in T.Parallel(BI, D):
                        KV_shared[j, d] = T.if_then_else(idx_shared[j] >= 0, KV[b_i, idx_shared[j], d],
                                                         T.cast(0, bf16))
                    if tail > 0:
                        for j, d in T.Parallel(BI, tail):
                            KVt_shared[j, d] = T.if_then_else(idx_shared[j] >= 0, KV[b_i, idx_shared[j], D + d],
                                                              T.cast(0, bf16))

                if WS:
                    T.sync_threads()
                # scores and dP in one product: [Q; dO] K^T (+ [Qt; 0] Kt^T)
                T.gemm(QdO_shared, KV_shared, acc_sp, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullRow)
                if tail > 0:
                    T.gemm(QtZ_shared, KVt_shared, acc_sp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for r, j in T.Parallel(M2, BI):
                    SP_shared[r, j] = T.if_then_else(
                        r < HG,
                        T.if_then_else(idx_shared[j] >= 0, T.exp2(acc_sp[r, j] * c2 - bias_f[r]), 0.0),
                        acc_sp[r, j] - bias_f[r])
                if WS:
                    T.sync_threads()
                for h, j in T.Parallel(HG, BI):
                    dS_shared[h, j] = T.cast(SP_shared[h, j] * SP_shared[HG + h, j] * sm_scale, bf16)
                    PdS_shared[h, j] = T.cast(SP_shared[h, j] * SP_shared[HG + h, j] * sm_scale, bf16)
                    PdS_shared[HG + h, j] = T.cast(SP_shared[h, j], bf16)
                if WS:
                    T.fence_proxy_async()
                    T.sync_threads()

                T.gemm(dS_shared, KV_shared, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                if tail > 0:
                    T.gemm(dS_shared, KVt_shared, acc_dq_t, policy=T.GemmWarpPolicy.FullCol)
                if do_dkv:
                    # dkv = [dS; P]^T [Q; dO]; tail [dS; P]^T [Qt; 0] = dS^T Qt
                    T.gemm(PdS_shared, QdO_shared, acc_dkv, transpose_A=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol)
                    if tail > 0:
                        T.gemm(PdS_shared, QtZ_shared, acc_dkv_t, transpose_A=True, clear_accum=True,
                               policy=T.GemmWarpPolicy.FullCol)

                    # exact, order-free accumulation: one rounding to 2**-F, then int64 adds (valid slots only)
                    if WS:
                        # per-warp staging: warp w stages the dkv columns its own mma fragment holds and its
                        # lanes send them; only warp-level barriers, so no warp waits for another's reduction
                        for r in T.serial(BI // RW):
                            if tx % 32 < NL:
                                # this lane's previous bulk op has finished reading the warp's staging
                                T.call_extern("handle", "smqa_bulk_wait_read0")
                            T.sync_warp()
                            for j, d in T.Parallel(BI, D):
                                if T.And(j // RW == r, d // WN == tx // 32):
                                    stage_w[d // WN, j % RW, d % WN] = T.cast(T.round(acc_dkv[j, d] * fx), i64)
                            if tail > 0:
                                for j, d in T.Parallel(BI, tail):
                                    if T.And(j // RW == r, d // WT == tx // 32):
                                        stage_w[d // WT, j % RW, WN + d % WT] = T.cast(
                                            T.round(acc_dkv_t[j, d] * fx), i64)
                            T.fence_proxy_async()
                            T.sync_warp()
                            if tx % 32 < RW:
                                if do_reduce:
                                    if idx_shared[r * RW + tx % 32] >= 0:
                                        T.call_extern("handle", "smqa_bulk_add_u64",
                                                      T.address_of(stage_w[tx // 32, tx % 32, 0]),
                                                      T.address_of(Acc[b_i, idx_shared[r * RW + tx % 32],
                                                                       (tx // 32) * WN]), WN * 8)
                                T.call_extern("handle", "smqa_bulk_commit")
                            elif tx % 32 < NL:
                                if do_reduce:
                                    if idx_shared[r * RW + tx % 32 - RW] >= 0:
                                        T.call_extern("handle", "smqa_bulk_add_u64",
                                                      T.address_of(stage_w[tx // 32, tx % 32 - RW, WN]),
                                                      T.address_of(Acc[b_i, idx_shared[r * RW + tx % 32 - RW],
                                                                       D + (tx // 32) * WT]), WT * 8)
                                T.call_extern("handle", "smqa_bulk_commit")
                    elif bulk:
                        for r in T.serial(NR):
                            # staging buffers rotate over the rounds of all blocks; a buffer is rewritten only
                            # after the bulk group that read it last retired (wait below, then the barrier)
                            bsel = r % 2 if NBUF == 2 else (kb * NR + r) % NBUF
                            for j, d in T.Parallel(BI, D):
                                if j // R == r:
                                    stage[bsel, j % R, d] = T.cast(T.round(acc_dkv[j, d] * fx), i64)
                            if tail > 0:
                                for j, d in T.Parallel(BI, tail):
                                    if j // R == r:
                                        stage[bsel, j % R, D + d] = T.cast(T.round(acc_dkv_t[j, d] * fx), i64)
                            T.fence_proxy_async()
                            T.sync_threads()
                            if tx < R:
                                if do_reduce:
                                    if idx_shared[r * R + tx] >= 0:
                                        T.call_extern("handle", "smqa_bulk_add_u64",
                                                      T.address_of(stage[bsel, tx, 0]),
                                                      T.address_of(Acc[b_i, idx_shared[r * R + tx], 0]), dqk * 8)
                                T.call_extern("handle", wait_fn)
                            T.sync_threads()
                        if drain:
                            # the staging may share memory with the next block's tiles: no read may stay in flight
                            if tx < R:
                                T.call_extern("handle", "smqa_bulk_wait_read0")
                            T.sync_threads()
                    else:
                        for j, d in T.Parallel(BI, D):
                            if idx_shared[j] >= 0:
                                T.atomic_add(Acc[b_i, idx_shared[j], d], T.cast(T.round(acc_dkv[j, d] * fx), i64))
                        if tail > 0:
                            for j, d in T.Parallel(BI, tail):
                                if idx_shared[j] >= 0:
                                    T.atomic_add(Acc[b_i, idx_shared[j], D + d],
                                                 T.cast(T.round(acc_dkv_t[j, d] * fx), i64))

            for h, d in T.Parallel(HG, D):
                if h0 + h < heads:
                    dQ[b_i, s_i, h0 + h, d] = T.cast(acc_dq[h, d], bf16)
            if tail > 0:
                for h, d in T.Parallel(HG, tail):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, D + d] = T.cast(acc_dq_t[h, d], bf16)
            if WS:
                if tx % 32 < NL:
                    T.call_extern("handle", "smqa_bulk_wait_all")
            elif bulk:
                if tx < R:
                    T.call_extern("handle", "smqa_bulk_wait_all")

    return sparse_mla_bwd


@functools.lru_cache(maxsize=None)
def compiled(variant: tuple, reduce: str = REDUCE, stage_rows: int = STAGE_ROWS, threads: int | None = None,
             prefetch: bool = PREFETCH, fused: bool = FUSED, drain: bool = DRAIN, stage_bufs: int = 2,
             _ablate: str = "", warp_stage: bool = False):
    """The compiled kernel of one variant (TileLang's disk cache under TILELANG_CACHE_DIR makes reloads cheap)."""
    import tilelang

    program = build_program(variant, reduce, stage_rows, threads, prefetch, fused, drain, stage_bufs, _ablate,
                            warp_stage)
    return tilelang.compile(program, out_idx=None, target=TARGET,
                            pass_configs=_pass_configs(prefetch and not fused, fused and warp_stage))


def kernel_source(variant: tuple, reduce: str = REDUCE, stage_rows: int = STAGE_ROWS,
                  threads: int | None = None, prefetch: bool = PREFETCH, fused: bool = FUSED,
                  drain: bool = DRAIN, stage_bufs: int = 2, _ablate: str = "", warp_stage: bool = False) -> str:
    return compiled(variant, reduce, stage_rows, threads, prefetch, fused, drain, stage_bufs,
                    _ablate, warp_stage).get_kernel_source()


def precompile() -> list[str]:
    """Compile every variant the plan can produce into the current TILELANG_CACHE_DIR, for sm_90a."""
    out = []
    for v in bwd_plan.variants(contract.KERNEL_DIMS):
        compiled(v)
        out.append("sparse_mla_bwd Dqk={} Dv={} head_group={} topk_block={}".format(*v))
    return out


def _fixed_point_scale(q, kv, grad_out, sm_scale, d_v):
    """2**F and F as device tensors (float32, int) from ``model.dkv_bound``'s formula, without a host sync."""
    import torch

    kvf = kv[..., :d_v].float()
    vnorm = kvf.mul(kvf).sum(-1).sqrt()
    vmax = torch.where(torch.isfinite(vnorm), vnorm, torch.zeros_like(vnorm)).amax()
    gof = grad_out.float()
    qmax = q.float().abs().amax(-1)
    gnorm = gof.mul(gof).sum(-1).sqrt()
    gmax = gof.abs().amax(-1)
    per = (abs(sm_scale) * bwd_plan.DS_BOUND_FACTOR) * vmax * qmax * gnorm + gmax
    G = per.sum()
    e = torch.ceil(torch.log2(G))
    F = (bwd_plan.ACC_BITS - bwd_plan.HEADROOM_BITS) - e
    F = torch.clamp(F, bwd_plan.F_MIN, bwd_plan.F_MAX)
    F = torch.where(G == 0, torch.full_like(F, bwd_plan.F_MAX), F)
    F = torch.where(torch.isfinite(G), F, torch.zeros_like(F))
    return torch.exp2(F).reshape(1).float(), F


def _kernel_lse(lse, attn_sink):
    import torch

    if attn_sink is None:
        return lse * contract.LOG2E
    sink = attn_sink.view(1, 1, -1).expand_as(lse)
    folded = torch.logaddexp(lse, sink)
    folded = torch.where(torch.isposinf(lse) | torch.isposinf(sink), torch.full_like(lse, float("inf")), folded)
    return folded * contract.LOG2E


def _sink_probability(lse, attn_sink):
    import torch

    sink = attn_sink.view(1, 1, -1).expand_as(lse)
    p = torch.exp(sink - torch.logaddexp(lse, sink))
    p = torch.where(torch.isposinf(sink), torch.ones_like(p), p)
    return torch.where(torch.isposinf(lse) & ~torch.isposinf(sink), torch.zeros_like(p), p)


def sparse_mla_backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None,
                        max_query_chunk: int = bwd_plan.MAX_QUERY_CHUNK, reduce: str = REDUCE,
                        stage_rows: int = STAGE_ROWS, threads: int | None = None, topk_block: int | None = None,
                        prefetch: bool = PREFETCH, fused: bool = FUSED, drain: bool = DRAIN, stage_bufs: int = 2,
                        _ablate: str = "", warp_stage: bool = False):
    """Contract backward on the GPU: ``(dq bf16, dkv bf16, d_sink fp32 or None)``, bitwise deterministic.

    Arguments are validated (shapes, kernel dtypes, device, supported dims) before any GPU work. The keyword
    arguments after ``topk_length`` select kernel configurations (module docstring; all give the same bits);
    ``_ablate`` leaves work out for timing attribution only and gives wrong results.
    """
    import torch

    dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length,
                               supported_dims=contract.KERNEL_DIMS, device_type="cuda")
    sm_scale = float(sm_scale)
    plan = bwd_plan.make_plan(dims.B, dims.S, dims.Skv, dims.H, dims.L, dims.Dqk, dims.Dv,
                              max_query_chunk=max_query_chunk, topk_block=topk_block)
    kernel = compiled(plan.variant, reduce, stage_rows, threads, prefetch, fused, drain, stage_bufs, _ablate,
                      warp_stage)
    dev = q.device
    q, kv, out, grad_out, lse, indices = (t.contiguous() for t in (q, kv, out, grad_out, lse, indices))
    with torch.cuda.device(dev):
        if topk_length is None:
            tl = torch.full((dims.B, dims.S), dims.L, dtype=torch.int32, device=dev)
        else:
            tl = topk_length.contiguous()
        delta = (out.float() * grad_out.float()).sum(-1)  # [B, S, H]
        lse2 = _kernel_lse(lse, attn_sink).contiguous()
        fx, F = _fixed_point_scale(q, kv, grad_out, sm_scale, dims.Dv)
        acc = torch.zeros((dims.B, dims.Skv, dims.Dqk), dtype=torch.int64, device=dev)
        dq = torch.empty((dims.B, dims.S, dims.H, dims.Dqk), dtype=torch.bfloat16, device=dev)
        partials = []
        ps = _sink_probability(lse, attn_sink) if attn_sink is not None else None
        for chunk in plan.chunks():
            rows = torch.arange(chunk.start, chunk.stop, dtype=torch.int32, device=dev)
            kernel(q, kv, grad_out, indices, tl, lse2, delta, rows, fx, dq, acc, sm_scale)
            if ps is not None:
                partials.append((ps[:, chunk.start:chunk.stop] * delta[:, chunk.start:chunk.stop]).sum((0, 1)))
        dkv = (acc.double() * torch.exp2(-F.double())).to(torch.bfloat16)
        d_sink = None
        if ps is not None:
            d_sink = -torch.stack(partials).sum(0)  # fixed order over chunks
    return dq, dkv, d_sink
