"""The training-step entry point ``sparse_mqa_attention``: autograd plumbing on CPU stand-ins, kernels on GPU."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparse_mqa_kernels import autograd as ag  # noqa: E402
from sparse_mqa_kernels import sparse_mqa_attention  # noqa: E402
from sparse_mqa_testkit import oracle  # noqa: E402
from sparse_mqa_testkit.backends.reference import ReferenceBackend  # noqa: E402
from sparse_mqa_testkit.cases import Case  # noqa: E402
from sparse_mqa_testkit.cases.tensors import case_tensors  # noqa: E402
from support import load_as  # noqa: E402

CASES = [
    Case(B=2, S=3, Skv=9, H=2, L=5, Dqk=16, Dv=8, sink="finite", topk="random", invalid="mixed", seed=1),
    Case(B=1, S=4, Skv=6, H=3, L=4, Dqk=12, Dv=12, seed=2),
    Case(B=2, S=2, Skv=5, H=2, L=6, Dqk=8, Dv=4, sink="mixed", invalid="empty_rows", duplicates=True, seed=3),
]


class Spy:
    """A stand-in forward or backward that records its calls and delegates to the reference backend."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


class StandIn(ReferenceBackend):
    """The reference backend under a kernel's name, its forward and backward counted by spies."""

    def __init__(self, name, forward_spy, backward_spy, supports=None):
        super().__init__()
        self.name, self.forward, self.backward = name, forward_spy, backward_spy
        if supports is not None:
            self.supports = supports


@pytest.fixture
def stand_ins(monkeypatch):
    """Both backward choices and the forward replaced by CPU reference spies (loaded by name by
    the entry point)."""
    ref = ReferenceBackend()
    spies = {"forward": Spy(ref.forward), "tilelang": Spy(ref.backward), "cudnn": Spy(ref.backward)}
    load_as(monkeypatch, "tilelang", StandIn("tilelang", spies["forward"], spies["tilelang"]))
    load_as(monkeypatch, "cudnn", StandIn("cudnn", Spy(ref.forward), spies["cudnn"]))
    return spies


def _leaves(case, device="cpu"):
    t = case_tensors(case, device)
    for k in ("q", "kv", "attn_sink"):
        if t[k] is not None:
            t[k] = t[k].clone().requires_grad_(True)
    return t


def _step(t, backend, **kw):
    out = sparse_mqa_attention(t["q"], t["kv"], t["indices"], t["sm_scale"], t["d_v"], attn_sink=t["attn_sink"],
                               topk_length=t["topk_length"], backward_backend=backend, **kw)
    o = out[0] if isinstance(out, tuple) else out
    o.backward(t["grad_out"])
    grads = (t["q"].grad, t["kv"].grad, None if t["attn_sink"] is None else t["attn_sink"].grad)
    return out, grads


def _raw(t, forward, backward):
    x = {k: (v.detach() if hasattr(v, "detach") else v) for k, v in t.items()}
    out, lse = forward(x["q"], x["kv"], x["indices"], x["sm_scale"], x["d_v"], attn_sink=x["attn_sink"],
                       topk_length=x["topk_length"])
    grads = backward(x["q"], x["kv"], out, x["grad_out"], lse, x["attn_sink"], x["indices"], x["sm_scale"],
                     topk_length=x["topk_length"])
    return out, lse, grads


def _same(a, b, what):
    assert (a is None) == (b is None), f"{what}: one is None"
    if a is not None:
        assert torch.equal(a, b), f"{what}: not bitwise equal (max |diff| {(a.float() - b.float()).abs().max()})"


