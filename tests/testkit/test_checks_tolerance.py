"""Meta-tests of the tolerance check: what it measures, what it reports, and that it accepts a plausible
kernel (the bf16 emulation) while rejecting structural mistakes."""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.strategies import cases
from sparse_mqa_testkit.checks import CheckFailure, CheckResult, check_backward_tolerance, check_forward_tolerance
from sparse_mqa_testkit.checks.result import FAILED_RATIO, repro_command
from sparse_mqa_testkit.compare import Expected, compare_tensor
from sparse_mqa_testkit.compare.error_model import ALL_TERMS, group_slots, row_terms
from support import EmulatedKernel


class Tweaked(ReferenceBackend):
    """The reference with one edit applied to its backward results: ``edit(dict) -> dict``."""

    def __init__(self, edit, name="tweaked"):
        super().__init__()
        self.edit, self.name = edit, name

    def backward(self, *args, **kw):
        dq, dkv, d_sink = super().backward(*args, **kw)
        r = self.edit({"dq": dq, "dkv": dkv, "d_sink": d_sink})
        return r["dq"], r["dkv"], r["d_sink"]


def _set(name, idx, value):
    def edit(r):
        t = r[name].clone()
        t[idx] = value
        return dict(r, **{name: t})

    return edit


CASE = Case(B=1, S=4, Skv=16, H=2, L=8, sink="finite", seed=11)


def test_reference_passes_with_margin():
    for case in (CASE, Case(H=17, sink="mixed", topk="random", invalid="mixed", seed=3),
                 Case(invalid="empty_rows", duplicates=True, order="sorted")):
        res = check_backward_tolerance(ReferenceBackend(), case)
        assert res.passed and res.ratio < 0.6, res.message
        assert set(res.per_tensor) == ({"dq", "dkv", "d_sink"} if case.sink != "none" else {"dq", "dkv"})
        fwd = check_forward_tolerance(ReferenceBackend(), case)
        assert fwd.passed and fwd.ratio < 0.6, fwd.message


def test_message_names_tensor_index_values_case_and_repro():
    idx = (0, 1, 0, 3)
    res = check_backward_tolerance(Tweaked(_set("dq", idx, 100.0), name="bad-dq"), CASE)
    assert not res.passed and res.ratio > 1
    m = res.message
    oracle_val = float(Expected(CASE).exact["dq"][idx])
    assert m.startswith("tolerance check failed for backend 'bad-dq'")
    assert re.search(r"^dq: relative L2 error [0-9.e+-]+ > allowed [0-9.e+-]+", m, re.M)
    assert "Mismatched elements: " in m
    assert "index (0, 1, 0, 3): kernel 100, oracle " in m
    assert f"{oracle_val:.6g}" in m
    assert f"Greatest absolute difference: {100 - oracle_val:.6g} at index (0, 1, 0, 3)" in m
    assert CASE.describe() in m and f"seed: {CASE.seed}" in m
    assert repro_command("bad-dq", "tolerance", CASE) in m
    assert res.per_tensor["dq"]["worst_index"] == idx
    assert res.per_tensor["dkv"]["ratio"] < 1  # only the broken tensor is blamed
    assert "dkv:" not in m
    with pytest.raises(CheckFailure) as ei:
        res.raise_if_failed()
    assert str(ei.value) == m


def test_repro_command_format():
    c = Case(H=3, seed=5)
    assert repro_command("reference", "guards", c) == (
        'sparse-mqa-check --backend reference --check guards --replay "Case(H=3, seed=5)"')


def test_nan_position_mismatch_is_caught_exactly():
    res = check_backward_tolerance(Tweaked(_set("dkv", (0, 2, 1), math.nan)), CASE)
    assert not res.passed and res.ratio == FAILED_RATIO
    assert "dkv: NaN positions differ from the oracle at 1 / " in res.message
    assert "index (0, 2, 1)" in res.message


def test_inf_where_oracle_is_finite_and_finite_where_oracle_is_inf():
    res = check_backward_tolerance(Tweaked(_set("dq", (0, 0, 1, 0), math.inf)), CASE)
    assert not res.passed and "dq: +inf positions differ" in res.message
    # forward: an empty row's lse is +inf in the oracle; a finite value there is a mismatch
    case = Case(invalid="empty_rows", seed=4)

    class FiniteLse(ReferenceBackend):
        def forward(self, *a, **kw):
            out, lse = super().forward(*a, **kw)
            return out, torch.nan_to_num(lse, posinf=0.0)

    res = check_forward_tolerance(FiniteLse(), case)
    assert not res.passed and "lse: +inf positions differ" in res.message


