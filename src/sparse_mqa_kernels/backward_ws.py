"""Warp-specialised main kernel of the deterministic backward for 64-head groups (``backward``).

One thread block = one query row x 64 heads, 384 threads in three warpgroups, no producer of its own (cuDNN's SM90
shape, with a sender added):

- WG0 gathers each block of ``topk_block`` valid KV rows (cp.async; an invalid slot's index is never an address),
  runs S = Q K^T and dP = dO V^T, P (0 on invalid slots) and dS = P (dP - Delta) sm_scale, and dq[:, :N0]; in the
  ``stored_pds`` variant it reads the block's P and dS from the bound pass instead (``bwd_rows``: the same values),
  into registers while the block's rows fly, and its two products go;
- WG1 runs dq[:, N0:] and dkv^T = Q^T dS + dO^T P in ``NCH`` chunks of ``C`` columns (wgmma with the columns as M),
  rounds each chunk to int32 at its KV row's scale (``bwd_rows``: 2**F_j, from the bound pass) and stages it (its
  dq product goes out with chunk 0's two, and KV is freed once that one is done; a chunk's two products share one
  wait); in the ``stored_pds`` variant, whose WG0 needs fewer registers, WG1 holds two chunks and issues chunk
  c + 1's products before it stages chunk c (``stage_chunk``), and frees P and dS before it stages the last;
- WG2 sends the staged rows with ``red.relaxed.gpu.global.add.u32`` (``smqa_send_block``): integer adds, so the sum
  is exact and order-free; a row no valid slot backs is never sent.

WG0 and WG1 store their dq columns once, after the loop, 16 bytes of a row a thread (``smqa_store_rows``): the last
thing a thread block does, into an SMs-to-L2 port the sender keeps busy, so whole sectors count.

WG0 reads the next block's indices while this block's copies fly and their scales after its products; q and dO come
by TMA (``query_tiles``), and WG0's first block flies with them. Hand-overs are mbarriers: q (q and dO), k_ready /
k_free (the KV tile), p (P and dS in shared memory), pds_free (WG1 is done reading them), staged / read (a chunk of
the one staging buffer; parities in ``read_parity``). Registers move from the sender to the two computing
warpgroups with setmaxnreg (``NREG``, ``NREG_STORED``).
"""

# No ``from __future__ import annotations``: TileLang evaluates the kernel's parameter annotations.

from sparse_mqa_testkit import contract

from .bwd_plan import BOUND_BLOCK
from .target import SMEM_LIMIT

THREADS = 384
C = 64  # dkv columns a chunk
N0 = 256  # dq columns WG0 computes; WG1 has [N0, Dqk)
ROWS_PER_PASS = 16  # WG0's gather: 8 threads a KV row, 16 bytes each
# registers per thread (setmaxnreg) of WG0 and WG1, and of the sender: the launch gives each thread 168 (65536 / 384,
# rounded down to 8), and an increase only takes what a decrease in the same block gave back. The sender's 64 hold a
# whole chunk of its rows (pointers and values) without spilling; WG1 runs in 216
NREG = (224, 216, 64)
# the ``stored_pds`` variant: WG0 forms neither S nor dP, so WG1 can hold a second dkv^T chunk (``stage_chunk``); it
# needs 240 for that (232 spills 792 bytes), and WG0 at 200 spills three words, reloaded once a block
NREG_STORED = (200, 240, 64)
assert sum(NREG) == sum(NREG_STORED) == 3 * 168

