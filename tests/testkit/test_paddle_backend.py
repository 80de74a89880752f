"""Backends driven with paddle tensors: same bits as the torch call, rejection named in paddle's terms, and the
torch-facing ``through_paddle`` route that the conformance checks run on."""

import numpy as np
import pytest
import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends import BackendSpec, get_backend
from sparse_mqa_testkit.backends.base import BackendBase
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.tensors import case_tensors
from sparse_mqa_testkit.paddle import frontend as F

CASES = [
    Case(seed=0),
    Case(sink="finite", topk="random", invalid="holes", seed=1),
    Case(B=2, S=5, Skv=7, H=3, L=9, Dqk=12, Dv=12, sink="mixed", invalid="out_of_range", duplicates=True, seed=2),
    Case(S=3, Skv=6, H=4, L=5, Dqk=10, Dv=3, sink="pos_inf", invalid="empty_rows", order="sorted", seed=3),
    Case(sink="neg_inf", topk="random", invalid="tails", seed=4),
]


def _torch_forward_backward(backend, t):
    out, lse = backend.forward(t["q"], t["kv"], t["indices"], t["sm_scale"], t["d_v"], attn_sink=t["attn_sink"],
                               topk_length=t["topk_length"])
    grads = backend.backward(t["q"], t["kv"], out, t["grad_out"], lse, t["attn_sink"], t["indices"], t["sm_scale"],
                             topk_length=t["topk_length"])
    return (out, lse), grads


def _same(a, b) -> bool:
    return (a is None and b is None) or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_paddle_backend_gives_the_torch_backends_bits(paddle, case):
    from sparse_mqa_testkit.paddle.backend import PaddleBackend

    ref = get_backend("reference")
    (out, lse), grads = _torch_forward_backward(ref, case_tensors(case))
    pb = PaddleBackend("reference")
    p = F.case_tensors(case)
    pout, plse = pb.forward(p["q"], p["kv"], p["indices"], p["sm_scale"], p["d_v"], attn_sink=p["attn_sink"],
                            topk_length=p["topk_length"])
    pgrads = pb.backward(p["q"], p["kv"], pout, p["grad_out"], plse, p["attn_sink"], p["indices"], p["sm_scale"],
                         topk_length=p["topk_length"])
    for name, want, got in zip(("out", "lse", "dq", "dkv", "d_sink"), (out, lse, *grads), (pout, plse, *pgrads)):
        if want is None:
            assert got is None, name
            continue
        assert isinstance(got, paddle.Tensor), name
        assert contract.dtype_name(got) == contract.KERNEL_DTYPES[name], name
        assert tuple(got.shape) == case.dims.shape(name), name
        assert _same(F.to_torch(got, name), want), name


@pytest.mark.parametrize("case", CASES[1:3], ids=lambda c: c.describe())
def test_through_paddle_gives_the_torch_backends_bits(paddle, case):
    from sparse_mqa_testkit.paddle.backend import through_paddle

    ref, tp = get_backend("reference"), through_paddle("reference")
    assert (tp.device, tp.deterministic, tp.dims, tp.tiles) == (ref.device, ref.deterministic, ref.dims, ref.tiles)
    t = case_tensors(case)
    want = _torch_forward_backward(ref, t)
    got = _torch_forward_backward(tp, t)
    for w, g in zip((*want[0], *want[1]), (*got[0], *got[1])):
        assert _same(w, g)


class _Recording(BackendBase):
    """Returns zeros of the right kinds and keeps what it was handed."""

    name = "recording"
    deterministic = True

    def __init__(self):
        self.seen = None

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        self.seen = dict(q=q, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=attn_sink, indices=indices,
                         topk_length=topk_length)
        return (torch.zeros_like(q), torch.zeros_like(kv), None if attn_sink is None else torch.zeros_like(attn_sink))


def _backward_args(case):
    t = case_tensors(case)
    ref = get_backend("reference")
    out, lse = ref.forward(t["q"], t["kv"], t["indices"], t["sm_scale"], t["d_v"], attn_sink=t["attn_sink"],
                           topk_length=t["topk_length"])
    return dict(q=t["q"], kv=t["kv"], out=out, grad_out=t["grad_out"], lse=lse, attn_sink=t["attn_sink"],
                indices=t["indices"], sm_scale=t["sm_scale"], topk_length=t["topk_length"])


