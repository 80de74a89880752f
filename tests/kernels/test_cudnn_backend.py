"""The ``cudnn`` backend: its layout adapter, validation and dependency errors (CPU), and cuDNN itself (gpu)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparse_mqa_kernels import cudnn as cu  # noqa: E402
from sparse_mqa_testkit import oracle  # noqa: E402
from sparse_mqa_testkit.backends import get_backend  # noqa: E402
from sparse_mqa_testkit.cases import Case  # noqa: E402
from sparse_mqa_testkit.cases.tensors import case_tensors  # noqa: E402


def _call_args(case, device="cpu"):
    """Backward arguments with out/lse from the float32 oracle (the adapter only moves them)."""
    t = case_tensors(case, device)
    out, lse = oracle.forward(t["q"], t["kv"], t["indices"], sm_scale=t["sm_scale"], d_v=t["d_v"],
                              attn_sink=t["attn_sink"], topk_length=t["topk_length"])
    t["out"] = torch.from_numpy(out).to(torch.bfloat16).to(device)
    t["lse"] = torch.from_numpy(lse).to(device)
    return t


def _flat(t):
    return cu.to_cudnn_layout(t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"],
                              t["topk_length"])


# ---- the layout adapter (pure, CPU) ------------------------------------------------------------------------------

@pytest.mark.parametrize("invalid", ["mixed", "out_of_range", "empty_rows"])
@pytest.mark.parametrize("B", [1, 3])
def test_adapter_shapes_and_global_indices(B, invalid):
    case = Case(B=B, S=5, Skv=7, H=3, L=6, Dqk=16, Dv=8, invalid=invalid, topk="random", sink="finite", seed=4)
    t = _call_args(case)
    f = _flat(t)
    S, H, Skv, L = case.S, case.H, case.Skv, case.L
    assert f["q"].shape == (B * S, H, 16) and f["kv"].shape == (B * Skv, 16)
    assert f["out"].shape == f["dout"].shape == (B * S, H, 8)
    assert f["lse"].shape == (B * S, H) and f["topk_idxs"].shape == (B * S, L)
    assert f["topk_idxs"].dtype == torch.int32 and f["topk_length"].shape == (B * S,)
    assert all(v.is_contiguous() for v in f.values() if v is not None)
    assert torch.equal(f["q"], t["q"].reshape(B * S, H, 16))
    assert torch.equal(f["kv"][Skv:2 * Skv] if B > 1 else f["kv"], t["kv"][1 if B > 1 else 0])
    assert torch.equal(f["topk_length"], t["topk_length"].reshape(-1))  # native: cuDNN clamps it to [0, L]
    idx = t["indices"].numpy().astype(np.int64)
    got = f["topk_idxs"].numpy().reshape(B, S, L).astype(np.int64)
    in_range = (idx >= 0) & (idx < Skv)  # the index part of the rule; topk_length travels separately
    expected = idx + (np.arange(B) * Skv)[:, None, None]
    np.testing.assert_array_equal(got[in_range], expected[in_range])
    if B > 1:
        # in a flat kv an invalid local index must not name another batch's row: all become -1
        assert (got[~in_range] == -1).all()
    else:
        # B = 1 passes through: cuDNN itself skips everything outside [0, Skv)
        np.testing.assert_array_equal(got, idx)


def test_adapter_sink_none_becomes_minus_inf():
    case = Case(B=2, S=3, Skv=5, H=4, L=3, Dqk=16, Dv=8, sink="none")
    f = _flat(_call_args(case))
    assert f["attn_sink"].dtype == torch.float32 and f["attn_sink"].shape == (4,)
    assert torch.isneginf(f["attn_sink"]).all()
    assert f["topk_length"] is None
    d_sink = torch.zeros(4)
    dq, dkv, ds = cu.from_cudnn_layout(torch.zeros(6, 4, 16, dtype=torch.bfloat16),
                                       torch.zeros(10, 16, dtype=torch.bfloat16), d_sink, case.dims, None)
    assert dq.shape == (2, 3, 4, 16) and dkv.shape == (2, 5, 16) and ds is None


@pytest.mark.parametrize("sink", ["none", "mixed"])
@pytest.mark.parametrize("invalid", ["mixed", "out_of_range", "empty_rows"])
def test_flat_problem_is_the_same_problem(sink, invalid):
    """The float64 oracle on cuDNN's flat problem (one batch, global indices, topk_length, -inf for no sink)
    gives the batched problem's gradients: the adapter changes the layout, never the maths."""
    case = Case(B=3, S=4, Skv=6, H=2, L=5, Dqk=16, Dv=8, sink=sink, topk="random", invalid=invalid, seed=11)
    t = _call_args(case)
    f = _flat(t)
    kw = dict(sm_scale=case.scale, d_v=case.Dv, dtype=np.float64)
    dq, dkv, d_sink = oracle.backward(t["q"], t["kv"], t["indices"], t["grad_out"], attn_sink=t["attn_sink"],
                                      topk_length=t["topk_length"], **kw)
    fdq, fdkv, fds = oracle.backward(f["q"][None], f["kv"][None], f["topk_idxs"][None], f["dout"][None],
                                     attn_sink=f["attn_sink"], topk_length=f["topk_length"][None], **kw)
    gdq, gdkv, gds = cu.from_cudnn_layout(torch.from_numpy(fdq[0]), torch.from_numpy(fdkv[0]),
                                          torch.from_numpy(fds), case.dims, t["attn_sink"])
    np.testing.assert_allclose(gdq.numpy(), dq, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gdkv.numpy(), dkv, rtol=1e-12, atol=1e-12)
    if sink == "none":
        assert gds is None and not fds.any()  # -inf sink: p_sink = 0, so cuDNN's d_sink is 0 and dropped
    else:
        np.testing.assert_allclose(gds.numpy(), d_sink, rtol=1e-12, atol=1e-12)


