"""Deterministic sparse-MQA backward on Hopper (TileLang, sm_90a): dq, dkv and d_sink, bitwise stable.

Algorithm
    One thread block serves one query row and one head group (``bwd_plan``: 16, 32 or 64 heads; padded heads
    load q = dO = Delta = 0 and lse = +inf, so P = dS = 0 there, and no row h >= H is read or written). It
    walks the row's valid top-k prefix ``min(L, topk_length)`` ``topk_block`` slots at a time: gathers the
    valid KV rows (an invalid slot's index is never used as an address), recomputes
    P = exp2(s sm_scale log2e - lse2) with the sink folded into lse2 (P = 0 on invalid slots), dP = dO V^T,
    dS = P (dP - Delta) sm_scale, and runs dq += dS K and dkv_blk = dS^T Q + P^T [dO; 0] on tensor cores (bf16
    operands, fp32 accumulators, a fixed instruction order).

Two paths, one algorithm
    64-head groups (H > 32, the production case): ``bwd_rows``' bound pass (Delta, and a bound per KV row), its
    row scales, then ``backward_ws``' warp-specialised main kernel (dq, and each dkv term rounded to int32 at its
    KV row's scale 2**F_j and added with integer reductions), then the conversion to bf16. Four bytes a term, and
    each row keeps 29 bits below its own bound instead of a bound over the whole call. Where
    ``BackwardConfig.pds_budget`` holds them (``BwdPlan.pds_bytes``), the bound pass also stores P and dS and the
    main kernel reads them instead of forming S and dP again: the same bits, two products a block fewer.
    16- and 32-head groups: the single-role body below (every thread does every step in turn), int64 terms at
    one scale 2**F a call (``_prep``, ``bwd_prep``). ``BackwardConfig(single_role=True)`` runs it for 64-head
    groups too: the same products, a different fixed point, so dkv agrees to rounding, not to the bit.

Determinism by construction
    dq has one writer per element (its block, in a fixed loop order). dkv rows get contributions from every
    (query, slot, head group) naming them, in an order the scheduler picks; so each fp32 contribution is
    rounded once to an integer multiple of a power of two and the integers are summed. Integer addition is
    associative: the sums are exact whatever the order, and one final pass turns them into bf16. The bounds are
    order-free too: the 64-head path counts each slot's bound in its row's octave (integer adds) and sums the
    counts in a fixed order; the other path's come from fixed-order sums (``bwd_prep``) and torch reductions on
    fixed shapes. Delta is a fixed-order sum; d_sink = -sum p_sink Delta is one torch reduction over the whole
    call's [B, S, H] products, so its bits do not depend on the query chunks either. No floating-point atomic is
    issued anywhere (tests/test_backward_compile.py reads the generated CUDA).

How the single-role body's int64 sums reach memory
    Contributions are staged in shared memory as int64, a few KV rows per round, and each valid row goes out as
    one ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64`` (two's complement, so u64 addition is
    signed addition) issued by the TMA engine; ``PRELUDE`` supplies it in inline PTX (TileLang 0.1.15 has only
    the .f32 flavour). A staging buffer is rewritten only after the bulk group that last read it has finished
    reading (``cp.async.bulk.wait_group.read``).

Fixed point and precision (single-role body; the 64-head path's is in ``bwd_rows``)
    F comes from a cheap bound G on any partial sum of dkv (``backward_model.dkv_bound``: per query and head
    sum_t P = m, the mass the sink leaves the slots, and sum_t |dS| <= 2 m |dO| Vmax, summed over queries;
    without m a sink-dominated call kept no bits of its gradient): F = 60 - ceil(log2 G), computed on the
    device (no host sync) and read by the kernel from a tensor. The resolution 2**-F sits 2**60 below G, so a
    term loses at most 2**-61 G: a row 2**30 below G summing 1024 terms keeps 2**-21 relative accuracy, one
    2**40 below keeps 2**-11, still under its own bf16 output rounding (2**-9). The bound is loose by the ratio
    of all queries to the queries that name a row (S L / Skv at most), which costs bits, not correctness.

The NumPy model ``backward_model`` runs this algorithm on CPU (same plan, padding and fixed-point scheme). Speed,
and the alternatives measured on the way here, are in BENCHMARKS.md.
"""

import functools

import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends.validate import check_backward_args

from . import backward_ws, bwd_plan, bwd_prep, bwd_rows
from .target import EXECUTION_BACKEND, SMEM_LIMIT, TARGET, kernel_ready, sm_count

THREADS = {64: 256, 32: 128, 16: 128}  # single-role body, per head group
STAGE_ROWS = 4  # single-role body: KV rows per staging round, double-buffered (the block shares its two buffers)

