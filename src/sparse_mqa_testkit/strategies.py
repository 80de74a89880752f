"""Hypothesis strategies that draw ``Case`` values: configurations and a seed, never element-wise arrays.

Sizes are biased toward tile boundaries: for each tile t a backend declares (head_group, query_chunk,
topk_block), H, S and L are drawn at t-1, t, t+1 (and small multiples), and H < 16 is always in the mix.
Each boundary class is reported with ``hypothesis.event`` so a run shows what it covered.
"""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st

from .cases import INVALID_MODES, ORDERS, SINK_MODES, TOPK_MODES, Case

# Small dims keep CPU runs fast; production dims are added when the backend asks for them.
SMALL_DIMS = ((16, 8), (8, 8), (24, 16), (5, 3), (1, 1))


def near_multiples(tile: int, max_mult: int = 2) -> list[int]:
    """t-1, t, t+1 at 1..max_mult multiples of a tile (sizes >= 1)."""
    out = set()
    for m in range(1, max_mult + 1):
        out.update(x for x in (m * tile - 1, m * tile, m * tile + 1) if x >= 1)
    return sorted(out)


def boundary_class(size: int, tile: int | None) -> str:
    """'below' / 'on' / 'above' a multiple of the tile, or 'interior'."""
    if not tile:
        return "interior"
    r = size % tile
    return "on" if r == 0 else "below" if r == tile - 1 else "above" if r == 1 else "interior"


def _size(limit: int, tile: int | None, floor: int = 1) -> st.SearchStrategy[int]:
    choices = st.integers(floor, limit)
    if tile:
        near = [x for x in near_multiples(tile) if floor <= x <= limit]
        if near:
            choices = st.one_of(st.sampled_from(near), choices)
    return choices


@st.composite
def cases(draw, *, dims=None, tiles: dict | None = None, max_b: int = 2, max_s: int = 24, max_skv: int = 48,
          max_h: int = 20, max_l: int = 40, sink_modes=SINK_MODES, topk_modes=TOPK_MODES,
          invalid_modes=INVALID_MODES) -> Case:
    """Draw a ``Case``.

    dims: (Dqk, Dv) pairs to choose from (default: small CPU sizes). tiles: the backend's declared
    ``head_group`` / ``query_chunk`` / ``topk_block``; limits are raised to reach two tiles past each.
    """
    tiles = dict(tiles or {})
    hg, qc, tb = tiles.get("head_group"), tiles.get("query_chunk"), tiles.get("topk_block")
    dqk, dv = draw(st.sampled_from(tuple(dims or SMALL_DIMS)))
    h = draw(st.one_of(st.integers(1, 15), _size(max(max_h, 2 * hg + 1 if hg else 0), hg)))
    s = draw(_size(max(max_s, 2 * qc + 1 if qc else 0), qc))
    l_ = draw(_size(max(max_l, 2 * tb + 1 if tb else 0), tb))
    b = draw(st.integers(1, max_b))
    skv = draw(st.integers(1, max_skv))
    case = Case(
        B=b, S=s, Skv=skv, H=h, L=l_, Dqk=dqk, Dv=dv,
        sm_scale=draw(st.sampled_from([None, 0.5, 1.0 / 192**0.5])),
        sink=draw(st.sampled_from(tuple(sink_modes))),
        topk=draw(st.sampled_from(tuple(topk_modes))),
        invalid=draw(st.sampled_from(tuple(invalid_modes))),
        duplicates=draw(st.booleans()),
        order=draw(st.sampled_from(ORDERS)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    for name, size, tile in (("H", h, hg), ("S", s, qc), ("L", l_, tb)):
        event(f"{name} {boundary_class(size, tile)} tile")
    if h < 16:
        event("H < 16")
    event(f"sink {case.sink}")
    event(f"topk {case.topk}")
    event(f"invalid {case.invalid}")
    return case
