"""The 64-head backward's fixed point, one scale per KV row (TileLang): the bound pass, the row scales, the conversion.

dkv row j sums a term from every (query, slot, head group) that names it. The main kernel (``backward_ws``) rounds
each term to an int32 multiple of 2**-F_j and adds the integers, so the sum is exact and order-free; F_j must keep
every partial sum of the row inside int32, which a bound B_j on the row's total |contribution| gives:
F_j = ROW_HEADROOM - ceil(log2 B_j) (``bwd_plan``).

``sparse_mqa_bwd_bound`` (one block = one query x 64 heads, 384 threads, ``build_bound``; the last wave's queries
split over several blocks by top-k block, ``BwdPlan.bound_split``) forms, per valid slot, the bound on each element
of its dkv term, summed over the group's heads:

    P_h (|sm_scale| max|q_h| |dP_h - Delta_h| + max|dO_h|) (1 + BOUND_MARGIN),

with S and dP as the main kernel forms them (fp32 products of the same bf16 operands, summed on the tensor cores in
another tile order: the last bits may differ), and P and dS before the main kernel rounds them to bf16 (2**-8 each:
the margin covers that, and ROW_HEADROOM's two bits the rest), and counts it in its KV row's octave: bucket b holds
terms in (2**(b - 128), 2**(b - 127)] (``smqa_octave_add``, one integer add). Integer adds need no fixed point, so
nothing global has to be known first, and the counts are the same whatever the order. Its prologue forms Delta_h =
out_h . dO_h, max|q_h| and max|dO_h|, and from the contract's lse and sink the kernel LSE (``LSE_PRELUDE``); it writes
Delta and the kernel LSE for the main kernel, and with a sink p_sink Delta for d_sink: no pass before this one.
Its ``stored`` build also writes P and dS, bf16 as the main kernel would round them, for the main kernel to read
instead of forming them (``bwd_plan``, "stored P and dS"): the pass already forms S and dP for the bound.
``sparse_mqa_bwd_scales`` sums a row's counts times their octaves' upper ends in float64, in bucket order: B_j, at
most twice the bound the terms sum to. ``sparse_mqa_bwd_convert`` turns the int32 sums into bf16 with one rounding:
float64 holds acc * 2**-F_j exactly, and cvt.rn.bf16.f64 rounds it once, as the NumPy oracle does.
"""

# No ``from __future__ import annotations``: TileLang evaluates the kernel's parameter annotations.

import functools
import struct

from sparse_mqa_testkit import contract

from . import backward_ws, bwd_plan
from .target import EXECUTION_BACKEND, TARGET

HG = 64  # heads a block
THREADS = 384  # three warpgroups
ROWS = 128 // 8  # KV rows a pass of the producer's gather: 8 threads a row, 16 bytes each
# registers per thread (setmaxnreg) of WG0 (q in registers), WG1 (dO) and the producer; the launch gives each 168
NREG = (224, 224, 56)
assert sum(NREG) == 3 * 168
WG0_TRACE = 1  # WG0's named barrier, in the timing probe's build only
TILES = 3  # the bound pass's KV tiles: block i in tile i % TILES
# the producer's row lists (block i's in list i % ROW_LISTS): WG1 frees a tile before WG0 counts the block's rows,
# so a list outlives its tile by a block
ROW_LISTS = TILES + 1
# the ``stored`` build: where WG0's P and WG1's dS are staged in the block's tile, past the hand-over (bytes), and
# the named barrier each warpgroup's staging takes
PDS_STAGE = (16384, 16384 + 64 * 72 * 2)
PDS_BARRIERS = (7, 8)
SCALE_ROWS = 32  # KV rows a block of the row-scale kernel, one thread each
SCALE_THREADS = 512  # the threads that copy a block's counts
CONVERT_ROWS = 8  # KV rows a block of the conversion