PRELUDE = r"""
__device__ __forceinline__ void sparse_mqa_bulk_add_u64(void const* smem, void* gmem, int bytes) {
  unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u64 [%0], [%1], %2;"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
__device__ __forceinline__ void sparse_mqa_bulk_commit_wait_read1() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}
__device__ __forceinline__ void sparse_mqa_bulk_wait_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void sparse_mqa_bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void sparse_mqa_bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// wait until at most N bulk groups still read their staging (N = staging buffers - 1)
template <int N> __device__ __forceinline__ void sparse_mqa_bulk_wait_read_n() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
"""


def build_program(key: bwd_plan.VariantKey):
    """The TileLang prim_func of one variant; B, S, Skv, H and L are symbolic."""
    if key.warp_specialized:
        return backward_ws.build_program(key)
    return _single_role_program(key)


def _single_role_program(key: bwd_plan.VariantKey):
    """Every thread of the block does every step in turn (16- and 32-head groups, and ``single_role``)."""
    import tilelang.language as T

    dqk, dv, HG, BI = key.dqk, key.dv, key.head_group, key.topk_block
    R = STAGE_ROWS
    assert BI % R == 0
    D = dv
    tail = dqk - dv
    TA = max(tail, 16)
    threads = THREADS[HG]
    # q, dO, the KV block, P, dS, the rope tail's q and KV, the indices, the int64 staging
    smem = (2 * HG * D + BI * D + 2 * HG * BI + HG * TA + BI * TA) * 2 + BI * 4 + 2 * R * dqk * 8
    assert smem <= SMEM_LIMIT, f"{key}: {smem} bytes of shared memory, over the {SMEM_LIMIT} an sm_90 block may use"
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32, i64 = T.bfloat16, T.float32, T.int32, T.int64
    log2e = contract.LOG2E

    @T.prim_func
    def sparse_mqa_bwd(
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
        with T.Kernel(n_rows, batch, groups, threads=threads, prelude=PRELUDE) as (bx, by, bz):
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
            stage = T.alloc_shared([2, R, dqk], i64)
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
            for kb in T.serial(n_blk):
                # validity by the contract's rule; an invalid slot keeps -1 and its row is zero-filled
                for j in T.Parallel(BI):
                    idx_shared[j] = T.if_then_else(kb * BI + j < n_valid, Indices[b_i, s_i, kb * BI + j], -1)
                for j in T.Parallel(BI):
                    idx_shared[j] = T.if_then_else(T.And(idx_shared[j] >= 0, idx_shared[j] < seq_kv),
                                                   idx_shared[j], -1)
                for j, d in T.Parallel(BI, D):
                    KV_shared[j, d] = T.if_then_else(idx_shared[j] >= 0, KV[b_i, idx_shared[j], d], T.cast(0, bf16))
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

                # exact, order-free accumulation: one rounding to 2**-F, then int64 adds (valid slots only)
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
                        if idx_shared[r * R + tx] >= 0:
                            T.call_extern("handle", "sparse_mqa_bulk_add_u64", T.address_of(stage[r % 2, tx, 0]),
                                          T.address_of(Acc[b_i, idx_shared[r * R + tx], 0]), dqk * 8)
                        T.call_extern("handle", "sparse_mqa_bulk_commit_wait_read1")
                    T.sync_threads()
                # the next block's rounds restart at buffer 0, which this block's last round may still be
                # reading (an odd number of rounds): no read stays in flight into the next block
                if tx < R:
                    T.call_extern("handle", "sparse_mqa_bulk_wait_read0")
                T.sync_threads()

            for h, d in T.Parallel(HG, D):
                if h0 + h < heads:
                    dQ[b_i, s_i, h0 + h, d] = T.cast(acc_dq[h, d], bf16)
            if tail > 0:
                for h, d in T.Parallel(HG, tail):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, D + d] = T.cast(acc_dq_t[h, d], bf16)
            if tx < R:
                T.call_extern("handle", "sparse_mqa_bulk_wait_all")

    return sparse_mqa_bwd


@functools.lru_cache(maxsize=None)
def compiled(key: bwd_plan.VariantKey):
    """The compiled kernel of one variant (TileLang's disk cache under TILELANG_CACHE_DIR makes reloads cheap)."""
    import tilelang

    configs = {}
    if not key.warp_specialized:
        # the single-role body: no automatic warp specialisation. TileLang's aggressive shared-memory merge
        # (off unless asked for) must stay off: its liveness does not see the top-k loop's back edge and gave
        # the int64 staging q's memory (Dqk 512, 16-head groups: NaN dq from the second block on)
        configs = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    return tilelang.compile(build_program(key), out_idx=None, target=TARGET, pass_configs=configs,
                            execution_backend=EXECUTION_BACKEND)


def kernel_source(key: bwd_plan.VariantKey) -> str:
    """Generated CUDA of one variant (compiles it if needed)."""
    return compiled(key).get_kernel_source()


