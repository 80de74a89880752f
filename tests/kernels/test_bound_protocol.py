"""The hand-overs of the 64-head bound pass (``bwd_rows.build_bound``) on CPU. The producer gathers block i into KV
tile i % TILES once WG1 has read block i - TILES's hand-over there (the tile's ``free``), puts its rows in list
i % ROW_LISTS, and the tile's ``full`` barrier completes when the copies land. WG0 waits ``full``, runs S and P,
counts block i - 1 once WG1 has put its sums (``sums``), waits for WG1's dP of the block (``dpdone``), then writes P
into the block's tile and arrives on ``pfull``; it counts the last block after its loop. WG1 waits ``full``, runs dP,
arrives on ``dpdone``, waits ``pfull``, reads P, frees the tile, puts the block's sums in the one sums buffer and
arrives on ``sums``. A tile serves every TILES-th block, so its barriers complete once a use (``tile_parity``);
``dpdone``, ``pfull`` and ``sums`` once a block. The ``stored`` build also writes P and dS out through the block's
tile: WG0 stages P there after ``pfull`` and WG1 dS after ``sums``, each reads its stage back and only then arrives
on the tile's ``free``, which counts both warpgroups.

The three warpgroups are simulated step by step under several schedules, with PTX's parity rule (a wait on parity p
passes once the barrier's current phase has parity other than p): no hang, no tile, hand-over, sums or row list
overwritten before it is read, for a query's block counts 0-8."""

import pytest

from protocol_sim import Barrier, schedule
from sparse_mqa_kernels.bwd_rows import ROW_LISTS, TILES, tile_parity


def run(n_blk, tile_parity, policy, seed=0, row_lists=ROW_LISTS, wait_dpdone=True, count_first=True, stored=False,
        free_counts_wg0=True):
    """Simulate one query's blocks; returns None, or what went wrong. ``count_first``: WG0 counts block i - 1 before
    it hands over block i's P (as the kernel does), else after. ``stored``: the build that writes P and dS out;
    ``free_counts_wg0``: its ``free`` waits for WG0's arrival too (as the kernel's does)."""
    full = [Barrier() for _ in range(TILES)]
    free = [Barrier(2 if stored and free_counts_wg0 else 1) for _ in range(TILES)]
    dpdone, pfull, sums = Barrier(), Barrier(), Barrier()
    s = {"tile": [None] * TILES, "p": [None] * TILES, "rows": [None] * row_lists, "sums": None,
         "s_done": -1, "dp_done": -1, "p_read": -1, "counted": -1, "p_out": -1 if stored else n_blk,
         "ds_out": -1 if stored else n_blk}
    if n_blk:  # block 0, from the prologue
        s["tile"][0], s["rows"][0] = 0, 0
        full[0].arrive()

    def producer():
        for i in range(1, n_blk):
            p = i % TILES
            if i >= TILES:
                yield from free[p].wait(tile_parity(i - TILES))
            if s["p_read"] < i - TILES or s["s_done"] < i - TILES:
                raise AssertionError(f"block {i} gathered over block {i - TILES}, which was still being read")
            if s["p_out"] < i - TILES or s["ds_out"] < i - TILES:
                raise AssertionError(f"block {i} gathered over block {i - TILES}'s P or dS before it went out")
            s["tile"][p] = i
            yield True  # the rows go in after the copies, a step later
            old = s["rows"][i % row_lists]
            if old is not None and s["counted"] < old:
                raise AssertionError(f"block {i}'s rows written over block {old}'s, which WG0 had not counted")
            s["rows"][i % row_lists] = i
            full[p].arrive()
            yield True

    def read_tile(i, product):
        # wait for block i's tile, and check that it holds block i
        p = i % TILES
        yield from full[p].wait(tile_parity(i))
        if s["tile"][p] != i:
            raise AssertionError(f"{product} of block {i} read tile {p} holding block {s['tile'][p]}")

    def count(i):
        yield from sums.wait(i & 1)
        if s["sums"] != i:
            raise AssertionError(f"block {i} counted from block {s['sums']}'s sums")
        if s["rows"][i % row_lists] != i:
            raise AssertionError(f"block {i}'s bounds counted into the rows of block {s['rows'][i % row_lists]}")
        s["counted"] = i
        yield True

    def wg0():
        for i in range(n_blk):
            yield from read_tile(i, "WG0's S")
            s["s_done"] = i
            yield True
            if i > 0 and count_first:
                yield from count(i - 1)
            if wait_dpdone:
                yield from dpdone.wait(i & 1)
            if s["dp_done"] < i:
                raise AssertionError(f"P of block {i} written into its tile while WG1's dP read it")
            s["p"][i % TILES] = i
            pfull.arrive()
            yield True
            if stored:  # P staged in the tile and read back out, then the tile may go
                s["p_out"] = i
                free[i % TILES].arrive()
                yield True
            if i > 0 and not count_first:
                yield from count(i - 1)
        if n_blk:
            yield from count(n_blk - 1)

    def wg1():
        for i in range(n_blk):
            p = i % TILES
            yield from read_tile(i, "WG1's dP")
            s["dp_done"] = i
            dpdone.arrive()
            yield True
            yield from pfull.wait(i & 1)
            if s["p"][p] != i:
                raise AssertionError(f"WG1 read block {i}'s P from tile {p} holding block {s['p'][p]}'s")
            s["p_read"] = i
            if not stored:
                free[p].arrive()
            yield True
            if s["counted"] < i - 1:
                raise AssertionError(f"block {i}'s sums written over block {i - 1}'s, which WG0 had not counted")
            s["sums"] = i
            sums.arrive()
            yield True
            if stored:  # dS staged in the tile and read back out, then the tile may go
                s["ds_out"] = i
                free[p].arrive()
                yield True

    order = ("producer", "wg0", "wg1") if policy == "producer first" else ("wg0", "wg1", "producer")
    return schedule({"wg0": wg0(), "wg1": wg1(), "producer": producer()}, order, policy, seed,
                    lambda: f"WG0 counted through block {s['counted']}")