@pytest.mark.parametrize("edit, needle", [
    (lambda r: dict(r, dq=r["dq"].float()), "dq: dtype float32 is not the contract's bfloat16"),
    (lambda r: dict(r, dkv=r["dkv"][:, :-1]), "dkv: shape (1, 15, 16) is not the contract's (1, 16, 16)"),
    (lambda r: dict(r, d_sink=r["d_sink"].to(torch.bfloat16)), "d_sink: dtype bfloat16 is not the contract's float32"),
    (lambda r: dict(r, d_sink=None), "d_sink: missing (got None)"),
])
def test_shape_and_dtype_mismatch(edit, needle):
    res = check_backward_tolerance(Tweaked(edit), CASE)
    assert not res.passed and res.ratio == FAILED_RATIO
    assert needle in res.message


def test_d_sink_must_be_none_without_sink():
    case = CASE.replace(sink="none")
    res = check_backward_tolerance(Tweaked(lambda r: dict(r, d_sink=torch.zeros(case.H))), case)
    assert not res.passed and "d_sink: must be None when attn_sink is None" in res.message


def test_zero_reference_uses_absolute_error():
    # one head whose sink is +inf: all probability on the sink, so out, dq, dkv and d_sink are exactly zero
    zero = Case(S=3, Skv=8, H=1, L=4, sink="pos_inf", seed=0)
    o = Expected(zero).exact
    assert all(float(abs(o[n]).max()) == 0.0 for n in ("dq", "dkv", "d_sink", "out"))
    res = check_backward_tolerance(ReferenceBackend(), zero)
    assert res.passed, res.message
    assert all(res.per_tensor[n]["mode"] == "absolute" for n in ("dq", "dkv", "d_sink"))
    assert check_forward_tolerance(ReferenceBackend(), zero).passed
    # a small nonzero answer where the truth is zero is judged against the floor, without dividing by zero
    res = check_backward_tolerance(Tweaked(_set("dq", (0, 1, 0, 2), 0.25)), zero)
    assert not res.passed and "dq: absolute L2 error (oracle is all zero) 2.500e-01" in res.message
    assert math.isfinite(res.per_tensor["dq"]["ratio"])


def test_compare_tensor_zero_reference():
    o = torch.zeros(3, 4, dtype=torch.float64)
    entry, prob = compare_tensor("dq", o.to(torch.bfloat16), o, o)
    assert prob is None and entry["mode"] == "absolute" and entry["error"] == 0.0 and entry["ratio"] == 0.0
    k = o.clone()
    k[1, 2] = 0.5
    entry, prob = compare_tensor("dq", k.to(torch.bfloat16), o, o, floor=1e-3)
    assert prob is not None and "absolute L2 error (oracle is all zero) 5.000e-01" in prob
    assert entry["worst_index"] == (1, 2) and math.isfinite(entry["ratio"]) and entry["ratio"] > 1


def test_compare_tensor_within_one_ulp_passes():
    o = torch.tensor([1.0, 2.0, -3.0, 0.5], dtype=torch.float64)  # exactly representable: reference error 0
    k = torch.tensor([1.0078125, 2.0, -3.0, 0.5], dtype=torch.float64)  # one bf16 ulp off at 1.0
    entry, prob = compare_tensor("out", k, o, o, floor=0.0)
    assert prob is None and entry["max_ulps"] == 1.0
    k2 = torch.tensor([1.015625, 2.0, -3.0, 0.5], dtype=torch.float64)  # two ulps
    _, prob = compare_tensor("out", k2, o, o, floor=0.0)
    assert prob is not None and "Largest difference in bf16 ulps: 2" in prob


def test_backend_exception_is_a_failure_with_traceback():
    class Crashes(ReferenceBackend):
        name = "crashes"

        def backward(self, *a, **kw):
            raise RuntimeError("kernel launch failed: too many resources requested")

    res = check_backward_tolerance(Crashes(), CASE)
    assert not res.passed and res.ratio == FAILED_RATIO
    assert "backward raised RuntimeError: kernel launch failed" in res.message
    assert "in backward" in res.message and "repro:" in res.message


