"""The execution checks on a GPU: a correct backend that computes on the device (support.DeviceTorch) passes all
five, and each planted bug fails the check written for it, with a message that says what happened."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sparse_mqa_testkit import CHECKS, Case  # noqa: E402
from sparse_mqa_testkit.checks import (  # noqa: E402
    check_allocations,
    check_graph,
    check_host_sync,
    check_repeats,
    check_streams,
)
from support import (  # noqa: E402
    EXECUTION_BUGS,
    DefaultStreamFill,
    DeviceTorch,
    HostPlan,
    OneIn257,
    ScratchPerCall,
    SyncsOnHost,
)

pytestmark = pytest.mark.gpu  # skipped with the reason without CUDA; a failure with --smqa-require-gpu

EXECUTION = ("graph", "streams", "host_sync", "allocations", "repeats")
CASES = [
    Case(B=2, S=8, Skv=40, H=4, L=16, Dqk=64, Dv=32, sink="finite", topk="random", invalid="holes", seed=1),
    Case(B=1, S=6, Skv=24, H=16, L=40, Dqk=64, Dv=32, sink="mixed", invalid="empty_rows", duplicates=True, seed=2),
    Case(B=3, S=5, Skv=16, H=2, L=8, Dqk=32, Dv=32, empty_lse="neg_inf", invalid="tails", seed=3),
]
BUG_CASE = Case(B=2, S=8, Skv=40, H=4, L=16, Dqk=64, Dv=32, sink="finite", topk="random", seed=5)


def test_every_execution_check_has_a_planted_bug():
    assert set(EXECUTION_BUGS) == set(EXECUTION) == {n for n, c in CHECKS.items() if c.execution}


@pytest.mark.parametrize("name", EXECUTION)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_a_correct_device_backend_passes_every_execution_check(name, case):
    res = CHECKS[name].function(DeviceTorch(), case)
    assert res.passed, res.message
    assert not res.skipped


@pytest.mark.parametrize("name", EXECUTION)
def test_each_planted_bug_fails_its_check(name):
    options = {"repeats": 300} if name == "repeats" else {}  # its fault shows once in 257 calls
    res = CHECKS[name].function(EXECUTION_BUGS[name](), BUG_CASE, **options)
    assert not res.passed and not res.skipped, f"{name} missed {EXECUTION_BUGS[name].__name__}"
    assert f"{name} check failed for backend" in res.message and BUG_CASE.repro() in res.message


def test_a_host_read_in_the_call_is_named_with_the_line_that_made_it():
    previous = torch.cuda.get_sync_debug_mode()
    res = check_host_sync(SyncsOnHost(), BUG_CASE)
    assert "backward synchronized with the host in a warmed-up call" in res.message
    assert "called a synchronizing CUDA operation" in res.message and "q.abs().amax().item()" in res.message
    assert "forward" not in res.message.split("case:")[0]  # its forward is clean
    assert torch.cuda.get_sync_debug_mode() == previous  # the mode is given back


def test_a_zero_fill_on_the_default_stream_shows_when_the_caller_uses_another():
    res = check_streams(DefaultStreamFill(), BUG_CASE)
    assert "dkv: backward on a side stream while the ambient stream was parked behind a sleep: differs bitwise" \
        in res.message
    # with the caller on the default stream the fill lands in order: the other situation passes
    assert "written by a sleeping side stream" not in res.message
    assert res.notes["backward.parked"]["overlapped"] and res.notes["backward.produced"]["overlapped"]


def test_a_plan_baked_into_the_graph_shows_after_the_inputs_change():
    res = check_graph(HostPlan(), BUG_CASE)
    assert "graph replay after the captured inputs were overwritten in place with Case(" in res.message
    assert "graph replay on the captured case" not in res.message  # right on the values it was captured with
    assert res.notes["rows_emptied"] > 0


def test_a_scratch_buffer_beyond_the_declared_workspace_is_reported_in_bytes():
    res = check_allocations(ScratchPerCall(), BUG_CASE)
    note = res.notes["backward"]
    assert note["workspace_bytes"] - note["declared"] > ScratchPerCall.SCRATCH - 1
    assert f"{note['workspace_bytes'] - note['declared']:,} bytes over" in res.message
    assert "forward" not in res.message.split("case:")[0]


def test_a_fault_once_in_257_calls_needs_the_long_repeats():
    assert check_repeats(OneIn257(), BUG_CASE, repeats=4).passed  # the ci count does not reach it
    res = check_repeats(OneIn257(), BUG_CASE, repeats=300)
    assert "backward dkv: call 257 of 300 differs bitwise at 1 / " in res.message
    assert "replay with --repeats 300" in res.message and res.notes["backward_calls"] == 257
