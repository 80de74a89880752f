"""Meta-tests of the guards check: poisoned unreferenced KV rows, fully written and fresh outputs."""

from __future__ import annotations

import torch

from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.checks import check_guards
from sparse_mqa_testkit.checks.guards import unreferenced_rows
from sparse_mqa_testkit.compare import Expected
from sparse_mqa_testkit.contract import valid_mask
from support import EmulatedKernel, MaskMultiply, StaleRow

CASE = Case(S=6, Skv=40, H=3, L=6, invalid="mixed", sink="finite", seed=31)


def test_unreferenced_rows_are_the_complement_of_valid_slots():
    x = CASE.inputs()
    un = unreferenced_rows(Expected(CASE))
    valid = valid_mask(x["indices"], CASE.Skv, x["topk_length"])
    used = set(int(j) for j in x["indices"][valid])
    assert {j for j in range(CASE.Skv) if not un[0, j]} == used
    assert un.any()


def test_reference_passes_and_reports_what_it_poisoned():
    res = check_guards(ReferenceBackend(), CASE)
    assert res.passed, res.message
    assert res.notes["poisoned_rows"] == int(unreferenced_rows(Expected(CASE)).sum()) > 0
    assert res.per_tensor["poison.dq"]["bitwise_equal"] and res.per_tensor["stale.dkv"]["bitwise_equal"]


def test_non_deterministic_backend_is_held_to_tolerance():
    res = check_guards(EmulatedKernel(), CASE)
    assert res.passed, res.message
    assert any(k.startswith("poison.") for k in res.per_tensor)


def test_nan_leak_from_a_masked_row_is_caught():
    res = check_guards(MaskMultiply(), Case(S=4, Skv=64, L=4, invalid="holes", seed=10))
    assert not res.passed
    assert "with unreferenced KV rows set to NaN: differs bitwise at " in res.message
    assert ", clean run " in res.message


def test_stale_output_row_is_caught():
    res = check_guards(StaleRow(), Case(S=8, Skv=24, invalid="empty_rows", seed=9))
    assert not res.passed
    assert "after a call with other inputs of the same shapes" in res.message and "dq" in res.message


def test_unwritten_nan_output_is_caught():
    class LeavesNaN(ReferenceBackend):
        """Allocates dq with NaN (an uninitialised buffer) and forgets the rows with no valid slot."""

        name = "leaves-nan"

        def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
            dq, dkv, d_sink = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                               topk_length=topk_length)
            rows = torch.from_numpy(valid_mask(indices.numpy(), kv.shape[1],
                                               None if topk_length is None else topk_length.numpy()).any(-1))
            buf = torch.full_like(dq, float("nan"))
            buf[rows] = dq[rows]
            return buf, dkv, d_sink

    res = check_guards(LeavesNaN(), Case(S=8, Skv=24, invalid="empty_rows", seed=9))
    assert not res.passed and "dq: NaN positions differ from the oracle" in res.message
