"""Deterministic sparse-MLA backward on Hopper (TileLang, sm_90a): dq, dkv and d_sink, bitwise stable.

Design (issue 6, lead (a): exact int64 fixed point)
    One thread block serves one query row and one head group (``bwd_plan``: 16, 32 or 64 heads; padded heads
    load q = dO = Delta = 0 and lse = +inf, so P = dS = 0 there, and are never read or written). It walks the
    row's top-k slots ``TOPK_BLOCK`` at a time: gathers the valid KV rows (an invalid slot's index is never
    used as an address: the row is zero-filled), recomputes P = exp2(s * sm_scale * log2e - lse2) with the
    sink folded into lse2, dP = dO V^T, dS = P (dP - Delta) sm_scale, and runs the GEMMs dq += dS K and
    dkv_blk = dS^T Q + P^T [dO; 0] on tensor cores (bf16 operands, fp32 accumulation, fixed order).

    dq has one writer per element (its block), so it is deterministic as it stands. dkv rows receive
    contributions from every (query, slot, head group) that names them, in an order the scheduler picks.
    Each fp32 contribution is therefore rounded once to an integer multiple of 2**-F and added with int64
    atomics into an int64 accumulator [B, Skv, Dqk]. Integer addition is associative, so the sum is exact and
    the same bits come out whatever the order; a final pass converts accumulator * 2**-F to bf16. Only valid
    slots add anything (empty rows and invalid slots add nothing; duplicates add once per slot).

    F comes from a cheap bound G on any partial sum of dkv (``model.dkv_bound``: per query and head,
    sum_t P <= 1 and sum_t |dS| <= 2 |dO| Vmax): F = 60 - ceil(log2 G), computed on the device from torch
    reductions (no host sync) and passed to the kernel as a tensor. Resolution 2**-F sits ~2**-60 below the
    bound; rows far below the bound lose relative precision (measured in tests/test_tilelang_model.py against
    float32 accumulation: at a 2**40 spread of term magnitudes the int64 sum still beats float32).

    Delta = <dO, out> (fp32), the kernel LSE and d_sink = -sum p_sink Delta are torch reductions, which are
    deterministic (fixed-shape tree reductions, no atomics); d_sink is summed per query chunk, then over
    chunks in order.

Why not (b) buffer + CSR + ordered reduction, or (c) shards: both move the [S, L, Dqk] fp32 contributions
    through memory at least twice; the int64 atomics move them once (at twice fp32's width). Speed notes and
    the measured numbers are in BENCHMARKS.md (section "Deterministic TileLang backward").

The NumPy model ``kernels.model`` runs this algorithm on CPU (same plan, padding and fixed-point scheme).
"""

import functools

from .. import contract
from ..backends.validate import check_backward_args
from . import bwd_plan

TARGET = {"kind": "cuda", "arch": "sm_90a"}


def _pass_configs():
    import tilelang

    return {
        tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True,
        tilelang.PassConfigKey.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE: True,
    }