def test_wrong_arity_is_a_failure():
    class TwoResults(ReferenceBackend):
        def backward(self, *a, **kw):
            return super().backward(*a, **kw)[:2]

    res = check_backward_tolerance(TwoResults(), CASE)
    assert not res.passed and "must return a tuple of 3 tensors" in res.message


def test_forward_tolerance_skips_backend_without_forward():
    class NoForward:
        name, device, deterministic, tiles, dims = "nofwd", "cpu", True, {}, None

        def supports(self, case):
            return None

        def backward(self, *a, **kw):
            return ReferenceBackend().backward(*a, **kw)

    res = check_forward_tolerance(NoForward(), CASE)
    assert res.passed and res.notes["skipped"] == "backend has no forward"
    assert check_backward_tolerance(NoForward(), CASE).passed


def test_k_is_honoured():
    # dq scaled by 1 + 2^-6: two bf16 ulps everywhere, ~8x the rounding error
    scaled = Tweaked(lambda r: dict(r, dq=(r["dq"].double() * (1 + 2.0 ** -6)).to(torch.bfloat16)))
    res = check_backward_tolerance(scaled, CASE)
    assert not res.passed and res.ratio > 1 and "dq:" in res.message
    loose = check_backward_tolerance(scaled, CASE, k=15.0)
    assert loose.passed and loose.ratio < 1
    assert isinstance(res, CheckResult) and res.check == "tolerance"


def test_backend_inputs_are_the_contracts():
    t = Expected(CASE).call()
    assert t["out"].dtype == torch.bfloat16 and t["lse"].dtype == torch.float32
    assert t["q"].dtype == torch.bfloat16 and t["indices"].dtype == torch.int32
    assert tuple(t["out"].shape) == CASE.dims.shape("out") and tuple(t["lse"].shape) == CASE.dims.shape("lse")
    own_out, _ = t.invoke(ReferenceBackend(), "forward")  # what a forward returns: the same contract tensor
    assert torch.equal(own_out, t["out"]) or (own_out.float() - t["out"].float()).abs().max() < 0.05


# A bf16 tensor-core kernel must pass (its survey: BENCHMARKS.md, "Tolerance model").
EMULATION_CASES = [
    Case(S=8, Skv=32, H=4, L=16, seed=1),
    Case(S=5, Skv=12, H=17, L=9, sink="mixed", topk="random", invalid="mixed", seed=2),
    Case(S=3, Skv=1, H=2, L=6, duplicates=True, seed=3),  # every slot on one row: out is V exactly
    Case(S=4, Skv=9, H=3, L=1, sink="finite", seed=4),  # one slot: dS cancels to P (1 - P) dp
    Case(B=2, S=6, Skv=20, H=16, L=12, Dqk=24, Dv=16, sink="pos_inf", invalid="empty_rows", seed=5),
    Case(S=3, Skv=6, H=5, L=6, Dqk=576, Dv=512, sm_scale=0.5, sink="finite", duplicates=True, seed=6),
]


@pytest.mark.parametrize("case", EMULATION_CASES, ids=lambda c: c.describe())
def test_emulated_kernel_within_model(case):
    b = EmulatedKernel()
    for res in (check_backward_tolerance(b, case), check_forward_tolerance(b, case)):
        assert res.passed, res.message


