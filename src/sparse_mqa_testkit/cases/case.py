"""A test case: a small frozen configuration plus a seed; the arrays are made from the seed, never drawn.

Hypothesis draws ``Case`` values (see ``sparse_mqa_testkit.strategies``), so shrinking works on a handful of
integers and enum choices, and any failure replays from one line: ``Case(...).inputs()``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from .. import contract
from ..oracle.bf16 import round_bf16
from .draws import NumpyDraws, draw_indices

# mixed: finite, -inf and +inf across heads; huge: finite, |sink| in [2.3e38, float32 max), both signs across heads
# (sink * log2(e) overflows float32); far: -400 and +400 across heads (beside lse near 400 with ``peaky``)
SINK_MODES = ("none", "finite", "neg_inf", "pos_inf", "mixed", "huge", "far")
HUGE_SINK = (2.3e38, 3.4e38)
FAR_SINK = 400.0
# random: lengths in [0, L + 2], so 0 and > L both occur; edges: each row's length from ``edge_lengths`` (-3, -1,
# 0, 1, one below / on / above each top-k tile and 512), every value the row's L allows once before any repeats
TOPK_MODES = ("none", "random", "edges")
# leading: the first top-k tile of every row invalid (-1, Skv and out-of-range values), valid slots after it;
# middle: one whole tile in the middle of every row invalid
INVALID_MODES = ("none", "holes", "out_of_range", "tails", "empty_rows", "mixed", "leading", "middle")
COMMON_TILES = (16, 32, 64, 128)  # tile sizes kernels commonly use: the default where none is declared
WIDE_TILE = 512  # a top-k tile of a wide kernel: lengths 511-513 are in every edges grid
ORDERS = ("random", "sorted")
EMPTY_LSE_MODES = ("pos_inf", "neg_inf")  # the lse a backward is given for an empty row: +inf, or -inf (zero mass)
# random: each row's slots anywhere in the cache; local: causal, a window before the query's position plus far
# picks, so neighbouring queries share most slots (DeepSeek-V3.2's indexer); hot: a few KV rows every query names
# disjoint: query i names rows from a block of its own, so neighbouring queries share no row (a kernel packing
# several queries into one tile must load each one's own rows)
PATTERNS = ("random", "local", "hot", "disjoint")
# unit: N(0, 1) everywhere; spread: grad_out scaled by 2^u, u from -20 to +20 along the queries, so gradients
# span 2^+-20 across rows (with the local pattern, dkv's rows too); peaky: q scaled by a power of two so the logits'
# spread is about PEAKY_SPREAD: logits up to a few hundred, a near one-hot softmax, exp(s) past float16's range
MAGNITUDES = ("unit", "spread", "peaky")
SPREAD_BITS = 20
PEAKY_SPREAD = 160.0
# each field that takes one of a few modes, with them (what a case validates, and what a compile key on the field
# ranges over)
MODES = {"sink": SINK_MODES, "topk": TOPK_MODES, "invalid": INVALID_MODES, "order": ORDERS,
         "empty_lse": EMPTY_LSE_MODES, "pattern": PATTERNS, "magnitude": MAGNITUDES}
LARGE = 1 << 26  # q elements past which a case's tensors are drawn by torch on its device (tensors.case_tensors)


@dataclass(frozen=True)
class Case:
    """One conformance case. ``inputs()`` is a pure function of the fields."""

    B: int = 1
    S: int = 4
    Skv: int = 16
    H: int = 2
    L: int = 8
    Dqk: int = 16
    Dv: int = 8
    sm_scale: float | None = None  # None: 1/sqrt(Dqk)
    sink: str = "none"
    topk: str = "none"
    invalid: str = "none"
    duplicates: bool = False
    order: str = "random"
    empty_lse: str = "pos_inf"
    pattern: str = "random"
    magnitude: str = "unit"
    topk_tile: int = 0  # the top-k tile the edges / leading / middle modes sit on; 0: the common tile sizes
    seed: int = 0

    def __post_init__(self):
        for name in ("B", "S", "Skv", "H", "L", "Dqk", "Dv"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Case.{name} must be an int >= 1, got {v!r}")
        if self.Dv > self.Dqk:
            raise ValueError(f"Case.Dv must be <= Dqk = {self.Dqk}, got {self.Dv}")
        if not isinstance(self.topk_tile, int) or self.topk_tile < 0:
            raise ValueError(f"Case.topk_tile must be an int >= 0, got {self.topk_tile!r}")
        for name, allowed in MODES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"Case.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    # ---- what a check needs to know ------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return float(self.sm_scale) if self.sm_scale is not None else 1.0 / math.sqrt(self.Dqk)

    @property
    def large(self) -> bool:
        """Too large for NumPy on a host: its tensors are drawn by torch on the device it runs on."""
        return self.B * self.S * self.H * self.Dqk > LARGE

    @property
    def dims(self) -> contract.Dims:
        return contract.Dims(B=self.B, S=self.S, H=self.H, Dqk=self.Dqk, Dv=self.Dv, Skv=self.Skv, L=self.L)

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    def repro(self) -> str:
        """A Python expression that rebuilds this case."""
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                           if getattr(self, f.name) != f.default)
        return f"Case({fields})"

    def describe(self) -> str:
        extra = "".join(f" {name}={getattr(self, name)}" for name, default in
                        (("empty_lse", "pos_inf"), ("pattern", "random"), ("magnitude", "unit"), ("topk_tile", 0))
                        if getattr(self, name) != default)
        return (f"B{self.B} S{self.S} Skv{self.Skv} H{self.H} L{self.L} {self.Dqk}/{self.Dv} "
                f"sink={self.sink} topk={self.topk} invalid={self.invalid} dup={self.duplicates} "
                f"order={self.order}{extra} seed={self.seed}")

    # ---- the arrays ------------------------------------------------------------------------------------------
    def inputs(self) -> dict:
        """NumPy inputs with kernel dtypes: q, kv, grad_out bf16; indices, topk_length int32; attn_sink fp32.

        Keys: q, kv, indices, topk_length (or None), attn_sink (or None), grad_out, sm_scale, d_v.
        A ``large`` case has none here: ``tensors.case_tensors`` draws it on its device.
        """
        if self.large:
            raise ValueError(f"{self.repro()} has {self.B * self.S * self.H * self.Dqk} q elements, past "
                             f"{LARGE}: torch draws its tensors on the device (tensors.case_tensors(case, device))")
        rng = np.random.default_rng(self.seed)
        B, S, Skv, H = self.B, self.S, self.Skv, self.H
        q = rng.standard_normal((B, S, H, self.Dqk), dtype=np.float32)
        q = round_bf16(q * np.float32(2.0 ** self.q_bits()))  # a power of two: the same as scaling after rounding
        kv = round_bf16(rng.standard_normal((B, Skv, self.Dqk), dtype=np.float32))
        go = rng.standard_normal((B, S, H, self.Dv), dtype=np.float32)
        grad_out = round_bf16(go * np.exp2(self.spread_exponents())[None, :, None, None].astype(np.float32))
        indices = draw_indices(self, NumpyDraws(rng))
        return {"q": q, "kv": kv, "indices": indices, "topk_length": self.topk_lengths(rng),
                "attn_sink": self.sinks(rng), "grad_out": grad_out, "sm_scale": self.scale, "d_v": self.Dv}

    def topk_lengths(self, rng) -> np.ndarray | None:
        """topk_length [B, S] int32 from a NumPy generator, or None (drawn after the indices)."""
        B, S = self.B, self.S
        if self.topk == "random":
            return rng.integers(0, self.L + 3, size=(B, S)).astype(np.int32)
        if self.topk == "edges":
            grid = np.array(self.edge_lengths(), dtype=np.int32)
            return np.resize(rng.permutation(grid), B * S).reshape(B, S)
        return None

    def topk_tiles(self) -> tuple[int, ...]:
        """The top-k tile the case targets, or the common sizes when it names none."""
        return (self.topk_tile,) if self.topk_tile else COMMON_TILES

    def edge_lengths(self) -> tuple[int, ...]:
        """The lengths the ``edges`` mode gives rows: -3, -1, 0, 1 and t - 1, t, t + 1 for the top-k tile (the common
        sizes without one) and 512, each only where L leaves a slot past it (v <= L + 1)."""
        tiles = self.topk_tiles() + (WIDE_TILE,)
        grid = {-3, -1, 0, 1} | {t + d for t in tiles for d in (-1, 0, 1)}
        return tuple(sorted(v for v in grid if v <= self.L + 1))

    def q_bits(self) -> int:
        """log2 of q's scale: 0, or for ``peaky`` the power of two that brings the logits' spread near
        PEAKY_SPREAD (a power of two keeps q exact in bf16)."""
        if self.magnitude != "peaky":
            return 0
        return int(round(math.log2(PEAKY_SPREAD / (abs(self.scale) * math.sqrt(self.Dqk)))))

    def sinks(self, rng) -> np.ndarray | None:
        """attn_sink [H] float32 from a NumPy generator, or None (drawn after topk_length)."""
        if self.sink == "none":
            return None
        # finite sinks on the scale of the logits, so the sink carries real probability mass
        sink = rng.normal(0.0, 2.0, size=self.H).astype(np.float32)
        if self.sink == "neg_inf":
            sink[:] = -np.inf
        elif self.sink == "pos_inf":
            sink[rng.random(self.H) < 0.5] = np.inf
            sink[0] = np.inf  # at least one head
        elif self.sink == "mixed":
            kind = rng.integers(0, 3, size=self.H)
            sink[kind == 1] = -np.inf
            sink[kind == 2] = np.inf
        elif self.sink in ("huge", "far"):
            sign = np.where(rng.random(self.H) < 0.5, 1.0, -1.0)
            sign[0] = 1.0
            sign[1:2] = -1.0  # both signs whenever there are two heads
            size = rng.uniform(*HUGE_SINK, size=self.H) if self.sink == "huge" else np.full(self.H, FAR_SINK)
            sink = (sign * size).astype(np.float32)  # finite: HUGE_SINK stays below float32 max
        return sink

    def spread_exponents(self) -> np.ndarray:
        """log2 of grad_out's scale per query position: 0 for ``unit``, -20 to +20 along S for ``spread``."""
        if self.magnitude != "spread" or self.S == 1:
            return np.zeros(self.S)
        return np.linspace(-SPREAD_BITS, SPREAD_BITS, self.S)


@functools.lru_cache(maxsize=4)
def host_inputs(case: Case) -> dict:
    """``case.inputs()``, read-only, kept for the last few cases: the arrays one case's check, its expected
    results and its coverage share (generating them is the costly part at GPU sizes)."""
    x = case.inputs()
    for v in x.values():
        if isinstance(v, np.ndarray):
            v.setflags(write=False)
    return x
