"""Meta-tests of the rejection check and its declarative registry."""

from __future__ import annotations

import re

import pytest
import torch

from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.checks import check_rejection
from sparse_mqa_testkit.checks.rejection import ErrorInput, error_inputs
from support import Float16Accepted, case_call

CASE = Case(S=3, H=2, sink="finite", topk="random", seed=2)


def test_registry_covers_the_issue():
    names = {e.name for e in error_inputs(CASE)}
    for arg in ("q", "kv", "out", "grad_out"):
        assert {f"{arg}_float16", f"{arg}_float32"} <= names
    for arg in ("lse", "attn_sink"):
        assert {f"{arg}_bfloat16", f"{arg}_float64"} <= names
    for arg in ("indices", "topk_length"):
        assert {f"{arg}_int64", f"{arg}_float32"} <= names
    for arg in ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices", "topk_length"):
        assert {f"{arg}_rank", f"{arg}_shape"} <= names
    assert "dv_gt_dqk" in names
    assert any(e.requires_cuda for e in error_inputs(CASE))  # mixed devices
    for e in error_inputs(CASE):
        assert isinstance(e, ErrorInput) and e.exc_type is ValueError and e.match and e.description


@pytest.mark.parametrize("entry", error_inputs(CASE), ids=lambda e: e.name)
def test_each_entry_is_rejected_by_the_reference_with_its_message(entry):
    if entry.requires_cuda and not torch.cuda.is_available():
        pytest.skip("mixed-device entry needs a CUDA GPU")
    b = ReferenceBackend()
    args = entry.build(case_call(b, CASE))
    with pytest.raises(entry.exc_type, match=entry.match):
        args.invoke(b, "backward")


def test_match_regex_must_name_the_argument():
    e = {x.name: x for x in error_inputs(CASE)}
    assert re.search(e["grad_out_float16"].match, "grad_out must be bfloat16, got float16")
    assert not re.search(e["grad_out_float16"].match, "q must be bfloat16, got float16")
    assert not re.search(e["out_float16"].match, "grad_out must be bfloat16, got float16")  # whole word
    assert re.search(e["indices_int64"].match, "indices must be int32, got int64")


@pytest.mark.parametrize("case", [CASE, Case(), Case(H=17, invalid="mixed", sink="mixed", seed=4)],
                         ids=lambda c: c.describe())
def test_reference_passes(case):
    res = check_rejection(ReferenceBackend(), case)
    assert res.passed, res.message
    assert res.notes["entries"] > 40


def test_silent_acceptance_is_reported_per_entry():
    res = check_rejection(Float16Accepted(), CASE)
    assert not res.passed
    assert "q_float16 (backward: q as float16 (must be bfloat16)) returned a result, expected ValueError" \
        in res.message
    assert "lse_" not in res.message  # the backend still validates the rest


def test_vague_message_fails_the_regex():
    class Vague(ReferenceBackend):
        name = "vague"

        def backward(self, *a, **kw):
            try:
                return super().backward(*a, **kw)
            except ValueError:
                raise ValueError("bad input") from None

    res = check_rejection(Vague(), CASE)
    assert not res.passed and "does not match" in res.message and "'bad input'" in res.message


def test_wrong_exception_type_fails():
    class TypeErrors(ReferenceBackend):
        def backward(self, *a, **kw):
            try:
                return super().backward(*a, **kw)
            except ValueError as exc:
                raise TypeError(str(exc)) from None

    res = check_rejection(TypeErrors(), CASE)
    assert not res.passed and "raised TypeError" in res.message and "expected ValueError" in res.message


def test_caller_tensors_must_be_unchanged():
    class ScribblesOnGradOut(ReferenceBackend):
        name = "scribbles"

        def backward(self, q, kv, out, grad_out, *rest, **kw):
            r = super().backward(q, kv, out, grad_out, *rest, **kw)
            grad_out.mul_(2)  # in place, after the work: a real kernel reusing its input as scratch
            return r

    res = check_rejection(ScribblesOnGradOut(), CASE)
    assert not res.passed and "valid backward call modified the caller's grad_out" in res.message


