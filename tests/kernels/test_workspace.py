"""What our backends declare to the execution checks, held against their host code on the CPU: the TileLang
backward's ``workspace_bytes`` bounds every tensor its host code creates (the kernels stood in for by in-place
fills, as TileLang's launcher allocates nothing), the forward creates nothing beyond its outputs, the in-place dkv
conversion gives the bits of the float64 copy it replaced without one, and the cuDNN adapter's declaration bounds
its layout code. The GPU side (torch's allocator counters around the real kernels) is the allocations check's."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sparse_mqa_kernels import backward, bwd_plan, bwd_prep, bwd_rows, forward
from sparse_mqa_kernels import cudnn as cu
from sparse_mqa_kernels.backends import TileLangBackend
from sparse_mqa_testkit.backends import validate
from sparse_mqa_testkit.calls import Call
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.tensors import case_tensors
from support import LiveBytes


def _call(case) -> Call:
    """The case's arguments on the CPU with out and lse of the right shapes (the host code never reads them)."""
    out = torch.zeros(case.dims.shape("out"), dtype=torch.bfloat16)
    return Call({**case_tensors(case, "cpu"), "out": out, "lse": torch.zeros(case.dims.shape("lse"))})


def _bytes(outs) -> int:
    return sum(v.numel() * v.element_size() for v in outs.values() if v is not None)


@pytest.fixture
def host_code_on_cpu(monkeypatch):
    """Our kernels' host code on CPU tensors: the device check passed, the compiled kernels replaced by in-place
    fills of their outputs, ``torch.cuda.device`` a no-op."""
    real_bwd, real_fwd = validate.check_backward_args, validate.check_forward_args
    monkeypatch.setattr(backward, "check_backward_args", lambda *a, **k: real_bwd(*a, **{**k, "device_type": None}))
    monkeypatch.setattr(forward, "check_forward_args", lambda *a, **k: real_fwd(*a, **{**k, "device_type": None}))

    def bwd_kernel(q, kv, grad_out, indices, tl, lse2, delta, rows, fx, dq, acc, sm_scale):
        dq.fill_(0.25)
        acc.fill_(-(2**40) + 3)

    def prep_kernel(q, out, grad_out, vmax, mass, delta, rows, c):
        delta.fill_(0.5)
        rows.fill_(3.0)

    def ws_kernel(q, kv, grad_out, indices, tl, lse2, delta, rows, scale, dq, acc, pds, sm_scale, pds_len):
        dq.fill_(0.25)
        acc.fill_(-(2**20) + 3)

    def bound_kernel(q, out, grad_out, kv, indices, tl, lse, sink, rows, delta, lse2, sink_delta, hist, pds, sm_scale,
                     has_sink, pds_len, whole, pieces, per_piece):
        delta.fill_(0.5)
        lse2.fill_(4.0)
        if has_sink:
            sink_delta.fill_(0.125)
        hist[..., 100].fill_(7)
        if pds_len:  # stored P and dS: [2, B, S, H, pds_len]
            assert pds.numel() == 2 * q.shape[0] * q.shape[1] * q.shape[2] * pds_len
            pds.fill_(0.5)

    def scales_kernel(hist, scale, inv):
        scale.fill_(2.0**-3)
        inv.fill_(8.0)

    def convert_kernel(acc, inv, dkv):
        dkv.fill_(1.5)

    def fwd_kernel(q, kv, indices, sink, topk_len, out, lse, scale):
        out.fill_(1.0)
        lse.fill_(2.0)

    monkeypatch.setattr(backward, "compiled", lambda key: ws_kernel if key.warp_specialized else bwd_kernel)
    monkeypatch.setattr(bwd_rows, "compiled", lambda dqk, dv, stored=False: (bound_kernel, scales_kernel,
                                                                               convert_kernel))
    monkeypatch.setattr(bwd_prep, "compiled", lambda dqk, dv: prep_kernel)
    monkeypatch.setattr(forward, "compiled", lambda key: fwd_kernel)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(backward, "sm_count", lambda d: 132)


