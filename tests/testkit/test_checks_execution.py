"""The execution checks (graph, streams, host_sync, allocations, repeats) on the CPU: a CPU backend is skipped with
the reason "CUDA only", never passed; a declaration that a backend cannot be captured is the graph check's skip
reason; and the parts of their logic that need no GPU, with fakes where they would read the device: the
allocation accounting, the repeats, the host-sync refusal and its message, the graph's second case. What needs a
GPU (capture, streams, the planted bugs) is in tests/testkit/gpu."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from sparse_mqa_testkit import CHECKS, Case, CheckSkipped, contract, get_backend
from sparse_mqa_testkit.backends.spec import BackendSpec
from sparse_mqa_testkit.cases.strategies import cases
from sparse_mqa_testkit.checks import allocations, graph, host_sync, repeats
from sparse_mqa_testkit.checks.execution import CUDA_ONLY, output_bytes
from sparse_mqa_testkit.compare import Expected
from sparse_mqa_testkit.harness import profiles
from support import DeviceTorch, EmulatedKernel, LiveBytes, OneIn257, device_torch_host_bytes

EXECUTION = ("graph", "streams", "host_sync", "allocations", "repeats")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only behaviour")


def test_the_registry_holds_the_execution_checks():
    assert {n for n, c in CHECKS.items() if c.execution} == set(EXECUTION)
    for name in EXECUTION:
        assert CHECKS[name].directions == ("backward", "forward") and CHECKS[name].help
    assert not any(c.execution for n, c in CHECKS.items() if n not in EXECUTION)


@pytest.mark.parametrize("name", EXECUTION)
@pytest.mark.parametrize("make", [lambda: get_backend("reference"), EmulatedKernel, lambda: DeviceTorch("cpu")],
                         ids=["reference", "emulated", "device-torch-on-cpu"])
def test_a_cpu_backend_is_skipped_as_cuda_only_never_passed(name, make):
    backend = make()
    res = CHECKS[name].function(backend, Case(S=3, seed=1))
    assert res.skipped.startswith(f"{CUDA_ONLY}: backend {BackendSpec.of(backend).name!r} runs on cpu")
    assert not res.passed and res.check == name
    assert CHECKS[name].applies_to(backend) == res.skipped  # the same reason at collection and at the call
    with pytest.raises(CheckSkipped, match=CUDA_ONLY):
        res.raise_if_failed()


@NO_CUDA
@pytest.mark.parametrize("name", EXECUTION)
def test_a_cuda_backend_without_a_gpu_is_skipped_saying_so(name):
    assert CHECKS[name].applies_to(DeviceTorch("cuda")) is None  # it applies; this machine cannot run it
    res = CHECKS[name].function(DeviceTorch("cuda"), Case(S=3, seed=1))
    assert res.skipped == f"{CUDA_ONLY}: torch.cuda.is_available() is False on this machine" and not res.passed


class Uncapturable(DeviceTorch):
    name = "uncapturable"
    graph_safe = False
    graph_unsafe_reason = "it plans on the host from topk_length every call"


def test_a_backend_that_cannot_be_captured_says_why_and_is_skipped_with_that():
    want = "backend 'uncapturable' declares graph_safe = False: it plans on the host from topk_length every call"
    assert CHECKS["graph"].applies_to(Uncapturable()) == want
    assert CHECKS["streams"].applies_to(Uncapturable()) is None  # the other checks still apply
    res = graph.check_graph(Uncapturable(), Case(seed=1))
    assert res.skipped == want and not res.passed
    Uncapturable.graph_unsafe_reason = ""
    try:
        assert CHECKS["graph"].applies_to(Uncapturable()).endswith("no reason given (graph_unsafe_reason)")
    finally:
        Uncapturable.graph_unsafe_reason = "it plans on the host from topk_length every call"
    assert BackendSpec.of(DeviceTorch()).graph_safe  # undeclared: expected to be capturable


# ---- declarations read through BackendSpec ---------------------------------------------------------------------
class BothDirections(DeviceTorch):
    def workspace_bytes(self, case):
        return 1000 + case.S


class Negative(DeviceTorch):
    name = "negative"

    def workspace_bytes(self, case, direction="backward"):
        return -1


def test_workspace_declarations_through_the_spec():
    case = Case(S=5)
    assert BackendSpec.of(get_backend("reference")).workspace_bytes(case) == 0
    assert not BackendSpec.of(get_backend("reference")).declares_workspace
    spec = BackendSpec.of(BothDirections("cpu"))
    assert spec.declares_workspace and spec.workspace_bytes(case, "forward") == spec.workspace_bytes(case) == 1005
    per = BackendSpec.of(DeviceTorch("cpu"))
    assert per.workspace_bytes(case, "forward") == per.backend.workspace_bytes(case, "forward") > 0
    with pytest.raises(ValueError, match=r"backend 'negative': workspace_bytes\(Case\(S=5\)\) must be an int >= 0"):
        BackendSpec.of(Negative()).workspace_bytes(case)


# ---- allocations: the accounting, with a fake allocator -----------------------------------------------------------
class FakeMemory:
    """Counters like torch's caching allocator's, fed by hand."""

    def __init__(self, held: int = 1000):
        self.now = self.top = held

    def available(self):
        return True

    def alloc(self, n):
        self.now += n
        self.top = max(self.top, self.now)

    def free(self, n):
        self.now -= n

    def current(self):
        return self.now

    def peak(self):
        return self.top

    def reset_peak(self):
        self.top = self.now


def _fake_call(memory, *, workspace, leak=0):
    def call():
        outs = {"dq": torch.zeros(750), "d_sink": None}  # 3000 bytes of outputs
        memory.alloc(3000)
        memory.alloc(workspace)
        memory.free(workspace - leak)
        return outs
    return call


def test_allocation_accounting_reports_the_excess_in_bytes():
    memory = FakeMemory()
    held, outs = allocations.held_by(_fake_call(memory, workspace=5000), memory)
    assert (held.before, held.peak, held.after, held.outputs) == (1000, 9000, 4000, 3000)
    assert held.extra == 5000 and held.retained == 0 and output_bytes(outs) == 3000
    problems, entry = allocations.judge("backward", held, 4096)
    assert problems == ["backward: held 5,000 bytes beyond its outputs (3,000 B) at its peak, declares 4,096 B of "
                        "workspace (workspace_bytes): 904 bytes over"]
    assert entry["error"] == 5000 and entry["allowed"] == 4096 and entry["ratio"] == pytest.approx(5000 / 4096)
    problems, entry = allocations.judge("backward", held, 5000)
    assert problems == [] and entry["ratio"] == 1.0
    problems, entry = allocations.judge("forward", allocations.Held(10, 10, 10, 0), 0)
    assert problems == [] and entry["ratio"] == 0.0


def test_memory_kept_after_the_call_fails_and_a_cycle_is_collected_first():
    memory = FakeMemory()
    held, _ = allocations.held_by(_fake_call(memory, workspace=5000, leak=128), memory)
    problems, _ = allocations.judge("backward", held, 10**6)
    assert held.retained == 128
    assert problems == ["backward: still holds 128 bytes beyond its outputs after returning (memory the warm-up "
                        "call did not keep: it grows call after call)"]

    class Cycle:  # a temporary a reference cycle keeps until the collector runs
        def __init__(self):
            self.me = self

        def __del__(self):
            memory.free(256)

    def call():
        memory.alloc(256)
        Cycle()
        return {"dq": None}

    gc.disable()
    try:
        held, _ = allocations.held_by(call, memory)
    finally:
        gc.enable()
    assert held.retained == 0 and held.extra == 256


def test_outputs_count_as_the_contract_sizes_them():
    buffer = torch.zeros(1000)
    assert output_bytes({"dq": buffer[:10], "dkv": torch.zeros(3, dtype=torch.bfloat16), "d_sink": None}) == 46


def test_the_allocations_check_end_to_end_with_a_fake_allocator(monkeypatch):
    """The check's own flow (warm-up, counters, message, footer) with its device parts faked on the CPU: a backend
    that takes 1 MiB beyond what it declares is told by how much."""
    memory = FakeMemory()

    class Counted(DeviceTorch):
        name = "counted"
        extra = 0

        def backward(self, *args, **kw):
            res = super().backward(*args, **kw)
            memory.alloc(output_bytes(dict(zip("abc", res))) + self.extra + 4096)
            memory.free(self.extra + 4096)
            return res

        def forward(self, *args, **kw):
            res = super().forward(*args, **kw)
            memory.alloc(output_bytes(dict(zip("ab", res))))
            return res

    _on_cpu(monkeypatch, allocations)
    case = Case(S=3, Skv=8, L=4, seed=3)
    ok = allocations.check_allocations(Counted("cpu"), case, memory=memory)
    assert ok.passed, ok.message
    assert ok.notes["backward"] == {"workspace_bytes": 4096, "declared": Counted().workspace_bytes(case),
                                    "retained": 0}
    big = Counted("cpu")
    big.extra = device_torch_host_bytes(case.dims) * 2 + (2 << 20)
    res = allocations.check_allocations(big, case, memory=memory)
    over = big.extra + 4096 - big.workspace_bytes(case)
    assert not res.passed and f"{over:,} bytes over" in res.message
    assert "backward: held" in res.message and "forward" not in res.message
    assert f'--check allocations --replay "{case.repro()}"' in res.message and f"seed: {case.seed}" in res.message


def _on_cpu(monkeypatch, module):
    """Let a CUDA-only check module run its flow on the CPU: no skip, the CPU as its device, no device sync."""
    monkeypatch.setattr(module, "not_here", lambda *a, **k: None)
    monkeypatch.setattr(module, "device_of", lambda spec: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


# ---- repeats ------------------------------------------------------------------------------------------------------
CASE = Case(B=2, S=4, Skv=12, H=3, L=6, Dqk=16, Dv=8, sink="finite", topk="random", seed=11)


class OneIn7(OneIn257):
    """The planted fault, sooner: the same logic in fewer CPU calls (the GPU test runs 257)."""

    PERIOD = 7


def test_repeats_finds_the_call_that_differs_and_stops_there():
    spec = BackendSpec.of(OneIn7("cpu"))
    problems, per_tensor, worst, made = repeats.repeated(spec, Expected(CASE), "backward", 9, 2.5)
    assert made == 7 and worst == math.inf
    assert len(problems) == 1 and problems[0].startswith("backward dkv: call 7 of 9 differs bitwise at 1 / ")
    assert "first at index (0, 0, 0): call 7 " in problems[0] and problems[0].endswith("(backend claims determinism)")
    fresh = BackendSpec.of(OneIn7("cpu"))
    assert repeats.repeated(fresh, Expected(CASE), "backward", 6, 2.5)[0] == []  # 6 calls miss it


def test_repeats_judges_a_nondeterministic_backend_by_tolerance_on_every_call():
    spec = BackendSpec.of(EmulatedKernel(seed=3))  # dkv summed in a random order: other bits, same tolerance
    problems, per_tensor, worst, made = repeats.repeated(spec, Expected(CASE), "backward", 5, 2.5)
    assert problems == [] and made == 5 and 0 < worst < 1 and set(per_tensor) >= {"dq", "dkv", "d_sink"}

    class WrongOnThird(EmulatedKernel):
        calls = 0

        def backward(self, *args, **kw):
            dq, dkv, d_sink = super().backward(*args, **kw)
            self.calls += 1
            return (dq * 2 if self.calls == 3 else dq), dkv, d_sink

    problems, _, worst, made = repeats.repeated(BackendSpec.of(WrongOnThird()), Expected(CASE), "backward", 6, 2.5)
    assert made == 3 and worst > 1 and problems and all(p.startswith("backward call 3 of 6: dq") for p in problems)


def test_the_repeats_check_message_says_how_to_replay_it(monkeypatch):
    _on_cpu(monkeypatch, repeats)
    res = repeats.check_repeats(OneIn7("cpu"), CASE, repeats=8)
    assert not res.passed and "call 7 of 8" in res.message
    assert "(made with 8 calls: replay with --repeats 8)" in res.message
    assert res.notes["backward_calls"] == 7 and res.notes["repeats"] == 8
    assert f'--check repeats --replay "{CASE.repro()}"' in res.message
    assert repeats.check_repeats(OneIn7("cpu"), CASE).passed  # 4 calls, the replay's default
    with pytest.raises(ValueError, match="repeats must be an int >= 2, got 1"):
        repeats.check_repeats(OneIn7("cpu"), CASE, repeats=1)


def test_the_profile_sets_the_repeats_count_and_caps_drawn_execution_cases():
    assert profiles.check_options("ci", "repeats", explicit=True) == {"repeats": 4}
    assert profiles.check_options("nightly", "repeats", explicit=True) == {"repeats": 1000}
    assert profiles.check_options("nightly", "repeats", explicit=False) == {"repeats": 4}
    assert profiles.check_options("nightly", "graph", explicit=True) == {}
    assert profiles.drawn_examples("ci", 100, execution=True) == profiles.EXECUTION_EXAMPLES["ci"] < 100
    assert profiles.drawn_examples("ci", 100, execution=False) == 100
    assert profiles.drawn_examples("ci", 3, execution=True) == 3  # SMQA_MAX_EXAMPLES below the cap wins


# ---- host sync ----------------------------------------------------------------------------------------------------
def test_python_level_syncs_are_refused_inside_and_restored_after():
    module_fn, event_fn = torch.cuda.synchronize, torch.cuda.Event.synchronize
    with host_sync.python_syncs_flagged():
        with pytest.raises(host_sync.HostSync, match=r"called torch.cuda.synchronize\(\): the host waits"):
            torch.cuda.synchronize()
        with pytest.raises(host_sync.HostSync, match=r"called torch.cuda.Event.synchronize\(\)"):
            torch.cuda.Event.synchronize(object())
    assert torch.cuda.synchronize is module_fn and torch.cuda.Event.synchronize is event_fn
    assert host_sync.is_sync_error(RuntimeError("called a synchronizing CUDA operation"))
    assert not host_sync.is_sync_error(ValueError("q must be bfloat16"))


class SyncOnSecondCall(DeviceTorch):
    """Warm on its first call; then reads a value on the host the way torch's sync debug mode refuses."""

    name = "sync-on-second-call"
    calls = 0

    def backward(self, *args, **kw):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("called a synchronizing CUDA operation")  # what torch raises at a .item()
        return super().backward(*args, **kw)

    def forward(self, *args, **kw):
        torch.cuda.synchronize()
        return super().forward(*args, **kw)


