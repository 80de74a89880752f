"""The contract's arguments are data: a new input declared once in ``contract.ARGUMENTS`` reaches the validators,
the call signature, the rejection entries and the arguments a check calls a backend with, with no other file
naming it.

Adding a real per-head input (say a per-head scale [H]) therefore touches five testkit files: the table
(``contract.py``), how a case draws it (``cases/case.py``), the two oracles' math (``oracle/host.py``,
``oracle/device.py``) and the error model's math (``compare/error_model.py``). The test below declares one
(``head_scale``), stands in for the case's drawing, and follows it everywhere else.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends import check_backward_args, check_forward_args
from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.calls import Call
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases import case as case_module
from sparse_mqa_testkit.checks.rejection import error_inputs
from sparse_mqa_testkit.compare import Expected

HEAD_SCALE = contract.Argument(
    "head_scale", ("H",), "float32", optional=True,
    takes=(("backward", contract.KEYWORD), ("forward", contract.KEYWORD)), rows=1, own_dim=0,
    bad_dtypes=("bfloat16", "float64"), other_device=True, fill=1.0)
CASE = Case(S=3, Skv=8, H=4, L=5, sink="finite")


@pytest.fixture
def declared(monkeypatch):
    monkeypatch.setattr(contract, "ARGUMENTS", contract.ARGUMENTS + (HEAD_SCALE,))


class Recording(ReferenceBackend):
    """The reference, taking (and recording) the new input."""

    def backward(self, *args, head_scale=None, **kw):
        self.seen = head_scale
        check_backward_args(*args, head_scale=head_scale, **kw)
        return super().backward(*args, **kw)


def test_the_table_names_each_argument_once_and_derives_the_rest():
    names = [a.name for a in contract.ARGUMENTS]
    assert len(names) == len(set(names))
    assert contract.inputs_of("backward") == ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices",
                                              "sm_scale", "topk_length")
    assert contract.inputs_of("forward") == ("q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length")
    assert contract.results_of("backward") == ("dq", "dkv", "d_sink")
    assert contract.results_of("forward") == ("out", "lse")
    assert str(contract.signature("backward")) == ("(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, "
                                                   "topk_length=None)")
    assert contract.KERNEL_DTYPES["grad_out"] == "bfloat16" and contract.kernel_dtype("topk_length") == "int32"


def test_a_new_input_reaches_the_signature_and_the_validators(declared):
    assert "head_scale=None" in str(contract.signature("backward"))
    assert contract.inputs_of("forward")[-1] == "head_scale"
    t = Expected(CASE).call().args
    args = [t[n] for n in ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices", "sm_scale")]
    assert check_backward_args(*args, head_scale=torch.ones(4)).H == 4
    with pytest.raises(ValueError, match=r"^head_scale must have shape \(4,\) \[H\], got \(5,\)$"):
        check_backward_args(*args, head_scale=torch.ones(5))
    with pytest.raises(ValueError, match=r"^head_scale must be float32, got bfloat16$"):
        check_forward_args(t["q"], t["kv"], t["indices"], t["sm_scale"], t["d_v"],
                           head_scale=torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="takes no argument nonsense"):
        check_backward_args(*args, nonsense=1)


def test_a_new_input_has_its_rejection_entries(declared):
    entries = {e.name: e for e in error_inputs(CASE) if e.argument == "head_scale"}
    assert set(entries) == {"head_scale_bfloat16", "head_scale_float64", "head_scale_rank", "head_scale_shape",
                            "head_scale_other_device"}
    valid = Expected(CASE).call()
    bad = entries["head_scale_float64"].build(valid)
    assert bad["head_scale"].dtype == torch.float64 and bad["head_scale"].shape == (4,)  # from its fill
    assert entries["head_scale_shape"].build(valid)["head_scale"].shape == (5,)
    assert entries["head_scale_bfloat16"].applies_to == ("backward", "forward")
    with pytest.raises(ValueError, match=entries["head_scale_float64"].match):
        bad.invoke(Recording(), "backward")


def test_a_new_input_reaches_the_backend_through_the_inputs(declared, monkeypatch):
    # the one line cases/case.py would add: the case draws the new input
    drawn = case_module.Case.inputs
    monkeypatch.setattr(case_module.Case, "inputs",
                        lambda self: {**drawn(self), "head_scale": np.full(self.H, 0.5, np.float32)})
    case_module.host_inputs.cache_clear()  # arrays made before the patch (kept for the last few cases) go
    call = Expected(CASE).call()
    assert call["head_scale"].dtype == torch.float32 and call["head_scale"].device.type == "cpu"
    backend = Recording()
    call.results(backend, "backward")
    assert torch.equal(backend.seen, torch.full((4,), 0.5))
    bound = Call.bind("backward", *call.for_("backward")[0], head_scale=call["head_scale"])
    assert bound["head_scale"] is call["head_scale"] and bound["topk_length"] is None
    # a case that leaves it out calls the backend without it, so a backend that predates it keeps working
    monkeypatch.setattr(case_module.Case, "inputs", drawn)
    case_module.host_inputs.cache_clear()
    assert "head_scale" not in Expected(CASE).call().for_("backward")[1]