WORKSPACE_CASES = [
    Case(B=2, S=64, Skv=256, H=64, L=32, Dqk=576, Dv=512, sink="finite", topk="random", seed=1),
    Case(B=1, S=128, Skv=64, H=16, L=16, Dqk=576, Dv=512, seed=2),
    Case(B=1, S=256, Skv=16, H=64, L=8, Dqk=512, Dv=512, sink="mixed", seed=3),  # per-row tensors dominate
    Case(B=3, S=17, Skv=1000, H=2, L=8, Dqk=512, Dv=512, topk="random", seed=4),  # the cache dominates
    Case(B=1, S=5, Skv=7, H=65, L=40, Dqk=512, Dv=512, sink="pos_inf", invalid="empty_rows", seed=5),
    Case(B=2, S=256, Skv=16, H=2, L=2048, Dqk=512, Dv=512, topk="random", duplicates=True, seed=6),  # the slots
]


@pytest.mark.parametrize("case", WORKSPACE_CASES, ids=lambda c: c.describe())
def test_tilelang_backward_workspace_bounds_its_host_code(host_code_on_cpu, case):
    call = _call(case)
    backend = TileLangBackend()
    with LiveBytes() as m:
        outs = call.results(backend, "backward")
    extra = m.peak - _bytes(outs)
    declared = backend.workspace_bytes(case, "backward")
    plan = bwd_plan.make_plan(case.B, case.S, case.Skv, case.H, case.L, case.Dqk, case.Dv)
    assert declared == plan.workspace_bytes(sink=case.sink != "none", topk_given=case.topk != "none")
    assert plan.accumulator_bytes() <= extra <= declared, (extra, declared)
    # beyond the host code the bound adds only the device's part (the d_sink reduction's scratch, scalars and
    # reduction staging, the KV-row norms' device copies) and a few rows of margin: it is not loose
    rows = 4 * case.B * case.S * case.H
    if plan.row_scaled():  # the octave counts, freed before the sums exist, are summed in the bound; a row spare
        spare = 4 * case.B * case.Skv * bwd_plan.OCTAVES + rows
        if plan.stored_pds:  # the peak comes with the stored P and dS, before dkv (an output, subtracted) exists
            spare += 2 * case.B * case.Skv * case.Dqk
        assert declared - extra <= bwd_plan.SCALAR_BYTES + spare, (extra, declared)
        return
    device_part = 2 * rows * (case.sink != "none") + bwd_plan.SCALAR_BYTES + 13 * case.B * case.Skv + 1
    slots = 13 * case.B * case.S * case.L  # the referenced-rows pass: a phase of its own, summed in the bound
    assert declared - extra <= device_part + slots + 3 * rows, (extra, declared)


def test_tilelang_forward_holds_nothing_beyond_its_outputs(host_code_on_cpu):
    backend = TileLangBackend()
    for case in (Case(B=2, S=9, Skv=30, H=16, L=8, Dqk=576, Dv=512, seed=6),
                 Case(B=1, S=9, Skv=30, H=64, L=8, Dqk=512, Dv=512, sink="finite", topk="random", seed=7)):
        call = _call(case)
        call.results(backend, "forward")  # first call: the placeholders for an absent sink or topk_length
        with LiveBytes() as m:
            outs = call.results(backend, "forward")
        assert m.peak == _bytes(outs)
        assert backend.workspace_bytes(case, "forward") == 0


