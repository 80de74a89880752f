"""Probe: the deterministic backward's compute path in cuDNN's SM90 shape, in TileLang (issue 26, lead 2).

    PYTHONUNBUFFERED=1 python benchmarks/probe_wide_backward.py [anchor l512 h128]   # on the GPU
    python benchmarks/probe_wide_backward.py                  # no GPU: compile for sm_90a only

One block = one query row x 64 heads, 256 threads, two warpgroups and no producer: WG0 gathers a 64-slot block of
KV rows (cp.async), runs S = Q K^T and dP = dO V^T (N = 64), P and dS, and dq[:, :256]; WG1 runs dq[:, 256:] and
dkv in 9 chunks of [64 slots x 64 columns] (M = slots). dkv is computed but not reduced: the probe times the products
and the gather, beside today's kernel (``sparse_mqa_kernels.backward``) on the same inputs; the reduction floors are
``bench_reduce.py``'s. dq is real, and compared bit for bit with today's kernel's.
"""
import statistics
import sys

import torch

from sparse_mqa_testkit import contract

C = 64  # dkv chunk columns
BI = 64  # top-k slots per block


def build_program(dqk=576, dv=512, n0=256):
    import tilelang.language as T

    HG, D = 64, dv
    NCH = dqk // C
    N1 = dqk - n0
    ROWS_PER_PASS = 16
    PASSES = BI // ROWS_PER_PASS
    CHUNKS = dqk // 64
    Q_CHUNKS, O_CHUNKS = HG * (dqk // 8), HG * (D // 8)
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
        sm_scale: f32,
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=256) as (bx, by, bz):
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
            acc_kv = T.alloc_fragment([BI, C], f32)
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
            for i in T.serial(T.ceildiv(Q_CHUNKS, 256)):
                c = i * 256 + tx
                if c < Q_CHUNKS:
                    for v in T.vectorized(8):
                        Q_shared[c // (dqk // 8), (c % (dqk // 8)) * 8 + v] = T.if_then_else(
                            h0 + c // (dqk // 8) < heads, Q[b_i, s_i, h0 + c // (dqk // 8), (c % (dqk // 8)) * 8 + v],
                            T.cast(0, bf16))
            for i in T.serial(T.ceildiv(O_CHUNKS, 256)):
                c = i * 256 + tx
                if c < O_CHUNKS:
                    for v in T.vectorized(8):
                        dO_shared[c // (D // 8), (c % (D // 8)) * 8 + v] = T.if_then_else(
                            h0 + c // (D // 8) < heads, dO[b_i, s_i, h0 + c // (D // 8), (c % (D // 8)) * 8 + v],
                            T.cast(0, bf16))
            for i in T.serial(T.ceildiv(BI * (dqk // 8), 256)):
                c = i * 256 + tx
                if c < BI * (dqk // 8):
                    for v in T.vectorized(8):
                        KV_shared[c // (dqk // 8), (c % (dqk // 8)) * 8 + v] = T.cast(0, bf16)
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
                    T.barrier_arrive(bar_k_free)
                    for c in T.unroll(NCH):
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
                    T.barrier_arrive(bar_pds_free)
                for h, d in T.Parallel(HG, N1):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, n0 + d] = T.cast(acc_dq1[h, d], bf16)

    return wide_bwd


def compiled():
    import tilelang

    from sparse_mqa_kernels.target import EXECUTION_BACKEND, TARGET
    return tilelang.compile(build_program(), out_idx=None, target=TARGET, execution_backend=EXECUTION_BACKEND)


def timed(fn, iters=10):
    ts = []
    for _ in range(iters + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[2:])


def main():
    k = compiled()
    if not torch.cuda.is_available():
        print("compiled for sm_90a (no GPU here: nothing timed)")
        return
    from sparse_mqa_kernels import backward, bwd_plan, forward
    from sparse_mqa_kernels.bench.shapes import PRESETS, make_inputs
    for name in sys.argv[1:] or ["anchor", "l512", "h128"]:
        x = make_inputs(PRESETS[name], "cuda", seed=0, sink=True)
        q, kv, go, idx, sink, sm = x["q"], x["kv"], x["grad_out"], x["indices"], x["attn_sink"], x["sm_scale"]
        out, lse = forward.sparse_mqa_forward(q, kv, idx, sm, 512, attn_sink=sink)
        B, S, H, _ = q.shape
        plan = bwd_plan.make_plan(B, S, kv.shape[1], H, idx.shape[-1], 576, 512)
        tl = torch.full((B, S), idx.shape[-1], dtype=torch.int32, device="cuda")
        delta, fx, F = backward._prep(q, kv, out, go, lse, sink, idx, tl, sm, 512)
        lse2 = contract.lse_to_base2(lse, sink).contiguous()
        rows = torch.arange(S, dtype=torch.int32, device="cuda")
        acc = torch.zeros((B, kv.shape[1], 576), dtype=torch.int64, device="cuda")
        dq_ref = torch.empty_like(q)
        dq = torch.empty_like(q)
        keep = torch.zeros((B, 576), dtype=torch.float32, device="cuda")
        k64 = backward.compiled(plan.key())
        t_ref = timed(lambda: k64(q, kv, go, idx, tl, lse2, delta, rows, fx, dq_ref, acc, sm))
        t_probe = timed(lambda: k(q, kv, go, idx, tl, lse2, delta, rows, dq, keep, sm))
        err = ((dq.float() - dq_ref.float()).norm() / dq_ref.float().norm()).item()
        print(f"{name}: kernel today {t_ref:.3f} ms, probe (dkv not reduced) {t_probe:.3f} ms; "
              f"dq bitwise equal {torch.equal(dq, dq_ref)} (rel. L2 diff {err:.2e})", flush=True)

if __name__ == "__main__":
    main()
