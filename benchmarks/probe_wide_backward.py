"""Probe: the deterministic backward in cuDNN's SM90 shape, in TileLang (issue 26): its compute path, and ways to
reduce its dkv exactly.

    PYTHONUNBUFFERED=1 python benchmarks/probe_wide_backward.py [anchor l512 h128] [--variants 64/none,48/bulk]
    python benchmarks/probe_wide_backward.py          # no GPU: compile every variant for sm_90a, time nothing

One block = one query row x 64 heads, 256 threads, two warpgroups and no producer: WG0 gathers a block of ``BI``
KV rows (cp.async), runs S = Q K^T and dP = dO V^T (N = BI), P and dS, and dq[:, :256]; WG1 runs dq[:, 256:] and
dkv in 9 chunks of 64 columns. At BI = 64 (cuDNN's tiles) dkv's chunks are [64 slots x 64 columns] and shared memory
is full (224.25 of 227 KiB); below 64 they are dkv^T's [64 columns x BI slots] (wgmma's M is 64) and the room left
holds an int32 staging buffer. A variant ``BI/mode``:

- ``none``: dkv computed, not reduced (the compute path);
- ``stage``: and each chunk rounded to int32 with its KV row's scale (held in registers) into shared memory;
- ``bulk``: and sent with ``cp.reduce.async.bulk .add.u32``, one 256-byte op per slot and chunk;
- ``line``: and sent with ``red.global.add.u32``, 32 lanes on one row's 128 bytes, by WG1 after each chunk;
- ``batched``: as ``line``, chunk c + 1's products in flight (async wgmma, two accumulators) while c is sent, and
  each warp's rows sent by one helper (``smqa_send_rows``): its loads first, then its reds;
- ``ws``: the ``tilelang`` backend's 64-head main kernel (``sparse_mqa_kernels.backward_ws``, 48 slots a block): a
  third warpgroup sends, each block's rows and scales read during the block before, q and dO by cp.async. It grew
  here as ``sender``, ``sender2`` and ``sender4`` (BENCHMARKS.md) and runs here beside the other variants.

Send paths measured and dropped (BENCHMARKS.md, 2026-12-01 17:59-18:31 UTC, at commit 2f9abda): an unrolled ``line``
without the memory clobber, a sender that forms row pointers every chunk, staging in an opaque helper, a 288 / 288 dq
split with two chunks in flight; and (19:49 UTC, at commit d0bce4a) ``sender3``, WG0 issuing the first block's copies
while the other warpgroups load q and dO: slower.

The single-role kernel (``sparse_mqa_kernels.backward``'s body for any head group, int64 sums with one F a call: the
probe's first reference, and the 64-head path's until the row-scaled kernel replaced it) runs beside it on the same
inputs. dq is compared bit for bit with its dq; a sending variant's dkv is compared with its exact dkv, with per-row
scales taken from that (its largest entry at 2**23, 8 bits below int32's 2**31 for partial sums; the bound pass that
would bound each row is not here).
"""
import argparse
import statistics
from types import SimpleNamespace

import torch

from sparse_mqa_kernels.backward import PRELUDE as _BACKWARD_PRELUDE
from sparse_mqa_kernels.bench.ptx import PRELUDE_4B
from sparse_mqa_testkit import contract

C = 64  # dkv chunk columns

# the 4-byte reductions and bulk-group waits come from the backward's and the benchmarks' preludes; below, the
# probes' own send helper
PRELUDE = _BACKWARD_PRELUDE + PRELUDE_4B + r"""
// one warp sends N staged rows (row i at stage + i * W) of a 64-column chunk, two 128-byte lines each, to the
// accumulator rows rows[i] (acc: row 0 at the chunk's first column; a negative row is skipped): loads first
template <int N, int W, int D>
__device__ __forceinline__ void smqa_send_rows(const int* stage, const int* rows, int* acc, int lane) {
  int r[N], v0[N], v1[N];
  #pragma unroll
  for (int i = 0; i < N; ++i) {
    r[i] = rows[i];
    v0[i] = stage[i * W + lane];
    v1[i] = stage[i * W + 32 + lane];
  }
  #pragma unroll
  for (int i = 0; i < N; ++i) {
    int* p = acc + static_cast<long long>(r[i] < 0 ? 0 : r[i]) * D + lane;
    if (r[i] >= 0) {
      asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v0[i]));
      asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p + 32), "r"(v1[i]));
    }
  }
}
"""