def _call(backend, a):
    return backend.backward(a["q"], a["kv"], a["out"], a["grad_out"], a["lse"], a["attn_sink"], a["indices"],
                            a["sm_scale"], topk_length=a["topk_length"])


def test_through_paddle_hands_the_backend_tensors_made_by_paddle(paddle):
    """Every input reaches the backend as a new torch tensor decoded from a paddle tensor (zero-copy)."""
    from sparse_mqa_testkit.paddle.backend import through_paddle

    rec = _Recording()
    a = _backward_args(CASES[1])
    _call(through_paddle(rec), a)
    for name, got in rec.seen.items():
        mine = a[name]
        assert got is not mine, name
        assert got.data_ptr() == mine.data_ptr() and torch.equal(got, mine), name


# (argument, bad dtype): the paddle path must name the argument, like the torch path does
BAD_DTYPES = [(n, d) for n in ("q", "kv", "out", "grad_out") for d in ("float16", "float32")] + [
    ("lse", "bfloat16"), ("lse", "float64"), ("attn_sink", "bfloat16"), ("attn_sink", "float16"),
    ("indices", "int64"), ("topk_length", "int64")]


@pytest.mark.parametrize("arg, dtype", BAD_DTYPES)
def test_paddle_backend_rejects_wrong_dtypes_by_name(paddle, arg, dtype):
    from sparse_mqa_testkit.paddle.backend import PaddleBackend

    rec = _Recording()
    a = {k: (F.to_paddle(v, k) if isinstance(v, torch.Tensor) else v) for k, v in _backward_args(CASES[1]).items()}
    snapshot = {k: F.to_numpy(v).copy() for k, v in a.items() if k != "sm_scale"}
    a[arg] = a[arg].astype(dtype)
    with pytest.raises(ValueError, match=rf"^{arg} must be {contract.KERNEL_DTYPES[arg]}, got {dtype}$"):
        _call(PaddleBackend(rec), a)
    assert rec.seen is None, "the backend must not be reached"
    for k, v in snapshot.items():
        if k != arg:
            assert np.array_equal(F.to_numpy(a[k]), v, equal_nan=True), f"{k} was modified"


def test_paddle_backend_rejects_shapes_and_foreign_tensors_by_name(paddle):
    from sparse_mqa_testkit.paddle.backend import PaddleBackend

    pb = PaddleBackend(_Recording())
    a = {k: (F.to_paddle(v, k) if isinstance(v, torch.Tensor) else v) for k, v in _backward_args(CASES[1]).items()}
    with pytest.raises(ValueError, match=r"^lse must have shape"):
        _call(pb, dict(a, lse=a["lse"][:, :1]))
    with pytest.raises(ValueError, match=r"^grad_out must be a paddle\.Tensor, got torch\.Tensor"):
        _call(pb, dict(a, grad_out=F.to_torch(a["grad_out"], "grad_out")))
    with pytest.raises(ValueError, match=r"^sm_scale must be finite"):
        _call(pb, dict(a, sm_scale=float("nan")))
    assert pb.inner.seen is None


def test_through_paddle_rejects_through_the_paddle_validation(paddle):
    """The torch-facing route validates on the paddle side: a backend that checks nothing still never sees
    bad input."""
    from sparse_mqa_testkit.paddle.backend import through_paddle

    rec = _Recording()
    a = _backward_args(CASES[1])
    with pytest.raises(ValueError, match=r"^kv must be bfloat16, got float32$"):
        _call(through_paddle(rec), dict(a, kv=a["kv"].float()))
    with pytest.raises(ValueError, match=r"^q must be a paddle\.Tensor, got numpy\.ndarray"):
        _call(through_paddle(rec), dict(a, q=a["q"].float().numpy()))
    assert rec.seen is None


def test_through_paddle_is_loadable_by_spec(paddle):
    b = get_backend("sparse_mqa_testkit.paddle.backend:reference_through_paddle")
    assert b.name == "through-paddle[reference]" and b.deterministic and BackendSpec.of(b).has_forward
