"""The main kernel's timing probe (benchmarks/trace_backward.py): its summary of the stamps, on stamps made up here."""
import numpy as np

from support import benchmark_module

TRACE = benchmark_module("trace_backward")


def _block(start, sm, blocks=4):
    # ns after ``start``: q and dO at 2 us, the first block at 3, WG1 starts at 5, WG0's loop ends at 3 + 4 blocks
    # of 2 us, its dq store takes 1 us, WG1's loop ends 2 us later and its store 1.5 us, the sender 0.5 us after it
    at = dict(start=0, query_ready=2000, first_block=3000, wg0_loop_end=11000, wg0_end=12000, wg1_first=5000,
              wg1_loop_end=13000, wg1_end=14500, sender_first=7000, sender_end=13500)
    row = [start + at[name] for name in TRACE.SLOTS[:10]] + [sm, blocks]
    return row


def test_each_phase_is_read_from_its_stamps_and_the_last_wave_is_the_tail():
    # two SMs: SM 0 runs three blocks back to back (1 us apart), SM 1 one block, so it idles from 14.5 us on
    ends = 14500
    stamps = np.array([_block(0, 0), _block(ends + 1000, 0), _block(2 * (ends + 1000), 0), _block(0, 1)],
                      dtype=np.int64)
    out = TRACE.summarise(stamps)
    assert out["block"] == 14.5 and out["prologue (q, dO landed)"] == 2.0 and out["first gather after that"] == 1.0
    assert out["fill (WG1's first product)"] == 5.0 and out["WG0 loop, per top-k block"] == 2.0
    assert out["drain (end after WG0's loop)"] == 3.5 and out["sender after WG1's loop"] == 0.5
    assert out["WG0 dq store"] == 1.0 and out["WG1 dq store"] == 1.5
    assert out["gap between blocks on an SM"] == 1.0
    assert out["SMs"] == 2 and out["blocks per SM (min/max)"] == (1, 3)
    assert out["kernel span"] == 2 * 15.5 + 14.5
    assert out["tail after the first SM goes idle"] == 2 * 15.5  # SM 1 done at 14.5 us, the kernel at 45.5


def test_the_bound_pass_phases():
    # one SM, two blocks 1 us apart: q, dO and out at 3 us, Delta 1 us, the loop from 4.5 us, 8 blocks of 1 us
    at = dict(start=0, query_ready=3000, prep_done=4000, loop_start=4500, loop_end=12500)
    # each warpgroup's cycles in its loop's phases, summed over the 8 blocks (the producer gathers 7 of them)
    phases = [800 * (k + 1) for k in range(len(TRACE.BOUND_ALL) - len(TRACE.BOUND_SLOTS))]
    one = [at[name] for name in TRACE.BOUND_SLOTS[:5]] + [0, 8] + phases
    stamps = np.array([one, [t + 13500 for t in one[:5]] + [0, 8] + phases], dtype=np.int64)
    out = TRACE.summarise_bound(stamps)
    names = [name for role in TRACE.BOUND_PHASES for name in role]
    assert out["wg0_full (cycles a block)"] == 100.0 and out[f"{names[5]} (cycles a block)"] == 600.0
    assert out["prod_issue (cycles a block)"] == 800 * len(names) / 7
    assert out["block"] == 12.5 and out["prologue (q, dO, out and block 0 landed)"] == 3.0
    assert out["Delta, max|q|, max|dO|"] == 1.0 and out["to the loop"] == 0.5 and out["loop, per 64-slot block"] == 1.0
    assert out["gap between blocks on an SM"] == 1.0 and out["kernel span"] == 26.0 and out["SMs"] == 1
