"""The sustained-load probe (benchmarks/sustained_backward.py): its run summary and its reading of nvidia-smi's
samples, on numbers made up here."""
import datetime

import pytest

from support import benchmark_module

SUSTAINED = benchmark_module("sustained_backward")


def test_a_run_is_split_into_its_first_calls_and_the_rest_and_by_input_set():
    # five fast calls after the idle pause, then the GPU settles slower, and calls 6, 9, ... (input set 0 of 3)
    # slower still
    times = [6.4, 6.5, 6.4, 6.5, 6.4] + [7.0, 7.2, 7.0] * 5
    out = SUSTAINED.summarize(times, sets=3)
    assert out["calls"] == 20 and out["first"] == 6.4 and out["after"] == 7.0 and out["best"] == 6.4
    assert out["last_half"] == 7.0
    assert out["per_set"] == [7.2, 7.0, 7.0]


def test_a_run_too_short_to_split_says_so():
    with pytest.raises(ValueError, match="more than 5 calls"):
        SUSTAINED.summarize([6.4] * 5, sets=3)


def test_only_the_samples_inside_the_window_count():
    lines = ["2026/12/03 18:10:00.000, 1980, 300.5, 40, 0x0000000000000000",
             "2026/12/03 18:10:01.000, 1755, 690.0, 52, 0x0000000000000004",
             "2026/12/03 18:10:01.500, 1830, 650.0, 50, 0x0000000000000000",
             "2026/12/03 18:10:03.000, 1980, 90.0, 45, 0x0000000000000000",
             "garbage line", "2026/12/03 18:10:01.700, [N/A], 1.0, 1, x"]
    t0 = datetime.datetime(2026, 12, 3, 18, 10, 0, 500000)
    t1 = datetime.datetime(2026, 12, 3, 18, 10, 2)
    out = SUSTAINED.parse_smi(lines, t0, t1)
    assert out["samples"] == 2 and out["sm_mhz_min"] == 1755 and out["watts_max"] == 690.0
    assert out["sm_mhz"] == (1755 + 1830) / 2 and out["temp_max"] == 52
    assert out["reasons"] == ["0x0000000000000000", "0x0000000000000004"]
    assert SUSTAINED.parse_smi(lines, t1, t1 + datetime.timedelta(seconds=0.5)) == {"samples": 0}
