"""Whether a case's boundary classes bite: a class counts as covered only where the case makes its boundary matter.

``strategies.case_events`` names the classes a case is in by its fields; ``effective_events`` keeps those whose
edge the case's arrays actually exercise: the edge slot (or edge head, edge query) valid in at least one
non-empty row, on a head whose sink does not hold all the mass (+inf, a huge positive or +400 sink), with non-zero
grad_out, and not in a ``peaky`` case (there each row's gradient flows through its one dominant slot: dS, and with it
dq, is about zero, so a wrong edge slot or head hardly shows). A case whose other modes cancel its boundary (an
edge slot made invalid, an edge row made empty) is in the class by name only. Classes that need no such check (a
sink mode, a pattern, dims) are effective whenever named.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import contract
from .case import FAR_SINK, WIDE_TILE, Case, host_inputs
from .draws import tile_run
from .strategies import case_events, topk_tile_edges

EDGES = ("below tile", "on tile", "above tile")


def needs_effect(label: str) -> bool:
    """Whether a class's effect depends on the arrays (not only on the fields that name it)."""
    return (any(e in label for e in EDGES) or label.startswith(("topk length", "invalid leading", "invalid middle"))
            or label in ("query tile", "sink huge", "sink far", "magnitude peaky"))


def effective_events(case: Case, tiles: dict | None = None) -> frozenset[str]:
    """The classes of ``case_events(case, tiles)`` the case makes matter. A ``large`` case (drawn on a device)
    is taken by its fields."""
    key = tuple(sorted((tiles or {}).items()))
    return _effective(case, key)


@functools.lru_cache(maxsize=1024)  # the explicit examples come back in every check
def _effective(case: Case, tiles_key: tuple) -> frozenset[str]:
    named = case_events(case, dict(tiles_key))
    if case.large or not any(needs_effect(label) for label in named):
        return frozenset(named)
    rows = _Rows(case)
    return frozenset(label for label in named if not needs_effect(label) or rows.bites(label))


class _Rows:
    """What the checks care about in a case's arrays: which slots are valid, which rows and heads carry a
    gradient."""

    def __init__(self, case: Case):
        x = host_inputs(case)  # the check's own arrays, already made
        self.case = case
        self.idx, self.tl = x["indices"], x["topk_length"]
        self.valid = contract.valid_mask(self.idx, case.Skv, self.tl)  # [B, S, L]
        self.in_range = contract.valid_mask(self.idx, case.Skv)  # ignoring topk_length
        sink = x["attn_sink"]
        self.live_head = np.ones(case.H, bool) if sink is None else ~(sink >= FAR_SINK)  # the rows hold mass
        moved = (np.asarray(x["grad_out"], np.float32) != 0).any(-1) & self.live_head  # [B, S, H]
        self.live = self.valid.any(-1) & moved.any(-1)  # [B, S]: a non-empty row whose gradient matters
        self.moved = moved

    def bites(self, label: str) -> bool:
        c = self.case
        if c.magnitude == "peaky" and label not in ("magnitude peaky", "sink far", "sink huge"):
            return False
        if label.startswith("L ") and any(e in label for e in EDGES):
            return bool((self.valid[..., c.L - 1] & self.live).any())
        if label.startswith("H ") and any(e in label for e in EDGES):
            return bool((self.valid.any(-1) & self.moved[..., c.H - 1]).any())
        if label.startswith("S ") and any(e in label for e in EDGES):
            return bool(self.live[:, c.S - 1].any())
        if label == "topk length <= 0":
            return bool(((self.tl <= 0) & self.in_range.any(-1)).any())
        if label.startswith("topk length at tile edge"):
            return self._cut_at(topk_tile_edges(c))
        if label == "topk length 511-513":
            return self._cut_at(tuple(range(WIDE_TILE - 1, WIDE_TILE + 2)))
        if label.startswith(("invalid leading", "invalid middle")):
            start, stop = tile_run(c)
            before = self.valid[..., :start].any(-1) if start else np.ones(self.live.shape, bool)
            return bool((self.live & before & self.valid[..., stop:].any(-1)).any())
        if label == "query tile":
            return self._neighbours_disjoint()
        return bool(self.live.any())  # a sink or magnitude mode: any row whose gradient matters

    def _cut_at(self, lengths) -> bool:
        """Some live row is cut at one of ``lengths`` (v <= L - 1, so slot v exists) with its slot v - 1 valid."""
        L = self.case.L
        for v in lengths:
            if 1 <= v <= L - 1 and ((self.tl == v) & self.valid[..., v - 1] & self.live).any():
                return True
        return False

    def _neighbours_disjoint(self) -> bool:
        B, S = self.live.shape
        for b in range(B):
            for i in range(S - 1):
                if self.live[b, i] and self.live[b, i + 1]:
                    a = set(self.idx[b, i][self.valid[b, i]].tolist())
                    if a.isdisjoint(self.idx[b, i + 1][self.valid[b, i + 1]].tolist()):
                        return True
        return False