@pytest.mark.parametrize("stored", [False, True], ids=["formed", "stored"])
@pytest.mark.parametrize("policy", ["wg0 first", "producer first", "random"])
def test_bound_pass_hand_overs_never_hang_or_overwrite(policy, stored):
    for n_blk in range(9):
        for seed in range(20 if policy == "random" else 1):
            assert run(n_blk, tile_parity, policy, seed, stored=stored) is None, (n_blk, seed)


def test_the_model_catches_p_gathered_over_before_it_went_out():
    """Meta-test: were the stored build's ``free`` to complete on WG1's arrival alone, the producer could gather
    block i + TILES over block i's staged P before WG0 had written it out."""
    found = {run(n, tile_parity, "random", seed, stored=True, free_counts_wg0=False)
             for n in (4, 5, 6) for seed in range(40)}
    assert f"block {TILES} gathered over block 0's P or dS before it went out" in found, found


def test_the_model_catches_a_wrong_tile_parity():
    """Meta-test: the parity of the block count itself (as if one tile served every block) hangs or overwrites."""
    wrong = [run(n, lambda i: i & 1, policy) for n in (4, 5, 6) for policy in ("wg0 first", "producer first")]
    assert all(wrong), wrong


def test_the_model_catches_a_row_list_reused_too_soon():
    """Meta-test: with a row list a tile, block i + TILES's gather, once WG1 has freed block i's tile, writes its
    rows over block i's before WG0 has counted them."""
    found = {run(n, tile_parity, "random", seed, row_lists=TILES) for n in (4, 5, 6) for seed in range(30)}
    assert f"block {TILES}'s rows written over block 0's, which WG0 had not counted" in found, found


def test_the_model_catches_sums_overwritten():
    """Meta-test: were WG0 to count block i - 1 after it hands over block i's P, WG1 could put block i's sums over
    block i - 1's before WG0 counted them (one sums buffer)."""
    found = {run(n, tile_parity, "random", seed, count_first=False)
             for n in (2, 3, 4) for seed in range(30)}
    assert "block 1's sums written over block 0's, which WG0 had not counted" in found, found


def test_the_model_catches_p_written_under_dp():
    """Meta-test: without the wait for WG1's dP (``dpdone``), WG0 writes a block's P into the tile dP reads."""
    found = {run(n, tile_parity, "producer first", wait_dpdone=False) for n in (1, 2)}
    assert "P of block 0 written into its tile while WG1's dP read it" in found, found
