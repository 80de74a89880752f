"""Meta-tests of the determinism check: bitwise for a claimed-deterministic backend, drift reported and held to
the tolerance otherwise, and the hostile environment actually hostile."""

from __future__ import annotations

import torch

from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.checks import check_determinism
from sparse_mqa_testkit.checks.determinism import poison_allocator
from sparse_mqa_testkit.checks.result import FAILED_RATIO
from support import EmulatedKernel, random_order_dkv

CASE = Case(S=4, Skv=8, H=3, L=8, sink="finite", invalid="holes", seed=21)


def test_reference_is_bitwise_deterministic_under_poisoning():
    res = check_determinism(ReferenceBackend(), CASE)
    assert res.passed, res.message
    assert res.notes["claims_deterministic"] is True
    assert res.notes["drift"] == {n: 0.0 for n in ("dq", "dkv", "d_sink", "out", "lse")}
    assert "poisoned" in res.notes


def test_cpu_skips_stream_parts_and_says_so():
    res = check_determinism(ReferenceBackend(), CASE)
    if not torch.cuda.is_available():
        assert any("non-default stream" in s for s in res.notes["skipped"])
        assert any("concurrent kernel" in s for s in res.notes["skipped"])
        assert set(res.notes["environments"]) == {"plain"}


def test_claimed_determinism_that_drifts_fails_naming_tensor_and_index():
    res = check_determinism(random_order_dkv(), CASE)
    assert not res.passed and res.ratio == FAILED_RATIO
    m = res.message
    assert m.startswith("determinism check failed for backend 'broken-random-order-dkv'")
    assert "dkv: call 2 (plain) differs bitwise at " in m
    assert "first at index (" in m and ": call 2 " in m and ", call 1 " in m and "(backend claims determinism)" in m
    assert "dq:" not in m  # dq is deterministic in that backend
    assert res.notes["drift"]["dkv"] > 0 and res.notes["drift"]["dq"] == 0.0
    assert res.per_tensor["dkv"]["bitwise_equal"] is False and res.per_tensor["dq"]["bitwise_equal"] is True
    assert 'repro: sparse-mqa-check --backend broken-random-order-dkv --check determinism --replay "' in m


def test_non_deterministic_backend_reports_drift_within_tolerance():
    res = check_determinism(EmulatedKernel(seed=3), CASE)
    assert res.passed, res.message
    assert res.notes["claims_deterministic"] is False
    assert set(res.notes["drift"]) == {"dq", "dkv", "d_sink", "out", "lse"}
    assert res.notes["drift"]["dq"] == 0.0  # dq is gathered, not scattered: no order to vary
    assert 0.0 <= res.ratio < 1


def test_drift_beyond_tolerance_fails_for_non_deterministic_backend():
    class Noisy(ReferenceBackend):
        """Honest about non-determinism, but its dkv wanders by ~2% from run to run."""

        name = "noisy"
        deterministic = False

        def __init__(self):
            super().__init__()
            self.gen = torch.Generator().manual_seed(0)

        def backward(self, *a, **kw):
            dq, dkv, d_sink = super().backward(*a, **kw)
            noise = 1 + 0.02 * torch.randn(dkv.shape, generator=self.gen)
            return dq, (dkv.float() * noise).to(torch.bfloat16), d_sink

    res = check_determinism(Noisy(), CASE)
    assert not res.passed and res.ratio > 1
    assert res.notes["drift"]["dkv"] > 0.01 and res.notes["drift"]["dq"] == 0.0
    assert "run 1: dkv: relative L2 error" in res.message


def test_outputs_poisoned_between_calls_expose_a_reused_buffer():
    class ReturnsCache(ReferenceBackend):
        """Caches its results and returns the same tensors again: the caller's poison shows up."""

        name = "returns-cache"

        def backward(self, *a, **kw):
            if not hasattr(self, "_cached"):
                self._cached = super().backward(*a, **kw)
            return self._cached

    res = check_determinism(ReturnsCache(), CASE)
    assert not res.passed and "differs bitwise" in res.message and "nan" in res.message
    assert check_determinism(ReturnsCache(), CASE, hostile=False).passed


def test_poison_allocator_runs_on_cpu():
    poison_allocator("cpu", [1 << 10, 4 << 20])