@settings(max_examples=8, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(cases(dims=[(576, 512)], max_b=1, max_s=4, max_skv=16, max_h=8, max_l=8))
def test_emulated_kernel_within_model_on_drawn_production_dims(case):
    b = EmulatedKernel()
    res = check_backward_tolerance(b, case)
    assert res.passed and res.ratio < 1, res.message


def _without_terms(case, *names, edit=None) -> Expected:
    """The case's expected results with the error model's ``names`` terms left out (and ``edit`` applied to
    the terms of each result)."""
    exp = Expected(case)
    terms = row_terms(exp.inputs, exp.exact["out"], terms=tuple(t for t in ALL_TERMS if t not in names))
    exp.terms = {n: (edit(t) if edit else t) for n, t in terms.items()}
    return exp


def _assert_dkv_needs_term(case, term, *also):
    """The emulated kernel passes ``case``, dkv's ``term`` error is larger than its rounded-oracle one, and
    with that term (and the terms named in ``also``) left out the same case fails on dkv."""
    res = check_backward_tolerance(EmulatedKernel(), case)
    assert res.passed, res.message
    assert res.per_tensor["dkv"][f"{term}_error"] > res.per_tensor["dkv"]["reference_error"]
    res = check_backward_tolerance(EmulatedKernel(), case, expected=_without_terms(case, term, *also))
    assert not res.passed and "dkv:" in res.message


def test_delta_term_is_what_lets_a_peaked_softmax_pass():
    # sm_scale 0.5 on 576 dims: nearly one-hot P, so dS = P (dp - Delta) cancels and the kernel's Delta from
    # the bf16 out dominates dkv's error; the rounded oracle alone cannot see that
    case = Case(B=2, S=1, Skv=13, H=13, L=13, Dqk=576, Dv=512, sm_scale=0.5, sink="pos_inf", invalid="tails",
                duplicates=True, order="sorted", seed=8)
    _assert_dkv_needs_term(case, "delta")


def test_repeat_term_is_what_lets_coherent_rounding_pass():
    # Skv = 1: all 15 slots name one row, P = 1/15 rounds to bf16 the same way 15 times and P^T dO carries that
    # one rounding 15 times (found by the conformance suite on an H200 and in the NumPy model alike); a small
    # sm_scale keeps the Delta term (sm_scale dDelta q per slot) from covering it as well. The operands'
    # rounding, computed for the oracle's own P, sees the same coherent error: only without both does it fail
    case = Case(S=1, Skv=1, H=1, L=15, Dqk=576, Dv=512, sm_scale=0.01)
    _assert_dkv_needs_term(case, "repeat", "operand")


def test_operand_term_is_what_lets_a_cancelling_sum_pass():
    # Dqk = 1 with a small sm_scale: P is nearly uniform over the 15 slots, and dkv's sum over 15 heads of
    # P dO (dO of both signs) cancels to a quarter of its terms, so the rounding of P to bf16 before P^T dO
    # is 5x the output rounding (found by the ci profile on the NumPy model of our backward)
    case = Case(S=1, Skv=39, H=15, L=15, Dqk=1, Dv=1, sm_scale=0.07216878364870323, seed=14)
    _assert_dkv_needs_term(case, "operand")


def test_unsummed_floor_is_what_lets_a_row_that_cancels_to_zero_pass():
    # Skv = 1 without a sink: every slot names row 0, so dP_t = Delta and each dq row is exactly zero, while a
    # kernel's float32 dP_t - Delta is not (found by the drawn production-dims test below): the floor applies
    # to the norm of the terms the row sums, not to their (zero) sum
    case = Case(S=15, Skv=1, H=1, L=15, Dqk=576, Dv=512)
    res = check_backward_tolerance(EmulatedKernel(), case)
    assert res.passed, res.message
    exp = _without_terms(case, edit=lambda t: dict(t, unsummed=torch.zeros_like(t["unsummed"])))
    res = check_backward_tolerance(EmulatedKernel(), case, expected=exp)
    assert not res.passed and "dq:" in res.message and "rows over their allowance" in res.message


def _float64_backward_with_delta(t, delta):
    """dq, dkv, d_sink of the contract in float64 with Delta [B, S, H] given (one batch, tiny cases)."""
    from sparse_mqa_testkit import contract

    q, kv, go = t["q"].double()[0], t["kv"].double()[0], t["grad_out"].double()[0]
    scale, dv = float(t["sm_scale"]), t["d_v"]
    tl = None if t["topk_length"] is None else t["topk_length"][0]
    valid = contract.valid_mask(t["indices"][0], kv.shape[0], tl)
    rows = torch.where(valid, t["indices"][0].long(), 0)
    K = torch.where(valid[..., None], kv[rows], 0.0)
    s = torch.einsum("shd,sld->shl", q, K) * scale
    lse = torch.logsumexp(torch.where(valid[:, None, :], s, -torch.inf), -1)
    denom = lse if t["attn_sink"] is None else torch.logaddexp(lse, t["attn_sink"].double())
    P = torch.where(valid[:, None, :], torch.exp(s - denom[..., None]), 0.0)
    dS = P * (torch.einsum("shd,sld->shl", go, K[..., :dv]) - delta[0][..., None])
    dq = scale * torch.einsum("shl,sld->shd", dS, K)
    contrib = scale * torch.einsum("shl,shd->sld", dS, q)
    contrib[..., :dv] += torch.einsum("shl,shd->sld", P, go)
    dkv = torch.zeros_like(kv).index_add_(0, rows[valid], contrib[valid])
    d_sink = None
    if t["attn_sink"] is not None:
        d_sink = -(contract.sink_probability(lse, t["attn_sink"].double()) * delta[0]).sum(0)
    return dq, dkv, d_sink


@pytest.mark.parametrize("case", [
    Case(S=13, Skv=1, H=1, L=15, Dqk=576, Dv=512, sm_scale=0.5, sink="finite", topk="random",
         invalid="empty_rows", seed=4),  # every slot names row 0: the slots' shifts add up coherently
    Case(S=5, Skv=9, H=4, L=12, Dqk=40, Dv=32, sink="finite", duplicates=True, seed=3),
], ids=lambda c: c.describe())
def test_delta_term_is_the_exact_shift_from_the_bf16_out(case):
    # a float64 backward fed Delta from the bf16 out differs from the oracle by exactly the delta term, row by
    # row (a term that counted slots as independent allowed sqrt(m) of m for m slots naming one row)
    r = Expected(case)
    t, out = r.inputs, r.exact["out"]
    exact = _float64_backward_with_delta(t, (t["grad_out"].double() * out).sum(-1))
    shifted = _float64_backward_with_delta(t, (t["grad_out"].double() * out.to(torch.bfloat16).double()).sum(-1))
    for name, e, s_ in zip(("dq", "dkv", "d_sink"), exact, shifted):
        if e is None:
            continue
        lead = {"dq": 2, "dkv": 1, "d_sink": 1}[name]  # one batch: its dimension dropped
        got = ((s_ - e) ** 2).reshape(*s_.shape[:lead], -1).sum(-1)
        want = r.terms[name]["delta"].reshape(got.shape)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-30), name
        assert float(want.sum()) > 0, name


