"""Host-side plan of the deterministic sparse-MQA backward: pure Python, no torch or TileLang import.

The kernel (``backward``) and its NumPy model (``backward_model``) both execute exactly this plan:

head groups
    One thread block handles ``head_group`` heads of one query. ``head_group`` is the smallest of 16, 32, 64
    that holds H (16 is the smallest M a tensor-core GEMM tile takes), and 64 beyond that; H = 128 is two
    groups. Heads past H in the last group are *padding*: the kernel loads q = dO = 0, Delta = 0 and
    lse = +inf for them (so P = dS = 0 exactly) and never reads or writes row h >= H of any tensor.
top-k blocks
    Slots are processed ``topk_block`` at a time (``TOPK_BLOCKS``, by head group; the 64-head bound pass takes
    ``BOUND_BLOCK``); L is padded up to a multiple and padded slots t >= L are invalid: their index is never read,
    their KV row never gathered, their contribution never added.
query chunks
    Queries are launched ``query_chunk`` at a time: at most ``MAX_QUERY_CHUNK``, fewer when ``workspace_budget``,
    after the dkv sums [B, Skv, Dqk] (``accumulator_bytes``: needed once whatever the chunking, counted first), leaves
    room for fewer at ``staging_bytes_per_query`` plus 4 bytes a head each. What a chunk holds of its own is its
    row ids; Delta, the kernel LSE and, with a sink, p_sink Delta (d_sink's terms) are whole-call fp32 [B, S, H]
    tensors whatever the chunking (see ``BwdPlan.workspace_bytes`` for everything a call holds beside its outputs).
stored P and dS
    With 64-head groups the bound pass forms S and dP exactly as the main kernel does; when ``pds_budget`` allows
    (``BwdPlan.pds_bytes``: 4 bytes a (query, head, slot) for the whole call, since every row scale needs every
    query's bound first), it also writes P and dS (bf16, [B, S, H, ``pds_len``]) and the main kernel reads them
    instead of forming them: two products a block fewer. The bits are the same either way.
fixed point
    Every dkv contribution is rounded to an integer multiple of a power of two and the integers are summed, so the
    sum is exact and independent of order.
    16- and 32-head groups (and ``single_role``): one F a call, int64 sums. F comes from a cheap bound G on any
    partial sum of dkv (see ``fixed_point_exponent``): the largest F with G * 2**F <= 2**(ACC_BITS - HEADROOM_BITS).
    64-head groups: one F_j a KV row, int32 sums (half the bytes a term). F_j = ROW_HEADROOM - ceil(log2 B_j) for a
    bound B_j on the row's total |contribution| that a bound pass forms from the same products as the main kernel
    (``bwd_rows``, ``row_exponent``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from sparse_mqa_testkit import contract

HEAD_GROUPS = (16, 32, 64)
# top-k slots per block, by head group: the 16-head block's [16 x slots] score tile needs 32 slots to spread
# over its 4 warps; 32-head groups take 16; the 64-head main kernel 48 (its dkv^T chunks are [64 columns x 48 slots],
# and 48 leaves shared memory for its int32 staging)
TOPK_BLOCKS = {16: 32, 32: 16, 64: 48}
# the single-role body at 64 heads (``single_role``): its tiles fit shared memory at 16 slots a block, not at 48
SINGLE_ROLE_TOPK_BLOCK = 16
TOPK_BLOCK = TOPK_BLOCKS[64]
DEFAULT_WORKSPACE_BUDGET = 256 * 2**20  # bytes
# bytes of stored P and dS a call may hold (BackwardConfig.pds_budget): 2 GiB at B1 S4096 H64 L2048, 4 GiB at H128
DEFAULT_PDS_BUDGET = 8 * 2**30
SCALAR_BYTES = 64 * 2**10  # workspace_bytes' allowance for 0-d tensors and reduction staging
MAX_QUERY_CHUNK = 4096  # queries per launch: the anchor shape (S = 4096) is one launch
ACC_BITS = 62  # int64 accumulator: magnitudes stay below 2**62, one bit short of the sign
HEADROOM_BITS = 2  # covers bf16 rounding of P and dS, out vs recomputed P, and per-term rounding
F_MIN, F_MAX = -120, 120  # 2**F stays a normal float32 either way
# Cheap bound on |dS| mass per (query, head): sum_t |dS_t| <= (|<dO,V_t>| + |Delta|) <= 2 |dO| Vmax;
# the factor below covers bf16 rounding of out and of the products (<= 2**-7 relative each).
DS_BOUND_FACTOR = 2.0 * (1.0 + 2.0**-6)
# 64-head groups, one scale a KV row. The bound pass's own tile (its S and dP per warpgroup take 64 slots).
BOUND_BLOCK = 64
# A slot's bound, sum over heads of P (|sm_scale| max|q| |dP - Delta| + max|dO|), is formed from P and dP before
# the main kernel rounds P and dS to bf16 (2**-8 relative each): the margin covers that.
BOUND_MARGIN = 2.0**-7
# Each term counts in its octave (a power-of-two bucket of float32's exponent range; the last bucket non-finite),
# so B_j is at most twice the sum it bounds.
OCTAVES = 257
# B_j 2**F_j <= 2**29: two bits below int32's 2**31 for what B_j leaves out (the terms' own rounding, n / 2 units
# for n terms, and float32 rounding of the bound); F_j clamped so 2**F_j and 2**-F_j stay normal float32.
ROW_HEADROOM = 29
ROW_F_MIN, ROW_F_MAX = -120, 120
# a bucket counts terms in int32: at most S * L * head groups of them name one row
MAX_ROW_TERMS = 2**31 - 1

# What the conformance strategies bias sizes around (the default plan's tiles).
TILES = {"head_group": 64, "query_chunk": MAX_QUERY_CHUNK, "topk_block": TOPK_BLOCK}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class VariantKey:
    """Everything a compiled backward kernel is specialised on (B, S, Skv, H and L are runtime sizes).

    64-head groups run the warp-specialised body (dkv summed in int32 at a scale per KV row, ``bwd_rows``); 16- and
    32-head groups, and ``single_role``, the single-role body (int64 at one scale a call). Both compute the same
    products; the simpler body is the other's cross-check.
    """

    dqk: int
    dv: int
    head_group: int
    topk_block: int
    single_role: bool = False
    stored_pds: bool = False  # the warp-specialised body reading P and dS from the bound pass

    def __post_init__(self):
        if self.stored_pds and not self.warp_specialized:
            raise ValueError("stored_pds needs the warp-specialised body (head_group 64, not single_role)")

    @property
    def warp_specialized(self) -> bool:
        return self.head_group == 64 and not self.single_role

    def describe(self) -> str:
        body = "warp-specialised" if self.warp_specialized else "single-role"
        return (f"sparse_mqa_bwd Dqk{self.dqk} Dv{self.dv} head_group{self.head_group} "
                f"topk_block{self.topk_block} {body}" + (" stored P,dS" if self.stored_pds else ""))


@dataclass(frozen=True)
class BackwardConfig:
    """What a caller may choose beyond the contract's arguments.

    max_query_chunk: queries per launch (the workspace budget caps it too; the same dq, dkv and d_sink bits whatever
    the chunks); single_role: run 64-head groups on the single-role body as well (its int64 fixed point, one scale a
    call: dkv agrees with the default to rounding), to compare the two bodies; pds_budget: the bytes the 64-head
    path may hold of stored P and dS (``BwdPlan.pds_bytes``, 4 a (query, head, slot)): a call that needs more, or a
    budget of 0, has the main kernel form them itself, slower, with the same dq, dkv and d_sink bits.
    """

    max_query_chunk: int = MAX_QUERY_CHUNK
    single_role: bool = False
    pds_budget: int = DEFAULT_PDS_BUDGET


def head_group_for(H: int) -> int:
    """Heads per thread block for H heads: 16, 32 or 64."""
    if H < 1:
        raise ValueError(f"H must be >= 1, got {H}")
    return min(HEAD_GROUPS[-1], max(HEAD_GROUPS[0], _next_pow2(H)))


@dataclass(frozen=True)
class BwdPlan:
    """How one backward call is cut into thread blocks and launches."""

    B: int
    S: int
    Skv: int
    H: int
    L: int
    Dqk: int
    Dv: int
    head_group: int
    topk_block: int
    query_chunk: int
    stored_pds: bool = False  # the bound pass stores P and dS for the main kernel (64-head groups)

    @property
    def n_groups(self) -> int:
        return -(-self.H // self.head_group)

    @property
    def padded_heads(self) -> int:
        return self.n_groups * self.head_group

    @property
    def n_topk_blocks(self) -> int:
        return -(-self.L // self.topk_block)

    @property
    def padded_L(self) -> int:
        return self.n_topk_blocks * self.topk_block

    @property
    def n_chunks(self) -> int:
        return -(-self.S // self.query_chunk)

    def heads(self, g: int) -> range:
        """The real heads of group g (padding excluded): what the block may read and write."""
        if not 0 <= g < self.n_groups:
            raise IndexError(f"head group {g} out of range [0, {self.n_groups})")
        return range(g * self.head_group, min(self.H, (g + 1) * self.head_group))

    def bound_split(self, rows: int, n_sm: int) -> tuple[int, int, int]:
        """How the bound pass launches ``rows`` query rows on ``n_sm`` SMs (one block = one row x one head group):
        ``(whole, pieces, per_piece)``: the first ``whole`` rows one block each, each later row in ``pieces`` blocks of
        ``per_piece`` top-k blocks (BOUND_BLOCK slots). A launch whose last wave would hold r <= n_sm / 2 blocks
        splits its last r rows, so that wave fills the machine; its outputs (Delta, integer counts) are the same
        whatever the split."""
        n_blocks = -(-self.L // BOUND_BLOCK)
        last = rows * self.B * self.n_groups % n_sm
        if last == 0 or last > n_sm // 2 or last > rows or n_blocks == 1:
            return rows, 1, n_blocks
        per = -(-n_blocks // min(n_sm // last, n_blocks))
        return rows - last, -(-n_blocks // per), per

    def chunks(self) -> list[range]:
        """Query ranges, one launch each, in launch order."""
        return [range(s0, min(self.S, s0 + self.query_chunk)) for s0 in range(0, self.S, self.query_chunk)]

    def topk_blocks(self) -> list[range]:
        """Slot ranges of the padded top-k loop; slots >= L are padding (invalid, never read)."""
        return [range(t0, t0 + self.topk_block) for t0 in range(0, self.padded_L, self.topk_block)]

    @property
    def pds_len(self) -> int:
        """Slots a stored row of P or dS holds: L up to whole bound-pass blocks, which it writes whole (0 past the
        valid slots); the main kernel reads no 16-byte piece past a row's last bound-pass block."""
        return -(-self.L // BOUND_BLOCK) * BOUND_BLOCK

    def pds_bytes(self) -> int:
        """Stored P and dS: bf16 [B, S, H, pds_len] each."""
        return 4 * self.B * self.S * self.H * self.pds_len

    def key(self, single_role: bool = False) -> VariantKey:
        """The compiled kernel this plan runs (B, S, Skv, H and L are runtime values)."""
        wide = single_role and self.head_group == 64
        return VariantKey(self.Dqk, self.Dv, self.head_group, SINGLE_ROLE_TOPK_BLOCK if wide else self.topk_block,
                          single_role, self.stored_pds and not single_role)

    def row_scaled(self, single_role: bool = False) -> bool:
        """Whether dkv is summed in int32 at a scale per KV row (``bwd_rows``): 64-head groups on the
        warp-specialised body."""
        return self.key(single_role).warp_specialized

    def row_terms(self) -> int:
        """The most terms that can name one KV row: every slot of every query of a batch, in every head group."""
        return self.S * self.L * self.n_groups

    def accumulator_bytes(self, single_role: bool = False) -> int:
        """The dkv sums: int32 (4 a dkv element), or int64 (8)."""
        return (4 if self.row_scaled(single_role) else 8) * self.B * self.Skv * self.Dqk

    def chunk_bytes(self) -> int:
        """What ``make_plan``'s budget counts per chunk."""
        return staging_bytes_per_query(self.B, self.H) * self.query_chunk + 4 * self.H

    def workspace_bytes(self, *, sink: bool, topk_given: bool, single_role: bool = False) -> int:
        """Bytes a call holds at once beside its outputs (torch's requested bytes, ``sparse_mqa_backward``), an
        upper bound. With a scale per KV row (``row_scaled``) the sum of

        - 4 per dkv element: the int32 sums; per KV row, 4 per octave count (freed before the sums exist, counted
          beside them) and 8 for its scale and inverse;
        - per (query, head), fp32: Delta and the kernel LSE for the whole call, and with a sink p_sink Delta, all
          three written by the bound pass: 2 rows, 3 with a sink;
        - with ``stored_pds``, the stored P and dS (``pds_bytes``);
        - 4 per query: topk_length's stand-in when none is given, and 4 per query of a chunk for its row ids;
        - 64 KiB: the 0-d scalars and the reductions' staging.

        Otherwise the sum of what its phases hold, each at most

        - 8 per dkv element: the int64 accumulator, converted to float64 in place at the end; before it exists,
          the Vmax pass's float32 copy of V and its square (8 per V element, no more);
        - 12 per KV row: that pass's row norms and their finite-masked copy; 1 per KV row and 13 per top-k slot
          for the rows some valid slot names (``contract.referenced_rows``: the slot mask and an int64 copy of
          the indices);
        - per (query, head), fp32: Delta and the kernel LSE for the whole call, and with a sink its probabilities,
          p_sink Delta (in place) and d_sink's reduction's scratch (2x): 6 rows; without a sink, the slot mass's
          temporaries: 5;
        - 4 per query: topk_length's stand-in when none is given, and 4 per query of a chunk for its row ids;
        - 64 KiB: the 0-d scalars of the fixed point and the reductions' staging.
        """
        kv_rows, rows, slots = self.B * self.Skv, self.B * self.S * self.H, self.B * self.S * self.L
        tail = (0 if topk_given else 4 * self.B * self.S) + 4 * self.query_chunk + SCALAR_BYTES
        if self.row_scaled(single_role):
            return (self.accumulator_bytes(single_role) + 4 * kv_rows * (OCTAVES + 2)
                    + 4 * rows * (3 if sink else 2) + (self.pds_bytes() if self.stored_pds else 0) + tail)
        return self.accumulator_bytes() + 13 * kv_rows + 1 + 13 * slots + 4 * rows * (6 if sink else 5) + tail


def staging_bytes_per_query(B: int, H: int) -> int:
    """Delta and kernel LSE (fp32, [B, H] per query)."""
    return 2 * 4 * B * H


def make_plan(B: int, S: int, Skv: int, H: int, L: int, Dqk: int, Dv: int, *,
              workspace_budget: int = DEFAULT_WORKSPACE_BUDGET, max_query_chunk: int = MAX_QUERY_CHUNK,
              pds_budget: int = DEFAULT_PDS_BUDGET, single_role: bool = False) -> BwdPlan:
    """The plan for one call. ``workspace_budget`` bounds the per-chunk staging (at least one query a chunk);
    ``pds_budget`` the stored P and dS of the 64-head path (``single_role``: none)."""
    for name, v in (("B", B), ("S", S), ("Skv", Skv), ("H", H), ("L", L), ("Dqk", Dqk), ("Dv", Dv),
                    ("max_query_chunk", max_query_chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if Dv > Dqk:
        raise ValueError(f"Dv must be <= Dqk = {Dqk}, got {Dv}")
    for name, v in (("workspace_budget", workspace_budget), ("pds_budget", pds_budget)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    head_group = head_group_for(H)
    plan = BwdPlan(B=B, S=S, Skv=Skv, H=H, L=L, Dqk=Dqk, Dv=Dv, head_group=head_group,
                   topk_block=TOPK_BLOCKS[head_group], query_chunk=1)
    per_q = staging_bytes_per_query(B, H) + 4 * H
    room = workspace_budget - plan.accumulator_bytes() - 8  # the sums do not depend on the chunk
    chunk = max(1, min(S, max_query_chunk, room // per_q)) if room > 0 else 1
    stored = plan.row_scaled(single_role) and plan.pds_bytes() <= pds_budget
    return replace(plan, query_chunk=chunk, stored_pds=stored)


def all_variants(dims=contract.PRODUCTION_DIMS) -> list[VariantKey]:
    """Every kernel variant a plan can ask for (H and L are runtime sizes, so these cover every H and L)."""
    return [VariantKey(dqk, dv, hg, TOPK_BLOCKS[hg], stored_pds=stored) for dqk, dv in dims for hg in HEAD_GROUPS
            for stored in ((False, True) if hg == 64 else (False,))]


def slot_mass(lse, attn_sink):
    """Per [B, S, H]: the probability a query row's slots hold, 1 / (1 + e^(sink - lse)) = 1 - p_sink, formed
    without the cancellation of 1 - p_sink (a sink that takes all but 1e-14 leaves 1e-14, not 0); 1 without a
    sink, 0 for an empty row (lse +-inf), 1 where it is NaN (so a bound built on it stays a bound). float32,
    a NumPy array or a torch tensor like ``lse``."""
    xp = contract._namespace(lse)
    if xp is np:
        lse = np.asarray(lse, dtype=np.float32)
        sink = None if attn_sink is None else np.asarray(attn_sink, dtype=np.float32)
    else:
        lse, sink = lse.float(), None if attn_sink is None else attn_sink.float()
    with np.errstate(over="ignore", invalid="ignore"):
        m = xp.ones_like(lse) if sink is None else 1.0 / (1.0 + xp.exp(sink - lse))
    m = xp.where(xp.isinf(lse), xp.zeros_like(m), m)
    return xp.where(xp.isnan(m), xp.ones_like(m), m)


def fixed_point_exponent(bound: float) -> int:
    """F such that a dkv whose every partial sum is at most ``bound`` in magnitude fits int64 at 2**-F.

    bound 0 (no gradient at all) gives F_MAX; a non-finite bound (non-finite inputs: the result is garbage
    anyway) gives 0. The kernel computes the same formula on the device, in float32.
    """
    if not math.isfinite(bound):
        return 0
    if bound <= 0.0:
        return F_MAX
    f = (ACC_BITS - HEADROOM_BITS) - math.ceil(math.log2(bound))
    return max(F_MIN, min(F_MAX, f))


def octave_ceil(t):
    """Each term of a row's bound as the bound pass counts it: the smallest power of two >= t (float64; 2**-126 for
    a subnormal float32, inf for a non-finite term, 0 for 0). NumPy, elementwise."""
    t = np.asarray(t, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        up = np.exp2(np.maximum(np.ceil(np.log2(t.astype(np.float64))), -126.0))
    return np.where(np.isfinite(t), np.where(t > 0, up, 0.0), np.inf)


def row_exponent(bound):
    """F_j for a KV row whose terms' |sum| is at most ``bound`` (float64, NumPy): ROW_HEADROOM - ceil(log2 B_j),
    clamped to [ROW_F_MIN, ROW_F_MAX] (an infinite bound, from non-finite inputs, takes ROW_F_MIN); a row with bound
    0 gets scale 0 in the kernel and any F here (ROW_F_MAX)."""
    b = np.asarray(bound, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        f = ROW_HEADROOM - np.ceil(np.log2(np.where(b > 0, b, 1.0)))
    f = np.where(b > 0, f, ROW_F_MAX)
    return np.clip(np.nan_to_num(f, nan=ROW_F_MIN, neginf=ROW_F_MIN), ROW_F_MIN, ROW_F_MAX).astype(np.int64)
