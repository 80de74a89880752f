"""Probe (issue 26, design (b) in BENCHMARKS): kernel B of a split backward. Compiled for sm_90a, NOT YET RUN on a GPU.

    PYTHONUNBUFFERED=1 python benchmarks/probe_split_dkv.py [anchor l512 h128] [--bi 32]
    python benchmarks/probe_split_dkv.py           # no GPU: compile for sm_90a only

Kernel A (not here) would gather KV, compute S, dP, P, dS, dq and each KV row's exact bound, and write P and dS in
bf16. Kernel B (this) reads P and dS with q and dO, and reduces dkv exactly: one block = one query x 64 heads, 256
threads; WG0 owns dkv columns [0, 256), WG1 [256, 576); per block of BI slots each computes its dkv^T chunks
([64 columns x BI slots], wgmma M = columns), rounds them to int32 with the slot's KV-row scale (registers) into a
whole-row staging buffer, and sends each valid row as one `.add.u32` bulk op per warpgroup (1024 and 1280 bytes).
No KV gather, so the staging buffer has room for whole rows.

The check: P, dS random bf16, the reference dkv from torch in float64, per-row scales from it (each row's largest
entry at 2**23, as in probe_wide_backward.py).
"""
import argparse
import statistics

import torch

C = 64
C0 = 256  # WG0's columns; WG1 has [C0, Dqk)
U32 = r"""
__device__ __forceinline__ void smqa_bulk_add_u32(void const* smem, void* gmem, int bytes) {
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%0], [%1], %2;"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
__device__ __forceinline__ void smqa_bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void smqa_bulk_wait_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void smqa_bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def build_program(BI=32, dqk=576, dv=512):
    import tilelang.language as T

    HG = 64
    W = dqk + 4  # staged int32 per row, padded 16 bytes
    CH0 = tuple(range(C0 // C))  # WG0's chunks
    CH1 = tuple(range(C0 // C, dqk // C))  # WG1's chunks (the last one is the rope tail: Q only)
    PV = BI // 8  # 16-byte vectors per head row of a P / dS block
    assert HG * PV == 256, "one vector of P and one of dS per thread"
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    Q_CHUNKS, O_CHUNKS = HG * (dqk // 8), HG * (dv // 8)

    @T.prim_func
    def split_dkv(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        P: T.Tensor([batch, seq_len, heads, topk], bf16),
        dS: T.Tensor([batch, seq_len, heads, topk], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        RowScale: T.Tensor([batch, seq_kv], f32),
        Rows: T.Tensor([n_rows], i32),
        Acc: T.Tensor([batch, seq_kv, dqk], i32),
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=256, prelude=U32) as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, dqk], bf16)
            dO_shared = T.alloc_shared([HG, dv], bf16)
            P_shared = T.alloc_shared([HG, BI], bf16)
            dS_shared = T.alloc_shared([HG, BI], bf16)
            stage = T.alloc_shared([BI, W], i32)
            idx_shared = T.alloc_shared([BI], i32)
            scale_shared = T.alloc_shared([BI], f32)
            acc0 = T.alloc_fragment([C, BI], f32)
            acc1 = T.alloc_fragment([C, BI], f32)
            scale0 = T.alloc_fragment([BI], f32)
            scale1 = T.alloc_fragment([BI], f32)
            row_j = T.alloc_var(i32)

            tx = T.get_thread_binding()
            b_i, s_i, h0 = by, Rows[bx], bz * HG
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
                        dO_shared[c // (dv // 8), (c % (dv // 8)) * 8 + v] = T.if_then_else(
                            h0 + c // (dv // 8) < heads, dO[b_i, s_i, h0 + c // (dv // 8), (c % (dv // 8)) * 8 + v],
                            T.cast(0, bf16))
            for kb in T.serial(n_blk):
                # this block's P and dS, 16 bytes a thread (padded heads and vectors past L as zero; slots past the
                # valid prefix are loaded but never sent, their rows being -1)
                for v in T.vectorized(8):
                    P_shared[tx // PV, (tx % PV) * 8 + v] = T.if_then_else(
                        T.And(h0 + tx // PV < heads, kb * BI + (tx % PV) * 8 + 8 <= topk),
                        P[b_i, s_i, h0 + tx // PV, kb * BI + (tx % PV) * 8 + v], T.cast(0, bf16))
                for v in T.vectorized(8):
                    dS_shared[tx // PV, (tx % PV) * 8 + v] = T.if_then_else(
                        T.And(h0 + tx // PV < heads, kb * BI + (tx % PV) * 8 + 8 <= topk),
                        dS[b_i, s_i, h0 + tx // PV, kb * BI + (tx % PV) * 8 + v], T.cast(0, bf16))
                if tx < BI:
                    row_j = -1
                    if kb * BI + tx < n_valid:
                        row_j = Indices[b_i, s_i, kb * BI + tx]
                    row_j = T.if_then_else(T.And(row_j >= 0, row_j < seq_kv), row_j, -1)
                    idx_shared[tx] = row_j
                    scale_shared[tx] = T.if_then_else(row_j >= 0, RowScale[b_i, T.max(row_j, 0)], 0.0)
                T.fence_proxy_async()
                T.sync_threads()
                if tx < 128:
                    for j in T.Parallel(BI):
                        scale0[j] = scale_shared[j]
                    for c in CH0:
                        T.gemm(Q_shared[:, c * C:(c + 1) * C], dS_shared, acc0, transpose_A=True, clear_accum=True)
                        T.gemm(dO_shared[:, c * C:(c + 1) * C], P_shared, acc0, transpose_A=True)
                        if c == CH0[0]:
                            # the previous block's rows have been read by the bulk engine
                            if tx < BI:
                                T.call_extern("handle", "smqa_bulk_wait_read0")
                            T.sync_threads(14, 128)
                        for d, j in T.Parallel(C, BI):
                            stage[j, c * C + d] = T.cast(T.round(acc0[d, j] * scale0[j]), i32)
                    T.fence_proxy_async()
                    T.sync_threads(14, 128)
                    if tx < BI:
                        row_j = idx_shared[tx]
                        if row_j >= 0:
                            T.call_extern("handle", "smqa_bulk_add_u32", T.address_of(stage[tx, 0]),
                                          T.address_of(Acc[b_i, row_j, 0]), C0 * 4)
                        T.call_extern("handle", "smqa_bulk_commit")
                else:
                    for j in T.Parallel(BI):
                        scale1[j] = scale_shared[j]
                    for c in CH1:
                        T.gemm(Q_shared[:, c * C:(c + 1) * C], dS_shared, acc1, transpose_A=True, clear_accum=True)
                        if c * C < dv:
                            T.gemm(dO_shared[:, c * C:(c + 1) * C], P_shared, acc1, transpose_A=True)
                        if c == CH1[0]:
                            if tx - 128 < BI:
                                T.call_extern("handle", "smqa_bulk_wait_read0")
                            T.sync_threads(15, 128)
                        for d, j in T.Parallel(C, BI):
                            stage[j, c * C + d] = T.cast(T.round(acc1[d, j] * scale1[j]), i32)
                    T.fence_proxy_async()
                    T.sync_threads(15, 128)
                    if tx - 128 < BI:
                        row_j = idx_shared[tx - 128]
                        if row_j >= 0:
                            T.call_extern("handle", "smqa_bulk_add_u32", T.address_of(stage[tx - 128, C0]),
                                          T.address_of(Acc[b_i, row_j, C0]), (dqk - C0) * 4)
                        T.call_extern("handle", "smqa_bulk_commit")
                # both warpgroups are done with this block's P, dS, rows and scales
                T.sync_threads()
            if tx % 128 < BI:
                T.call_extern("handle", "smqa_bulk_wait_all")

    return split_dkv


def compiled(bi=32):
    import tilelang

    from sparse_mqa_kernels.target import EXECUTION_BACKEND, TARGET
    return tilelang.compile(build_program(bi), out_idx=None, target=TARGET, execution_backend=EXECUTION_BACKEND)


def timed(fn, iters):
    ts = []
    for _ in range(iters + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts[2:])


def reference_dkv(q, go, P, dS, idx, Skv):
    """float64 dkv = sum over (query, slot) naming a row of dS^T q + P^T [dO; 0], 64 queries at a time."""
    B, S, H, Dqk = q.shape
    dkv = torch.zeros(B, Skv, Dqk, dtype=torch.float64, device=q.device)
    go_pad = torch.nn.functional.pad(go, (0, Dqk - go.shape[-1]))
    for b in range(B):
        for s0 in range(0, S, 64):
            sl = slice(s0, s0 + 64)
            t = torch.einsum("sht,shd->std", dS[b, sl].float(), q[b, sl].float())
            t += torch.einsum("sht,shd->std", P[b, sl].float(), go_pad[b, sl].float())
            dkv[b].index_add_(0, idx[b, sl].reshape(-1).long(), t.reshape(-1, Dqk).double())
    return dkv


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", default=["anchor", "l512", "h128"])
    p.add_argument("--bi", type=int, default=32)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args(argv)
    k = compiled(a.bi)
    if not torch.cuda.is_available():
        print(f"compiled BI={a.bi} for sm_90a (no GPU here: nothing timed)")
        return
    from sparse_mqa_kernels.bench.shapes import PRESETS, make_inputs
    for name in a.shapes:
        x = make_inputs(PRESETS[name], "cuda", seed=0, sink=True)
        q, go, idx = x["q"], x["grad_out"], x["indices"]
        B, S, H, _ = q.shape
        L, Skv = idx.shape[-1], x["kv"].shape[1]
        g = torch.Generator(device="cuda").manual_seed(1)
        P = torch.rand(B, S, H, L, generator=g, device="cuda").mul_(2 / L).to(torch.bfloat16)
        dS = torch.randn(B, S, H, L, generator=g, device="cuda").mul_(1 / L).to(torch.bfloat16)
        tl = torch.full((B, S), L, dtype=torch.int32, device="cuda")
        rows = torch.arange(S, dtype=torch.int32, device="cuda")
        ref = reference_dkv(q, go, P, dS, idx, Skv)
        rmax = ref.abs().amax(-1)
        scale = torch.where(rmax > 0, torch.exp2(23 - torch.ceil(torch.log2(rmax))), torch.zeros_like(rmax)).float()
        acc = torch.zeros(B, Skv, q.shape[-1], dtype=torch.int32, device="cuda")
        t = timed(lambda: k(q, go, P, dS, idx, tl, scale, rows, acc), a.iters)
        acc.zero_()
        k(q, go, P, dS, idx, tl, scale, rows, acc)
        dkv = acc.double() / torch.where(scale > 0, scale, torch.ones_like(scale)).double()[..., None]
        err = ((dkv - ref).norm() / ref.norm()).item()
        worst = ((dkv - ref).abs().amax(-1) / rmax.clamp_min(1e-30)).max().item()
        print(f"{name}: kernel B (BI={a.bi}) {t:.3f} ms; dkv rel. L2 diff {err:.2e}, worst row {worst:.2e}",
              flush=True)


if __name__ == "__main__":
    main()