PRELUDE = r"""
__device__ __forceinline__ void smqa_mbar_wait(void* bar, int parity) {
  unsigned int b = static_cast<unsigned int>(__cvta_generic_to_shared(bar));
  asm volatile("{\n\t.reg .pred P1;\n\tLAB_WAIT:\n\t"
               "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t@P1 bra DONE;\n\tbra LAB_WAIT;\n\tDONE:\n\t}"
               :: "r"(b), "r"(parity) : "memory");
}
// 16 bytes of stored P or dS (bf16 at base + off) into dst, or zeros where ok is false
__device__ __forceinline__ void smqa_ld16(void* dst, const void* base, long long off, bool ok) {
  int4 v = make_int4(0, 0, 0, 0);
  if (ok) v = *reinterpret_cast<const int4*>(static_cast<const unsigned short*>(base) + off);
  *reinterpret_cast<int4*>(dst) = v;
}
// a warpgroup's [64 x N] float32 wgmma accumulator (thread t: rows 16 w + lane / 4 and 8 more, columns
// 8 k + 2 (lane % 4) + e at acc[4 k + 2 r + e]) out as bf16 rows dst + row * ld, for rows r0 <= row < nrows. Each
// quad's 4 x 4 words (bf16 pairs) of four column groups are transposed by two shuffle stages, so that a thread stores
// 16 consecutive bytes of one row and a quad 64: whole 32-byte sectors, where the fragment's own 4-byte stores fill
// half of each. dst comes const: TileLang declares a buffer the kernel writes only through calls like this one
// read-only
template <int N>
__device__ __forceinline__ void smqa_store_rows(const float* acc, const void* dst, int ld, int r0, int nrows, int t) {
  int w = t >> 5, lane = t & 31, q = lane & 3;
  unsigned short* d = static_cast<unsigned short*>(const_cast<void*>(dst));
  #pragma unroll
  for (int r = 0; r < 2; ++r) {
    int row = 16 * w + (lane >> 2) + 8 * r;
    #pragma unroll
    for (int m = 0; m < N / 32; ++m) {
      unsigned int v[4];  // v[i]: this thread's pair of columns 8 (4 m + i) + 2 q
      #pragma unroll
      for (int i = 0; i < 4; ++i)  // the even column in the low half (the prelude sits before the bf16 headers)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v[i]) : "f"(acc[4 * (4 * m + i) + 2 * r + 1]),
            "f"(acc[4 * (4 * m + i) + 2 * r]));
      #pragma unroll
      for (int s = 1; s <= 2; s <<= 1) {  // v[i] of lane q ^ s for the slots whose bit s differs from q's
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (i & s) continue;
          unsigned int give = (q & s) ? v[i] : v[i | s];
          unsigned int got = __shfl_xor_sync(0xffffffffu, give, s);
          if (q & s) v[i] = got; else v[i | s] = got;
        }
      }
      // now v[j] is pair j of column group 4 m + q: columns 8 (4 m + q) .. + 7
      if (row >= r0 && row < nrows)
        *reinterpret_cast<int4*>(d + static_cast<long long>(row) * ld + 8 * (4 * m + q)) =
            make_int4(static_cast<int>(v[0]), static_cast<int>(v[1]), static_cast<int>(v[2]), static_cast<int>(v[3]));
    }
  }
}
__device__ __forceinline__ void smqa_mbar_arrive(void* bar) {
  unsigned int b = static_cast<unsigned int>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(b) : "memory");
}
// the sender warpgroup, one call a top-k block: this warp's N staged rows (row i at stage + i * W, its KV row in column
// RC, negative for a slot no valid row backs) for each of the block's NCH chunks of C columns. A chunk costs its loads
// and reds (two 128-byte lines a row): all N rows' values are loaded and the stage freed before any red goes out (WG1
// stages the next chunk while they do). The row pointers are formed after chunk 0 is freed, off WG1's path: column RC
// is written with chunk 0 only, so it holds until the next block's, which waits for this block's last read. A row no
// valid slot backs points below acc (the test reads as r >= 0 either way) and is never sent. k0 is the block's first
// chunk number (mbarrier parities).
template <int N, int W, int D, int RC, int NCH, int C>
__device__ __forceinline__ void smqa_send_block(const int* stage, int* acc, int lane, void* staged, void* read,
                                                int k0) {
  int* p[N];
  #pragma unroll
  for (int c = 0; c < NCH; ++c) {
    smqa_mbar_wait(staged, (k0 + c) & 1);
    int v0[N], v1[N];
    #pragma unroll
    for (int i = 0; i < N; ++i) {
      v0[i] = stage[i * W + lane];
      v1[i] = stage[i * W + 32 + lane];
    }
    smqa_mbar_arrive(read);
    if (c == 0) {
      #pragma unroll
      for (int i = 0; i < N; ++i) {
        int r = stage[i * W + RC];
        p[i] = acc + static_cast<long long>(r) * D + lane;  // below acc for a row no valid slot backs
      }
    }
    #pragma unroll
    for (int i = 0; i < N; ++i) {
      if (p[i] >= acc) {
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p[i] + c * C), "r"(v0[i]));
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" :: "l"(p[i] + c * C + 32), "r"(v1[i]));
      }
    }
  }
}
"""