def test_repeat_term_counts_only_repeated_rows():
    idx = torch.tensor([[3, 3, 1, 3, 0], [2, 2, 2, 2, 2]])
    valid = torch.tensor([[True, True, True, False, True], [True, True, False, False, False]])
    inv, counts = group_slots(valid, idx)
    sizes = torch.where(valid, counts[inv].reshape(valid.shape), 0)
    assert sizes.tolist() == [[2, 2, 1, 0, 1], [2, 2, 0, 0, 0]]
    distinct = Expected(Case(S=4, Skv=64, H=3, L=16, sink="finite", seed=2))  # distinct indices in a row
    assert all(float(t["repeat"].sum()) == 0.0 for t in distinct.terms.values())
    dup = Expected(Case(S=4, Skv=3, H=3, L=16, sink="finite", seed=2))  # L > Skv: rows repeat
    assert float(dup.terms["dkv"]["repeat"].sum()) > 0 and float(dup.terms["dq"]["repeat"].sum()) > 0
    assert float(dup.terms["d_sink"]["repeat"].sum()) == 0.0


def test_compare_tensor_shape_mismatch_is_a_problem_not_a_broadcast():
    o = torch.ones(2, 3, dtype=torch.float64)
    entry, prob = compare_tensor("dq", torch.ones(1, 3), o, o)
    assert prob == "dq: shape (1, 3) is not the oracle's (2, 3)" and math.isinf(entry["ratio"])


def test_infinite_k_checks_only_the_structure_and_the_nonfinite_positions():
    # the guards check compares nonfinite positions only (k = inf); an all-zero row must not turn inf x 0 into
    # NaN and a failure (found on an H200: empty rows of dq)
    o = torch.zeros(2, 3, dtype=torch.float64)
    o[0] = 1.0
    off = o.clone()
    off[0, 0] = 5.0
    entry, prob = compare_tensor("dq", off.to(torch.bfloat16), o, o, k=math.inf)
    assert prob is None and entry["ratio"] == 0.0
    off[1, 1] = math.nan
    entry, prob = compare_tensor("dq", off.to(torch.bfloat16), o, o, k=math.inf)
    assert prob is not None and "NaN positions differ from the oracle at 1 / 6 elements" in prob
