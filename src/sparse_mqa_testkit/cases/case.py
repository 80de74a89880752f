"""A test case: a small frozen configuration plus a seed; the arrays are made from the seed, never drawn.

Hypothesis draws ``Case`` values (see ``sparse_mqa_testkit.strategies``), so shrinking works on a handful of
integers and enum choices, and any failure replays from one line: ``Case(...).inputs()``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .. import contract
from ..oracle.bf16 import round_bf16
from .draws import NumpyDraws, draw_indices

SINK_MODES = ("none", "finite", "neg_inf", "pos_inf", "mixed")  # mixed: finite, -inf and +inf across heads
TOPK_MODES = ("none", "random")  # random draws lengths in [0, L + 2], so 0 and > L both occur
INVALID_MODES = ("none", "holes", "out_of_range", "tails", "empty_rows", "mixed")
ORDERS = ("random", "sorted")
EMPTY_LSE_MODES = ("pos_inf", "neg_inf")  # the lse a backward is given for an empty row: +inf, or -inf (zero mass)
# random: each row's slots anywhere in the cache; local: causal, a window before the query's position plus far
# picks, so neighbouring queries share most slots (DeepSeek-V3.2's indexer); hot: a few KV rows every query names
PATTERNS = ("random", "local", "hot")
# unit: N(0, 1) everywhere; spread: grad_out scaled by 2^u, u from -20 to +20 along the queries, so gradients
# span 2^+-20 across rows (with the local pattern, dkv's rows too)
MAGNITUDES = ("unit", "spread")
SPREAD_BITS = 20
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
    seed: int = 0

    def __post_init__(self):
        for name in ("B", "S", "Skv", "H", "L", "Dqk", "Dv"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Case.{name} must be an int >= 1, got {v!r}")
        if self.Dv > self.Dqk:
            raise ValueError(f"Case.Dv must be <= Dqk = {self.Dqk}, got {self.Dv}")
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
                        (("empty_lse", "pos_inf"), ("pattern", "random"), ("magnitude", "unit"))
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
        B, S, Skv, H, L = self.B, self.S, self.Skv, self.H, self.L
        q = round_bf16(rng.standard_normal((B, S, H, self.Dqk), dtype=np.float32))
        kv = round_bf16(rng.standard_normal((B, Skv, self.Dqk), dtype=np.float32))
        go = rng.standard_normal((B, S, H, self.Dv), dtype=np.float32)
        grad_out = round_bf16(go * np.exp2(self.spread_exponents())[None, :, None, None].astype(np.float32))
        indices = self._indices(rng)
        topk_length = None
        if self.topk == "random":
            topk_length = rng.integers(0, L + 3, size=(B, S)).astype(np.int32)
        return {"q": q, "kv": kv, "indices": indices, "topk_length": topk_length, "attn_sink": self._sink(rng),
                "grad_out": grad_out, "sm_scale": self.scale, "d_v": self.Dv}

    def _sink(self, rng) -> np.ndarray | None:
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
        return sink

    def spread_exponents(self) -> np.ndarray:
        """log2 of grad_out's scale per query position: 0 for ``unit``, -20 to +20 along S for ``spread``."""
        if self.magnitude == "unit" or self.S == 1:
            return np.zeros(self.S)
        return np.linspace(-SPREAD_BITS, SPREAD_BITS, self.S)

    def _indices(self, rng) -> np.ndarray:
        return draw_indices(self, NumpyDraws(rng))
