"""Tile sizes a backend declares (``tiles = {"head_group": .., "query_chunk": .., "topk_block": ..}``), where a size
may depend on the head count: ``ByHeads({16: 32, 64: 16})`` is 32 up to 16 heads and 16 beyond (a kernel whose
head group decides its top-k block). The strategies and the boundary examples then sit on the edges the kernel
really has at each H."""

from __future__ import annotations

from dataclasses import dataclass

TILE_KEYS = ("head_group", "query_chunk", "topk_block")


@dataclass(frozen=True)
class ByHeads:
    """A tile size by head count: ``sizes`` maps "up to this many heads" to the size; past the largest key the
    last size holds."""

    sizes: tuple

    def __init__(self, sizes: dict):
        items = tuple(sorted((int(h), int(t)) for h, t in dict(sizes).items()))
        if not items or any(h < 1 or t < 1 for h, t in items):
            raise ValueError(f"ByHeads needs positive head counts and sizes, got {sizes!r}")
        object.__setattr__(self, "sizes", items)

    def at(self, H: int) -> int:
        return next((t for h, t in self.sizes if H <= h), self.sizes[-1][1])

    def ranges(self) -> tuple[tuple[int, int | None, int], ...]:
        """(first H, last H or None for no end, size) for each run of head counts with one size."""
        out, lo = [], 1
        for i, (h, t) in enumerate(self.sizes):
            last = None if i == len(self.sizes) - 1 else h
            if out and out[-1][2] == t:
                out[-1] = (out[-1][0], last, t)
            else:
                out.append((lo, last, t))
            lo = h + 1
        return tuple(out)

    def __repr__(self) -> str:
        return f"ByHeads({dict(self.sizes)!r})"


def tile_at(tiles: dict, key: str, H: int) -> int | None:
    """The declared size of tile ``key`` for H heads, or None when it is not declared."""
    t = (tiles or {}).get(key)
    return t.at(H) if isinstance(t, ByHeads) else t


def tile_ranges(tiles: dict, key: str) -> tuple[tuple[int, int | None, int], ...]:
    """(first H, last H or None, size) for each distinct size of tile ``key``; () when it is not declared."""
    t = (tiles or {}).get(key)
    if t is None:
        return ()
    return t.ranges() if isinstance(t, ByHeads) else ((1, None, int(t)),)
