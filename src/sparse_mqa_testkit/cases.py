"""A test case: a small frozen configuration plus a seed; the arrays are made from the seed, never drawn.

Hypothesis draws ``Case`` values (see ``sparse_mqa_testkit.strategies``), so shrinking works on a handful of
integers and enum choices, and any failure replays from one line: ``Case(...).inputs()``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from . import contract
from .oracle.bf16 import round_bf16

SINK_MODES = ("none", "finite", "neg_inf", "pos_inf", "mixed")  # mixed: finite, -inf and +inf across heads
TOPK_MODES = ("none", "random")  # random draws lengths in [0, L + 2], so 0 and > L both occur
INVALID_MODES = ("none", "holes", "out_of_range", "tails", "empty_rows", "mixed")
ORDERS = ("random", "sorted")
EMPTY_LSE_MODES = ("pos_inf", "neg_inf")  # the lse a backward is given for an empty row: +inf, or -inf (zero mass)


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
    seed: int = 0

    def __post_init__(self):
        for name in ("B", "S", "Skv", "H", "L", "Dqk", "Dv"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Case.{name} must be an int >= 1, got {v!r}")
        if self.Dv > self.Dqk:
            raise ValueError(f"Case.Dv must be <= Dqk = {self.Dqk}, got {self.Dv}")
        for name, allowed in (("sink", SINK_MODES), ("topk", TOPK_MODES), ("invalid", INVALID_MODES),
                              ("order", ORDERS), ("empty_lse", EMPTY_LSE_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Case.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    # ---- what a check needs to know ------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return float(self.sm_scale) if self.sm_scale is not None else 1.0 / math.sqrt(self.Dqk)

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
        lse = "" if self.empty_lse == "pos_inf" else f" empty_lse={self.empty_lse}"
        return (f"B{self.B} S{self.S} Skv{self.Skv} H{self.H} L{self.L} {self.Dqk}/{self.Dv} "
                f"sink={self.sink} topk={self.topk} invalid={self.invalid} dup={self.duplicates} "
                f"order={self.order}{lse} seed={self.seed}")

    # ---- the arrays ------------------------------------------------------------------------------------------
    def inputs(self) -> dict:
        """NumPy inputs with kernel dtypes: q, kv, grad_out bf16; indices, topk_length int32; attn_sink fp32.

        Keys: q, kv, indices, topk_length (or None), attn_sink (or None), grad_out, sm_scale, d_v.
        """
        rng = np.random.default_rng(self.seed)
        B, S, Skv, H, L = self.B, self.S, self.Skv, self.H, self.L
        q = round_bf16(rng.standard_normal((B, S, H, self.Dqk), dtype=np.float32))
        kv = round_bf16(rng.standard_normal((B, Skv, self.Dqk), dtype=np.float32))
        grad_out = round_bf16(rng.standard_normal((B, S, H, self.Dv), dtype=np.float32))
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

    def _indices(self, rng) -> np.ndarray:
        B, S, Skv, L = self.B, self.S, self.Skv, self.L
        if self.duplicates or L > Skv:
            idx = rng.integers(0, Skv, size=(B, S, L))
        else:  # distinct per row: argsort of random keys is a vectorised sample without replacement
            idx = np.argsort(rng.random((B, S, Skv)), axis=-1)[..., :L]
        if self.duplicates and L > 1:  # make duplicates certain, not merely likely
            idx[..., -1] = idx[..., 0]
        if self.order == "sorted":
            idx = np.sort(idx, axis=-1)
        idx = idx.astype(np.int64)
        mode = self.invalid
        invalid = {k: np.array(v, dtype=np.int64) for k, v in contract.invalid_values(Skv).items()}
        if mode == "mixed":
            mode = ("holes", "out_of_range", "tails", "empty_rows")[int(rng.integers(0, 4))]
            # and sprinkle the other kinds too
            idx = np.where(rng.random(idx.shape) < 0.1, -1, idx)
        if mode == "holes":
            idx = np.where(rng.random(idx.shape) < 0.25, -1, idx)
        elif mode == "out_of_range":
            bad = invalid["out_of_range"]
            pick = bad[rng.integers(0, len(bad), size=idx.shape)]
            idx = np.where(rng.random(idx.shape) < 0.25, pick, idx)
        elif mode == "tails":
            keep = rng.integers(0, L + 1, size=(B, S, 1))
            idx = np.where(np.arange(L) < keep, idx, -1)
        elif mode == "empty_rows":
            empty = rng.random((B, S, 1)) < 0.3
            empty[0, 0, 0] = True
            filler = invalid["sentinel"][rng.integers(0, len(invalid["sentinel"]), size=idx.shape)]
            idx = np.where(empty, filler, idx)
        return idx.astype(np.int32)