PRELUDE = r"""
// one term t >= 0 of a KV row's bound, counted in the octave whose upper end 2**(b - 127) is the smallest power of
// two >= t (b = 1 for subnormals, 256 for inf and NaN, nothing for 0): integer adds, so order-free and exact
__device__ __forceinline__ void smqa_octave_add(int* hist, float t) {
  unsigned int u = __float_as_uint(t) & 0x7fffffffu;
  if (u == 0u) return;
  int e = static_cast<int>(u >> 23);
  int b = e == 255 ? 256 : (e == 0 ? 1 : e + ((u & 0x7fffffu) != 0u));
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(hist + b) : "memory");
}
// a warpgroup's 64 x 64 wgmma accumulator summed over its rows (thread t holds rows 16 w + t % 32 / 4 and 8 more,
// columns 8 k + 2 (t % 4) + e, at acc[4 k + 2 r + e]): the thread's two rows, its warp's eight row groups (xor 4, 8,
// 16), then red[w * 64 + column], the four warps' sums for the caller to add in order
__device__ __forceinline__ void smqa_col_sums(const float* acc, float* red, int t) {
  int w = t >> 5, lane = t & 31;
  #pragma unroll
  for (int k = 0; k < 8; ++k) {
    #pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = acc[4 * k + e] + acc[4 * k + 2 + e];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (lane < 4) red[w * 64 + 8 * k + 2 * lane + e] = v;
    }
  }
}
// the hand-over of a 64 x 64 wgmma accumulator from one warpgroup to another with the same layout: thread t's 32
// values at ex[128 k + t] (a warp's stores and loads, 128 consecutive bytes); ex is raw shared memory to both sides
__device__ __forceinline__ void smqa_ex_put(void* ex, const float* v, int t) {
  #pragma unroll
  for (int k = 0; k < 32; ++k) static_cast<float*>(ex)[128 * k + t] = v[k];
}
__device__ __forceinline__ void smqa_ex_mul(float* acc, const void* ex, int t) {
  #pragma unroll
  for (int k = 0; k < 32; ++k) acc[k] *= static_cast<const float*>(ex)[128 * k + t];
}
// stored P and dS (the ``stored`` build): a warpgroup's 64 x 64 accumulator v (times m and scale where m is given)
// as bf16 pairs pk[16], 0 in a column whose row list entry is negative (the main kernel's P and dS there)
__device__ __forceinline__ void smqa_pack(unsigned int* pk, const float* v, const float* m, float scale,
                                          const int* rows, int t) {
  int lane = t & 31;
  #pragma unroll
  for (int k = 0; k < 8; ++k) {
    int col = 8 * k + 2 * (lane & 3);
    bool ok0 = rows[col] >= 0, ok1 = rows[col + 1] >= 0;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      float a = v[4 * k + 2 * half], b = v[4 * k + 2 * half + 1];
      if (m != nullptr) {  // dS = P (dP - Delta) sm_scale, in the main kernel's order
        a = a * m[4 * k + 2 * half] * scale;
        b = b * m[4 * k + 2 * half + 1] * scale;
      }
      unsigned int pr;  // column col in the low half, col + 1 in the high
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(pr) : "f"(ok1 ? b : 0.0f), "f"(ok0 ? a : 0.0f));
      pk[2 * k + half] = pr;
    }
  }
}
__device__ __forceinline__ const float* smqa_no_factor() { return nullptr; }
// ... then out to dst + off as rows of 64 slots (row r at r * ld, rows below nrows): staged in st, a padded
// [64][72] bf16 tile (the fragment's 4-byte stores meet no bank conflict), and each row's 128 bytes written by 8
// threads' 16-byte stores; bar_id: a named barrier of the warpgroup's 128 threads. dst comes const: TileLang declares
// a buffer the kernel writes only through calls like this one read-only
__device__ __forceinline__ void smqa_rows_out(void* st, const unsigned int* pk, const void* dst, long long off,
                                              long long ld, int nrows, int t, int bar_id) {
  unsigned short* s = static_cast<unsigned short*>(st);
  int w = t >> 5, lane = t & 31;
  #pragma unroll
  for (int k = 0; k < 8; ++k) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      int row = 16 * w + (lane >> 2) + 8 * half;
      *reinterpret_cast<unsigned int*>(s + row * 72 + 8 * k + 2 * (lane & 3)) = pk[2 * k + half];
    }
  }
  asm volatile("bar.sync %0, 128;" :: "r"(bar_id) : "memory");
  unsigned short* d = static_cast<unsigned short*>(const_cast<void*>(dst)) + off;
  #pragma unroll
  for (int u = 0; u < 4; ++u) {
    int row = (t >> 3) + 16 * u, c8 = t & 7;
    int4 x = *reinterpret_cast<const int4*>(s + row * 72 + c8 * 8);
    if (row < nrows) *reinterpret_cast<int4*>(d + row * ld + c8 * 8) = x;
  }
}
__device__ __forceinline__ void* smqa_at(void* p, int bytes) { return static_cast<char*>(p) + bytes; }
__device__ __forceinline__ void smqa_ex_get(float* acc, const void* ex, int t) {
  #pragma unroll
  for (int k = 0; k < 32; ++k) acc[k] = static_cast<const float*>(ex)[128 * k + t];
}
// tile p's buffer (a, b or c): a select, so that one copy of the code serves every tile
__device__ __forceinline__ void* smqa_tile(int p, void* a, void* b, void* c) { return p == 0 ? a : (p == 1 ? b : c); }
// ... and its bytes past a
__device__ __forceinline__ int smqa_tile_off(int p, void* a, void* b, void* c) {
  return static_cast<int>(static_cast<char*>(smqa_tile(p, a, b, c)) - static_cast<char*>(a));
}
"""
# the call's LSE conventions per (query, head), as ``contract.lse_to_base2`` and ``contract.sink_probability`` state
# them in torch (logaddexp as torch's CUDA kernel forms it, LOG2E rounded to float32 as torch's multiply rounds it):
# the kernel LSE (base 2, the sink folded in; +inf for an empty row) and the sink's probability
LSE_PRELUDE = r"""
__device__ __forceinline__ float smqa_logaddexp(float a, float b) {
  if (isinf(a) && a == b) return a;
  return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
}
__device__ __forceinline__ float smqa_lse2(float lse, float sink, int has_sink) {
  if (lse == -INFINITY) lse = INFINITY;
  if (has_sink) {
    float folded = smqa_logaddexp(lse, sink);
    lse = (lse == INFINITY || sink == INFINITY) ? INFINITY : folded;
  }
  return lse * %s;
}
__device__ __forceinline__ float smqa_sink_prob(float lse, float sink) {
  if (sink == INFINITY) return 1.0f;
  if (isinf(lse)) return 0.0f;
  return expf(sink - smqa_logaddexp(lse, sink));
}
""" % (float.hex(struct.unpack("f", struct.pack("f", contract.LOG2E))[0]) + "f")
# cp.async of a KV row's N 16-byte pieces (chunks) of this thread, 128 bytes apart in global memory: one source
# address and immediate offsets, where a 64-bit index a piece takes four instructions a copy; the destinations are the
# shared addresses given, the first NV moved by ``off_v`` bytes and the rest by ``off_r`` (a tile chosen at run time,
# one copy of the code for all: the gather's ``copy_row``; the bound pass's prelude holds it)
CP_ROW_PRELUDE = r"""
template <int N, int NV, typename... D>
__device__ __forceinline__ void smqa_cp_row(const void* src, int off_v, int off_r, D... dst) {
  static_assert(sizeof...(D) == N, "one shared address a chunk");
  const char* s = static_cast<const char*>(src);
  const void* d[N] = {dst...};
  #pragma unroll
  for (int u = 0; u < N; ++u)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(d[u])) + (u < NV ? off_v : off_r)),
                   "l"(s + 128 * u) : "memory");
}
"""
# one rounding, to nearest even (sm_90); the bf16 type's constructor from double goes through float. The prelude sits
# before the headers, so it stores the 16 bits itself
CONVERT_PRELUDE = r"""
__device__ __forceinline__ void smqa_store_bf16_f64(void* dst, double x) {
  unsigned short h;
  asm("cvt.rn.bf16.f64 %0, %1;" : "=h"(h) : "d"(x));
  *static_cast<unsigned short*>(dst) = h;
}
"""


