"""Warp-specialised kernel body of the deterministic backward for 64-head groups (``backward``).

Same algorithm, plan, fixed point and int64 bulk reductions as the single-role kernel in ``backward``; what
changes is who does what, so that the KV gather, the tensor-core products and the bulk reductions overlap
instead of taking turns:

- producer warpgroup: reads each top-k block's indices, applies the contract's validity rule and gathers only
  valid KV rows with cp.async into a two-stage ring (an invalid slot's row is never addressed);
- consumer 0: scores S = Q K^T, P (masked to 0 on invalid slots), dq[:, :Dv/2] and dkv's columns [0, Dv/2);
- consumer 1: dP = dO V^T, dS = P (dP - Delta) sm_scale, dq[:, Dv/2:] and dkv's columns [Dv/2, Dqk), the rope
  tail included (consumer 0 already has the longer scores product, and consumer 1 used to wait for its P).
dkv is computed transposed, dkv^T = Q^T dS + dO^T P, so that its products run on wgmma with the 256 columns
as M (a 16-slot block as M only fits mma.sync, which was ~2x slower here).

Each consumer rounds its own dkv columns to int64 and sends them with ``cp.reduce.async.bulk .add.u64`` from
its own staging ring (``STAGE_ROWS`` rows x ``STAGE_BUFS`` buffers), synchronising only its own 128 threads.
It waits for the TMA engine only before rewriting a buffer whose last reduction is still reading it, and the
last ``DEFER`` rounds of a block go out during the next block's products (the first while the next scores
run, the second after the next dq product), so the engine reads one round while the consumer computes instead
of the consumer waiting for it right after its dkv product. Staging rows are padded so a warp's int64 stores
spread over all shared-memory banks.

The roles hand work over with mbarriers: k_ready / k_free for the KV ring (producer <-> both consumers),
p (consumer 0's P is in shared memory), ds (consumer 1's dS is), pds_free (both are done reading this block's
P and dS, so the next block may overwrite them). Products, their order and the fixed point are those of the
single-role body, so both give the same bits (tests/gpu/test_backward_gpu.py checks it).
"""

# No ``from __future__ import annotations``: TileLang evaluates the kernel's parameter annotations.

from sparse_mqa_testkit import contract

THREADS = 384
STAGES = 2  # KV ring depth
# registers per thread by role (consumer 0, consumer 1 with the tail's accumulators, producer):
# setmaxnreg.inc draws only on what setmaxnreg.dec released inside the same block, so the three must sum to
# what the launch allocated (168 per thread at 384 threads)
NREG = (200, 240, 64)
assert sum(NREG) == 3 * 168
SMEM_LIMIT = 227 * 1024  # dynamic shared memory per block on sm_90
# named barriers of one consumer's 128 threads (ids TileLang's own partial syncs do not take)
_WG_BARRIER = (14, 15)
STAGE_ROWS, STAGE_BUFS = 8, 1  # per consumer: KV rows per staging round x buffers (fewer, larger rounds win)
DEFER = 2  # a block's last staging rounds sent during the next block's products