def read_parity(kb, c, nch: int):
    """The sender's ``read`` barrier completes once a chunk, in block-major order (block kb's chunk c is chunk
    kb * nch + c of the query): staging chunk c of block kb waits for the read of the chunk before it, the
    barrier's completion kb * nch + c - 1, whose phase parity this is (Python ints or TIR expressions). With the
    block's chunk number alone, kb + c + 1, the parity is right only for an odd chunk count: Dqk 512 hung."""
    return (kb * nch + c + 1) & 1


def query_tiles(T, HG: int, split: int = 0, dqk: int = 0):
    """``load_query`` (a T.macro): one query's q and dO rows of a head group into shared memory by TMA, completing
    one phase of the mbarrier ``bar`` (arrival count 1: one elected thread issues the copies and arrives); rows past
    the tensor's heads arrive as zeros (the copy's out-of-bounds fill). The caller waits on ``bar``. With ``split``
    (and ``dqk``), q's columns below it go to ``Q_shared`` and the rest to ``Q_rest``; else all of q to ``Q_shared``
    (``Q_rest`` unused)."""

    @T.macro
    def load_query(Q, dO, Q_shared, Q_rest, dO_shared, bar, b_i, s_i, h0):
        if split:
            T.tma_copy(Q[b_i, s_i, h0:h0 + HG, 0:split], Q_shared, barrier=bar)
            if dqk > split:
                T.tma_copy(Q[b_i, s_i, h0:h0 + HG, split:dqk], Q_rest, barrier=bar)
        else:
            T.tma_copy(Q[b_i, s_i, h0:h0 + HG, :], Q_shared, barrier=bar)
        T.tma_copy(dO[b_i, s_i, h0:h0 + HG, :], dO_shared, barrier=bar, annotations={"emit_arrive": 1})

    return load_query


TRACE_PRELUDE = r"""
__device__ __forceinline__ long long smqa_now() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ long long smqa_smid() {
  unsigned int s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ void smqa_put(void* dst, long long v) { *static_cast<long long*>(dst) = v; }
"""
# trace=True: where each block's time goes (``benchmarks/trace_backward.py``); slot k of the int64 stamps a block
# leaves in head 0's dq row, which that build does not store
TRACE_SLOTS = ("start", "query_ready", "first_block", "wg0_loop_end", "wg0_end", "wg1_first", "wg1_loop_end",
               "wg1_end", "sender_first", "sender_end", "smid", "blocks")


def tracing(T, slots):
    """A traced build's stamps by slot name (``TRACE_PRELUDE``), as T.macro: ``alloc()`` the int64 slots, ``stamp``
    a slot with %globaltimer, ``stamp_end`` the SM and the block count too, ``put`` the named slots, slot k at
    ``dst(k)``'s address."""
    at = {name: k for k, name in enumerate(slots)}

    def alloc():
        return T.alloc_local([len(slots)], T.int64)

    @T.macro
    def stamp(stamps, name):
        stamps[at[name]] = T.call_extern("int64", "smqa_now")

    @T.macro
    def stamp_end(stamps, name, n_blk):
        stamps[at[name]] = T.call_extern("int64", "smqa_now")
        stamps[at["smid"]] = T.call_extern("int64", "smqa_smid")
        stamps[at["blocks"]] = T.cast(n_blk, T.int64)

    @T.macro
    def put(stamps, names, dst):
        for name in names:  # a Python tuple: unrolled
            T.call_extern("handle", "smqa_put", T.address_of(dst(at[name])), stamps[at[name]])

    return alloc, stamp, stamp_end, put