def test_a_write_before_validation_is_one_line_for_every_bad_input():
    class ScribblesFirst(ReferenceBackend):
        name = "scribbles-first"

        def backward(self, q, kv, out, grad_out, *rest, **kw):
            grad_out.mul_(2)  # before validating: every call writes, refused or not
            return super().backward(q, kv, out, grad_out, *rest, **kw)

    res = check_rejection(ScribblesFirst(), Case(S=2, seed=6))
    lines = res.message.splitlines()
    assert not res.passed and len(lines) <= 8, res.message
    (grouped,) = [line for line in lines if "bad-input backward calls" in line]
    assert re.match(r"\d\d bad-input backward calls \(q_float16, q_float32, kv_float16, kv_float32, \.\.\.\) each "
                    r"modified the caller's grad_out; the first: grad_out \(differs bitwise at 32 / 32 elements",
                    grouped), grouped
    assert "valid backward call modified the caller's grad_out" in res.message


def test_outside_domain_must_be_refused():
    class Only576(ReferenceBackend):
        name = "only-576"
        dims = ((576, 512),)

        def backward(self, *a, **kw):
            out = a[2]
            if (a[0].shape[-1], out.shape[-1]) not in self.dims:
                raise ValueError(f"(Dqk, Dv) = ({a[0].shape[-1]}, {out.shape[-1]}) not supported")
            return super().backward(*a, **kw)

        def forward(self, q, kv, indices, sm_scale, d_v, **kw):
            if (q.shape[-1], d_v) not in self.dims:
                raise ValueError("(Dqk, Dv) not supported")
            return super().forward(q, kv, indices, sm_scale, d_v, **kw)

    class AnswersAnyway(ReferenceBackend):
        name = "answers-anyway"
        dims = ((576, 512),)

    res = check_rejection(Only576(), Case())
    assert res.passed and "not in" in res.notes["outside_domain"]
    res = check_rejection(AnswersAnyway(), Case())
    assert not res.passed and "outside the declared domain" in res.message
    assert "returned a result, expected ValueError" in res.message


class ScratchGradOut(ReferenceBackend):
    """Uses grad_out as scratch and puts it back: the values are as they were, the writes are not."""

    name = "scratch-grad-out"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        res = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
        saved = grad_out.clone()
        grad_out.mul_(2)
        grad_out.copy_(saved)
        return res


def test_a_write_that_restores_the_values_is_still_a_write():
    res = check_rejection(ScratchGradOut(), Case(S=2, seed=6))
    assert not res.passed
    assert ("valid backward call modified the caller's grad_out (written in place: its version counter went "
            "from 0 to 2, its values are as they were)") in res.message


class OverwritesQ(ReferenceBackend):
    name = "overwrites-q"

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        res = super().backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
        q[0, 1, 0, 3] = 7.0
        return res


def test_an_in_place_change_names_the_count_and_the_first_index():
    res = check_rejection(OverwritesQ(), Case(S=2, seed=6))
    assert re.search(r"valid backward call modified the caller's q \(differs bitwise at 1 / \d+ elements, first at "
                     r"index \(0, 1, 0, 3\): now 7, was [-\d.e]+\)", res.message), res.message


class CrashesOnEverything(ReferenceBackend):
    name = "crashes"

    def backward(self, *args, **kwargs):
        raise TypeError("no such thing")


def test_one_repeated_exception_is_reported_once_with_its_count():
    res = check_rejection(CrashesOnEverything(), Case(S=2, seed=6))
    lines = [line for line in res.message.splitlines() if "no such thing" in line and "bad inputs" in line]
    assert len(lines) == 1 and re.search(r"\d\d bad inputs \(q_float16, q_float32, kv_float16, kv_float32, "
                                         r"\.\.\.\) each raised TypeError: no such thing", lines[0]), res.message
