"""Our TileLang sparse-MLA forward on a GPU against the float64 NumPy oracle and the contract's special cases.

Error model (same shape as the conformance suite's): ``out`` is bf16, so its relative L2 error may be OUT_K times
that of the float64 result rounded to bf16, plus a floor; the kernel also rounds P to bf16 before P V, which
adds about as much again in the worst case. ``lse`` is fp32 from fp32 sums of at most a few thousand
``ex2.approx`` terms (about sqrt(L) 2^-24 relative) and one ``lg2.approx``: a few 1e-6 absolute at |lse| ~ 10.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tilelang")

from sparse_mqa_testkit import contract, oracle  # noqa: E402
from sparse_mqa_testkit.cases import Case  # noqa: E402
from sparse_mqa_testkit.convert import input_tensors  # noqa: E402
from sparse_mqa_testkit.oracle.bf16 import round_bf16  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OUT_K = 2.5
OUT_FLOOR = 1e-4
LSE_ABS = 5e-5  # times (1 + |lse|)


def _forward(x: dict):
    from sparse_mqa_kernels.forward import sparse_mqa_forward

    t = input_tensors(x, "cuda")
    out, lse = sparse_mqa_forward(t["q"], t["kv"], t["indices"], x["sm_scale"], x["d_v"],
                                  attn_sink=t["attn_sink"], topk_length=t["topk_length"])
    torch.cuda.synchronize()
    return out, lse


def _oracle(x: dict):
    return oracle.forward(x["q"], x["kv"], x["indices"], sm_scale=x["sm_scale"], d_v=x["d_v"],
                          attn_sink=x["attn_sink"], topk_length=x["topk_length"], dtype=np.float64)


def _rel_l2(a, b) -> float:
    den = float(np.linalg.norm(b))
    num = float(np.linalg.norm(a - b))
    return num / den if den > 0 else num


def assert_matches_oracle(x: dict, out, lse, what: str):
    ref_out, ref_lse = _oracle(x)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert tuple(out.shape) == ref_out.shape and tuple(lse.shape) == ref_lse.shape
    o = out.float().cpu().numpy().astype(np.float64)
    s = lse.cpu().numpy().astype(np.float64)
    assert np.isfinite(o).all(), f"{what}: out has {(~np.isfinite(o)).sum()} non-finite entries"
    # +inf lse exactly on empty rows, finite elsewhere
    ref_inf = np.isposinf(ref_lse)
    bad = np.argwhere(np.isposinf(s) != ref_inf)
    assert bad.size == 0, f"{what}: lse +inf pattern differs at {bad[:5].tolist()} (kernel {s[tuple(bad[0])]})"
    assert np.isfinite(s[~ref_inf]).all(), f"{what}: lse non-finite on non-empty rows"
    # out exactly zero where the oracle's is (empty rows, sink +inf heads)
    zero = (ref_out == 0).all(-1)
    assert (o[zero] == 0).all(), f"{what}: out not exactly 0 on {int((o[zero] != 0).any(-1).sum())} zero rows"
    err = _rel_l2(o, ref_out)
    allowed = OUT_K * _rel_l2(round_bf16(ref_out).astype(np.float64), ref_out) + OUT_FLOOR
    assert err <= allowed, f"{what}: out relative L2 error {err:.3e} > allowed {allowed:.3e}"
    fin = ~ref_inf
    if fin.any():
        dl = np.abs(s[fin] - ref_lse[fin]) / (1 + np.abs(ref_lse[fin]))
        assert dl.max() <= LSE_ABS, f"{what}: lse error {dl.max():.3e} (scaled) > {LSE_ABS}"
    return err, allowed


# ---- tolerance over the contract's corners ------------------------------------------------------------------

_CASES = []
for i, (dims, h, l_, sink, topk, invalid) in enumerate([
    ((576, 512), 1, 1, "none", "none", "none"),
    ((576, 512), 15, 37, "finite", "none", "holes"),
    ((576, 512), 16, 64, "neg_inf", "random", "none"),
    ((576, 512), 17, 100, "pos_inf", "none", "out_of_range"),
    ((576, 512), 64, 130, "mixed", "random", "mixed"),
    ((576, 512), 128, 300, "finite", "random", "tails"),
    ((576, 512), 64, 257, "finite", "none", "empty_rows"),
    ((576, 512), 65, 129, "mixed", "none", "holes"),
    ((512, 512), 1, 5, "finite", "random", "mixed"),
    ((512, 512), 15, 64, "none", "none", "out_of_range"),
    ((512, 512), 16, 200, "pos_inf", "random", "empty_rows"),
    ((512, 512), 17, 128, "mixed", "none", "none"),
    ((512, 512), 64, 300, "finite", "random", "holes"),
    ((512, 512), 128, 77, "neg_inf", "none", "tails"),
]):
    _CASES.append(Case(B=2, S=5, Skv=400, H=h, L=l_, Dqk=dims[0], Dv=dims[1], sink=sink, topk=topk,
                       invalid=invalid, duplicates=bool(i % 3 == 0), seed=100 + i))


@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.describe().replace(" ", "-"))
def test_matches_oracle(case):
    x = case.inputs()
    out, lse = _forward(x)
    assert_matches_oracle(x, out, lse, case.repro())


@pytest.mark.parametrize("dims", contract.PRODUCTION_DIMS)
def test_production_sizes(dims):
    """L = 2048 with a finite sink and DeepSeek's sm_scale, against the oracle."""
    case = Case(B=1, S=6, Skv=4096, H=64, L=2048, Dqk=dims[0], Dv=dims[1], sm_scale=1.0 / 192**0.5,
                sink="finite", topk="random", invalid="holes", seed=7)
    x = case.inputs()
    out, lse = _forward(x)
    assert_matches_oracle(x, out, lse, case.repro())


