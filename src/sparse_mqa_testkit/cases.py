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
# random: each row's slots anywhere in the cache; local: causal, a window before the query's position plus far
# picks, so neighbouring queries share most slots (DeepSeek-V3.2's indexer); hot: a few KV rows every query names
PATTERNS = ("random", "local", "hot")
# unit: N(0, 1) everywhere; spread: grad_out scaled by 2^u, u from -20 to +20 along the queries, so gradients
# span 2^+-20 across rows (with the local pattern, dkv's rows too)
MAGNITUDES = ("unit", "spread")
SPREAD_BITS = 20
HOT_ROWS = 8  # how many KV rows the hot pattern has every query name
LARGE = 1 << 26  # q elements past which a case's tensors are drawn by torch on its device (torch_io.case_tensors)


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
        for name, allowed in (("sink", SINK_MODES), ("topk", TOPK_MODES), ("invalid", INVALID_MODES),
                              ("order", ORDERS), ("empty_lse", EMPTY_LSE_MODES), ("pattern", PATTERNS),
                              ("magnitude", MAGNITUDES)):
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
        A ``large`` case has none here: ``torch_io.case_tensors`` draws it on its device.
        """
        if self.large:
            raise ValueError(f"{self.repro()} has {self.B * self.S * self.H * self.Dqk} q elements, past "
                             f"{LARGE}: torch draws its tensors on the device (torch_io.case_tensors(case, device))")
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


class NumpyDraws:
    """Random draws from a NumPy generator, for ``draw_indices`` (``torch_io.TorchDraws`` is its torch twin)."""

    xp = np

    def __init__(self, rng):
        self.rng = rng

    def random(self, shape):
        return self.rng.random(shape)

    def integers(self, low, high, shape):
        return self.rng.integers(low, high, size=shape)

    def distinct(self, shape, n):
        """[*shape[:-1], k] distinct values in [0, n) per row (k = shape[-1] <= n): argsort of random keys."""
        return np.argsort(self.rng.random((*shape[:-1], n)), axis=-1)[..., :shape[-1]]

    def arange(self, n):
        return np.arange(n)

    def array(self, values):
        return np.array(values, dtype=np.int64)

    def sort(self, x):
        return np.sort(x, axis=-1)

    def int32(self, x):
        return x.astype(np.int32)

    def int64(self, x):
        return x.astype(np.int64)


def draw_indices(case: Case, draws):
    """The case's [B, S, L] indices: random (or a pattern's) slots, duplicates, order, then the invalid mode."""
    xp = draws.xp
    B, S, Skv, L = case.B, case.S, case.Skv, case.L
    if case.duplicates or L > Skv:
        idx = draws.integers(0, Skv, (B, S, L))
    else:  # distinct per row
        idx = draws.distinct((B, S, L), Skv)
    if case.pattern != "random":
        idx = pattern_indices(case, idx, draws)
    if case.duplicates and L > 1:  # make duplicates certain, not merely likely
        idx[..., -1] = idx[..., 0]
    if case.order == "sorted":
        idx = draws.sort(idx)
    mode = case.invalid
    invalid = {k: draws.array(v) for k, v in contract.invalid_values(Skv).items()}
    if mode == "mixed":
        mode = ("holes", "out_of_range", "tails", "empty_rows")[int(draws.integers(0, 4, ()))]
        # and sprinkle the other kinds too
        idx = xp.where(draws.random(idx.shape) < 0.1, -1, idx)
    if mode == "holes":
        idx = xp.where(draws.random(idx.shape) < 0.25, -1, idx)
    elif mode == "out_of_range":
        bad = invalid["out_of_range"]
        pick = bad[draws.integers(0, len(bad), idx.shape)]
        idx = xp.where(draws.random(idx.shape) < 0.25, pick, idx)
    elif mode == "tails":
        keep = draws.integers(0, L + 1, (B, S, 1))
        idx = xp.where(draws.arange(L) < keep, idx, -1)
    elif mode == "empty_rows":
        empty = draws.random((B, S, 1)) < 0.3
        empty[0, 0, 0] = True
        filler = invalid["sentinel"][draws.integers(0, len(invalid["sentinel"]), idx.shape)]
        idx = xp.where(empty, filler, idx)
    return draws.int32(idx)


def pattern_indices(case: Case, idx, draws):
    """The ``local`` or ``hot`` pattern from a random draw ``idx`` [B, S, L] and ``draws`` (``NumpyDraws`` or
    ``torch_io.TorchDraws``): uniforms [B, S, L] for the far picks, then the hot rows [B, HOT_ROWS].

    local: query i sits at cache position p = (i + 1) Skv / S - 1 (causal); its first 3/4 of the slots are the
    window p, p - 1, ... and the rest far picks uniform in [0, p - window], before the window; a row that sees
    fewer keys than that has -1 in the rest, as an indexer's top-k pads it. hot: the first min(HOT_ROWS, L / 2)
    slots of every row name the same hot rows. Without ``duplicates`` a slot repeating an earlier one of its
    row becomes -1 (an indexer never names a row twice).
    """
    xp = draws.xp
    B, S, L, Skv = case.B, case.S, case.L, case.Skv
    u, hot = draws.random((B, S, L)), draws.integers(0, Skv, (B, HOT_ROWS))
    if case.pattern == "hot":
        n = min(HOT_ROWS, max(1, L // 2))
        head = hot[:, None, :n] + xp.zeros_like(idx[..., :n])
        out = xp.concatenate([head, idx[..., n:]], -1) if n < L else head
    else:
        pos = ((draws.arange(S) + 1) * Skv) // S - 1  # [S]
        window = L - L // 4
        t = draws.arange(L)
        near = pos[:, None] - t[None, :]  # [S, L]: p, p - 1, ...
        room = pos[None, :, None] - window + 1  # [1, S, 1]: positions before the window
        far = draws.int64(u * xp.where(room > 0, room, 0))
        far = xp.where(room > 0, far, -1)
        out = xp.where(t[None, None, :] < window, near[None], far)
        out = xp.where(out < 0, -1, out)
    return out if case.duplicates else _repeats_to_minus_one(out)


def _repeats_to_minus_one(idx):
    """-1 in each slot whose index an earlier slot of its row already names."""
    if isinstance(idx, np.ndarray):
        order = np.argsort(idx, axis=-1, kind="stable")
        srt = np.take_along_axis(idx, order, -1)
        rep = np.zeros(idx.shape, dtype=bool)
        rep[..., 1:] = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        back = np.zeros_like(rep)
        np.put_along_axis(back, order, rep, -1)
        return np.where(back, -1, idx)
    srt, order = idx.sort(dim=-1, stable=True)
    rep = srt.new_zeros(srt.shape).bool()
    rep[..., 1:] = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    back = rep.new_zeros(rep.shape).scatter_(-1, order, rep)
    return idx.masked_fill(back, -1)
