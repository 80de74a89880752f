"""The top-k indices of a case, drawn the same way from a NumPy generator (``NumpyDraws``) or a torch one on a
device (``tensors.TorchDraws``): slots, a pattern (``local``, ``hot``), duplicates, order, then the invalid mode."""

from __future__ import annotations

import numpy as np

from .. import contract

HOT_ROWS = 8  # how many KV rows the hot pattern has every query name


class NumpyDraws:
    """Random draws from a NumPy generator, for ``draw_indices`` (``tensors.TorchDraws`` is its torch twin)."""

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


def draw_indices(case, draws):
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
    if case.invalid in ("leading", "middle"):
        return draws.int32(_invalid_tile(case, idx, draws))
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


def tile_run(case) -> tuple[int, int]:
    """[start, stop) of the slots the ``leading`` / ``middle`` modes make invalid: one top-k tile (the case's, else
    the largest of 16, 32, 64 below L, else half of L), the row's first, or its second when the row has slots past
    it (else a run in the middle of a short row)."""
    L = case.L
    tile = case.topk_tile or max([t for t in (16, 32, 64) if t < L] or [max(1, L // 2)])
    if case.invalid == "leading":
        start = 0
    else:
        start = tile if L > 2 * tile else max(1, (L - tile) // 2)
    return start, min(L, start + tile)


def _invalid_tile(case, idx, draws):
    """Every row's ``tile_run`` slots invalid, with -1, Skv and out-of-range values mixed."""
    xp = draws.xp
    start, stop = tile_run(case)
    bad = draws.array(sorted(set(contract.invalid_values(case.Skv)["out_of_range"]) | {-1}))
    pick = bad[draws.integers(0, len(bad), idx.shape)]
    t = draws.arange(case.L)
    return xp.where((t >= start) & (t < stop), pick, idx)


def pattern_indices(case, idx, draws):
    """The ``local`` or ``hot`` pattern from a random draw ``idx`` [B, S, L] and ``draws`` (``NumpyDraws`` or
    ``tensors.TorchDraws``): uniforms [B, S, L] for the far picks, then the hot rows [B, HOT_ROWS].

    local: query i sits at cache position p = (i + 1) Skv / S - 1 (causal); its first 3/4 of the slots are the
    window p, p - 1, ... and the rest far picks uniform in [0, p - window], before the window; a row that sees
    fewer keys than that has -1 in the rest, as an indexer's top-k pads it. hot: the first min(HOT_ROWS, L / 2)
    slots of every row name the same hot rows. disjoint: query i names rows i L to (i + 1) L - 1 modulo Skv, so
    neighbours share none while Skv >= 2 L. Without ``duplicates`` a slot repeating an earlier one of its row
    becomes -1 (an indexer never names a row twice).
    """
    xp = draws.xp
    B, S, L, Skv = case.B, case.S, case.L, case.Skv
    u, hot = draws.random((B, S, L)), draws.integers(0, Skv, (B, HOT_ROWS))
    if case.pattern == "disjoint":  # query i: rows i L ... (i + 1) L - 1 (mod Skv), rotated by a random start
        turn = draws.integers(0, L, (B, S, 1))
        t = draws.arange(L)
        out = (draws.arange(S)[None, :, None] * L + (t + turn) % L) % Skv
    elif case.pattern == "hot":
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