@pytest.mark.parametrize("backend", ["tilelang", "cudnn"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_autograd_matches_raw_backend_bitwise(stand_ins, backend, case):
    t = _leaves(case)
    (out, lse), grads = _step(t, backend, return_lse=True)
    ref = ReferenceBackend()
    r_out, r_lse, r_grads = _raw(t, ref.forward, ref.backward)
    _same(out, r_out, "out")
    _same(lse, r_lse, "lse")
    assert not lse.requires_grad
    for name, g, r in zip(("dq", "dkv", "d_sink"), grads, r_grads):
        _same(g, r, name)
    assert grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16


def test_switching_backend_changes_only_the_backward(stand_ins):
    case = CASES[0]
    outs = {}
    for backend in ("tilelang", "cudnn"):
        t = _leaves(case)
        before = {k: s.calls for k, s in stand_ins.items()}
        outs[backend], _ = _step(t, backend)
        called = {k: s.calls - before[k] for k, s in stand_ins.items()}
        other = "cudnn" if backend == "tilelang" else "tilelang"
        assert called == {"forward": 1, backend: 1, other: 0}
    _same(outs["tilelang"], outs["cudnn"], "out")


def test_attn_sink_gradient(stand_ins):
    case = Case(B=2, S=4, Skv=8, H=3, L=5, Dqk=16, Dv=8, sink="finite", seed=7)
    t = _leaves(case)
    _, (dq, dkv, d_sink) = _step(t, "tilelang")
    assert d_sink is not None and d_sink.shape == (3,) and d_sink.dtype == torch.float32
    assert d_sink.abs().sum() > 0  # finite sinks carry mass, so the gradient is not identically zero
    # d_sink[h] = -sum p_sink * Delta, from the float64 oracle's out and lse (the stand-in backward recomputes
    # them in float32, so this also checks that it is d_sink, not some other vector, that reaches the leaf)
    x = case.inputs()
    out, lse = oracle.forward(x["q"], x["kv"], x["indices"], sm_scale=x["sm_scale"], d_v=x["d_v"],
                              attn_sink=x["attn_sink"], dtype=np.float64)
    delta = (x["grad_out"].astype(np.float64) * out).sum(-1)
    sink = x["attn_sink"].astype(np.float64)
    p_sink = np.exp(sink - np.logaddexp(lse, sink))
    np.testing.assert_allclose(d_sink.double().numpy(), -(p_sink * delta).sum((0, 1)), rtol=1e-4, atol=1e-6)


def test_no_sink_gives_no_sink_gradient(stand_ins):
    t = _leaves(CASES[1])
    _, (dq, dkv, d_sink) = _step(t, "cudnn")
    assert d_sink is None and dq is not None and dkv is not None


@pytest.mark.parametrize("bad", ["cuDNN", "reference", "", None])
def test_bad_backward_backend_rejected_before_forward(stand_ins, bad):
    t = _leaves(CASES[0])
    with pytest.raises(ValueError, match=r"backward_backend must be one of 'tilelang', 'cudnn'"):
        _step(t, bad)
    assert stand_ins["forward"].calls == 0


def test_cudnn_refusal_found_before_forward(monkeypatch):
    """cuDNN's own declared domain (``CudnnBackend.supports``) refuses before our forward runs."""
    from sparse_mqa_kernels.cudnn import CudnnBackend

    spy = Spy(ReferenceBackend().forward)
    load_as(monkeypatch, "tilelang", StandIn("tilelang", spy, Spy(ReferenceBackend().backward)))
    load_as(monkeypatch, "cudnn", CudnnBackend())
    for case, match in ((Case(H=1, Dqk=576, Dv=512, S=2, Skv=4, L=2), "H >= 2"),
                        (Case(H=2, Dqk=16, Dv=8), r"\(Dqk, Dv\)")):
        with pytest.raises(ValueError, match=match):
            _step(_leaves(case), "cudnn")
    assert spy.calls == 0


def test_the_backward_is_the_one_chosen_at_the_forward(stand_ins, monkeypatch):
    """A step's backward is the backend its forward chose, even if the table changes in between."""
    t = _leaves(CASES[0])
    out = sparse_mqa_attention(t["q"], t["kv"], t["indices"], t["sm_scale"], t["d_v"], attn_sink=t["attn_sink"],
                               topk_length=t["topk_length"], backward_backend="cudnn")
    later = Spy(ReferenceBackend().backward)
    load_as(monkeypatch, "cudnn", StandIn("cudnn", Spy(ReferenceBackend().forward), later))
    out.backward(t["grad_out"])
    assert stand_ins["cudnn"].calls == 1 and later.calls == 0


# ---- on the GPU ---------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_CASE = Case(B=2, S=16, Skv=256, H=64, L=128, Dqk=576, Dv=512, sink="finite", topk="random",
                invalid="holes", seed=21)


def _require(module, attr):
    """Our kernel entry point, or a skip: the module must import and TileLang (imported lazily) be installed."""
    try:
        importlib.import_module("tilelang")
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"{module}.{attr} is not available here: {exc}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_tilelang_step_bitwise_repeatable():
    _require("sparse_mqa_kernels.forward", "sparse_mqa_forward")
    _require("sparse_mqa_kernels.backward", "sparse_mqa_backward")
    runs = []
    for _ in range(3):
        t = _leaves(GPU_CASE, "cuda")
        out, grads = _step(t, "tilelang")
        torch.cuda.synchronize()
        runs.append((out, *grads))
    for again in runs[1:]:
        for name, a, b in zip(("out", "dq", "dkv", "d_sink"), runs[0], again):
            _same(a, b, name)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["tilelang", "cudnn"])
def test_gpu_autograd_matches_raw_backend(backend, monkeypatch):
    if backend == "cudnn":
        from sparse_mqa_kernels import cudnn as cu

        try:
            cu.load_dsa()
        except cu.MissingDependency as exc:
            pytest.skip(str(exc))
        try:
            forward = _require("sparse_mqa_kernels.forward", "sparse_mqa_forward")
        except pytest.skip.Exception:
            # without our forward, the reference forward (on CUDA tensors) feeds cuDNN's backward
            ref = ReferenceBackend("cuda")
            load_as(monkeypatch, "tilelang", StandIn("tilelang", ref.forward, ref.backward))
            forward = ref.forward
    else:
        forward = _require("sparse_mqa_kernels.forward", "sparse_mqa_forward")
    backward = ag.backend(backend).backward
    t = _leaves(GPU_CASE, "cuda")
    out, grads = _step(t, backend)
    r_out, _, r_grads = _raw(t, forward, backward)
    _same(out, r_out, "out")  # the forward is ours in both modes and deterministic
    if backend == "tilelang":
        for name, g, r in zip(("dq", "dkv", "d_sink"), grads, r_grads):
            _same(g, r, name)
    else:  # cuDNN accumulates dkv and d_sink with atomics on SM90: same call, same values up to that order
        for name, g, r in zip(("dq", "dkv", "d_sink"), grads, r_grads):
            torch.testing.assert_close(g, r, msg=lambda m, name=name: f"{name}: {m}")