# ---- what it declares and refuses (CPU: all before any GPU work) -------------------------------------------------

def test_registered_and_declared():
    b = get_backend("cudnn")
    assert isinstance(b, cu.CudnnBackend)
    assert b.name == "cudnn" and b.device == "cuda" and b.deterministic is False
    assert tuple(map(tuple, b.dims)) == ((576, 512), (512, 512))


@pytest.mark.parametrize("case, reason", [
    (Case(H=2, Dqk=576, Dv=512), None),
    (Case(H=128, Dqk=512, Dv=512), None),
    (Case(H=2, Dqk=576, Dv=576), "(Dqk, Dv)"),
    (Case(H=2, Dqk=64, Dv=32), "(Dqk, Dv)"),
    (Case(H=1, Dqk=576, Dv=512), "H >= 2"),
    (Case(B=2, Skv=2**30 + 1, H=2, Dqk=576, Dv=512), "int32"),
])
def test_supports(case, reason):
    got = cu.CudnnBackend().supports(case)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


@pytest.fixture
def no_gpu_work(monkeypatch):
    """Fail the test if the backend gets as far as loading cuDNN."""
    def boom():
        raise AssertionError("load_dsa() reached: validation must reject before any GPU work")
    monkeypatch.setattr(cu, "load_dsa", boom)


def _small(Dqk=576, Dv=512, H=2, **kw):
    return _call_args(Case(B=1, S=2, Skv=8, H=H, L=4, Dqk=Dqk, Dv=Dv, **kw))


def _backward(t, **override):
    t = {**t, **override}
    return cu.CudnnBackend().backward(t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"],
                                      t["indices"], t["sm_scale"], topk_length=t["topk_length"])


@pytest.mark.parametrize("override, match", [
    (lambda t: {"grad_out": t["grad_out"].to(torch.float16)}, "grad_out must be bfloat16, got float16"),
    (lambda t: {"lse": t["lse"].double()}, "lse must be float32"),
    (lambda t: {"indices": t["indices"].long()}, "indices must be int32"),
    (lambda t: {"q": t["q"][..., :512]}, "kv must have shape"),
    (lambda t: {"out": None}, "out is required"),
    (lambda t: {"sm_scale": float("nan")}, "sm_scale must be finite"),
    (lambda t: {"attn_sink": torch.zeros(3)}, "attn_sink must have shape"),
])
def test_rejects_bad_arguments_before_gpu_work(no_gpu_work, override, match):
    t = _small(sink="finite")
    with pytest.raises(ValueError, match=match):
        _backward(t, **override(t))


@pytest.mark.parametrize("kw, match", [
    (dict(Dqk=64, Dv=32), r"\(Dqk, Dv\) = \(64, 32\)"),
    (dict(Dqk=576, Dv=576), r"\(Dqk, Dv\) = \(576, 576\)"),
    (dict(H=1), "H >= 2"),
])
def test_rejects_what_cudnn_refuses(no_gpu_work, kw, match):
    with pytest.raises(ValueError, match=match):
        _backward(_small(**kw))


def test_rejects_cpu_tensors_before_loading_cudnn(no_gpu_work):
    with pytest.raises(ValueError, match="CUDA"):
        _backward(_small())


# ---- missing dependencies name the extra --------------------------------------------------------------------------