def query_tiles(T, dqk: int, dv: int, HG: int = 64, threads: int = 256):
    """Two T.macro pieces the probes' kernels share: ``load_query`` puts one query's q and dO rows of a head group
    into shared memory, 16 bytes a thread, padded heads as zero (q only when ``dv`` is 0); ``zero_rows`` zeroes a
    [rows x dqk] tile (a KV block starts at zero, so a slot never gathered holds finite values).
    The loads go through registers, two to four in flight a thread (``backward_ws.query_tiles`` copies them by TMA)."""
    bf16 = T.bfloat16

    def rows_loader(D: int):
        CHUNKS = HG * (D // 8)

        @T.macro
        def load_rows(src, dst, b_i, s_i, h0, heads, tx):
            # the group's HG rows of D columns, 16 bytes a thread; rows past H as zero
            for i in T.serial(T.ceildiv(CHUNKS, threads)):
                c = i * threads + tx
                if c < CHUNKS:
                    for v in T.vectorized(8):
                        dst[c // (D // 8), (c % (D // 8)) * 8 + v] = T.if_then_else(
                            h0 + c // (D // 8) < heads,
                            src[b_i, s_i, h0 + c // (D // 8), (c % (D // 8)) * 8 + v], T.cast(0, bf16))

        return load_rows

    load_q = rows_loader(dqk)
    load_do = rows_loader(dv) if dv > 0 else None

    @T.macro
    def load_query(Q, dO, Q_shared, dO_shared, b_i, s_i, h0, heads, tx):
        load_q(Q, Q_shared, b_i, s_i, h0, heads, tx)
        if dv > 0:
            load_do(dO, dO_shared, b_i, s_i, h0, heads, tx)

    @T.macro
    def zero_rows(tile, rows, tx):
        for i in T.serial(T.ceildiv(rows * (dqk // 8), threads)):
            c = i * threads + tx
            if c < rows * (dqk // 8):
                for v in T.vectorized(8):
                    tile[c // (dqk // 8), (c % (dqk // 8)) * 8 + v] = T.cast(0, bf16)

    return load_query, zero_rows

def build_program(BI: int, mode: str, dqk=576, dv=512, n0=256):
    import tilelang.language as T

    reds = "none_t" if (mode == "none" and BI < 64) else mode
    if BI not in (32, 48, 64) or mode not in MODES:
        raise ValueError(f"variant {BI}/{mode}: BI is 32, 48 or 64 and mode one of {', '.join(MODES)}")
    if BI == 64 and mode != "none":
        raise ValueError(f"variant 64/{mode}: 64-slot tiles leave no shared memory for staging; use 48 or 32 slots")
    HG, D = 64, dv
    W = C + 4  # staged int32 per row, padded 16 bytes
    NCH = dqk // C
    CHS = tuple(range(NCH))
    N1 = dqk - n0
    ROWS_PER_PASS = 16
    PASSES = BI // ROWS_PER_PASS
    CHUNKS = dqk // 64
    threads = 256
    load_query, zero_rows = query_tiles(T, dqk, dv, HG, threads)
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    log2e = contract.LOG2E

    @T.prim_func
    def wide_bwd(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        Lse2: T.Tensor([batch, seq_len, heads], f32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        Rows: T.Tensor([n_rows], i32),
        dQ: T.Tensor([batch, seq_len, heads, dqk], bf16),
        Keep: T.Tensor([batch, dqk], f32),
        RowScale: T.Tensor([batch, seq_kv], f32),
        Acc: T.Tensor([batch, seq_kv, dqk], i32),
        sm_scale: f32,
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=threads, prelude=PRELUDE) as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, dqk], bf16)
            dO_shared = T.alloc_shared([HG, D], bf16)
            KV_shared = T.alloc_shared([BI, dqk], bf16)
            idx_shared = T.alloc_shared([BI], i32)
            P_shared = T.alloc_shared([HG, BI], bf16)
            dS_shared = T.alloc_shared([HG, BI], bf16)
            acc_s = T.alloc_fragment([HG, BI], f32)
            acc_dp = T.alloc_fragment([HG, BI], f32)
            acc_dq0 = T.alloc_fragment([HG, n0], f32)
            acc_dq1 = T.alloc_fragment([HG, N1], f32)
            if reds == "none":
                acc_kv = T.alloc_fragment([BI, C], f32)
            else:
                acc_kvt = T.alloc_fragment([C, BI], f32)  # dkv^T chunk: M = columns (BI < 64 slots)
                acc_kvt2 = T.alloc_fragment([C, BI], f32)  # batched: the next chunk's, in flight meanwhile
                scale_f = T.alloc_fragment([BI], f32)  # this block's row scales, in registers
                stage = T.alloc_shared([1, BI, W], i32)
                scale_shared = T.alloc_shared([BI], f32)
                scale1_shared = T.alloc_shared([BI], f32)  # WG1's copy: WG0 rewrites scale_shared once KV is free
                idx1_shared = T.alloc_shared([BI], i32)
                row_j = T.alloc_var(i32)
            lse_f = T.alloc_fragment([HG], f32)
            delta_f = T.alloc_fragment([HG], f32)
            idx_r = T.alloc_local([PASSES], i32)
            ok = T.alloc_var("bool")
            bar_k_ready = T.alloc_barrier(arrive_count=256)  # 128 cp.async + 128 plain arrivals (WG0)
            bar_k_free = T.alloc_barrier(arrive_count=256)  # both warpgroups done reading KV_shared
            bar_p = T.alloc_barrier(arrive_count=128)  # WG0: P and dS in shared memory
            bar_pds_free = T.alloc_barrier(arrive_count=128)  # WG1: done reading P and dS

            tx = T.get_thread_binding()
            b_i, s_i, h0 = by, Rows[bx], bz * HG
            c2 = sm_scale * log2e
            n_valid = T.max(T.min(TopkLen[b_i, s_i], topk), 0)
            n_blk = T.ceildiv(n_valid, BI)
            load_query(Q, dO, Q_shared, dO_shared, b_i, s_i, h0, heads, tx)
            zero_rows(KV_shared, BI, tx)
            T.fence_proxy_async()
            T.sync_threads()

            if tx < 128:
                for h in T.Parallel(HG):
                    lse_f[h] = T.if_then_else(h0 + h < heads, Lse2[b_i, s_i, h0 + h], T.infinity(f32))
                    delta_f[h] = T.if_then_else(h0 + h < heads, Delta[b_i, s_i, h0 + h], 0.0)
                T.clear(acc_dq0)
                p = tx
                for kb in T.serial(n_blk):
                    for r in T.unroll(PASSES):
                        idx_r[r] = -1
                        if kb * BI + r * ROWS_PER_PASS + p // 8 < n_valid:
                            idx_r[r] = Indices[b_i, s_i, kb * BI + r * ROWS_PER_PASS + p // 8]
                    if kb > 0:
                        T.barrier_wait(bar_k_free, (kb - 1) & 1)
                    for r in T.unroll(PASSES):
                        row = r * ROWS_PER_PASS + p // 8
                        ok = T.And(kb * BI + row < n_valid, T.And(idx_r[r] >= 0, idx_r[r] < seq_kv))
                        if p % 8 == 0:
                            idx_shared[row] = T.if_then_else(ok, idx_r[r], -1)
                            if reds != "none":
                                scale_shared[row] = T.if_then_else(ok, RowScale[b_i, idx_r[r]], 0.0)
                        if ok:
                            for u in T.serial(CHUNKS):
                                T.ptx_cp_async(
                                    T.access_ptr(KV_shared[row, 64 * u + (p % 8) * 8], "w", 8),
                                    T.access_ptr(KV[b_i, idx_r[r], 64 * u + (p % 8) * 8], "r", 8),
                                    8,
                                )
                    T.cp_async_barrier_noinc(bar_k_ready)
                    T.barrier_arrive(bar_k_ready)
                    T.barrier_wait(bar_k_ready, kb & 1)
                    T.wgmma_gemm(Q_shared, KV_shared, acc_s, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(dO_shared, KV_shared[:, 0:D], acc_dp, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    for h, j in T.Parallel(HG, BI):
                        acc_s[h, j] = T.if_then_else(idx_shared[j] >= 0, T.exp2(acc_s[h, j] * c2 - lse_f[h]), 0.0)
                    for h, j in T.Parallel(HG, BI):
                        acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_f[h]) * sm_scale
                    if kb > 0:
                        T.barrier_wait(bar_pds_free, (kb - 1) & 1)
                    T.copy(acc_s, P_shared)
                    T.copy(acc_dp, dS_shared)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_p)
                    T.gemm(dS_shared, KV_shared[:, 0:n0], acc_dq0)
                    T.barrier_arrive(bar_k_free)
                for h, d in T.Parallel(HG, n0):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, d] = T.cast(acc_dq0[h, d], bf16)
            else:
                T.clear(acc_dq1)
                for kb in T.serial(n_blk):
                    T.barrier_wait(bar_p, kb & 1)
                    T.gemm(dS_shared, KV_shared[:, n0:dqk], acc_dq1)
                    if reds != "none":
                        # this block's rows and scales, read before WG0 may gather the next block
                        if tx - 128 < BI:
                            row_j = idx_shared[tx - 128]
                            scale1_shared[tx - 128] = scale_shared[tx - 128]
                            idx1_shared[tx - 128] = idx_shared[tx - 128]
                        if reds != "none_t":
                            for j in T.Parallel(BI):
                                scale_f[j] = scale_shared[j]
                    T.barrier_arrive(bar_k_free)
                    if reds == "batched":
                        # chunk c + 1's products run on the tensor cores while chunk c is staged and sent
                        T.wgmma_gemm(Q_shared[:, 0:C], dS_shared, acc_kvt, transpose_A=True, clear_accum=True)
                        T.wgmma_gemm(dO_shared[:, 0:C], P_shared, acc_kvt, transpose_A=True)
                        for c in CHS:
                            if c + 1 < NCH:
                                if c % 2 == 0:
                                    T.wgmma_gemm(Q_shared[:, (c + 1) * C:(c + 2) * C], dS_shared, acc_kvt2,
                                                 transpose_A=True, clear_accum=True)
                                    if (c + 1) * C < D:
                                        T.wgmma_gemm(dO_shared[:, (c + 1) * C:(c + 2) * C], P_shared, acc_kvt2,
                                                     transpose_A=True)
                                else:
                                    T.wgmma_gemm(Q_shared[:, (c + 1) * C:(c + 2) * C], dS_shared, acc_kvt,
                                                 transpose_A=True, clear_accum=True)
                                    if (c + 1) * C < D:
                                        T.wgmma_gemm(dO_shared[:, (c + 1) * C:(c + 2) * C], P_shared, acc_kvt,
                                                     transpose_A=True)
                                T.wait_wgmma(2 if (c + 1) * C < D else 1)
                            else:
                                T.wait_wgmma(0)
                            T.sync_threads(14, 128)  # the previous chunk's rows have been read
                            if c % 2 == 0:
                                for d, j in T.Parallel(C, BI):
                                    stage[0, j, d] = T.cast(T.round(acc_kvt[d, j] * scale_f[j]), i32)
                            else:
                                for d, j in T.Parallel(C, BI):
                                    stage[0, j, d] = T.cast(T.round(acc_kvt2[d, j] * scale_f[j]), i32)
                            T.sync_threads(14, 128)
                            # warp w sends rows [RW w, RW (w + 1)): all loads first, then the reds
                            T.call_extern("handle", f"smqa_send_rows<{BI // 4}, {W}, {dqk}>",
                                          T.address_of(stage[0, (tx - 128) // 32 * (BI // 4), 0]),
                                          T.address_of(idx1_shared[(tx - 128) // 32 * (BI // 4)]),
                                          T.address_of(Acc[b_i, 0, c * C]), tx % 32)
                    for c in T.unroll(0 if reds == "batched" else NCH):
                        if reds == "none":
                            if c * C < D:
                                T.gemm(P_shared, dO_shared[:, c * C:(c + 1) * C], acc_kv, transpose_A=True,
                                       clear_accum=True)
                                T.gemm(dS_shared, Q_shared[:, c * C:(c + 1) * C], acc_kv, transpose_A=True)
                            else:
                                T.gemm(dS_shared, Q_shared[:, c * C:(c + 1) * C], acc_kv, transpose_A=True,
                                       clear_accum=True)
                            # keeps the chunk's product alive without moving its bytes (the probe times compute)
                            for j, d in T.Parallel(BI, C):
                                if acc_kv[j, d] == 1.0e30:
                                    Keep[b_i, c * C + d] = acc_kv[j, d]
                        else:
                            T.gemm(Q_shared[:, c * C:(c + 1) * C], dS_shared, acc_kvt, transpose_A=True,
                                   clear_accum=True)
                            if c * C < D:
                                T.gemm(dO_shared[:, c * C:(c + 1) * C], P_shared, acc_kvt, transpose_A=True)
                        if reds == "none_t":
                            for d, j in T.Parallel(C, BI):
                                if acc_kvt[d, j] == 1.0e30:
                                    Keep[b_i, c * C + d] = acc_kvt[d, j]
                        if reds == "stage":  # timing only: the stores, without the barriers a send needs
                            for d, j in T.Parallel(C, BI):
                                stage[0, j, d] = T.cast(T.round(acc_kvt[d, j] * scale_f[j]), i32)
                        if reds in ("bulk", "line"):
                            # the previous chunk's rows have been read (by the bulk engine, or by this warpgroup)
                            if T.And(tx - 128 < BI, reds == "bulk"):
                                T.call_extern("handle", "sparse_mqa_bulk_wait_read0")
                            T.sync_threads(14, 128)
                            for d, j in T.Parallel(C, BI):
                                stage[0, j, d] = T.cast(T.round(acc_kvt[d, j] * scale_f[j]), i32)
                            if reds == "bulk":
                                T.fence_proxy_async()
                            T.sync_threads(14, 128)
                            if reds == "line":
                                # whole 128-byte lines: warp w sends rows w, w + 4, ...; lane l columns l and 32 + l
                                for r4 in T.serial(BI // 4):
                                    rr = r4 * 4 + (tx - 128) // 32
                                    if idx1_shared[rr] >= 0:
                                        for k2 in T.unroll(C // 32):
                                            T.call_extern("handle", "smqa_red_u32", T.address_of(
                                                Acc[b_i, idx1_shared[rr], c * C + k2 * 32 + tx % 32]),
                                                stage[0, rr, k2 * 32 + tx % 32])
                            elif tx - 128 < BI:
                                if T.And(row_j >= 0, reds == "bulk"):
                                    T.call_extern("handle", "sparse_mqa_bulk_add_u32",
                                                  T.address_of(stage[0, tx - 128, 0]),
                                                  T.address_of(Acc[b_i, row_j, c * C]), C * 4)
                                T.call_extern("handle", "sparse_mqa_bulk_commit")
                    T.barrier_arrive(bar_pds_free)
                for h, d in T.Parallel(HG, N1):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, n0 + d] = T.cast(acc_dq1[h, d], bf16)
                if reds != "none":
                    if tx - 128 < BI:
                        T.call_extern("handle", "sparse_mqa_bulk_wait_all")
    return wide_bwd


MODES = ("none", "stage", "bulk", "line", "batched")
VARIANTS = ("64/none", "48/none", "48/stage", "48/bulk", "48/line", "32/bulk", "48/batched", "48/ws")


def compiled(variant: str, dims=(576, 512)):
    """A variant's kernel, called as the probe's: (Q, KV, dO, Indices, TopkLen, Lse2, Delta, Rows, dQ, Keep, RowScale,
    Acc, sm_scale). ``48/ws`` is the ``tilelang`` backend's main kernel (no Keep; its own argument order)."""
    import tilelang

    from sparse_mqa_kernels.target import EXECUTION_BACKEND, TARGET
    bi, mode = variant.split("/")
    if mode == "ws":
        from sparse_mqa_kernels import backward, bwd_plan

        if int(bi) != bwd_plan.TOPK_BLOCKS[64]:
            raise ValueError(f"variant {variant}: the tilelang backend's main kernel takes {bwd_plan.TOPK_BLOCKS[64]} "
                             "slots a block")
        k = backward.compiled(bwd_plan.VariantKey(*dims, 64, int(bi)))

        def ws(q, kv, go, idx, tl, lse2, delta, rows, dq, keep, scale, acc, sm):  # forms P and dS itself
            k(q, kv, go, idx, tl, lse2, delta, rows, scale, dq, acc, q.view(-1), sm, 0)

        ws.get_kernel_source = k.get_kernel_source
        return ws
    return tilelang.compile(build_program(int(bi), mode, *dims), out_idx=None, target=TARGET,
                            execution_backend=EXECUTION_BACKEND)


def time_ms(fn, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after two warm-ups (``sparse-mqa-bench``'s timing)."""
    from sparse_mqa_kernels.bench import timing

    return statistics.median(timing.time_calls(lambda _: fn(), 1, 2, iters, "cuda"))


def today(name: str) -> SimpleNamespace:
    """A bench preset's inputs (finite sink), today's forward and prep on them, the single-role kernel (one scale
    2**F for the call, int64 sums) and its exact dkv in float64 (the accumulator over 2**F, before the bf16
    rounding): what both probes run beside and check against."""
    from sparse_mqa_kernels import backward, bwd_plan, forward
    from sparse_mqa_kernels.bench.shapes import PRESETS, make_inputs

    x = make_inputs(PRESETS[name], "cuda", seed=0, sink=True)
    t = SimpleNamespace(q=x["q"], kv=x["kv"], go=x["grad_out"], idx=x["indices"], sink=x["attn_sink"],
                        sm=x["sm_scale"])
    t.out, t.lse = forward.sparse_mqa_forward(t.q, t.kv, t.idx, t.sm, 512, attn_sink=t.sink)
    B, S, H, Dqk = t.q.shape
    t.L, t.Skv = t.idx.shape[-1], t.kv.shape[1]
    t.tl = torch.full((B, S), t.L, dtype=torch.int32, device="cuda")
    t.rows = torch.arange(S, dtype=torch.int32, device="cuda")
    t.delta, t.fx, _ = backward._prep(t.q, t.kv, t.out, t.go, t.lse, t.sink, t.idx, t.tl, t.sm, 512)
    t.lse2 = contract.lse_to_base2(t.lse, t.sink).contiguous()
    t.kernel = backward.compiled(bwd_plan.make_plan(B, S, t.Skv, H, t.L, Dqk, 512).key(single_role=True))
    t.acc = torch.zeros(B, t.Skv, Dqk, dtype=torch.int64, device="cuda")
    t.dq = torch.empty_like(t.q)
    t.kernel(t.q, t.kv, t.go, t.idx, t.tl, t.lse2, t.delta, t.rows, t.fx, t.dq, t.acc, t.sm)
    t.exact = t.acc.double() / float(t.fx.item())
    return t


def reference_scales(ref):
    """Per-row scales for a check against ``ref`` ([B, Skv, Dqk] float64): each row's largest entry at 2**23 (8 bits
    below int32's 2**31 for partial sums); 0 for an all-zero row. Returns (float32 scales, float64 divisors)."""
    rmax = ref.abs().amax(-1)
    f = 23 - torch.ceil(torch.log2(rmax.clamp_min(1e-300)))
    return (torch.where(rmax > 0, torch.exp2(f), torch.zeros_like(f)).float(),
            torch.where(rmax > 0, torch.exp2(f), torch.ones_like(f)))


def dkv_error(dkv, ref) -> str:
    """Relative L2 error of ``dkv`` against ``ref`` and its worst row (largest |error| over the row's largest entry)."""
    err = ((dkv - ref).norm() / ref.norm()).item()
    worst = ((dkv - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)).max().item()
    return f"rel. L2 {err:.2e}, worst row (max-rel) {worst:.2e}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", default=["anchor", "l512", "h128"], help="sparse-mqa-bench presets")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", default="", help="valid slots a query (topk_length), e.g. 48,96,192,384,768,1536: each "
                   "variant timed at each on the shape's inputs, and a least-squares line ms = fixed + per block x "
                   "blocks, whose fixed part is the per-query cost (prologue, pipeline fill and drain)")
    a = p.parse_args(argv)
    ks = {v: compiled(v) for v in a.variants.split(",")}
    if not torch.cuda.is_available():
        print(f"compiled {', '.join(ks)} for sm_90a (no GPU here: nothing timed)")
        return
    for name in a.shapes:
        t = today(name)
        B, S, H, Dqk = t.q.shape
        dq_ref, dq = t.dq.clone(), torch.empty_like(t.q)
        t_ref = time_ms(lambda: t.kernel(t.q, t.kv, t.go, t.idx, t.tl, t.lse2, t.delta, t.rows, t.fx, dq_ref, t.acc,
                                         t.sm), a.iters)
        print(f"{name}: the single-role kernel {t_ref:.3f} ms", flush=True)
        keep = torch.zeros((B, Dqk), dtype=torch.float32, device="cuda")
        row_scale, divisor = reference_scales(t.exact)
        acc32 = torch.zeros((B, t.Skv, Dqk), dtype=torch.int32, device="cuda")
        for v, k in ks.items():
            def call():
                k(t.q, t.kv, t.go, t.idx, t.tl, t.lse2, t.delta, t.rows, dq, keep, row_scale, acc32, t.sm)
            ms = time_ms(call, a.iters)
            extra = ""
            if v.split("/")[1] in ("bulk", "line", "batched", "ws"):
                acc32.zero_()
                call()
                err = dkv_error(acc32.double() / divisor[..., None], t.exact)
                extra = f"; dkv against the single-role kernel's exact sum: {err}"
            print(f"  probe {v}: {ms:.3f} ms; dq bitwise equal {torch.equal(dq, dq_ref)}{extra}", flush=True)
            if a.sweep:
                sweep(v, call, t, [int(n) for n in a.sweep.split(",")], int(v.split("/")[0]), a.iters)


def sweep(name, call, t, lengths, bi, iters):
    """``call`` timed with each query's valid slots cut to each of ``lengths`` (``t.tl``, restored after), and
    the line through (blocks a query, ms) by least squares."""
    full = t.tl.clone()
    xs, ys = [], []
    for n in lengths:
        t.tl.fill_(n)
        xs.append(-(-n // bi))
        ys.append(time_ms(call, iters))
    t.tl.copy_(full)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"  {name} by valid slots {dict(zip(lengths, (round(y, 3) for y in ys)))}: "
          f"{my - slope * mx:.3f} ms fixed + {slope:.4f} ms a block of {bi} slots", flush=True)


if __name__ == "__main__":
    main()
