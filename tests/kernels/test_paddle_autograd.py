"""The PyLayer entry point against the torch one, on CPU with the ``reference`` backend put into the table both
entry points load by name (``sparse_mqa_kernels.autograd.backend``): same outputs and gradients, bit
for bit."""

import types

import numpy as np
import pytest
import torch

from sparse_mqa_kernels import autograd as torch_entry
from sparse_mqa_testkit.backends import get_backend
from sparse_mqa_testkit.backends.reference import ReferenceBackend
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.tensors import case_tensors
from sparse_mqa_testkit.paddle import frontend as F
from support import load_as  # noqa: E402


@pytest.fixture
def entry(paddle, monkeypatch):
    """The paddle entry point with the reference backend behind both names of the switch."""
    from sparse_mqa_kernels import paddle_autograd as paddle_entry

    calls = []

    class Tagged(ReferenceBackend):
        def __init__(self, tag):
            super().__init__()
            self.name = tag

        def backward(self, *args, **kwargs):
            calls.append(self.name)
            return super().backward(*args, **kwargs)

    for tag in ("tilelang", "cudnn"):
        load_as(monkeypatch, tag, Tagged(tag))
    return types.SimpleNamespace(sparse_mqa_attention=paddle_entry.sparse_mqa_attention, calls=calls)


CASES = [
    Case(seed=0),
    Case(sink="finite", topk="random", invalid="mixed", duplicates=True, seed=1),
    Case(B=2, S=3, Skv=5, H=3, L=6, Dqk=12, Dv=8, sink="mixed", invalid="empty_rows", seed=2),
]


def _torch_step(case, backend):
    t = case_tensors(case)
    leaves = {k: t[k].clone().requires_grad_() for k in ("q", "kv", "attn_sink") if t[k] is not None}
    out, lse = torch_entry.sparse_mqa_attention(leaves["q"], leaves["kv"], t["indices"], t["sm_scale"], t["d_v"],
                                                attn_sink=leaves.get("attn_sink"), topk_length=t["topk_length"],
                                                backward_backend=backend, return_lse=True)
    out.backward(t["grad_out"])
    return out.detach(), lse, {k: v.grad for k, v in leaves.items()}


def _paddle_step(entry, case, backend):
    p = F.case_tensors(case)
    leaves = {k: p[k] for k in ("q", "kv", "attn_sink") if p[k] is not None}
    for v in leaves.values():
        v.stop_gradient = False
    out, lse = entry.sparse_mqa_attention(leaves["q"], leaves["kv"], p["indices"], p["sm_scale"], p["d_v"],
                                          attn_sink=leaves.get("attn_sink"), topk_length=p["topk_length"],
                                          backward_backend=backend, return_lse=True)
    assert not out.stop_gradient and lse.stop_gradient
    out.backward(p["grad_out"])
    return out, lse, {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_pylayer_matches_the_torch_entry_point_bitwise(entry, case):
    import paddle

    t_out, t_lse, t_grads = _torch_step(case, "tilelang")
    p_out, p_lse, p_grads = _paddle_step(entry, case, "tilelang")
    assert entry.calls == ["tilelang", "tilelang"]
    assert torch.equal(F.to_torch(p_out, "out"), t_out) and torch.equal(F.to_torch(p_lse, "lse"), t_lse)
    assert p_grads.keys() == t_grads.keys()
    for name, g in p_grads.items():
        assert isinstance(g, paddle.Tensor), name
        want = t_grads[name]
        got = F.to_torch(g, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name


def test_the_switch_picks_the_named_backward_and_changes_nothing_else(entry):
    case = CASES[1]
    a = _paddle_step(entry, case, "tilelang")
    b = _paddle_step(entry, case, "cudnn")
    assert entry.calls == ["tilelang", "cudnn"]
    for x, y in zip((a[0], a[1], *a[2].values()), (b[0], b[1], *b[2].values())):
        assert np.array_equal(F.to_numpy(x), F.to_numpy(y), equal_nan=True)


def test_unknown_backward_backend_lists_the_choices(entry):
    p = F.case_tensors(CASES[0])
    with pytest.raises(ValueError, match=r"^backward_backend must be one of 'tilelang', 'cudnn' or a backend object, "
                                         r"got 'fast'$"):
        entry.sparse_mqa_attention(p["q"], p["kv"], p["indices"], p["sm_scale"], p["d_v"], backward_backend="fast")


def test_the_backward_is_the_one_chosen_at_the_forward(entry, monkeypatch):
    p = F.case_tensors(CASES[0])
    p["q"].stop_gradient = False
    out = entry.sparse_mqa_attention(p["q"], p["kv"], p["indices"], p["sm_scale"], p["d_v"])
    load_as(monkeypatch, "tilelang", get_backend("reference"))  # swapped after the forward
    out.backward(p["grad_out"])
    assert entry.calls == ["tilelang"]


@pytest.mark.parametrize("arg, dtype", [("q", "float16"), ("kv", "float32"), ("attn_sink", "bfloat16"),
                                        ("indices", "int64"), ("topk_length", "int64")])
def test_wrong_paddle_dtypes_are_named_before_any_work(entry, arg, dtype):
    p = F.case_tensors(Case(sink="finite", topk="random", seed=3))
    p[arg] = p[arg].astype(dtype)
    want = {"q": "bfloat16", "kv": "bfloat16", "attn_sink": "float32", "indices": "int32", "topk_length": "int32"}
    with pytest.raises(ValueError, match=rf"^{arg} must be {want[arg]}, got {dtype}$"):
        entry.sparse_mqa_attention(p["q"], p["kv"], p["indices"], p["sm_scale"], p["d_v"],
                                   attn_sink=p["attn_sink"], topk_length=p["topk_length"])
    assert entry.calls == []


def test_torch_tensors_are_refused_by_name(entry):
    t = case_tensors(CASES[0])
    p = F.case_tensors(CASES[0])
    with pytest.raises(ValueError, match=r"^kv must be a paddle\.Tensor, got torch\.Tensor"):
        entry.sparse_mqa_attention(p["q"], t["kv"], p["indices"], p["sm_scale"], p["d_v"])


def test_out_only_by_default_and_no_gradient_without_sink(entry):
    p = F.case_tensors(CASES[0])
    p["kv"].stop_gradient = False
    out = entry.sparse_mqa_attention(p["q"], p["kv"], p["indices"], p["sm_scale"], p["d_v"])
    assert tuple(out.shape) == CASES[0].dims.shape("out")
    out.backward(p["grad_out"])
    assert p["kv"].grad is not None and p["q"].grad is None
