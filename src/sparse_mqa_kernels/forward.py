"""Sparse-MQA forward on Hopper (TileLang, sm_90a): the contract's out and lse, with sinks and topk_length.

One block serves one query row and a group of ``fwd_plan.HEAD_BLOCK`` heads; it walks the row's top-k slots
in tiles of ``TOPK_TILE`` KV rows, double buffered, with three warpgroups:

- producer: reads each slot's index, decides validity by the contract's rule (slot < min(L, topk_length),
  0 <= idx < Skv) and gathers only valid rows with cp.async; an invalid row is never addressed;
- consumer 0: scores (Q K^T), masks invalid slots to -inf *after* the product (so whatever sits in an unused
  shared row cannot leak in), runs the online softmax and accumulates the left half of P V;
- consumer 1: the right half of P V.

Internally the softmax is base 2 (scores scaled by sm_scale * log2 e); at the end the sink is folded into the
normaliser and the lse is written in the contract's convention (natural log, sink excluded, +inf when the row
has no valid slot, where out is 0). B, S, Skv, H and L are symbolic and sm_scale is a runtime argument, so one
compiled variant per ``fwd_plan.VariantKey`` serves every size.
"""

# No ``from __future__ import annotations`` here: TileLang evaluates the kernel's parameter annotations, and
# they name sizes local to ``build_program``.
import functools
import math

import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends.validate import check_forward_args

from . import fwd_plan
from .target import EXECUTION_BACKEND, TARGET, kernel_ready

_V_HALF = 256  # each consumer owns Dv / 2 = 256 output columns


def _ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def _pass_configs():
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