def build_program(key, trace: bool = False):
    """TileLang prim_func for a 64-head ``bwd_plan.VariantKey``: dq, and dkv as int32 sums at each KV row's scale.
    ``trace``: a timing probe's build (``TRACE_SLOTS``), never the backend's."""
    import tilelang.language as T

    dqk, dv, HG, BI = key.dqk, key.dv, key.head_group, key.topk_block
    assert HG == 64, "the warp-specialised kernel serves 64-head groups"
    assert BI % ROWS_PER_PASS == 0 and BI % 4 == 0 and dqk % C == 0
    D = dv
    W = C + 4  # staged int32 a row: a chunk and the row's KV index, padded to 16 bytes
    NCH = dqk // C
    CHS = tuple(range(NCH))
    N1 = dqk - N0
    PASSES = BI // ROWS_PER_PASS
    CHUNKS = dqk // 64  # 16-byte copies a gathering thread makes a row
    smem = (HG * dqk + HG * D + BI * dqk + 2 * HG * BI) * 2 + (BI * W + 2 * BI) * 4
    assert smem <= SMEM_LIMIT, f"{smem} bytes of shared memory, over the {SMEM_LIMIT} an sm_90 block may use"
    load_query = query_tiles(T, HG)
    trace_alloc, stamp, stamp_end, put = tracing(T, TRACE_SLOTS)
    batch, seq_len, seq_kv, heads, topk, n_rows, n_pds = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows, n_pds")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    log2e = contract.LOG2E
    stored = key.stored_pds
    nreg = NREG_STORED if stored else NREG
    PIECES = HG * BI // 8 // 128  # stored: 16-byte pieces of P (and of dS) a WG0 thread loads a block
    assert not stored or (HG * BI // 8 % 128 == 0 and BI % 8 == 0)

    @T.macro
    def next_rows(rows, Indices, b_i, s_i, kb, n_valid, p):
        # this thread's KV rows of block kb, -1 past the valid slots
        for r in T.unroll(PASSES):
            rows[r] = -1
            if kb * BI + r * ROWS_PER_PASS + p // 8 < n_valid:
                rows[r] = Indices[b_i, s_i, kb * BI + r * ROWS_PER_PASS + p // 8]

    def valid(slot, j, n_valid, seq_kv):
        # the contract's validity rule; an invalid slot keeps -1 and is neither gathered nor sent
        return T.And(slot < n_valid, T.And(j >= 0, j < seq_kv))

    @T.macro
    def copy_row(KV_shared, KV, b_i, row, rows, r, p):
        # this thread's 16-byte pieces of KV row rows[r] into the tile's row ``row`` (cp.async)
        for u in T.serial(CHUNKS):
            T.ptx_cp_async(
                T.access_ptr(KV_shared[row, 64 * u + (p % 8) * 8], "w", 8),
                T.access_ptr(KV[b_i, rows[r], 64 * u + (p % 8) * 8], "r", 8),
                8,
            )

    @T.macro
    def gather_first(KV_shared, idx_shared, scale_shared, KV, RowScale, idx_n, sc_n, bar_k_ready, b_i, n_valid, seq_kv,
                     p):
        # WG0, before the loop: the first block's copies (as in the loop below), then its row scales; the rows it
        # does not gather are zeroed, so a slot never gathered holds finite values (later blocks leave the rows before)
        for r in T.unroll(PASSES):
            row = r * ROWS_PER_PASS + p // 8
            first_ok = valid(row, idx_n[r], n_valid, seq_kv)
            if p % 8 == 0:
                idx_shared[row] = T.if_then_else(first_ok, idx_n[r], -1)
            if first_ok:
                copy_row(KV_shared, KV, b_i, row, idx_n, r, p)
            else:
                for u in T.serial(CHUNKS):
                    for v in T.vectorized(8):
                        KV_shared[row, 64 * u + (p % 8) * 8 + v] = T.cast(0, bf16)
        T.cp_async_barrier_noinc(bar_k_ready)
        T.barrier_arrive(bar_k_ready)
        for r in T.unroll(PASSES):
            sc_n[r] = RowScale[b_i, T.min(T.max(idx_n[r], 0), seq_kv - 1)]
        for r in T.unroll(PASSES):
            if p % 8 == 0:
                scale_shared[r * ROWS_PER_PASS + p // 8] = T.if_then_else(
                    valid(r * ROWS_PER_PASS + p // 8, idx_n[r], n_valid, seq_kv), sc_n[r], 0.0)

    @T.macro
    def store_rows(acc, n, dQ, b_i, s_i, h0, col, heads, tx):
        # a warpgroup's dq columns [col, col + n) of the group's real heads (a traced build's stamps hold head 0's row)
        T.call_extern("handle", f"smqa_store_rows<{n}>", acc.data, T.address_of(dQ[b_i, s_i, h0, col]), dqk,
                      1 if trace else 0, T.min(heads - h0, HG), tx % 128)

    def n_products(c):
        # wgmma groups of chunk c (each product is one): dO^T P only where the chunk's columns are V's
        return 0 if c >= NCH else (2 if c * C < D else 1)

    @T.macro
    def chunk_products(Q_shared, dO_shared, P_shared, dS_shared, acc, c):
        # chunk c of dkv^T = Q^T dS + dO^T P into acc; its two products accumulate in flight
        T.wgmma_gemm(Q_shared[:, c * C:(c + 1) * C], dS_shared, acc, transpose_A=True, clear_accum=True)
        if c * C < D:
            T.wgmma_gemm(dO_shared[:, c * C:(c + 1) * C], P_shared, acc, transpose_A=True)

    @T.macro
    def stage_chunk(acc, stage, scale_f, row_j, bar_k_free, bar_pds_free, bar_read, bar_staged, kb, c, ahead, tx):
        # WG1: once chunk c's products are done (``ahead`` groups of the next chunk may still fly; wgmma groups
        # complete in order), its rows rounded at their scales into the stage, after the sender read the last chunk
        if c == 0:  # dq's product is the group before chunk 0's two
            T.wait_wgmma(2 + ahead)
            T.barrier_arrive(bar_k_free)
        T.wait_wgmma(ahead)
        if stored and c == NCH - 1:  # the block's last product is done: WG0 may write the next P and dS
            T.barrier_arrive(bar_pds_free)
        if c > 0:
            T.barrier_wait(bar_read, read_parity(kb, c, NCH))
        else:
            if kb > 0:
                T.barrier_wait(bar_read, read_parity(kb, c, NCH))
        for d, j in T.Parallel(C, BI):
            stage[0, j, d] = T.cast(T.round(acc[d, j] * scale_f[j]), i32)
        if T.And(tx - 128 < BI, c == 0):
            stage[0, tx - 128, C] = row_j  # once a block: the sender reads it at chunk 0
        T.barrier_arrive(bar_staged)

    @T.prim_func
    def sparse_mqa_bwd_ws(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        Lse2: T.Tensor([batch, seq_len, heads], f32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        Rows: T.Tensor([n_rows], i32),
        RowScale: T.Tensor([batch, seq_kv], f32),
        dQ: T.Tensor([batch, seq_len, heads, dqk], bf16),
        Acc: T.Tensor([batch, seq_kv, dqk], i32),
        Pds: T.Tensor([n_pds], bf16),
        sm_scale: f32,
        pds_len: i32,
    ):
        groups = T.ceildiv(heads, HG)
        with T.Kernel(n_rows, batch, groups, threads=THREADS, prelude=PRELUDE + (TRACE_PRELUDE if trace else "")) \
                as (bx, by, bz):
            Q_shared = T.alloc_shared([HG, dqk], bf16)
            dO_shared = T.alloc_shared([HG, D], bf16)
            KV_shared = T.alloc_shared([BI, dqk], bf16)
            idx_shared = T.alloc_shared([BI], i32)
            P_shared = T.alloc_shared([HG, BI], bf16)
            dS_shared = T.alloc_shared([HG, BI], bf16)
            if stored:
                pr = T.alloc_local([PIECES * 8], bf16)  # WG0: this thread's pieces of the block's P
                dr = T.alloc_local([PIECES * 8], bf16)  # ... and of dS
            else:
                acc_s = T.alloc_fragment([HG, BI], f32)
                acc_dp = T.alloc_fragment([HG, BI], f32)
            acc_dq0 = T.alloc_fragment([HG, N0], f32)
            acc_dq1 = T.alloc_fragment([HG, N1], f32)
            acc_kvt = T.alloc_fragment([C, BI], f32)  # a dkv^T chunk: M = columns
            if stored:
                acc_kvt2 = T.alloc_fragment([C, BI], f32)  # ... and the next one, in flight while one is staged
            scale_f = T.alloc_fragment([BI], f32)  # this block's row scales, in WG1's registers
            stage = T.alloc_shared([1, BI, W], i32)
            scale_shared = T.alloc_shared([BI], f32)
            row_j = T.alloc_var(i32)
            lse_f = T.alloc_fragment([HG], f32)
            delta_f = T.alloc_fragment([HG], f32)
            idx_r = T.alloc_local([PASSES], i32)
            idx_n = T.alloc_local([PASSES], i32)  # the next block's rows and scales
            sc_n = T.alloc_local([PASSES], f32)
            sc_r = T.alloc_local([PASSES], f32)
            ok = T.alloc_var("bool")
            bar_k_ready = T.alloc_barrier(arrive_count=256)  # 128 cp.async + 128 plain arrivals (WG0)
            bar_k_free = T.alloc_barrier(arrive_count=256)  # WG0 and WG1 done reading KV_shared
            bar_p = T.alloc_barrier(arrive_count=128)  # WG0: P and dS in shared memory
            bar_pds_free = T.alloc_barrier(arrive_count=128)  # WG1: done reading P and dS
            bar_staged = T.alloc_barrier(arrive_count=128)  # WG1 has staged a chunk
            bar_read = T.alloc_barrier(arrive_count=128)  # the sender has read it
            bar_q = T.alloc_barrier(arrive_count=1)  # q and dO landed (TMA)
            if trace:
                stamps = trace_alloc()
                stamp(stamps, "start")

            tx = T.get_thread_binding()
            b_i, s_i, h0 = by, Rows[bx], bz * HG
            c2 = sm_scale * log2e
            n_valid = T.max(T.min(TopkLen[b_i, s_i], topk), 0)
            n_blk = T.ceildiv(n_valid, BI)
            # stored: row h0's P at Pds[pds_at] (dS a half further); the bound pass wrote each row's slots up to its
            # last whole block of BOUND_BLOCK, and no piece past them is read
            pds_at = ((T.cast(b_i, T.int64) * seq_len + s_i) * heads + h0) * pds_len
            pds_half = T.cast(batch, T.int64) * seq_len * heads * pds_len
            pds_end = T.ceildiv(n_valid, BOUND_BLOCK) * BOUND_BLOCK
            # WG0's first block goes out while q and dO fly (k_ready tracks the block, bar_q the query)
            if tx < 128:
                next_rows(idx_n, Indices, b_i, s_i, 0, n_valid, tx)
            load_query(Q, dO, Q_shared, None, dO_shared, bar_q, b_i, s_i, h0)
            if tx < 128:
                gather_first(KV_shared, idx_shared, scale_shared, KV, RowScale, idx_n, sc_n, bar_k_ready, b_i, n_valid,
                             seq_kv, tx)
                T.ptx_commit_group()
            T.mbarrier_wait_parity(bar_q, 0)
            T.fence_proxy_async()
            T.sync_threads()
            if trace:
                stamp(stamps, "query_ready")

            if tx < 128:
                T.set_max_nreg(nreg[0], 1)
                if not stored:
                    for h in T.Parallel(HG):
                        lse_f[h] = T.if_then_else(h0 + h < heads, Lse2[b_i, s_i, h0 + h], T.infinity(f32))
                        delta_f[h] = T.if_then_else(h0 + h < heads, Delta[b_i, s_i, h0 + h], 0.0)
                T.clear(acc_dq0)
                p = tx
                for kb in T.serial(n_blk):
                    for r in T.unroll(PASSES):
                        idx_r[r] = idx_n[r]
                        sc_r[r] = sc_n[r]
                    if kb > 0:  # block 0 went out before the loop
                        T.barrier_wait(bar_k_free, (kb - 1) & 1)
                        for r in T.unroll(PASSES):
                            row = r * ROWS_PER_PASS + p // 8
                            ok = valid(kb * BI + row, idx_r[r], n_valid, seq_kv)
                            if p % 8 == 0:
                                idx_shared[row] = T.if_then_else(ok, idx_r[r], -1)
                                scale_shared[row] = T.if_then_else(ok, sc_r[r], 0.0)
                            if ok:
                                copy_row(KV_shared, KV, b_i, row, idx_r, r, p)
                        T.cp_async_barrier_noinc(bar_k_ready)
                        T.barrier_arrive(bar_k_ready)
                    next_rows(idx_n, Indices, b_i, s_i, kb + 1, n_valid, p)
                    if stored:
                        # piece p + 128 u: head row (p + 128 u) // (BI / 8), slots 8 ((p + 128 u) % (BI / 8)) on;
                        # zeros on padded heads and past the bound pass's last block
                        for u in T.unroll(PIECES):
                            for t, buf in ((0, pr), (1, dr)):  # a Python tuple: unrolled
                                T.call_extern(
                                    "handle", "smqa_ld16", T.address_of(buf[u * 8]), Pds.data,
                                    t * pds_half + pds_at + T.cast((p + 128 * u) // (BI // 8), T.int64) * pds_len
                                    + kb * BI + (p + 128 * u) % (BI // 8) * 8,
                                    T.And(h0 + (p + 128 * u) // (BI // 8) < heads,
                                          kb * BI + (p + 128 * u) % (BI // 8) * 8 < pds_end))
                        for r in T.unroll(PASSES):
                            sc_n[r] = RowScale[b_i, T.min(T.max(idx_n[r], 0), seq_kv - 1)]
                        if kb > 0:
                            T.barrier_wait(bar_pds_free, (kb - 1) & 1)
                        for u in T.unroll(PIECES):
                            for v in T.vectorized(8):
                                P_shared[(p + 128 * u) // (BI // 8), (p + 128 * u) % (BI // 8) * 8 + v] = pr[u * 8 + v]
                            for v in T.vectorized(8):
                                dS_shared[(p + 128 * u) // (BI // 8), (p + 128 * u) % (BI // 8) * 8 + v] = dr[u * 8 + v]
                        T.fence_proxy_async()
                        T.barrier_wait(bar_k_ready, kb & 1)
                        if trace:
                            if kb == 0:
                                stamp(stamps, "first_block")
                    else:
                        T.barrier_wait(bar_k_ready, kb & 1)
                        if trace:
                            if kb == 0:
                                stamp(stamps, "first_block")
                        T.wgmma_gemm(Q_shared, KV_shared, acc_s, transpose_B=True, clear_accum=True)
                        T.wgmma_gemm(dO_shared, KV_shared[:, 0:D], acc_dp, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(0)
                        for h, j in T.Parallel(HG, BI):
                            acc_s[h, j] = T.if_then_else(idx_shared[j] >= 0, T.exp2(acc_s[h, j] * c2 - lse_f[h]), 0.0)
                        for h, j in T.Parallel(HG, BI):
                            acc_dp[h, j] = acc_s[h, j] * (acc_dp[h, j] - delta_f[h]) * sm_scale
                        # the next block's rows have had this block's products to arrive
                        for r in T.unroll(PASSES):
                            sc_n[r] = RowScale[b_i, T.min(T.max(idx_n[r], 0), seq_kv - 1)]
                        if kb > 0:
                            T.barrier_wait(bar_pds_free, (kb - 1) & 1)
                        T.copy(acc_s, P_shared)
                        T.copy(acc_dp, dS_shared)
                        T.fence_proxy_async()
                    T.barrier_arrive(bar_p)
                    T.gemm(dS_shared, KV_shared[:, 0:N0], acc_dq0)
                    T.barrier_arrive(bar_k_free)
                if trace:
                    stamp(stamps, "wg0_loop_end")
                store_rows(acc_dq0, N0, dQ, b_i, s_i, h0, 0, heads, tx)
                if trace:
                    stamp_end(stamps, "wg0_end", n_blk)
                    if tx == 0:
                        put(stamps, TRACE_SLOTS[:5] + ("smid", "blocks"), lambda k: dQ[b_i, s_i, h0, 4 * k])
            elif tx < 256:
                T.set_max_nreg(nreg[1], 1)
                T.clear(acc_dq1)
                for kb in T.serial(n_blk):
                    T.barrier_wait(bar_p, kb & 1)
                    if trace:
                        if kb == 0:
                            stamp(stamps, "wg1_first")
                    # dq's share and chunk 0's products go out together; KV is free once the first group is done
                    T.wgmma_gemm(dS_shared, KV_shared[:, N0:dqk], acc_dq1)
                    if stored:
                        chunk_products(Q_shared, dO_shared, P_shared, dS_shared, acc_kvt, 0)
                    # this block's rows and scales, read before WG0 may gather the next block
                    if tx - 128 < BI:
                        row_j = idx_shared[tx - 128]
                    for j in T.Parallel(BI):
                        scale_f[j] = scale_shared[j]
                    for c in CHS:  # a Python tuple: the chunks unrolled (a range here would be a TIR loop)
                        if not stored:
                            chunk_products(Q_shared, dO_shared, P_shared, dS_shared, acc_kvt, c)
                            stage_chunk(acc_kvt, stage, scale_f, row_j, bar_k_free, bar_pds_free, bar_read, bar_staged,
                                        kb, c, 0, tx)
                        elif c % 2 == 0:  # stored: chunk c + 1's products fly while chunk c is staged
                            if c + 1 < NCH:
                                chunk_products(Q_shared, dO_shared, P_shared, dS_shared, acc_kvt2, c + 1)
                            stage_chunk(acc_kvt, stage, scale_f, row_j, bar_k_free, bar_pds_free, bar_read, bar_staged,
                                        kb, c, n_products(c + 1), tx)
                        else:
                            if c + 1 < NCH:
                                chunk_products(Q_shared, dO_shared, P_shared, dS_shared, acc_kvt, c + 1)
                            stage_chunk(acc_kvt2, stage, scale_f, row_j, bar_k_free, bar_pds_free, bar_read, bar_staged,
                                        kb, c, n_products(c + 1), tx)
                    if not stored:
                        T.barrier_arrive(bar_pds_free)
                if trace:
                    stamp(stamps, "wg1_loop_end")
                store_rows(acc_dq1, N1, dQ, b_i, s_i, h0, N0, heads, tx)
                if trace:
                    stamp(stamps, "wg1_end")
                    if tx == 128:
                        put(stamps, ("wg1_first", "wg1_loop_end", "wg1_end"), lambda k: dQ[b_i, s_i, h0, 4 * k])
            else:
                T.set_max_nreg(nreg[2], 0)
                for kb in T.serial(n_blk):
                    # every address here is in bounds for any kb: TileLang wraps a call in a bounds check when an
                    # address_of index may leave its buffer, and a sender that skipped this call would hang WG1
                    T.call_extern("handle", f"smqa_send_block<{BI // 4}, {W}, {dqk}, {C}, {NCH}, {C}>",
                                  T.address_of(stage[0, (tx - 256) // 32 * (BI // 4), 0]),
                                  T.address_of(Acc[b_i, 0, 0]), tx % 32, T.address_of(bar_staged[0]),
                                  T.address_of(bar_read[0]), kb * NCH)
                    if trace:
                        if kb == 0:
                            stamp(stamps, "sender_first")
                if trace:
                    stamp(stamps, "sender_end")
                    if tx == 256:
                        put(stamps, ("sender_first", "sender_end"), lambda k: dQ[b_i, s_i, h0, 4 * k])

    return sparse_mqa_bwd_ws