def build_program(variant: tuple):
    """The TileLang prim_func of one variant (Dqk, Dv, head_group, topk_block); sizes are symbolic."""
    import tilelang.language as T

    dqk, dv, HG, BI = variant
    D = dv
    tail = dqk - dv
    TA = max(tail, 16)
    threads = 256 if HG >= 64 else 128
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
        with T.Kernel(n_rows, batch, groups, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, D], bf16)
            dO_shared = T.alloc_shared([HG, D], bf16)
            KV_shared = T.alloc_shared([BI, D], bf16)
            P_shared = T.alloc_shared([HG, BI], bf16)
            dS_shared = T.alloc_shared([HG, BI], bf16)
            idx_shared = T.alloc_shared([BI], i32)
            # the rope tail (Dqk - Dv columns); allocated at a dummy size when there is none
            Qt_shared = T.alloc_shared([HG, TA], bf16)
            KVt_shared = T.alloc_shared([BI, TA], bf16)
            acc_dq_t = T.alloc_fragment([HG, TA], f32)
            acc_dkv_t = T.alloc_fragment([BI, TA], f32)

            acc_p = T.alloc_fragment([HG, BI], f32)
            acc_dp = T.alloc_fragment([HG, BI], f32)
            acc_dq = T.alloc_fragment([HG, D], f32)
            acc_dkv = T.alloc_fragment([BI, D], f32)
            lse_f = T.alloc_fragment([HG], f32)
            delta_f = T.alloc_fragment([HG], f32)

            b_i = by
            s_i = Rows[bx]
            h0 = bz * HG
            fx = Fx[0]
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

            for kb in T.serial(T.ceildiv(n_valid, BI)):
                # validity by the contract's rule; an invalid slot keeps -1 and its row is zero-filled
                for j in T.Parallel(BI):
                    idx_shared[j] = T.if_then_else(kb * BI + j < n_valid, Indices[b_i, s_i, kb * BI + j], -1)
                for j in T.Parallel(BI):
                    idx_shared[j] = T.if_then_else(T.And(idx_shared[j] >= 0, idx_shared[j] < seq_kv),
                                                   idx_shared[j], -1)
                for j, d in T.Parallel(BI, D):
                    KV_shared[j, d] = T.if_then_else(idx_shared[j] >= 0, KV[b_i, idx_shared[j], d],
                                                     T.cast(0, bf16))
                if tail > 0:
                    for j, d in T.Parallel(BI, tail):
                        KVt_shared[j, d] = T.if_then_else(idx_shared[j] >= 0, KV[b_i, idx_shared[j], D + d],
                                                          T.cast(0, bf16))

                T.gemm(Q_shared, KV_shared, acc_p, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                if tail > 0:
                    T.gemm(Qt_shared, KVt_shared, acc_p, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                for h, j in T.Parallel(HG, BI):
                    acc_p[h, j] = T.if_then_else(idx_shared[j] >= 0, T.exp2(acc_p[h, j] * c2 - lse_f[h]), 0.0)
                T.copy(acc_p, P_shared)

                T.gemm(dO_shared, KV_shared, acc_dp, transpose_B=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                for h, j in T.Parallel(HG, BI):
                    acc_dp[h, j] = acc_p[h, j] * (acc_dp[h, j] - delta_f[h]) * sm_scale
                T.copy(acc_dp, dS_shared)

                T.gemm(dS_shared, KV_shared, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                if tail > 0:
                    T.gemm(dS_shared, KVt_shared, acc_dq_t, policy=T.GemmWarpPolicy.FullCol)

                T.gemm(dS_shared, Q_shared, acc_dkv, transpose_A=True, clear_accum=True,
                       policy=T.GemmWarpPolicy.FullCol)
                T.gemm(P_shared, dO_shared, acc_dkv, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
                if tail > 0:
                    T.gemm(dS_shared, Qt_shared, acc_dkv_t, transpose_A=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullCol)

                # exact, order-free accumulation: one rounding to 2**-F, then int64 atomics (valid slots only)
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

    return sparse_mla_bwd


@functools.lru_cache(maxsize=None)
def compiled(variant: tuple):
    """The compiled kernel of one variant (TileLang's disk cache under TILELANG_CACHE_DIR makes reloads cheap)."""
    import tilelang

    return tilelang.compile(build_program(variant), out_idx=None, target=TARGET, pass_configs=_pass_configs())


def kernel_source(variant: tuple) -> str:
    return compiled(variant).get_kernel_source()


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
                        max_query_chunk: int = bwd_plan.MAX_QUERY_CHUNK):
    """Contract backward on the GPU: ``(dq bf16, dkv bf16, d_sink fp32 or None)``, bitwise deterministic.

    Arguments are validated (shapes, kernel dtypes, device, supported dims) before any GPU work.
    """
    import torch

    dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length,
                               supported_dims=contract.KERNEL_DIMS)
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")
    sm_scale = float(sm_scale)
    plan = bwd_plan.make_plan(dims.B, dims.S, dims.Skv, dims.H, dims.L, dims.Dqk, dims.Dv,
                              max_query_chunk=max_query_chunk)
    kernel = compiled(plan.variant)
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