def build_program(key: fwd_plan.VariantKey):
    """The TileLang prim_func of one variant (uncompiled)."""
    import tilelang.language as T

    dqk, dv = key.dqk, key.dv
    D = dv  # V columns (the first Dv of the latent)
    tail = dqk - dv  # rope dims that enter the scores only (64 or 0)
    HB, BI = key.head_block, key.topk_tile
    NS = fwd_plan.STAGES
    assert D == 2 * _V_HALF and NS == 2 and fwd_plan.THREADS == 384
    has_sink, has_topk = key.has_sink, key.has_topk_length
    ROWS_PER_PASS = 16  # producer: 8 threads per KV row, 16 rows per pass, BI / 16 passes
    PASSES = BI // ROWS_PER_PASS
    CHUNKS = dqk // 64  # 16-byte chunks per thread per row (8 threads x 8 bf16 = 64 columns per step)
    ROW_CHUNKS = dqk // 8  # 16-byte chunks in one row of Q or KV
    Q_CHUNKS = HB * ROW_CHUNKS
    KV_CHUNKS = NS * BI * ROW_CHUNKS

    batch, seq_len, seq_kv, heads, topk = T.dynamic("batch, seq_len, seq_kv, heads, topk")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    sink_shape = [heads] if has_sink else [1]
    topk_len_shape = [batch, seq_len] if has_topk else [1]
    ln2 = math.log(2.0)
    log2e = contract.LOG2E

    @T.prim_func
    def sparse_mqa_fwd(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        Sink: T.Tensor(sink_shape, f32),
        TopkLen: T.Tensor(topk_len_shape, i32),
        Out: T.Tensor([batch, seq_len, heads, dv], bf16),
        Lse: T.Tensor([batch, seq_len, heads], f32),
        scale2: f32,
    ):
        groups = T.ceildiv(heads, HB)
        with T.Kernel(seq_len * groups, batch, threads=384) as (bx, by):
            Q_shared = T.alloc_shared([HB, dqk], bf16)
            KV_shared = T.alloc_shared([NS, BI, dqk], bf16)
            S_shared = T.alloc_shared([HB, BI], bf16)
            O_shared = Q_shared  # reused once every score product is done
            valid_shared = T.alloc_shared([NS, BI], "bool")
            alpha_shared = T.alloc_shared([HB], f32)
            inv_shared = T.alloc_shared([HB], f32)

            acc_s = T.alloc_fragment([HB, BI], f32)
            # one accumulator per consumer: a fragment's layout binds it to one warpgroup's threads
            acc_o_l = T.alloc_fragment([HB, _V_HALF], f32)
            acc_o_r = T.alloc_fragment([HB, _V_HALF], f32)
            m_i = T.alloc_fragment([HB], f32)
            m_prev = T.alloc_fragment([HB], f32)
            m_use = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            sumexp = T.alloc_fragment([HB], f32)
            sumexp_i = T.alloc_fragment([HB], f32)
            inv = T.alloc_fragment([HB], f32)

            idx_r = T.alloc_local([PASSES], i32)
            ok = T.alloc_var("bool")

            # k_ready: 128 cp.async arrivals (data landed) + 128 plain arrivals (release of valid_shared)
            bar_k_ready = T.alloc_barrier(arrive_count=[256] * NS)
            bar_k_free = T.alloc_barrier(arrive_count=[256] * NS)
            bar_s_ready = T.alloc_barrier(arrive_count=256)
            bar_s_free = T.alloc_barrier(arrive_count=256)
            bar_fin = T.alloc_barrier(arrive_count=128)

            tx = T.get_thread_binding()
            b_i = by
            s_i = bx // groups
            h0 = (bx % groups) * HB
            # slots at or past n_valid are invalid by the contract (topk_length and L both cap the row)
            n_valid = T.alloc_var(i32)
            if has_topk:
                n_valid = T.min(TopkLen[b_i, s_i], topk)
            else:
                n_valid = topk
            n_pairs = T.ceildiv(T.max(n_valid, 0), BI * NS)

            # Padded heads get zero query rows (their results are never stored). Unused KV rows start at zero
            # and afterwards hold only rows gathered for valid slots, so P V never meets uninitialised bits.
            # (explicit 16-byte chunks per thread: 384 threads do not tile every buffer shape evenly)
            for i in T.serial(_ceildiv(Q_CHUNKS, 384)):
                c = i * 384 + tx
                if c < Q_CHUNKS:
                    for v in T.vectorized(8):
                        Q_shared[c // ROW_CHUNKS, (c % ROW_CHUNKS) * 8 + v] = T.if_then_else(
                            h0 + c // ROW_CHUNKS < heads,
                            Q[b_i, s_i, h0 + c // ROW_CHUNKS, (c % ROW_CHUNKS) * 8 + v], T.cast(0, bf16))
            for i in T.serial(_ceildiv(KV_CHUNKS, 384)):
                c = i * 384 + tx
                if c < KV_CHUNKS:
                    for v in T.vectorized(8):
                        KV_shared[c // (BI * ROW_CHUNKS), (c // ROW_CHUNKS) % BI, (c % ROW_CHUNKS) * 8 + v] = T.cast(
                            0, bf16)
            T.fence_proxy_async()
            T.sync_threads()

            if tx < 128:
                # consumer 0: scores, online softmax, left half of the output
                T.set_max_nreg(240, 1)
                T.fill(sumexp, 0)
                T.fill(m_i, -T.infinity(f32))
                T.fill(acc_o_l, 0)
                for it in T.serial(n_pairs):
                    for st in T.unroll(NS):
                        T.barrier_wait(bar_k_ready[st], it & 1)
                        T.fence_proxy_async()
                        # the score product's pieces go to the tensor cores back to back, one wait at the end
                        T.wgmma_gemm(Q_shared[:, 0:_V_HALF], KV_shared[st, :, 0:_V_HALF], acc_s,
                                     transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(Q_shared[:, _V_HALF:D], KV_shared[st, :, _V_HALF:D], acc_s, transpose_B=True)
                        if tail > 0:
                            T.wgmma_gemm(Q_shared[:, D:dqk], KV_shared[st, :, D:dqk], acc_s, transpose_B=True)
                        T.wait_wgmma(0)
                        for h, j in T.Parallel(HB, BI):
                            acc_s[h, j] = T.if_then_else(valid_shared[st, j], acc_s[h, j] * scale2,
                                                         -T.infinity(f32))
                        if it != 0 or st != 0:
                            # consumer 1 must be done with the previous S_shared and alpha_shared
                            T.barrier_arrive(bar_s_free)
                            T.barrier_wait(bar_s_free, ((it * NS + st) & 1) ^ 1)
                        T.copy(m_i, m_prev)
                        T.reduce_max(acc_s, m_i, dim=1, clear=False)
                        for h in T.Parallel(HB):
                            # a row with nothing valid yet keeps m = -inf; subtract 0 then (exp2(-inf) = 0)
                            m_use[h] = T.if_then_else(m_i[h] == -T.infinity(f32), 0.0, m_i[h])
                            alpha[h] = T.exp2(m_prev[h] - m_use[h])
                        for h, j in T.Parallel(HB, BI):
                            acc_s[h, j] = T.exp2(acc_s[h, j] - m_use[h])
                        T.reduce_sum(acc_s, sumexp_i, dim=1)
                        for h in T.Parallel(HB):
                            sumexp[h] = sumexp[h] * alpha[h] + sumexp_i[h]
                            alpha_shared[h] = alpha[h]
                        for h, d in T.Parallel(HB, _V_HALF):
                            acc_o_l[h, d] *= alpha[h]
                        T.copy(acc_s, S_shared)
                        T.gemm(S_shared, KV_shared[st, :, 0:_V_HALF], acc_o_l)
                        T.barrier_arrive(bar_s_ready)
                        T.barrier_arrive(bar_k_free[st])

                # finish: fold the sink into the normaliser; lse in the contract's convention
                for h in T.Parallel(HB):
                    m_use[h] = T.if_then_else(m_i[h] == -T.infinity(f32), 0.0, m_i[h])
                    if has_sink:
                        inv[h] = T.if_then_else(
                            sumexp[h] > 0,
                            1.0 / (sumexp[h] + T.exp2(T.if_then_else(h0 + h < heads, Sink[h0 + h] * log2e,
                                                                     -T.infinity(f32)) - m_use[h])),
                            0.0)
                    else:
                        inv[h] = T.if_then_else(sumexp[h] > 0, 1.0 / sumexp[h], 0.0)
                    inv_shared[h] = inv[h]
                    sumexp_i[h] = T.if_then_else(sumexp[h] > 0, (T.log2(sumexp[h]) + m_use[h]) * ln2,
                                                 T.infinity(f32))
                T.barrier_arrive(bar_fin)
                for h in T.Parallel(HB):
                    if h0 + h < heads:
                        Lse[b_i, s_i, h0 + h] = sumexp_i[h]
                for h, d in T.Parallel(HB, _V_HALF):
                    O_shared[h, d] = T.cast(acc_o_l[h, d] * inv[h], bf16)
                for h, d in T.Parallel(HB, _V_HALF):
                    if h0 + h < heads:
                        Out[b_i, s_i, h0 + h, d] = O_shared[h, d]

            elif tx < 256:
                # consumer 1: right half of the output
                T.set_max_nreg(168, 1)
                T.fill(acc_o_r, 0)
                for it in T.serial(n_pairs):
                    for st in T.unroll(NS):
                        T.barrier_arrive(bar_s_ready)
                        T.barrier_wait(bar_s_ready, (it * NS + st) & 1)
                        T.fence_proxy_async()
                        for h, d in T.Parallel(HB, _V_HALF):
                            acc_o_r[h, d] *= alpha_shared[h]
                        T.gemm(S_shared, KV_shared[st, :, _V_HALF:D], acc_o_r)
                        T.barrier_arrive(bar_k_free[st])
                        if it != n_pairs - 1 or st != NS - 1:
                            T.barrier_arrive(bar_s_free)
                T.barrier_wait(bar_fin, 0)
                for h, d in T.Parallel(HB, _V_HALF):
                    O_shared[h, _V_HALF + d] = T.cast(acc_o_r[h, d] * inv_shared[h], bf16)
                for h, d in T.Parallel(HB, _V_HALF):
                    if h0 + h < heads:
                        Out[b_i, s_i, h0 + h, _V_HALF + d] = O_shared[h, _V_HALF + d]

            else:
                # producer: validity by the contract's rule, then gather only valid rows
                T.set_max_nreg(80, 0)
                p = tx - 256
                for it in T.serial(n_pairs):
                    for st in T.unroll(NS):
                        # this tile's indices are read before waiting for its buffer: their latency overlaps
                        # the wait instead of serialising with the copies
                        for r in T.unroll(PASSES):
                            idx_r[r] = -1
                            if (it * NS + st) * BI + r * ROWS_PER_PASS + p // 8 < n_valid:
                                idx_r[r] = Indices[b_i, s_i, (it * NS + st) * BI + r * ROWS_PER_PASS + p // 8]
                        T.barrier_wait(bar_k_free[st], (it & 1) ^ 1)
                        for r in T.unroll(PASSES):
                            row = r * ROWS_PER_PASS + p // 8
                            ok = T.And((it * NS + st) * BI + row < n_valid,
                                       T.And(idx_r[r] >= 0, idx_r[r] < seq_kv))
                            valid_shared[st, row] = ok
                            if ok:
                                for u in T.serial(CHUNKS):
                                    T.ptx_cp_async(
                                        T.access_ptr(KV_shared[st, row, 64 * u + (p % 8) * 8], "w", 8),
                                        T.access_ptr(KV[b_i, idx_r[r], 64 * u + (p % 8) * 8], "r", 8),
                                        8,
                                    )
                        T.cp_async_barrier_noinc(bar_k_ready[st])
                        T.barrier_arrive(bar_k_ready[st])

    return sparse_mqa_fwd


@functools.lru_cache(maxsize=None)
def compiled(key: fwd_plan.VariantKey):
    """The compiled kernel of one variant (TileLang's disk cache under TILELANG_CACHE_DIR makes reloads cheap)."""
    import tilelang

    return tilelang.compile(build_program(key), out_idx=None, target=TARGET, pass_configs=_pass_configs(),
                            execution_backend=EXECUTION_BACKEND)


def kernel_source(key: fwd_plan.VariantKey) -> str:
    """Generated CUDA source of one variant (compiles it if needed)."""
    return compiled(key).get_kernel_source()


def precompile() -> list[str]:
    """Compile every variant the plan can produce into the current TILELANG_CACHE_DIR, for sm_90a.

    B, S, Skv, H and L are symbolic in the kernel, so these variants cover every size the suite draws.
    """
    out = []
    for key in fwd_plan.all_variants():
        compiled(key)
        out.append(key.describe())
    return out


@functools.lru_cache(maxsize=None)
def _placeholder(kind: str, device: str):
    """A one-element stand-in for an absent sink or topk_length (the variant never reads it)."""
    dtype = torch.float32 if kind == "sink" else torch.int32
    return torch.zeros(1, dtype=dtype, device=device)


def sparse_mqa_forward(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
    """Contract forward on the GPU: ``(out bf16 [B,S,H,Dv], lse fp32 [B,S,H])``, lse natural-log, sink excluded.

    Arguments are validated (shapes, kernel dtypes, device, supported dims) before any GPU work.
    """
    dims = check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length,
                              supported_dims=contract.PRODUCTION_DIMS, device_type="cuda")
    plan = fwd_plan.plan_forward(dims, has_sink=attn_sink is not None, has_topk_length=topk_length is not None)
    kernel = compiled(plan.key)
    q, kv, indices = kernel_ready(q), kernel_ready(kv), kernel_ready(indices)
    dev = str(q.device)
    sink = kernel_ready(attn_sink) if attn_sink is not None else _placeholder("sink", dev)
    topk_len = kernel_ready(topk_length) if topk_length is not None else _placeholder("topk", dev)
    out = torch.empty((dims.B, dims.S, dims.H, dims.Dv), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((dims.B, dims.S, dims.H), dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        kernel(q, kv, indices, sink, topk_len, out, lse, float(sm_scale) * contract.LOG2E)
    return out, lse