@pytest.mark.parametrize("F", [-30, 0, 40, 100, 120])
def test_dkv_conversion_in_place_gives_the_float64_copy_bits_without_one(F):
    g = torch.Generator().manual_seed(F + 200)
    acc = torch.randint(-(2**62), 2**62, (3, 40, 576), generator=g, dtype=torch.int64)
    acc[0, :4] = torch.tensor([0, 1, -1, 2**20])[:, None]
    Ft = torch.tensor(float(F))  # a 0-d float32 tensor, as the backward's prep pass returns it
    want = (acc.double() * torch.exp2(-Ft.double())).to(torch.bfloat16)
    with LiveBytes() as m:
        got = backward.dkv_from_fixed_point(acc, Ft)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert m.peak <= got.numel() * got.element_size() + 64  # the bf16 result and 0-d scalars, no float64 copy


def test_cudnn_scratch_formula_at_known_shapes():
    anchor = Case(B=1, S=4096, Skv=8192, H=64, L=2048, Dqk=576, Dv=512).dims
    assert cu.scratch_workspace_bytes(anchor) == 2 * 4096 * 64 * 4 + 8192 * 576 * 4
    big = Case(B=8, S=4096, Skv=8192, H=128, L=16, Dqk=576, Dv=512).dims
    assert cu.scratch_workspace_bytes(big) - 2 * 8 * 4096 * 128 * 4 == 150_994_944  # 65536 KV rows x 576 x 4
    odd = Case(B=3, S=5, Skv=7, H=2, L=4, Dqk=512, Dv=512).dims  # 15 -> 64 rows, 21 -> 64 rows
    assert cu.scratch_workspace_bytes(odd) == 2 * 512 + 64 * 512 * 4


@pytest.mark.parametrize("case", [Case(B=3, S=17, Skv=40, H=4, L=24, Dqk=64, Dv=32, topk="random", seed=1),
                                  Case(B=1, S=17, Skv=40, H=4, L=24, Dqk=64, Dv=32, sink="finite", seed=2),
                                  Case(B=4, S=50, Skv=40, H=8, L=64, Dqk=64, Dv=32, invalid="mixed", seed=3)],
                         ids=lambda c: c.describe())
def test_cudnn_adapter_bytes_bound_its_layout_code(case):
    x = _call(case)
    with LiveBytes() as m:
        flat = cu.to_cudnn_layout(**{n: x[n] for n in ("q", "kv", "out", "grad_out", "lse", "attn_sink",
                                                        "indices", "topk_length")})
        # what backward adds without a sink: the d_sink it passes cuDNN, dropped afterwards
        dropped = [torch.empty_like(flat["attn_sink"])] if case.sink == "none" else []
    declared = cu.adapter_bytes(case.dims, sink_given=case.sink != "none")
    assert m.peak <= declared
    if case.B > 1:
        assert m.peak >= 33 * case.B * case.S * case.L  # the index map is most of it: the bound is not loose
    else:
        assert m.peak == (0 if case.sink != "none" else 8 * case.H)
    assert cu.CudnnBackend().workspace_bytes(case) == cu.scratch_workspace_bytes(case.dims) + declared
    assert len(dropped) == (case.sink == "none")


def test_row_scaled_backward_refuses_more_terms_than_int32_counts(host_code_on_cpu, monkeypatch):
    """The 64-head path counts a KV row's bound terms in int32: a call where more terms could name one row
    (S * L * head groups) is refused before any kernel runs, naming the way out; the single-role body takes it."""
    from sparse_mqa_kernels.bwd_plan import BackwardConfig

    case = Case(B=1, S=8, Skv=16, H=64, L=8, Dqk=576, Dv=512, seed=7)
    t = _call(case).args
    args = [t[k] for k in ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices")] + [case.scale]
    monkeypatch.setattr(bwd_plan, "MAX_ROW_TERMS", 8 * 8 - 1)
    with pytest.raises(ValueError, match=r"S \* L \* head groups = 8 \* 8 \* 1 = 64 .*single_role=True"):
        backward.sparse_mqa_backward(*args)
    dq, dkv, _ = backward.sparse_mqa_backward(*args, config=BackwardConfig(single_role=True))
    assert dq.shape == t["q"].shape and dkv.shape == t["kv"].shape
