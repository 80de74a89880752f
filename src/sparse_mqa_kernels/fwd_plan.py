"""Host-side plan of the sparse-MQA forward kernel: head groups, top-k tiles, grid and the variant key.

Pure Python (no TileLang, no torch), so it is tested on CPU. The kernel (``forward.py``) takes B, S, Skv, H
and L as symbolic sizes, so a compiled variant depends only on ``variant_key``: the head dims, the head-group
and top-k tile sizes, and whether a sink and a topk_length are given. Padding happens inside the kernel:
heads past H are zero query rows whose results are never stored, and slots past L (or past topk_length) are
invalid by the contract's rule, masked and never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_mqa_testkit import contract

# One block serves HEAD_BLOCK heads of one query row: the 64 rows of a wgmma tile on Hopper.
HEAD_BLOCK = 64
# KV rows gathered per pipeline stage; the kernel runs stages in pairs (double buffering).
TOPK_TILE = 64
STAGES = 2
THREADS = 384  # two consumer warpgroups (score + left half of V, right half of V) and one producer
GRID_X_MAX = 2**31 - 1  # CUDA's limit on gridDim.x
GRID_Y_MAX = 65535


@dataclass(frozen=True)
class VariantKey:
    """Everything a compiled forward kernel is specialised on (nothing here depends on B, S, Skv, H or L)."""

    dqk: int
    dv: int
    head_block: int
    topk_tile: int
    has_sink: bool
    has_topk_length: bool

    def describe(self) -> str:
        return (f"sparse_mqa_fwd Dqk{self.dqk} Dv{self.dv} heads/block{self.head_block} "
                f"topk_tile{self.topk_tile} sink={self.has_sink} topk_length={self.has_topk_length}")


@dataclass(frozen=True)
class FwdPlan:
    """How one call is laid out on the GPU."""

    B: int
    S: int
    H: int
    L: int
    key: VariantKey

    @property
    def head_groups(self) -> int:
        return -(-self.H // self.key.head_block)

    @property
    def padded_heads(self) -> int:
        return self.head_groups * self.key.head_block

    @property
    def topk_tiles(self) -> int:
        """Tiles the kernel walks: ceil(L / tile) rounded up to whole stage pairs."""
        pair = self.key.topk_tile * STAGES
        return -(-self.L // pair) * STAGES

    @property
    def padded_topk(self) -> int:
        return self.topk_tiles * self.key.topk_tile

    @property
    def grid(self) -> tuple[int, int]:
        """(x, y): x enumerates (query row, head group) with the head group fastest, y the batch."""
        return (self.S * self.head_groups, self.B)

    def block_of(self, s: int, g: int) -> int:
        """Grid x of query row ``s``, head group ``g`` (the kernel decodes s = x // G, g = x % G)."""
        return s * self.head_groups + g

    def heads_of_group(self, g: int) -> range:
        """Real heads served by group ``g`` (the rest of its block is padding)."""
        h0 = g * self.key.head_block
        return range(h0, min(h0 + self.key.head_block, self.H))


def variant_key(dqk: int, dv: int, *, has_sink: bool, has_topk_length: bool) -> VariantKey:
    """The compiled variant for head dims (dqk, dv); ValueError for dims the kernel is not built for."""
    if (dqk, dv) not in contract.PRODUCTION_DIMS:
        raise ValueError(f"(Dqk, Dv) = ({dqk}, {dv}) is not supported by the forward kernel; "
                         f"supported: {contract.PRODUCTION_DIMS}")
    return VariantKey(dqk=int(dqk), dv=int(dv), head_block=HEAD_BLOCK, topk_tile=TOPK_TILE,
                      has_sink=bool(has_sink), has_topk_length=bool(has_topk_length))


def plan_forward(dims: contract.Dims, *, has_sink: bool, has_topk_length: bool) -> FwdPlan:
    """The plan for a validated call; ValueError when the grid would not fit CUDA's limits."""
    key = variant_key(dims.Dqk, dims.Dv, has_sink=has_sink, has_topk_length=has_topk_length)
    plan = FwdPlan(B=dims.B, S=dims.S, H=dims.H, L=dims.L, key=key)
    gx, gy = plan.grid
    if gx > GRID_X_MAX:
        raise ValueError(f"q has S * ceil(H / {HEAD_BLOCK}) = {gx} blocks, over CUDA's grid limit {GRID_X_MAX}")
    if gy > GRID_Y_MAX:
        raise ValueError(f"q has batch B = {gy}, over CUDA's grid limit {GRID_Y_MAX}")
    return plan


def all_variants() -> list[VariantKey]:
    """Every variant ``plan_forward`` can produce (H and L are symbolic, so these cover every H and L)."""
    return [variant_key(dqk, dv, has_sink=s, has_topk_length=t)
            for (dqk, dv) in contract.PRODUCTION_DIMS for s in (False, True) for t in (False, True)]