def test_the_host_sync_message_names_the_operation_and_the_case(monkeypatch):
    _on_cpu(monkeypatch, host_sync)
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    res = host_sync.check_host_sync(SyncOnSecondCall("cpu"), CASE)
    assert not res.passed and modes == ["error", 0, "error", 0]  # set for each call, restored after
    text = res.message
    assert ('backward synchronized with the host in a warmed-up call under torch.cuda.set_sync_debug_mode("error"): '
            "RuntimeError: called a synchronizing CUDA operation") in text
    assert "in backward: raise RuntimeError" in text  # the frame that made it
    assert "forward synchronized with the host" in text and "called torch.cuda.synchronize()" in text
    assert f"case: {CASE.describe()}" in text and f'--check host_sync --replay "{CASE.repro()}"' in text


# ---- graph: the second case ---------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(case=cases(max_s=6, max_skv=16, max_l=10, max_h=4))
def test_the_second_case_keeps_shapes_and_optional_inputs_and_moves_rows(case):
    first = Expected(case)
    second, counts = graph.second_case(first)
    a, b = first.call("cpu"), second.call("cpu")
    assert set(a.tensors()) == set(b.tensors())  # the same optional inputs
    assert all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a.tensors())
    assert a["sm_scale"] == b["sm_scale"] and second.case.sink == case.sink and second.case.topk == case.topk
    assert not torch.equal(a["q"], b["q"]) and not torch.equal(a["grad_out"], b["grad_out"])
    rows_a = contract.valid_mask(a["indices"], case.Skv, a["topk_length"]).any(-1)
    rows_b = contract.valid_mask(b["indices"], case.Skv, b["topk_length"]).any(-1)
    assert counts == {"rows_emptied": int((rows_a & ~rows_b).sum()), "rows_filled": int((~rows_a & rows_b).sum())}
    if rows_a.any():
        assert counts["rows_emptied"] > 0  # a row with valid slots goes empty