def test_hypothesis_cases():
    """A fixed budget of drawn cases (the suite's strategy, kernel dims)."""
    from hypothesis import HealthCheck, given, settings

    from sparse_mqa_testkit.cases.strategies import cases

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(cases(dims=contract.PRODUCTION_DIMS, tiles={"head_group": 64, "topk_block": 64}, max_s=6, max_skv=300,
                 max_h=130, max_l=260))
    def run(case):
        x = case.inputs()
        out, lse = _forward(x)
        assert_matches_oracle(x, out, lse, case.repro())

    run()


# ---- the contract's special rules -----------------------------------------------------------------------------

@pytest.mark.parametrize("dims", contract.PRODUCTION_DIMS)
def test_unreferenced_kv_rows_are_never_read(dims):
    """NaN in every KV row no valid slot references changes no bit of out or lse."""
    case = Case(B=2, S=6, Skv=500, H=20, L=150, Dqk=dims[0], Dv=dims[1], sink="mixed", topk="random",
                invalid="mixed", seed=11)
    x = case.inputs()
    out, lse = _forward(x)
    poisoned = dict(x)
    kv = x["kv"].copy()
    kv[~contract.referenced_rows(x["indices"], x["topk_length"], case.Skv)] = np.nan
    poisoned["kv"] = kv
    out_p, lse_p = _forward(poisoned)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    assert_matches_oracle(poisoned, out_p, lse_p, case.repro() + " with NaN-poisoned unreferenced rows")


def test_empty_rows_give_zero_out_and_inf_lse():
    case = Case(B=1, S=4, Skv=64, H=17, L=70, Dqk=576, Dv=512, sink="finite", seed=3)
    x = case.inputs()
    idx = x["indices"].copy()
    idx[0, 0] = -1                    # all -1
    idx[0, 1] = 64                    # all == Skv
    idx[0, 2, ::2], idx[0, 2, 1::2] = 2**31 - 1, -(2**31)
    x["indices"] = idx
    x["topk_length"] = np.array([[70, 70, 70, 0]], dtype=np.int32)  # row 3: nothing by topk_length
    out, lse = _forward(x)
    assert (out[0, :4] == 0).all()
    assert torch.isposinf(lse[0, :4]).all()


def test_sink_pos_inf_gives_zero_out_and_sink_free_lse():
    case = Case(B=1, S=3, Skv=80, H=5, L=40, Dqk=512, Dv=512, seed=5)
    x = case.inputs()
    out0, lse0 = _forward(x)
    x["attn_sink"] = np.array([np.inf, 0.5, -np.inf, np.inf, -2.0], dtype=np.float32)
    out, lse = _forward(x)
    assert (out[:, :, [0, 3]] == 0).all()
    assert torch.equal(out[:, :, 2], out0[:, :, 2])  # -inf sink is no sink
    assert torch.equal(lse, lse0)  # lse excludes the sink
    assert_matches_oracle(x, out, lse, "sink +-inf")


def test_duplicates_count_once_per_slot():
    case = Case(B=1, S=2, Skv=50, H=16, L=66, Dqk=576, Dv=512, seed=9)
    x = case.inputs()
    x["indices"] = np.full_like(x["indices"], 7)
    x["indices"][:, :, :3] = [1, 2, 7]
    out, lse = _forward(x)
    assert_matches_oracle(x, out, lse, "duplicates")


def test_deterministic_bitwise():
    case = Case(B=2, S=8, Skv=300, H=64, L=256, Dqk=576, Dv=512, sink="finite", topk="random", invalid="mixed",
                seed=13)
    x = case.inputs()
    first = _forward(x)
    for _ in range(3):
        junk = torch.randn(1 << 22, device="cuda")  # dirty the allocator
        again = _forward(x)
        del junk
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_no_recompile_across_b_s_skv_h_l():
    from sparse_mqa_kernels import forward

    base = Case(B=1, S=3, Skv=100, H=16, L=64, Dqk=576, Dv=512, sink="finite", seed=1)
    _forward(base.inputs())
    before = forward.compiled.cache_info().misses
    for change in (dict(B=3), dict(S=9), dict(Skv=333), dict(H=70), dict(L=200), dict(H=1, L=1)):
        c = base.replace(**change)
        x = c.inputs()
        out, lse = _forward(x)
        assert_matches_oracle(x, out, lse, c.repro())
    assert forward.compiled.cache_info().misses == before


def test_bad_arguments_raise_before_gpu_work():
    from sparse_mqa_kernels.forward import sparse_mqa_forward

    x = Case(B=1, S=2, Skv=16, H=2, L=8, Dqk=576, Dv=512).inputs()
    t = input_tensors(x, "cuda")
    with pytest.raises(ValueError, match="q must be bfloat16"):
        sparse_mqa_forward(t["q"].half(), t["kv"], t["indices"], 0.1, 512)
    with pytest.raises(ValueError, match="indices must be int32"):
        sparse_mqa_forward(t["q"], t["kv"], t["indices"].long(), 0.1, 512)
    with pytest.raises(ValueError, match="kv must be on"):
        sparse_mqa_forward(t["q"], t["kv"].cpu(), t["indices"], 0.1, 512)


def test_conformance_forward_tolerance():
    """The conformance suite's forward tolerance check, through the tilelang backend."""
    tol = pytest.importorskip("sparse_mqa_testkit.checks.tolerance")
    from sparse_mqa_kernels.backends import TileLangBackend

    backend = TileLangBackend()
    ratios = []
    for case in _CASES:
        res = tol.check_forward_tolerance(backend, case)
        res.raise_if_failed()
        ratios.append(res.ratio)
    print(f"conformance forward_tolerance: {len(ratios)} cases, worst ratio {max(ratios):.3f}")