def precompile() -> list[str]:
    """Compile every variant a plan can produce, the prep pass and the row-scale kernels into the current
    TILELANG_CACHE_DIR."""
    out = []
    for key in bwd_plan.all_variants():
        compiled(key)
        out.append(key.describe())
    for dqk, dv in contract.PRODUCTION_DIMS:
        bwd_prep.compiled(dqk, dv)
        out.append(bwd_prep.describe(dqk, dv))
        for stored in (False, True):
            bwd_rows.compiled(dqk, dv, stored)
            out.append(bwd_rows.describe(dqk, dv, stored))
    return out


def _prep(q, kv, out, grad_out, lse, attn_sink, indices, tl, sm_scale, d_v):
    """Delta [B, S, H] and the fixed point (2**F as a float32 tensor, F) on the device, without a host sync.

    ``bwd_prep`` computes Delta and each query row's term of ``backward_model.dkv_bound``'s bound in one pass over q,
    out and dO; Vmax (over the KV rows some valid slot names), each row's slot mass (``bwd_plan.slot_mass``) and the
    sum over query rows are torch reductions on fixed shapes.
    """
    B, S, H, Dqk = q.shape
    kvf = kv[..., :d_v].float()
    vnorm = kvf.mul(kvf).sum(-1).sqrt()
    named = contract.referenced_rows(indices, tl, kv.shape[1]) & torch.isfinite(vnorm)
    vmax = torch.where(named, vnorm, torch.zeros_like(vnorm)).amax().reshape(1)
    delta = torch.empty((B, S, H), dtype=torch.float32, device=q.device)
    rows = torch.empty((B, S), dtype=torch.float32, device=q.device)
    mass = bwd_plan.slot_mass(lse, attn_sink).contiguous()
    bwd_prep.compiled(Dqk, d_v)(q, out, grad_out, vmax, mass, delta, rows, abs(sm_scale) * bwd_plan.DS_BOUND_FACTOR)
    G = rows.sum()
    e = torch.ceil(torch.log2(G))
    F = (bwd_plan.ACC_BITS - bwd_plan.HEADROOM_BITS) - e
    F = torch.clamp(F, bwd_plan.F_MIN, bwd_plan.F_MAX)
    F = torch.where(G == 0, torch.full_like(F, bwd_plan.F_MAX), F)
    F = torch.where(torch.isfinite(G), F, torch.zeros_like(F))
    return delta, torch.exp2(F).reshape(1).float(), F


def dkv_from_fixed_point(acc, F):
    """dkv (bf16) from the int64 accumulator at 2**-F, converted in ``acc``'s own bytes: each element is read
    before it is written, the products are those of ``(acc.double() * 2**-F).to(bf16)`` bit for bit, and no
    float64 copy (16 bytes per dkv element) is made. ``acc`` holds float64 afterwards."""
    acc64 = acc.view(torch.float64)
    acc64.copy_(acc)
    acc64.mul_(torch.exp2(-F.double()))
    return acc64.to(torch.bfloat16)


def sparse_mqa_backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None,
                        config: bwd_plan.BackwardConfig = bwd_plan.BackwardConfig()):
    """Contract backward on the GPU: ``(dq bf16, dkv bf16, d_sink fp32 or None)``, bitwise deterministic.

    Arguments are validated (shapes, kernel dtypes, device, supported dims) before any GPU work. ``config``
    chooses the launch chunking (the same bits whatever the chunks) and, for 64-head groups, the body.
    """
    dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length,
                               supported_dims=contract.PRODUCTION_DIMS, device_type="cuda")
    sm_scale = float(sm_scale)
    plan = bwd_plan.make_plan(dims.B, dims.S, dims.Skv, dims.H, dims.L, dims.Dqk, dims.Dv,
                              max_query_chunk=config.max_query_chunk, pds_budget=config.pds_budget,
                              single_role=config.single_role)
    row_scaled = plan.row_scaled(config.single_role)
    if row_scaled and plan.row_terms() > bwd_plan.MAX_ROW_TERMS:
        raise ValueError(f"S * L * head groups = {dims.S} * {dims.L} * {plan.n_groups} = {plan.row_terms()} terms "
                         f"may name one KV row, over the {bwd_plan.MAX_ROW_TERMS} the 64-head backward counts "
                         "in int32; pass config=BackwardConfig(single_role=True) (int64 sums)")
    dev = q.device
    q, kv, out, grad_out, lse, indices = (kernel_ready(t) for t in (q, kv, out, grad_out, lse, indices))
    with torch.cuda.device(dev):
        tl = (torch.full((dims.B, dims.S), dims.L, dtype=torch.int32, device=dev) if topk_length is None
              else kernel_ready(topk_length))
        args = (q, kv, out, grad_out, lse, attn_sink, indices, tl, sm_scale)
        dq, dkv, sink_delta = _row_scaled(plan, *args) if row_scaled else _one_scale(plan, config, *args)
        d_sink = None if attn_sink is None else sink_delta.sum((0, 1)).neg_()
    return dq, dkv, d_sink