def gather_macros(T, BI: int, ROWS: int, dqk: int, ahead: int, split: int = 0):
    """The bound pass's gather, as T.macro pieces: ``prefetch_rows`` loads this thread's rows of block kb into
    registers (-1 past the valid slots); ``issue`` sends block kb's copies into a tile (cp.async, 16 bytes a thread,
    8 threads a row, ROWS rows a pass; by the contract's validity rule a row no valid slot backs is not copied),
    commits them, and loads the rows of block kb + ``ahead`` (the next block this thread gathers); ``publish`` puts
    the rows ``issue`` copied into row list p of ``rows_s``, for the thread that counts their bounds. A tile is two
    buffers: ``KVt`` holds columns below ``split`` and ``Rt`` the rest from column 0 (``split`` 0: ``KVt`` all);
    ``off`` (two int32, bytes) moves the copies from ``KVt`` and ``Rt`` to another tile of the same layout."""
    PASSES = BI // ROWS
    head = (split or dqk) // 64  # pieces of a row in KVt

    @T.macro
    def copy_row(KVt, Rt, off, row, KV, b_i, j, t):
        # thread t's 16-byte pieces of KV row j (columns 64 u + 8 (t % 8)) into tile row ``row``: one source address,
        # the rest 128-byte immediate offsets from it (smqa_cp_row), the destinations as the tile's layout puts them,
        # moved by off[0] bytes (KVt's) and off[1] (Rt's)
        T.call_extern("handle", f"smqa_cp_row<{dqk // 64}, {head}>", T.access_ptr(KV[b_i, j, (t % 8) * 8], "r", 8),
                      off[0], off[1],
                      *([T.access_ptr(KVt[row, 64 * u + (t % 8) * 8], "w", 8) for u in range(head)]
                        + [T.access_ptr(Rt[row, 64 * u + (t % 8) * 8], "w", 8) for u in range(dqk // 64 - head)]))

    @T.macro
    def prefetch_rows(nxt, Indices, b_i, s_i, kb, n_valid, t):
        for r in T.unroll(PASSES):
            slot = kb * BI + r * ROWS + t // 8
            nxt[r] = T.if_then_else(slot < n_valid, Indices[b_i, s_i, T.max(T.min(slot, n_valid - 1), 0)], -1)

    @T.macro
    def issue(KVt, Rt, off, KV, nxt, jr, Indices, b_i, s_i, kb, n_valid, seq_kv, t):
        for r in T.unroll(PASSES):
            jr[r] = T.if_then_else(T.And(nxt[r] >= 0, nxt[r] < seq_kv), nxt[r], -1)
            if jr[r] >= 0:
                copy_row(KVt, Rt, off, r * ROWS + t // 8, KV, b_i, jr[r], t)
        T.ptx_commit_group()
        prefetch_rows(nxt, Indices, b_i, s_i, kb + ahead, n_valid, t)

    @T.macro
    def publish(rows_s, jr, p, t):
        for r in T.unroll(PASSES):
            if t % 8 == 0:
                rows_s[p, r * ROWS + t // 8] = jr[r]

    return prefetch_rows, issue, publish


# trace=True: a timing probe's build (``benchmarks/trace_backward.py``): thread 0's int64 stamps, slot k over
# Delta[.., 2k] (so that build's Delta is not the kernel's)
TRACE_SLOTS = ("start", "query_ready", "prep_done", "loop_start", "loop_end", "smid", "blocks")
# ... and each warpgroup's SM cycles in each phase of its loop, summed over its blocks (WG0's, WG1's and the producer's
# first thread put them, as int64, in the slots after TRACE_SLOTS)
TRACE_PHASES = (("wg0_full", "wg0_s", "wg0_p", "wg0_count", "wg0_dpdone", "wg0_put"),
                ("wg1_full", "wg1_dp", "wg1_f", "wg1_pfull", "wg1_sums"),
                ("prod_free", "prod_issue"))
TRACE_CLOCK = r"""
__device__ __forceinline__ int smqa_clk() {
  int t;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(t));
  return t;
}
"""


def tile_parity(i):
    """The parity of the bound pass's mbarrier phase for block i on its KV tile (tile i % TILES, used by every
    TILES-th block: the tile's full / free barriers complete once a use). ``i`` an int or a TIR expression."""
    return (i // TILES) & 1


def build_bound(dqk: int, dv: int, trace: bool = False, stored: bool = False):
    """``sparse_mqa_bwd_bound``: Delta, and each valid slot's bound counted in its KV row's octave (module docstring).

    Three warpgroups. WG0 runs S = q K^T and WG1 dP = dO V^T, each [64 heads x BI slots] with its query rows in
    registers (wgmma's A operand). Shared memory holds ``TILES`` KV tiles: one of its own, one over q and one over dO
    once both are in registers. A tile is two buffers, V's columns and the rest (q likewise), so that the one over dO
    fits; S is two products, one per buffer. The producer gathers block i into tile i % TILES as soon as WG1 is done
    with block i - TILES there, so the gather runs up to two blocks ahead; its copies arrive on the tile's mbarrier as
    they land (cp.async.mbarrier.arrive), and the rows it copied go in list i % ``ROW_LISTS``. WG0 forms P, counts
    the block before (below) and hands P to WG1 in the block's own tile, once both products have read it (``dpdone``:
    WG1's dP is done), and goes on to the next S; WG1 forms each element's |sm_scale| max|q_h| |dP - Delta_h| +
    max|dO_h|, multiplies it by P, frees the tile, sums over heads (``smqa_col_sums``: each of its warps' sums) and
    goes on to the next dP, while WG0's next S runs; WG0 adds the four warps' sums in turn (a fixed order) and counts
    each valid slot while it waits for that dP. Hand-overs are mbarriers: full / free (a tile; ``tile_parity``),
    dpdone, pfull and sums (once a block). Registers move from the producer to WG0 and WG1 with setmaxnreg (``NREG``).
    ``trace``: a timing probe's build (``TRACE_SLOTS``), never the backend's.

    ``stored``: the pass also writes P and dS (bf16, the main kernel's values: 0 on a slot no valid row backs) for
    the main kernel to read (``bwd_plan`` "stored P and dS"), into ``Pds``, [2, B, S, H, pds_len] flat. WG0 stages
    P in the block's tile past the hand-over after it arrives on ``pfull``, and writes it out as whole rows; WG1
    stages dS there after it arrives on ``sums``. A tile is free once both have read their stage (``free`` counts
    both warpgroups). Otherwise ``Pds`` and ``pds_len`` are not read."""
    import tilelang.language as T

    BI = bwd_plan.BOUND_BLOCK
    PASSES = BI // ROWS
    OC = dv // 8 // 32  # 16-byte chunks of out a lane, per head
    rope = dqk - dv  # a KV row's (and q's) columns past V's: a buffer of their own in each tile
    batch, seq_len, seq_kv, heads, topk, n_rows = T.dynamic("batch, seq_len, seq_kv, heads, topk, n_rows")
    n_sink, sd_batch, sd_len, sd_heads, n_pds = T.dynamic("n_sink, sd_batch, sd_len, sd_heads, n_pds")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    log2e = contract.LOG2E
    margin = 1.0 + bwd_plan.BOUND_MARGIN
    load_query = backward_ws.query_tiles(T, HG, split=dv, dqk=dqk)  # q in two buffers: V's columns, the rest
    prefetch_rows, issue, publish = gather_macros(T, BI, ROWS, dqk, ahead=1, split=dv)
    trace_alloc, stamp, stamp_end, put = backward_ws.tracing(T, TRACE_SLOTS)
    slot_of = {name: len(TRACE_SLOTS) + k for k, name in enumerate(n for role in TRACE_PHASES for n in role)}

    @T.macro
    def tick(ph, c0, name, role):
        # the cycles since the last tick, to phase ``name`` (32-bit clock: a difference wraps correctly)
        now = T.call_extern("int32", "smqa_clk")
        ph[TRACE_PHASES[role].index(name)] += now - c0[0]
        c0[0] = now

    @T.macro
    def put_phases(ph, role, Delta, b_i, s_i, h0):
        for k, name in enumerate(TRACE_PHASES[role]):  # a Python tuple: unrolled
            T.call_extern("handle", "smqa_put", T.address_of(Delta[b_i, s_i, h0 + 2 * slot_of[name]]),
                          T.cast(ph[k], T.int64))

    assert HG * BI <= HG * dv // 2 and BI == HG  # the hand-over fits in a tile's V buffer; tiles b, c view q's, dO's
    assert PDS_STAGE[0] == HG * BI * 4 and PDS_STAGE[1] + HG * 72 * 2 <= BI * dv * 2  # the stages fit past it

    @T.macro
    def tile_product(rows_f, V0, V1, V2, acc, p, clear):
        # a warpgroup's [HG x BI] product of its query rows (registers) with tile p's buffer (issued, not waited)
        if p == 0:
            T.wgmma_gemm(rows_f, V0, acc, transpose_B=True, clear_accum=clear)
        elif p == 1:
            T.wgmma_gemm(rows_f, V1, acc, transpose_B=True, clear_accum=clear)
        else:
            T.wgmma_gemm(rows_f, V2, acc, transpose_B=True, clear_accum=clear)

    def tile(p, a, b, c, dtype="handle", helper="smqa_tile"):
        # tile p's buffer among a, b, c (smqa_tile: a select), or its bytes past a's (smqa_tile_off, int32)
        return T.call_extern(dtype, helper, p, T.address_of(a[0, 0]), T.address_of(b[0, 0]), T.address_of(c[0, 0]))

    @T.macro
    def count_block(Hist, rows_s, red_s, bar_sums, b_i, i, tx):
        # WG0 counts block i once WG1's four warps have put their sums (in order: a fixed sum)
        T.barrier_wait(bar_sums, i & 1)
        if tx < BI:
            if rows_s[i % ROW_LISTS, tx] >= 0:
                T.call_extern("handle", "smqa_octave_add", T.address_of(Hist[b_i, rows_s[i % ROW_LISTS, tx], 0]),
                              (red_s[tx] + red_s[BI + tx] + red_s[2 * BI + tx] + red_s[3 * BI + tx]) * margin)

    @T.macro
    def out_rows(O, ob, b_i, s_i, h0, heads, tx):
        # this lane's columns of out for its warp's heads w, w + 8, ..., all loads in flight together (into registers)
        w, lane = tx // 32, tx % 32
        for i in T.unroll(HG // 8):
            for c in T.unroll(OC):
                for v in T.vectorized(8):
                    ob[(i * OC + c) * 8 + v] = O[b_i, s_i, T.min(h0 + i * 8 + w, heads - 1), (c * 32 + lane) * 8 + v]

    @T.macro
    def max_abs(st, buf, cols, w, lane):
        # st[3 i + 2] = max(st[3 i + 2], |buf[8 i + w, :cols]|) for the warp's heads, this lane's 16-byte chunks
        for c in T.unroll(T.ceildiv(cols // 8, 32)):
            if c * 32 + lane < cols // 8:
                for v in T.unroll(8):
                    for i in T.unroll(HG // 8):
                        st[3 * i + 2] = T.max(st[3 * i + 2],
                                              T.abs(T.cast(buf[i * 8 + w, (c * 32 + lane) * 8 + v], f32)))

    @T.macro
    def heads_prep(Qv, Qr, dO_shared, delta_s, c_s, g_s, ob, st, h0, heads, sm_abs, tx):
        # warp w takes heads w, w + 8, ...: Delta (its lanes' columns in order, then the butterfly), max|q|, max|dO|
        # (st[3 i + k]: Delta, max|dO|, max|q| of head 8 i + w), all eight heads' chains in flight together
        w, lane = tx // 32, tx % 32
        for k in T.unroll(3 * HG // 8):
            st[k] = 0.0
        for c in T.unroll(OC):
            for v in T.unroll(8):
                for i in T.unroll(HG // 8):
                    st[3 * i] += T.cast(ob[(i * OC + c) * 8 + v], f32) * T.cast(
                        dO_shared[i * 8 + w, (c * 32 + lane) * 8 + v], f32)
                    st[3 * i + 1] = T.max(st[3 * i + 1],
                                          T.abs(T.cast(dO_shared[i * 8 + w, (c * 32 + lane) * 8 + v], f32)))
        max_abs(st, Qv, dv, w, lane)
        if rope:
            max_abs(st, Qr, rope, w, lane)
        for i in T.unroll(HG // 8):
            st[3 * i] = T.warp_reduce_sum(st[3 * i])
            st[3 * i + 1] = T.warp_reduce_max(st[3 * i + 1])
            st[3 * i + 2] = T.warp_reduce_max(st[3 * i + 2])
        if lane == 0:
            for i in T.unroll(HG // 8):
                h = i * 8 + w
                delta_s[h] = T.if_then_else(h0 + h < heads, st[3 * i], 0.0)
                c_s[h] = T.if_then_else(h0 + h < heads, sm_abs * st[3 * i + 2], 0.0)
                g_s[h] = T.if_then_else(h0 + h < heads, st[3 * i + 1], 0.0)

    @T.prim_func
    def sparse_mqa_bwd_bound(
        Q: T.Tensor([batch, seq_len, heads, dqk], bf16),
        O: T.Tensor([batch, seq_len, heads, dv], bf16),
        dO: T.Tensor([batch, seq_len, heads, dv], bf16),
        KV: T.Tensor([batch, seq_kv, dqk], bf16),
        Indices: T.Tensor([batch, seq_len, topk], i32),
        TopkLen: T.Tensor([batch, seq_len], i32),
        Lse: T.Tensor([batch, seq_len, heads], f32),
        Sink: T.Tensor([n_sink], f32),
        Rows: T.Tensor([n_rows], i32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        Lse2: T.Tensor([batch, seq_len, heads], f32),
        SinkDelta: T.Tensor([sd_batch, sd_len, sd_heads], f32),
        Hist: T.Tensor([batch, seq_kv, bwd_plan.OCTAVES], i32),
        Pds: T.Tensor([n_pds], bf16),
        sm_scale: f32,
        has_sink: i32,
        pds_len: i32,
        whole: i32,
        pieces: i32,
        per_piece: i32,
    ):
        groups = T.ceildiv(heads, HG)
        # Rows[:whole] one block each; each later row in ``pieces`` blocks of ``per_piece`` top-k blocks (the last
        # wave's rows spread over the machine: bwd_plan.bound_split)
        with T.Kernel(whole + (n_rows - whole) * pieces, batch, groups, threads=THREADS,
                      prelude=CP_ROW_PRELUDE + PRELUDE + LSE_PRELUDE
                      + (backward_ws.TRACE_PRELUDE + TRACE_CLOCK if trace else "")) as (bx, by, bz):
            Qv = T.alloc_shared([HG, dv], bf16)
            dO_shared = T.alloc_shared([HG, dv], bf16)
            Va = T.alloc_shared([BI, dv], bf16)  # tile 0
            if rope:
                Qr = T.alloc_shared([HG, rope], bf16)
                Ra = T.alloc_shared([BI, rope], bf16)
                Rb = T.view(Qr, [BI, rope], bf16)
                Rc = T.alloc_shared([BI, rope], bf16)
                q_r = T.alloc_fragment([HG, rope], bf16)
            else:
                Qr, Ra, Rb, Rc = None, None, None, None  # no second buffers: passed along, never touched
            # tiles 1 and 2 over q and dO once both are in registers. Each tile's V buffer holds its block's hand-over
            # (WG0's P, smqa_ex_put) once both products have read it: raw shared memory to both warpgroups, whatever
            # the tile's layout
            Vb = T.view(Qv, [BI, dv], bf16)
            Vc = T.view(dO_shared, [BI, dv], bf16)
            red_s = T.alloc_shared([4 * BI], f32)  # WG1's four warps' sums over their heads, for WG0 to count
            rows_s = T.alloc_shared([ROW_LISTS, BI], i32)
            delta_s = T.alloc_shared([HG], f32)
            lse2_s = T.alloc_shared([HG], f32)  # the kernel LSE, +inf on padded heads
            c_s = T.alloc_shared([HG], f32)
            g_s = T.alloc_shared([HG], f32)
            q_v = T.alloc_fragment([HG, dv], bf16)  # WG0's
            do_f = T.alloc_fragment([HG, dv], bf16)  # WG1's
            acc = T.alloc_fragment([HG, BI], f32)  # WG0: S, then P
            accp = T.alloc_fragment([HG, BI], f32)  # WG1: dP, then its factor, then the terms
            if stored:
                pf = T.alloc_fragment([HG, BI], f32)  # WG1: P from the hand-over
                pk = T.alloc_local([16], T.uint32)  # P (WG0) or dS (WG1) as bf16 pairs
            lse_f = T.alloc_fragment([HG], f32)
            c_f = T.alloc_fragment([HG], f32)
            g_f = T.alloc_fragment([HG], f32)
            d_f = T.alloc_fragment([HG], f32)
            nxt = T.alloc_local([PASSES], i32)
            off = T.alloc_local([2], i32)  # the producer's: its tile's bytes past tile 0's, V's and the rest's
            jr = T.alloc_local([PASSES], i32)
            ob = T.alloc_local([HG // 8 * dv // 32], bf16)  # this thread's out columns of its warp's 8 heads
            st = T.alloc_local([3 * HG // 8], f32)
            bar_q = T.alloc_barrier(arrive_count=1)  # q and dO landed (TMA)
            # the producer's copies into a tile have landed: 128 cp.async arrivals and 128 plain ones
            bar_full = T.alloc_barrier(arrive_count=[256] * TILES)
            # WG1 has read a tile's hand-over (and stored, WG0 and WG1 their stages there)
            bar_free = T.alloc_barrier(arrive_count=[256 if stored else 128] * TILES)
            bar_dpdone = T.alloc_barrier(arrive_count=128)  # WG1's dP of the block is done: its tile may take P
            bar_pfull = T.alloc_barrier(arrive_count=128)  # WG0 has written P (and counted the block before)
            bar_sums = T.alloc_barrier(arrive_count=128)  # WG1 has written the block's sums
            bar_regs = T.alloc_barrier(arrive_count=256)  # WG0 and WG1 have q and dO in registers
            if trace:
                stamps = trace_alloc()
                ph = T.alloc_local([max(len(r) for r in TRACE_PHASES)], i32)
                c0 = T.alloc_local([1], i32)
                for k in T.unroll(max(len(r) for r in TRACE_PHASES)):
                    ph[k] = 0
                stamp(stamps, "start")
            tx = T.get_thread_binding()
            part = T.max(bx - whole, 0)
            row = T.if_then_else(bx < whole, bx, whole + part // pieces)
            kb0 = T.if_then_else(bx < whole, 0, part % pieces * per_piece)
            b_i, s_i, h0 = by, Rows[row], bz * HG
            # stored: the block's first P element, its dS's, and the rows it writes (its real heads)
            pds_at = ((T.cast(b_i, T.int64) * seq_len + s_i) * heads + h0) * pds_len + kb0 * BI
            pds_half = T.cast(batch, T.int64) * seq_len * heads * pds_len
            pds_rows = T.min(heads - h0, HG)
            c2 = sm_scale * log2e
            n_valid = T.max(T.min(TopkLen[b_i, s_i], topk), 0)
            kb1 = T.if_then_else(bx < whole, T.ceildiv(n_valid, BI), T.min(kb0 + per_piece, T.ceildiv(n_valid, BI)))
            n_blk = T.max(kb1 - kb0, 0)
            n_mine = T.min(n_valid, kb1 * BI)  # slots past this piece's blocks are the next piece's: not copied here
            if tx >= 256:  # block 0's copies fly with q and dO
                prefetch_rows(nxt, Indices, b_i, s_i, kb0, n_mine, tx - 256)
                off[0] = 0
                off[1] = 0
                issue(Va, Ra, off, KV, nxt, jr, Indices, b_i, s_i, kb0, n_mine, seq_kv, tx - 256)
                publish(rows_s, jr, 0, tx - 256)
                T.cp_async_barrier_noinc(bar_full[0])
                T.barrier_arrive(bar_full[0])
            load_query(Q, dO, Qv, Qr, dO_shared, bar_q, b_i, s_i, h0)
            if tx < 256:
                out_rows(O, ob, b_i, s_i, h0, heads, tx)
            if tx < HG:
                lse2_s[tx] = T.if_then_else(h0 + tx < heads, T.call_extern(
                    "float32", "smqa_lse2", Lse[b_i, s_i, T.min(h0 + tx, heads - 1)],
                    Sink[T.min(T.min(h0 + tx, heads - 1), n_sink - 1)], has_sink), T.infinity(f32))
            T.mbarrier_wait_parity(bar_q, 0)
            T.sync_threads()
            if trace:
                stamp(stamps, "query_ready")
            if tx < 256:
                heads_prep(Qv, Qr, dO_shared, delta_s, c_s, g_s, ob, st, h0, heads, T.abs(sm_scale), tx)
            T.sync_threads()
            if trace:
                stamp(stamps, "prep_done")
            if T.And(T.And(tx < HG, h0 + tx < heads), kb0 == 0):  # a row's first piece writes its per-head values
                Delta[b_i, s_i, h0 + tx] = delta_s[tx]
                Lse2[b_i, s_i, h0 + tx] = lse2_s[tx]
                if has_sink:
                    SinkDelta[b_i, s_i, h0 + tx] = T.call_extern(
                        "float32", "smqa_sink_prob", Lse[b_i, s_i, h0 + tx], Sink[T.min(h0 + tx, n_sink - 1)]
                    ) * delta_s[tx]
            if tx < 128:
                T.set_max_nreg(NREG[0], 1)
                T.copy(Qv, q_v)
                if rope:
                    T.copy(Qr, q_r)
                T.barrier_arrive(bar_regs)  # then tiles 1 and 2 (over q and dO) may be written
                for h in T.Parallel(HG):
                    lse_f[h] = lse2_s[h]  # +inf on padded heads, so P = 0 there
                if trace:
                    stamp(stamps, "loop_start")
                    c0[0] = T.call_extern("int32", "smqa_clk")
                for i in T.serial(n_blk):
                    p = i % TILES
                    T.barrier_wait(bar_full[p], tile_parity(i))
                    if trace:
                        tick(ph, c0, "wg0_full", 0)
                    T.fence_proxy_async()
                    tile_product(q_v, Va, Vb, Vc, acc, p, True)
                    if rope:
                        tile_product(q_r, Ra, Rb, Rc, acc, p, False)
                    T.wait_wgmma(0)
                    if trace:
                        tick(ph, c0, "wg0_s", 0)
                    # a slot no valid row backs holds whatever its tile row held: its column is never counted
                    for h, j in T.Parallel(HG, BI):
                        acc[h, j] = T.exp2(acc[h, j] * c2 - lse_f[h])
                    if trace:
                        tick(ph, c0, "wg0_p", 0)
                    if i > 0:
                        count_block(Hist, rows_s, red_s, bar_sums, b_i, i - 1, tx)
                    if trace:
                        tick(ph, c0, "wg0_count", 0)
                    T.barrier_wait(bar_dpdone, i & 1)  # then P may go over the tile
                    if trace:
                        tick(ph, c0, "wg0_dpdone", 0)
                    T.call_extern("handle", "smqa_ex_put", tile(p, Va, Qv, dO_shared), acc.data, tx)
                    T.barrier_arrive(bar_pfull)  # and WG1 may write the next sums: this block's are counted
                    if stored:  # P out, off WG1's path
                        T.call_extern("handle", "smqa_pack", pk.data, acc.data,
                                      T.call_extern("handle", "smqa_no_factor"), sm_scale,
                                      T.address_of(rows_s[i % ROW_LISTS, 0]), tx)
                        T.call_extern("handle", "smqa_rows_out",
                                      T.call_extern("handle", "smqa_at", tile(p, Va, Qv, dO_shared), PDS_STAGE[0]),
                                      pk.data, Pds.data, pds_at + i * BI, T.cast(pds_len, T.int64), pds_rows, tx,
                                      PDS_BARRIERS[0])
                        T.barrier_arrive(bar_free[p])
                    if trace:
                        tick(ph, c0, "wg0_put", 0)
                if n_blk > 0:
                    count_block(Hist, rows_s, red_s, bar_sums, b_i, n_blk - 1, tx)
                if trace:
                    stamp_end(stamps, "loop_end", n_blk)
                    T.sync_threads(WG0_TRACE, 128)  # WG0's Delta writes are done: the stamps go over them
                    if tx == 0:
                        put(stamps, TRACE_SLOTS, lambda k: Delta[b_i, s_i, h0 + 2 * k])
                        put_phases(ph, 0, Delta, b_i, s_i, h0)
            elif tx < 256:
                T.set_max_nreg(NREG[1], 1)
                T.copy(dO_shared, do_f)
                T.barrier_arrive(bar_regs)
                for h in T.Parallel(HG):
                    c_f[h] = c_s[h]
                    g_f[h] = g_s[h]
                    d_f[h] = delta_s[h]
                if trace:
                    c0[0] = T.call_extern("int32", "smqa_clk")
                for i in T.serial(n_blk):
                    p = i % TILES
                    T.barrier_wait(bar_full[p], tile_parity(i))
                    if trace:
                        tick(ph, c0, "wg1_full", 1)
                    T.fence_proxy_async()
                    tile_product(do_f, Va, Vb, Vc, accp, p, True)
                    T.wait_wgmma(0)
                    T.barrier_arrive(bar_dpdone)
                    if trace:
                        tick(ph, c0, "wg1_dp", 1)
                    for h, j in T.Parallel(HG, BI):
                        accp[h, j] = (accp[h, j] - d_f[h] if stored else c_f[h] * T.abs(accp[h, j] - d_f[h]) + g_f[h])
                    if trace:
                        tick(ph, c0, "wg1_f", 1)
                    T.barrier_wait(bar_pfull, i & 1)
                    if trace:
                        tick(ph, c0, "wg1_pfull", 1)
                    if stored:  # dS packed from P and dP - Delta, then the terms; dS out once the sums are put
                        T.call_extern("handle", "smqa_ex_get", pf.data, tile(p, Va, Qv, dO_shared), tx - 128)
                        T.call_extern("handle", "smqa_pack", pk.data, pf.data, accp.data, sm_scale,
                                      T.address_of(rows_s[i % ROW_LISTS, 0]), tx - 128)
                        for h, j in T.Parallel(HG, BI):
                            accp[h, j] = (c_f[h] * T.abs(accp[h, j]) + g_f[h]) * pf[h, j]
                        T.call_extern("handle", "smqa_col_sums", accp.data, T.address_of(red_s[0]), tx - 128)
                        T.barrier_arrive(bar_sums)
                        T.call_extern("handle", "smqa_rows_out",
                                      T.call_extern("handle", "smqa_at", tile(p, Va, Qv, dO_shared), PDS_STAGE[1]),
                                      pk.data, Pds.data, pds_half + pds_at + i * BI, T.cast(pds_len, T.int64),
                                      pds_rows, tx - 128, PDS_BARRIERS[1])
                        T.barrier_arrive(bar_free[p])
                    else:
                        T.call_extern("handle", "smqa_ex_mul", accp.data, tile(p, Va, Qv, dO_shared), tx - 128)
                        T.barrier_arrive(bar_free[p])
                        T.call_extern("handle", "smqa_col_sums", accp.data, T.address_of(red_s[0]), tx - 128)
                        T.barrier_arrive(bar_sums)
                    if trace:
                        tick(ph, c0, "wg1_sums", 1)
                if trace:
                    if tx == 128:
                        put_phases(ph, 1, Delta, b_i, s_i, h0)
            else:
                T.set_max_nreg(NREG[2], 0)
                T.barrier_wait(bar_regs, 0)
                if trace:
                    c0[0] = T.call_extern("int32", "smqa_clk")
                # block i into tile i % TILES once WG1 has read block i - TILES's hand-over there; its rows into list
                # i % ROW_LISTS, which WG0 finished counting from (block i - 4) before it handed that one over
                for i in T.serial(1, n_blk):
                    p = i % TILES
                    if i >= TILES:
                        T.barrier_wait(bar_free[p], tile_parity(i - TILES))
                    if trace:
                        tick(ph, c0, "prod_free", 2)
                    off[0] = tile(p, Va, Qv, dO_shared, "int32", "smqa_tile_off")
                    off[1] = 0
                    if rope:
                        off[1] = tile(p, Ra, Qr, Rc, "int32", "smqa_tile_off")
                    issue(Va, Ra, off, KV, nxt, jr, Indices, b_i, s_i, kb0 + i, n_mine, seq_kv, tx - 256)
                    publish(rows_s, jr, i % ROW_LISTS, tx - 256)
                    T.cp_async_barrier_noinc(bar_full[p])
                    T.barrier_arrive(bar_full[p])
                    if trace:
                        tick(ph, c0, "prod_issue", 2)
                if trace:
                    if tx == 256:
                        put_phases(ph, 2, Delta, b_i, s_i, h0)

    return sparse_mqa_bwd_bound


def build_scales():
    """``sparse_mqa_bwd_scales``: a row's bound from its octave counts, B_j = sum_b count_b 2**(b - 127) in float64,
    buckets in order (one thread a row: a fixed order), then F_j, the row's scale 2**F_j and its inverse (0 and 1 for
    a row no valid slot names; a non-finite term makes B_j infinite and F_j its lower clamp). A block's threads first
    copy its rows' counts into shared memory together, so no thread waits on its row's 256 scattered loads in turn."""
    import tilelang.language as T

    batch, seq_kv = T.dynamic("batch, seq_kv")
    f32, f64, i32 = T.float32, T.float64, T.int32
    n = bwd_plan.OCTAVES
    R = SCALE_ROWS

    @T.prim_func
    def sparse_mqa_bwd_scales(
        Hist: T.Tensor([batch, seq_kv, n], i32),
        Scale: T.Tensor([batch, seq_kv], f32),
        Inv: T.Tensor([batch, seq_kv], f32),
    ):
        with T.Kernel(T.ceildiv(seq_kv, R), batch, threads=SCALE_THREADS) as (bx, by):
            counts = T.alloc_shared([R, n], i32)  # a row's stride, 257 words, puts the R threads in distinct banks
            bnd = T.alloc_var(f64)
            up = T.alloc_var(f64)
            tx = T.get_thread_binding()
            for r, b in T.Parallel(R, n):
                counts[r, b] = Hist[by, T.min(bx * R + r, seq_kv - 1), b]
            T.sync_threads()
            if tx < R:
                j = bx * R + tx
                bnd = 0.0
                up = T.exp2(T.cast(-126, f64))  # bucket 1's upper end; doubling keeps every power of two exact
                for b in T.serial(n - 1):
                    bnd += T.cast(counts[tx, b + 1], f64) * up
                    up = up * 2.0
                if counts[tx, n - 1] > 0:
                    bnd = T.infinity(f64)
                f = T.max(T.min(float(bwd_plan.ROW_HEADROOM) - T.ceil(T.log2(bnd)), float(bwd_plan.ROW_F_MAX)),
                          float(bwd_plan.ROW_F_MIN))
                if j < seq_kv:
                    Scale[by, j] = T.cast(T.if_then_else(bnd > 0.0, T.exp2(f), 0.0), f32)
                    Inv[by, j] = T.cast(T.if_then_else(bnd > 0.0, T.exp2(-f), 1.0), f32)

    return sparse_mqa_bwd_scales


def build_convert(dqk: int):
    """``sparse_mqa_bwd_convert``: dkv = bf16(acc * 2**-F_j) in float64, one rounding (module docstring)."""
    import tilelang.language as T

    batch, seq_kv = T.dynamic("batch, seq_kv")
    bf16, f32, f64, i32 = T.bfloat16, T.float32, T.float64, T.int32
    R = CONVERT_ROWS

    @T.prim_func
    def sparse_mqa_bwd_convert(
        Acc: T.Tensor([batch, seq_kv, dqk], i32),
        Inv: T.Tensor([batch, seq_kv], f32),
        dKV: T.Tensor([batch, seq_kv, dqk], bf16),
    ):
        with T.Kernel(T.ceildiv(seq_kv, R), batch, threads=128, prelude=CONVERT_PRELUDE) as (bx, by):
            for r, d in T.Parallel(R, dqk):
                j = T.min(bx * R + r, seq_kv - 1)
                if bx * R + r < seq_kv:
                    T.call_extern("handle", "smqa_store_bf16_f64", T.address_of(dKV[by, j, d]),
                                  T.cast(Acc[by, j, d], f64) * T.cast(Inv[by, j], f64))

    return sparse_mqa_bwd_convert


def _compile(program):
    import tilelang

    return tilelang.compile(program, out_idx=None, target=TARGET, execution_backend=EXECUTION_BACKEND)


def describe(dqk: int, dv: int, stored: bool = False) -> str:
    return f"sparse_mqa_bwd_bound, _scales, _convert Dqk={dqk} Dv={dv}" + (" stored P,dS" if stored else "")


@functools.lru_cache(maxsize=None)
def compiled(dqk: int, dv: int, stored: bool = False):
    """(bound pass, row scales, conversion) for head dims (Dqk, Dv), compiled (or loaded from TILELANG_CACHE_DIR);
    ``stored``: the bound pass that also writes P and dS."""
    return _compile(build_bound(dqk, dv, stored=stored)), _compile(build_scales()), _compile(build_convert(dqk))
