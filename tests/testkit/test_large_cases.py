"""Large cases (q past ``cases.LARGE`` elements): torch draws them on the device they run on, the device
oracle is their truth, and every mode still makes what it says. Exercised on the host with LARGE lowered."""

from __future__ import annotations

import pytest
import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases import case as case_module
from sparse_mqa_testkit.cases.tensors import case_tensors
from sparse_mqa_testkit.checks import check_backward_tolerance
from sparse_mqa_testkit.compare import Expected, truth_device
from support import EmulatedKernel


@pytest.fixture
def large(monkeypatch):
    monkeypatch.setattr(case_module, "LARGE", 64)


def test_a_large_case_has_no_numpy_inputs_and_says_where_they_are(large):
    case = Case(S=4, Skv=8, H=2, L=4)
    assert case.large
    with pytest.raises(ValueError, match=r"tensors.case_tensors\(case, device\)"):
        case.inputs()
    assert truth_device("cpu", case) == "cpu" and truth_device("cuda:0", case) == "cuda:0"


@pytest.mark.parametrize("fields", [
    dict(invalid="mixed", sink="mixed", topk="random"),
    dict(pattern="local", magnitude="spread"),
    dict(pattern="hot", duplicates=True, order="sorted", invalid="empty_rows"),
])
def test_torch_drawn_tensors_follow_the_contract_and_the_seed(large, fields):
    case = Case(B=2, S=6, Skv=16, H=3, L=8, **fields, seed=5)
    t, again = case_tensors(case), case_tensors(case)
    for name in ("q", "kv", "indices", "topk_length", "attn_sink", "grad_out"):
        if t[name] is None:
            continue
        assert contract.dtype_name(t[name]) == contract.KERNEL_DTYPES[name], name
        assert tuple(t[name].shape) == case.dims.shape(name), name
        assert torch.equal(t[name], again[name]) or name == "attn_sink" and torch.equal(
            t[name].isnan(), again[name].isnan()), f"{name} is not a function of the seed"
    other = case_tensors(case.replace(seed=6))
    assert not torch.equal(other["q"], t["q"])
    if fields.get("invalid") == "empty_rows":
        assert not contract.valid_mask(t["indices"][0, 0], case.Skv).any(), "row (0, 0) is always emptied"


def test_a_large_case_is_compared_with_the_device_oracle(large):
    # the reference of a large case comes from the float64 device oracle even on the host, and a correct
    # kernel passes against it while a wrong one does not
    case = Case(S=5, Skv=12, H=4, L=6, Dqk=24, Dv=16, sink="finite", pattern="local", seed=2)
    r = Expected(case, "cpu")
    assert r.exact["dq"].dtype == torch.float64 and r.rounded["dq"].dtype == torch.bfloat16
    assert check_backward_tolerance(ReferenceBackend(), case).passed
    assert check_backward_tolerance(EmulatedKernel(), case).passed

    class Off(ReferenceBackend):
        def backward(self, *a, **kw):
            dq, dkv, d_sink = super().backward(*a, **kw)
            return dq, (dkv.double() * 1.05).to(dkv.dtype), d_sink

    res = check_backward_tolerance(Off(), case)
    assert not res.passed and "dkv:" in res.message
