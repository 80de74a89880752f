"""The stage hand-over of the 64-head backward's main kernel (``backward_ws``) on CPU: WG1 stages each dkv chunk
into one shared buffer and arrives on ``bar_staged``; the sender warpgroup waits on it, reads the chunk, arrives on
``bar_read``, and WG1 waits on that before staging the next chunk. Both barriers are mbarriers
waited on by phase parity, so a wrong parity either passes early (a chunk overwritten before it is read) or waits
for a phase already gone (the kernel hangs: it did at Dqk 512, an even chunk count, on the H200, 2026-12-01).

The two parties are simulated step by step under several schedules, with PTX's parity rule: a wait on parity p
passes once the barrier's current phase has parity other than p."""

import pytest

from protocol_sim import Slot, schedule
from sparse_mqa_kernels.backward_ws import read_parity


def run(n_blk, nch, read_parity, policy, seed=0):
    """Simulate one query's blocks; returns None, or what went wrong."""
    stage = Slot("chunk", "staged", "the sender")  # bar_staged is its full barrier, bar_read its free one

    def stager():
        for kb in range(n_blk):
            for c in range(nch):
                yield from stage.put(kb * nch + c, read_parity(kb, c, nch) if kb or c else None)
                yield True

    def sender():
        for g in range(n_blk * nch):
            yield from stage.take(g, g & 1)
            yield True

    order = ("sender", "stager") if policy == "sender first" else ("stager", "sender")
    return schedule({"stager": stager(), "sender": sender()}, order, policy, seed,
                    lambda: f"{stage.free.phase} chunks read")


@pytest.mark.parametrize("nch", [8, 9])  # Dqk 512 and 576 in 64-column chunks
@pytest.mark.parametrize("n_blk", [1, 2, 3, 5])
@pytest.mark.parametrize("policy", ["stager first", "sender first", "random"])
def test_hand_over_never_hangs_or_overwrites(nch, n_blk, policy):
    for seed in range(3 if policy == "random" else 1):
        assert run(n_blk, nch, read_parity, policy, seed) is None


def test_block_local_parity_fails_at_an_even_chunk_count():
    """The parity the kernel first had, (kb + c + 1) & 1, is the global one only when the chunk count is odd; at 8
    chunks a block, block 1's first chunk waits for the wrong phase: it hangs when the sender has read chunk 7 by
    then, and overwrites chunk 7 unread when it has not."""
    def old(kb, c, nch):
        return (kb + c + 1) & 1

    assert all(run(2, 9, old, policy) is None for policy in ("stager first", "sender first"))
    assert run(2, 8, old, "sender first").startswith("deadlock")
    assert run(2, 8, old, "stager first") == "chunk 8 staged over chunk 7, which the sender had not read"