def test_missing_cutlass_dsl_names_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cutlass", None)  # import cutlass -> ImportError
    with pytest.raises(cu.MissingDependency, match=r"nvidia-cutlass-dsl.*sparse-mqa-testkit\[gpu\]"):
        cu.load_dsa()
    with pytest.raises(ImportError, match=r"\[gpu\]"):
        cu.CudnnBackend().require()


def test_missing_tvm_ffi_names_gpu_extra(monkeypatch):
    # seen on an H200 with cudnn-frontend and the DSL but no apache-tvm-ffi: the first execute failed deep
    # inside the DSL's from_dlpack; the backend now says so up front
    monkeypatch.setitem(sys.modules, "cutlass", types.ModuleType("cutlass"))
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)
    with pytest.raises(cu.MissingDependency, match=r"apache-tvm-ffi.*sparse-mqa-testkit\[gpu\]"):
        cu.load_dsa()


def test_missing_cudnn_frontend_names_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cutlass", types.ModuleType("cutlass"))
    monkeypatch.setitem(sys.modules, "tvm_ffi", types.ModuleType("tvm_ffi"))
    monkeypatch.setitem(sys.modules, "cudnn", None)
    with pytest.raises(cu.MissingDependency, match=r"nvidia-cudnn-frontend==1\.32\.0.*sparse-mqa-testkit\[gpu\]"):
        cu.load_dsa()


# ---- one plan per shape ------------------------------------------------------------------------------------------

class _FakePlan:
    made = 0

    def __init__(self, **samples):
        type(self).made += 1
        self.samples = samples
        self.checked = self.compiled = False

    def check_support(self):
        self.checked = True
        return True

    def compile(self):
        assert self.checked
        self.compiled = True


def test_one_plan_per_shape():
    fake = types.SimpleNamespace(SparseAttentionBackward=_FakePlan)
    b = cu.CudnnBackend()
    base = Case(B=2, S=3, Skv=5, H=2, L=4, Dqk=16, Dv=8)
    flats = [_flat(_call_args(c)) for c in (base, base.replace(seed=1), base.replace(sm_scale=0.3),
                                             base.replace(L=6), base.replace(topk="random"))]
    plans = [b._plan(fake, f) for f in flats]
    # new data or a new scale reuse the plan (the scale is passed per call); L and topk_length do not
    assert plans[0] is plans[1] is plans[2]
    assert len({id(p) for p in plans}) == 3 and b.plan_count == 3
    assert all(p.compiled for p in plans)
    assert plans[4].samples["sample_topk_length"] is not None and plans[0].samples["sample_topk_length"] is None


# ---- on the GPU ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _require_cudnn():
    try:
        cu.load_dsa()
    except cu.MissingDependency as exc:
        pytest.skip(str(exc))


GPU_CASES = [
    Case(B=1, S=8, Skv=128, H=64, L=64, Dqk=576, Dv=512, seed=1),
    Case(B=2, S=8, Skv=128, H=64, L=64, Dqk=576, Dv=512, sink="mixed", invalid="mixed", seed=2),
    Case(B=2, S=8, Skv=128, H=64, L=64, Dqk=576, Dv=512, sink="finite", invalid="out_of_range", seed=3),
    Case(B=1, S=8, Skv=128, H=64, L=64, Dqk=576, Dv=512, sink="pos_inf", invalid="empty_rows", seed=4),
    Case(B=2, S=8, Skv=128, H=64, L=64, Dqk=576, Dv=512, sink="finite", topk="random", invalid="holes",
         duplicates=True, seed=5),
    Case(B=1, S=8, Skv=128, H=16, L=64, Dqk=512, Dv=512, sink="neg_inf", seed=6),
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.describe())
def test_gpu_tolerance(case):
    _require_cudnn()
    tol = pytest.importorskip("sparse_mqa_testkit.checks.tolerance")
    res = tol.check_backward_tolerance(get_backend("cudnn"), case)
    assert res.passed, res.message


@pytest.mark.gpu
@needs_cuda
def test_gpu_repeated_calls_reuse_the_plan():
    _require_cudnn()
    case = GPU_CASES[1]
    b = cu.CudnnBackend()
    t = _call_args(case, "cuda")
    first = _backward_with(b, t)
    for _ in range(3):
        _backward_with(b, t)
    assert b.plan_count == 1
    assert first[0].shape == case.dims.shape("dq") and first[1].shape == case.dims.shape("dkv")
    assert first[2].shape == (case.H,) and first[2].dtype == torch.float32


def _backward_with(b, t):
    return b.backward(t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"],
                      t["sm_scale"], topk_length=t["topk_length"])