def test_the_second_case_fills_rows_the_first_left_empty():
    for case in (Case(B=2, S=8, invalid="empty_rows", seed=4), Case(S=12, topk="random", L=3, seed=5)):
        first = Expected(case)
        _, counts = graph.second_case(first)
        assert counts["rows_emptied"] > 0 and counts["rows_filled"] > 0, counts


def test_a_failed_capture_reports_its_first_error_and_the_last():
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as exc:
        text = graph._root_error(exc)
    assert text.startswith("RuntimeError: operation not permitted when stream is capturing")
    assert text.endswith("then: RuntimeError: CUDA error: operation failed due to a previous error during capture")


# ---- the correct CUDA backend of the GPU tests, held to the contract and to its declaration on the CPU -------------
@pytest.mark.parametrize("case", [CASE, Case(S=3, Skv=8, H=16, L=40, Dqk=64, Dv=32, sink="mixed",
                                             invalid="empty_rows", seed=2),
                                  Case(B=3, S=1, Skv=40, H=2, L=8, Dqk=16, Dv=8, topk="random", seed=3)],
                         ids=lambda c: c.describe())
def test_device_torch_is_a_correct_deterministic_backend_within_its_declared_workspace(case):
    backend = DeviceTorch("cpu")
    for name in ("tolerance", "forward_tolerance", "determinism", "guards"):
        res = CHECKS[name].function(backend, case)
        assert res.passed, res.message
    call = Expected(case).call("cpu")
    for which in ("backward", "forward"):
        with LiveBytes() as m:
            outs = call.results(backend, which)
        assert m.peak - output_bytes(outs) <= device_torch_host_bytes(case.dims)
        assert backend.workspace_bytes(case, which) == 2 * device_torch_host_bytes(case.dims) + (1 << 20)