def build_program(key, prelude: str):
    """TileLang prim_func for a 64-head ``bwd_plan.VariantKey``; the same arguments as the single-role body's."""
    import tilelang.language as T

    dqk, dv, HG, BI = key.dqk, key.dv, key.head_group, key.topk_block
    assert HG == 64, "the warp-specialised kernel serves 64-head groups"
    D = dv
    C0 = D // 2  # consumer 0 owns V columns [0, C0), consumer 1 [C0, D)
    tail = dqk - dv
    # staged int64 per row: [0, C0), the tail (consumer 1's), and 2 of padding: consecutive rows then start 16
    # bytes apart modulo the 128 bytes of the banks, and the 4 rows one store of a warp touches do not collide
    W0 = C0 + tail + 2
    R, NBUF = STAGE_ROWS, STAGE_BUFS
    assert BI % R == 0 and BI % 16 == 0
    NR = BI // R  # staging rounds per top-k block
    smem = (HG * dqk + HG * D + STAGES * BI * dqk + 2 * HG * BI) * 2 + (STAGES * BI + HG * BI) * 4 \
        + 2 * NBUF * R * W0 * 8
    assert smem <= SMEM_LIMIT, f"{smem} bytes of shared memory, over the {SMEM_LIMIT} an sm_90 block may use"
    ROWS_PER_PASS = 16  # producer: 8 threads per KV row
    assert BI % ROWS_PER_PASS == 0
    PASSES = BI // ROWS_PER_PASS
    CHUNKS = dqk // 64  # 16-byte chunks per producer thread per row
    ROW_CHUNKS = dqk // 8
    Q_CHUNKS = HG * ROW_CHUNKS
    O_CHUNKS = HG * (D // 8)
    KV_CHUNKS = STAGES * BI * ROW_CHUNKS

    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    bf16, f32, i32, i64 = T.bfloat16, T.float32, T.int32, T.int64
    log2e = contract.LOG2E

    defer = min(DEFER, NR)
    early = list(range(NR - defer))  # rounds sent right after the block's dkv product
    late = list(range(NR - defer, NR))
    late_a, late_b = late[:-1], late[-1:]  # ... after the next block's scores are issued / its dq product

    @T.macro
    def send_round(c, r, kb_r, stage, acc, acc_t, row_idx, Acc, tx, fx, b_i):
        """Consumer c rounds staging round r of block kb_r's dkv columns to int64 and sends its valid rows."""
        buf = (kb_r * NR + r) % NBUF
        lane = tx - 128 * c
        if lane < R:
            # the group that last read this buffer, NBUF rounds ago, has finished reading
            T.call_extern("handle", f"sparse_mqa_bulk_wait_read_n<{NBUF - 1}>")
        T.sync_threads(_WG_BARRIER[c], 128)
        # the accumulator is dkv^T (columns x slots): slot j of round r goes to staging row j % R
        for d, j in T.Parallel(C0, BI):
            if j // R == r:
                stage[c, buf, j % R, d] = T.cast(T.round(acc[d, j] * fx), T.int64)
        if c == 1 and tail > 0:
            for d, j in T.Parallel(tail, BI):
                if j // R == r:
                    stage[1, buf, j % R, C0 + d] = T.cast(T.round(acc_t[d, j] * fx), T.int64)
        T.fence_proxy_async()
        T.sync_threads(_WG_BARRIER[c], 128)
        if lane < R:
            if row_idx[r] >= 0:
                T.call_extern("handle", "sparse_mqa_bulk_add_u64", T.address_of(stage[c, buf, lane, 0]),
                              T.address_of(Acc[b_i, row_idx[r], c * C0]), C0 * 8)
                if c == 1 and tail > 0:
                    T.call_extern("handle", "sparse_mqa_bulk_add_u64", T.address_of(stage[1, buf, lane, C0]),
                                  T.address_of(Acc[b_i, row_idx[r], D]), tail * 8)
            # no wait here: this round's reads overlap what the consumer does next
            T.call_extern("handle", "sparse_mqa_bulk_commit")

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
        with T.Kernel(n_rows, batch, groups, threads=THREADS, prelude=prelude) as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, dqk], bf16)
            dO_shared = T.alloc_shared([HG, D], bf16)
            KV_shared = T.alloc_shared([STAGES, BI, dqk], bf16)
            idx_shared = T.alloc_shared([STAGES, BI], i32)  # -1 where the slot is invalid
            P32_shared = T.alloc_shared([HG, BI], f32)
            P_shared = T.alloc_shared([HG, BI], bf16)
            dS_shared = T.alloc_shared([HG, BI], bf16)
            # one buffer for both consumers' rings (separate buffers used in separate branches could be
            # given the same memory by the allocator, which cannot see that the branches run concurrently)
            stage = T.alloc_shared([2, NBUF, R, W0], i64)

            acc_s = T.alloc_fragment([HG, BI], f32)
            acc_dp = T.alloc_fragment([HG, BI], f32)
            acc_dq0 = T.alloc_fragment([HG, C0], f32)
            acc_dq1 = T.alloc_fragment([HG, C0], f32)
            acc_dqt = T.alloc_fragment([HG, max(tail, 16)], f32)
            # dkv^T per block (columns x slots): on wgmma, M = columns; the tail's belongs to consumer 1
            acc_dkv0 = T.alloc_fragment([C0, BI], f32)
            acc_dkv1 = T.alloc_fragment([C0, BI], f32)
            acc_dkvt = T.alloc_fragment([max(tail, 16), BI], f32)
            lse_f = T.alloc_fragment([HG], f32)
            delta_f = T.alloc_fragment([HG], f32)
            idx_r = T.alloc_local([PASSES], i32)
            row_idx = T.alloc_local([NR], i32)  # issuing threads: this block's destination rows
            ok = T.alloc_var("bool")

            # k_ready: 128 cp.async arrivals (data landed) + 128 plain arrivals (idx_shared written)
            bar_k_ready = T.alloc_barrier(arrive_count=[256] * STAGES)
            bar_k_free = T.alloc_barrier(arrive_count=[256] * STAGES)
            bar_p = T.alloc_barrier(arrive_count=128)  # consumer 0: P of this block in shared memory
            bar_ds = T.alloc_barrier(arrive_count=128)  # consumer 1: dS of this block in shared memory
            bar_pds_free = T.alloc_barrier(arrive_count=256)  # both: done reading this block's P and dS

            tx = T.get_thread_binding()
            b_i = by
            s_i = Rows[bx]
            h0 = bz * HG
            fx = Fx[0]
            c2 = sm_scale * log2e
            n_valid = T.max(T.min(TopkLen[b_i, s_i], topk), 0)
            n_blk = T.ceildiv(n_valid, BI)

            # padded heads: q = dO = 0 (and below lse +inf, Delta 0), so P = dS = 0; rows >= heads never touched
            for i in T.serial(T.ceildiv(Q_CHUNKS, THREADS)):
                c = i * THREADS + tx
                if c < Q_CHUNKS:
                    for v in T.vectorized(8):
                        Q_shared[c // ROW_CHUNKS, (c % ROW_CHUNKS) * 8 + v] = T.if_then_else(
                            h0 + c // ROW_CHUNKS < heads,
                            Q[b_i, s_i, h0 + c // ROW_CHUNKS, (c % ROW_CHUNKS) * 8 + v], T.cast(0, bf16))
            for i in T.serial(T.ceildiv(O_CHUNKS, THREADS)):
                c = i * THREADS + tx
                if c < O_CHUNKS:
                    for v in T.vectorized(8):
                        dO_shared[c // (D // 8), (c % (D // 8)) * 8 + v] = T.if_then_else(
                            h0 + c // (D // 8) < heads,
                            dO[b_i, s_i, h0 + c // (D // 8), (c % (D // 8)) * 8 + v], T.cast(0, bf16))
            # KV rows start at zero and afterwards hold only rows gathered for valid slots: finite
            for i in T.serial(T.ceildiv(KV_CHUNKS, THREADS)):
                c = i * THREADS + tx
                if c < KV_CHUNKS:
                    for v in T.vectorized(8):
                        KV_shared[c // (BI * ROW_CHUNKS), (c // ROW_CHUNKS) % BI, (c % ROW_CHUNKS) * 8 + v] = T.cast(
                            0, bf16)
            T.fence_proxy_async()
            T.sync_threads()

            if tx < 128:
                # consumer 0
                T.set_max_nreg(NREG[0], 1)
                for h in T.Parallel(HG):
                    lse_f[h] = T.if_then_else(h0 + h < heads, Lse2[b_i, s_i, h0 + h], T.infinity(f32))
                T.clear(acc_dq0)
                if defer > 0:
                    # deferred rounds read the previous block's dkv and rows (never at kb = 0: this is for the checker)
                    T.clear(acc_dkv0)
                    for r in T.unroll(NR):
                        row_idx[r] = -1
                for kb in T.serial(n_blk):
                    st = kb % STAGES
                    T.barrier_wait(bar_k_ready[st], (kb // STAGES) & 1)
                    T.wgmma_gemm(Q_shared[:, 0:C0], KV_shared[st, :, 0:C0], acc_s, transpose_B=True,
                                 clear_accum=True)
                    T.wgmma_gemm(Q_shared[:, C0:D], KV_shared[st, :, C0:D], acc_s, transpose_B=True)
                    if tail > 0:
                        T.wgmma_gemm(Q_shared[:, D:dqk], KV_shared[st, :, D:dqk], acc_s, transpose_B=True)
                    if kb > 0:
                        for r in late_a:
                            send_round(0, r, kb - 1, stage, acc_dkv0, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                    T.wait_wgmma(0)
                    for h, j in T.Parallel(HG, BI):
                        acc_s[h, j] = T.if_then_else(idx_shared[st, j] >= 0, T.exp2(acc_s[h, j] * c2 - lse_f[h]),
                                                     0.0)
                    if kb > 0:
                        # consumer 1 is done with the previous block's P
                        T.barrier_wait(bar_pds_free, (kb - 1) & 1)
                    T.copy(acc_s, P32_shared)
                    T.copy(acc_s, P_shared)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_p)
                    T.barrier_wait(bar_ds, kb & 1)
                    T.gemm(dS_shared, KV_shared[st, :, 0:C0], acc_dq0)
                    if kb > 0:
                        for r in late_b:
                            send_round(0, r, kb - 1, stage, acc_dkv0, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                    # this block's destination rows, read before the producer may overwrite idx_shared[st]
                    if tx < R:
                        for r in T.unroll(NR):
                            row_idx[r] = idx_shared[st, r * R + tx]
                    T.barrier_arrive(bar_k_free[st])
                    T.gemm(Q_shared[:, 0:C0], dS_shared, acc_dkv0, transpose_A=True, clear_accum=True)
                    T.gemm(dO_shared[:, 0:C0], P_shared, acc_dkv0, transpose_A=True)
                    T.barrier_arrive(bar_pds_free)
                    for r in early:
                        send_round(0, r, kb, stage, acc_dkv0, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                if n_blk > 0:
                    for r in late:
                        send_round(0, r, n_blk - 1, stage, acc_dkv0, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                for h, d in T.Parallel(HG, C0):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, d] = T.cast(acc_dq0[h, d], bf16)
                if tx < R:
                    T.call_extern("handle", "sparse_mqa_bulk_wait_all")

            elif tx < 256:
                # consumer 1
                T.set_max_nreg(NREG[1], 1)
                for h in T.Parallel(HG):
                    delta_f[h] = T.if_then_else(h0 + h < heads, Delta[b_i, s_i, h0 + h], 0.0)
                T.clear(acc_dq1)
                if tail > 0:
                    T.clear(acc_dqt)
                if defer > 0:
                    T.clear(acc_dkv1)
                    if tail > 0:
                        T.clear(acc_dkvt)
                    for r in T.unroll(NR):
                        row_idx[r] = -1
                for kb in T.serial(n_blk):
                    st = kb % STAGES
                    T.barrier_wait(bar_k_ready[st], (kb // STAGES) & 1)
                    T.wgmma_gemm(dO_shared[:, 0:C0], KV_shared[st, :, 0:C0], acc_dp, transpose_B=True,
                                 clear_accum=True)
                    T.wgmma_gemm(dO_shared[:, C0:D], KV_shared[st, :, C0:D], acc_dp, transpose_B=True)
                    if kb > 0:
                        for r in late_a:
                            send_round(1, r, kb - 1, stage, acc_dkv1, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                    T.wait_wgmma(0)
                    T.barrier_wait(bar_p, kb & 1)
                    if kb > 0:
                        # consumer 0 is done with the previous block's dS
                        T.barrier_wait(bar_pds_free, (kb - 1) & 1)
                    for h, j in T.Parallel(HG, BI):
                        acc_dp[h, j] = P32_shared[h, j] * (acc_dp[h, j] - delta_f[h]) * sm_scale
                    T.copy(acc_dp, dS_shared)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_ds)
                    T.gemm(dS_shared, KV_shared[st, :, C0:D], acc_dq1)
                    if tail > 0:
                        T.gemm(dS_shared, KV_shared[st, :, D:dqk], acc_dqt)
                    if kb > 0:
                        for r in late_b:
                            send_round(1, r, kb - 1, stage, acc_dkv1, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                    if tx - 128 < R:
                        for r in T.unroll(NR):
                            row_idx[r] = idx_shared[st, r * R + tx - 128]
                    T.barrier_arrive(bar_k_free[st])
                    T.gemm(Q_shared[:, C0:D], dS_shared, acc_dkv1, transpose_A=True, clear_accum=True)
                    T.gemm(dO_shared[:, C0:D], P_shared, acc_dkv1, transpose_A=True)
                    if tail > 0:
                        T.gemm(Q_shared[:, D:dqk], dS_shared, acc_dkvt, transpose_A=True, clear_accum=True)
                    T.barrier_arrive(bar_pds_free)
                    for r in early:
                        send_round(1, r, kb, stage, acc_dkv1, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                if n_blk > 0:
                    for r in late:
                        send_round(1, r, n_blk - 1, stage, acc_dkv1, acc_dkvt, row_idx, Acc, tx, fx, b_i)
                for h, d in T.Parallel(HG, C0):
                    if h0 + h < heads:
                        dQ[b_i, s_i, h0 + h, C0 + d] = T.cast(acc_dq1[h, d], bf16)
                if tail > 0:
                    for h, d in T.Parallel(HG, tail):
                        if h0 + h < heads:
                            dQ[b_i, s_i, h0 + h, D + d] = T.cast(acc_dqt[h, d], bf16)
                if tx - 128 < R:
                    T.call_extern("handle", "sparse_mqa_bulk_wait_all")

            else:
                # producer: validity by the contract's rule, then gather only valid rows
                T.set_max_nreg(NREG[2], 0)
                p = tx - 256
                for kb in T.serial(n_blk):
                    st = kb % STAGES
                    # indices are read before waiting for the buffer: their latency overlaps the wait
                    for r in T.unroll(PASSES):
                        idx_r[r] = -1
                        if kb * BI + r * ROWS_PER_PASS + p // 8 < n_valid:
                            idx_r[r] = Indices[b_i, s_i, kb * BI + r * ROWS_PER_PASS + p // 8]
                    T.barrier_wait(bar_k_free[st], ((kb // STAGES) & 1) ^ 1)
                    for r in T.unroll(PASSES):
                        row = r * ROWS_PER_PASS + p // 8
                        ok = T.And(kb * BI + row < n_valid, T.And(idx_r[r] >= 0, idx_r[r] < seq_kv))
                        if p % 8 == 0:
                            idx_shared[st, row] = T.if_then_else(ok, idx_r[r], -1)
                        if ok:
                            for u in T.serial(CHUNKS):
                                T.ptx_cp_async(
                                    T.access_ptr(KV_shared[st, row, 64 * u + (p % 8) * 8], "w", 8),
                                    T.access_ptr(KV[b_i, idx_r[r], 64 * u + (p % 8) * 8], "r", 8),
                                    8,
                                )
                    T.cp_async_barrier_noinc(bar_k_ready[st])
                    T.barrier_arrive(bar_k_ready[st])

    return sparse_mqa_bwd
