"""Our kernels' side of the execution checks on a GPU: the backward's in-place dkv conversion gives the bits of
the float64 copy it replaced and takes no memory beyond dkv, and the cuDNN adapter's scratch formula is cuDNN's.
(The five checks themselves run on ``tilelang`` and ``cudnn`` through the suite: ``sparse-mqa-check --check``.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sparse_mqa_testkit.cases import Case  # noqa: E402

pytestmark = pytest.mark.gpu  # skipped with the reason without CUDA; a failure with --smqa-require-gpu


@pytest.mark.parametrize("F", [-30, 0, 40, 100, 120])
def test_dkv_conversion_in_place_on_the_device(F):
    from sparse_mqa_kernels.backward import dkv_from_fixed_point

    g = torch.Generator(device="cuda").manual_seed(F + 300)
    acc = torch.randint(-(2**62), 2**62, (2, 1024, 576), generator=g, dtype=torch.int64, device="cuda")
    acc[0, :3] = torch.tensor([0, 1, -(2**20)], device="cuda")[:, None]
    Ft = torch.tensor(float(F), device="cuda")
    want = (acc.double() * torch.exp2(-Ft.double())).to(torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["requested_bytes.all.current"]
    torch.cuda.reset_peak_memory_stats()
    got = dkv_from_fixed_point(acc, Ft)
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert peak - before <= got.numel() * got.element_size() + 64  # dkv and 0-d scalars: no float64 copy


@pytest.mark.parametrize("case", [Case(B=1, S=64, Skv=256, H=64, L=64, Dqk=576, Dv=512),
                                  Case(B=3, S=5, Skv=70, H=16, L=40, Dqk=512, Dv=512, topk="random"),
                                  Case(B=2, S=100, Skv=1000, H=128, L=64, Dqk=576, Dv=512, sink="finite")],
                         ids=lambda c: c.describe())
def test_cudnn_scratch_formula_is_cudnns(case):
    from sparse_mqa_kernels import cudnn as cu
    from sparse_mqa_testkit.cases.tensors import case_tensors

    pytest.importorskip("cudnn")
    dsa = cu.load_dsa()
    t = case_tensors(case, "cuda")
    out = torch.zeros(case.dims.shape("out"), dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(case.dims.shape("lse"), dtype=torch.float32, device="cuda")
    flat = cu.to_cudnn_layout(t["q"], t["kv"], out, t["grad_out"], lse, t["attn_sink"], t["indices"],
                              t["topk_length"])
    plan = cu.CudnnBackend()._plan(dsa, flat)
    assert plan.scratch_workspace_bytes() == cu.scratch_workspace_bytes(case.dims)
