"""The hand-overs of the 64-head bound pass (``bwd_rows.build_bound``) on CPU. The producer gathers block i into KV
tile i % 2 once WG0 has freed it (block i - 2's ``free``), and the tile's ``full`` barrier completes when the copies
land. WG1 waits ``full``, runs dP and writes the hand-over buffer ``ex`` once WG0 has read the last one (``exfree``),
arriving on ``exfull``. WG0 waits ``full``, runs S, waits ``exfull``, reads ``ex`` (arrives ``exfree``), counts the
block's rows and arrives on the tile's ``free``. Each tile serves every other block, so its barriers complete once a
use (``tile_parity``); ``ex``'s once a block.

The three warpgroups are simulated step by step under several schedules, with PTX's parity rule (a wait on parity p
passes once the barrier's current phase has parity other than p): no hang, no tile or buffer overwritten before it
is read, for a query's block counts 0-6."""

import pytest

from protocol_sim import Barrier, Slot, schedule
from sparse_mqa_kernels.bwd_rows import tile_parity


def run(n_blk, tile_parity, policy, seed=0):
    """Simulate one query's blocks; returns None, or what went wrong."""
    full, free = [Barrier(), Barrier()], [Barrier(), Barrier()]
    ex = Slot("ex of block", "written", "WG0")  # exfull is its full barrier, exfree its free one
    s = {"tile": [None, None], "rows": [None, None], "wg0_done": -1, "wg1_done": -1}
    if n_blk:  # block 0, from the prologue
        s["tile"][0], s["rows"][0] = 0, 0
        full[0].arrive()

    def producer():
        for i in range(1, n_blk):
            p = i % 2
            if i >= 2:
                yield from free[p].wait(tile_parity(i - 2))
            if s["wg0_done"] < i - 2 or s["wg1_done"] < i - 2:
                raise AssertionError(f"block {i} gathered over block {i - 2}, which was still being read")
            s["tile"][p], s["rows"][p] = i, i
            full[p].arrive()
            yield True

    def read_tile(i, product):
        # wait for block i's tile, and check that it holds block i
        p = i % 2
        yield from full[p].wait(tile_parity(i))
        if s["tile"][p] != i:
            raise AssertionError(f"{product} of block {i} read tile {p} holding block {s['tile'][p]}")

    def wg1():
        for i in range(n_blk):
            yield from read_tile(i, "WG1's dP")
            s["wg1_done"] = i
            yield from ex.put(i, (i - 1) & 1 if i > 0 else None)
            yield True

    def wg0():
        for i in range(n_blk):
            p = i % 2
            yield from read_tile(i, "WG0's S")
            yield from ex.take(i, i & 1)
            if s["rows"][p] != i:
                raise AssertionError(f"block {i}'s bounds counted into the rows of block {s['rows'][p]}")
            s["wg0_done"] = i
            free[p].arrive()
            yield True

    order = ("producer", "wg1", "wg0") if policy == "producer first" else ("wg0", "wg1", "producer")
    return schedule({"wg0": wg0(), "wg1": wg1(), "producer": producer()}, order, policy, seed,
                    lambda: f"WG0 done through block {s['wg0_done']}")


@pytest.mark.parametrize("policy", ["wg0 first", "producer first", "random"])
def test_bound_pass_hand_overs_never_hang_or_overwrite(policy):
    for n_blk in range(7):
        for seed in range(20 if policy == "random" else 1):
            assert run(n_blk, tile_parity, policy, seed) is None, (n_blk, seed)


def test_the_model_catches_a_wrong_tile_parity():
    """Meta-test: the parity of the block count itself (as if one tile served every block) hangs or overwrites."""
    wrong = [run(n, lambda i: i & 1, policy) for n in (3, 4, 5) for policy in ("wg0 first", "producer first")]
    assert all(wrong), wrong