def _launch_rows(plan, dev):
    """Each query chunk's row ids, made as its launch comes (``BwdPlan.workspace_bytes``: 4 bytes a query of one
    chunk)."""
    for c in plan.chunks():
        yield torch.arange(c.start, c.stop, dtype=torch.int32, device=dev)


def stored_pds_buffer(plan, q):
    """``(pds, pds_len)``, what the 64-head kernels take for stored P and dS: with ``plan.stored_pds`` the flat
    [2, B, S, H, pds_len] bf16 buffer (uninitialised: the bound pass writes every slot a row's bound-pass blocks
    cover, and the main kernel reads no other) and its row length; otherwise q as a stand-in neither kernel reads,
    and 0."""
    if not plan.stored_pds:
        return q.view(-1), 0
    return torch.empty(plan.pds_bytes() // 2, dtype=torch.bfloat16, device=q.device), plan.pds_len


def _one_scale(plan, config, q, kv, out, grad_out, lse, attn_sink, indices, tl, sm_scale):
    """The single-role body: Delta and the call's fixed point (``_prep``), the kernel per query chunk, int64 sums at
    2**-F converted in place. Returns dq, dkv and, with a sink, p_sink Delta [B, S, H]."""
    kernel = compiled(plan.key(config.single_role))
    lse2 = contract.lse_to_base2(lse, attn_sink).contiguous()
    delta, fx, F = _prep(q, kv, out, grad_out, lse, attn_sink, indices, tl, sm_scale, plan.Dv)
    acc = torch.zeros((plan.B, plan.Skv, plan.Dqk), dtype=torch.int64, device=q.device)
    dq = torch.empty((plan.B, plan.S, plan.H, plan.Dqk), dtype=torch.bfloat16, device=q.device)
    for rows in _launch_rows(plan, q.device):
        kernel(q, kv, grad_out, indices, tl, lse2, delta, rows, fx, dq, acc, sm_scale)
    sink_delta = None if attn_sink is None else contract.sink_probability(lse, attn_sink).mul_(delta)
    return dq, dkv_from_fixed_point(acc, F), sink_delta


def _row_scaled(plan, q, kv, out, grad_out, lse, attn_sink, indices, tl, sm_scale):
    """The 64-head path (module docstring): the bound pass per query chunk (Delta, the kernel LSE and p_sink Delta
    too, and with ``plan.stored_pds`` P and dS), the row scales, the main kernel per chunk, the conversion. Every
    kernel on the current stream, no host read of the data. Returns dq, dkv and, with a sink, p_sink Delta
    [B, S, H]."""
    bound, scales, convert = bwd_rows.compiled(plan.Dqk, plan.Dv, plan.stored_pds)
    kernel = compiled(plan.key())
    B, S, Skv, H, Dqk = plan.B, plan.S, plan.Skv, plan.H, plan.Dqk
    dev = q.device
    delta = torch.empty((B, S, H), dtype=torch.float32, device=dev)
    lse2 = torch.empty_like(delta)
    has_sink = attn_sink is not None
    # without a sink the pass ignores both by its flag: lse stands in for them (no allocation, nothing written)
    sink = kernel_ready(attn_sink) if has_sink else lse.view(-1)
    sink_delta = torch.empty_like(delta) if has_sink else lse
    pds, pds_len = stored_pds_buffer(plan, q)
    hist = torch.zeros((B, Skv, bwd_plan.OCTAVES), dtype=torch.int32, device=dev)
    n_sm = sm_count(dev)
    for rows in _launch_rows(plan, dev):
        bound(q, out, grad_out, kv, indices, tl, lse, sink, rows, delta, lse2, sink_delta, hist, pds, sm_scale,
              int(has_sink), pds_len, *plan.bound_split(len(rows), n_sm))
    scale = torch.empty((B, Skv), dtype=torch.float32, device=dev)
    inv = torch.empty_like(scale)
    scales(hist, scale, inv)
    del hist
    acc = torch.zeros((B, Skv, Dqk), dtype=torch.int32, device=dev)
    dq = torch.empty((B, S, H, Dqk), dtype=torch.bfloat16, device=dev)
    for rows in _launch_rows(plan, dev):
        kernel(q, kv, grad_out, indices, tl, lse2, delta, rows, scale, dq, acc, pds, sm_scale, pds_len)
    del pds
    dkv = torch.empty((B, Skv, Dqk), dtype=torch.bfloat16, device=dev)
    convert(acc, inv, dkv)
    return dq, dkv, sink_delta if has_sink else None
