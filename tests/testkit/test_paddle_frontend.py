"""Paddle <-> torch <-> NumPy at the edges: exact round trips, zero copies, the oracle on paddle tensors.

paddle is imported by a fixture, not at collection, so pytest-xdist workers that never run these tests do
not load it.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

from sparse_mqa_testkit import contract, oracle
from sparse_mqa_testkit.cases import Case
from sparse_mqa_testkit.cases.tensors import case_tensors as torch_case_tensors
from sparse_mqa_testkit.paddle import frontend as F

# bit patterns that must survive: signed zeros, subnormals, extremes, inf and NaN
_SPECIAL = np.array([0.0, -0.0, 1.0, -2.5, 1e-40, -1e-42, 3.0e38, -3.0e38, np.inf, -np.inf, np.nan], np.float32)


def _sample(dtype: str) -> np.ndarray:
    rng = np.random.default_rng(7)
    if dtype in ("bfloat16", "float16", "float32", "float64"):
        a = np.concatenate([_SPECIAL, rng.standard_normal(53, dtype=np.float32) * 100]).reshape(4, 16)
        with np.errstate(over="ignore"):  # 3e38 is inf in float16, on purpose
            return a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    if dtype == "bool":
        return rng.random((4, 16)) < 0.5
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=(4, 16), dtype=dtype, endpoint=True)
    a[0, :3] = (info.min, info.max, -1 if info.min < 0 else 0)
    return a


def _bits(a: np.ndarray) -> np.ndarray:
    """Raw bytes as unsigned integers, so NaN payloads and -0.0 compare too."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fV" or a.dtype.name == "bfloat16" else a


DTYPES = ["bfloat16", "float32", "int32", "float16", "float64", "int64", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_paddle_torch_paddle_is_exact(paddle, dtype):
    a = _sample(dtype)
    p = F.from_numpy(a)
    assert F.to_numpy(p).dtype == a.dtype and np.array_equal(_bits(F.to_numpy(p)), _bits(a))
    t = F.to_torch(p, "x")
    assert isinstance(t, torch.Tensor) and str(t.dtype) == f"torch.{dtype}"
    assert np.array_equal(_bits(oracle.to_numpy(t)), _bits(a))
    back = F.to_paddle(t, "x")
    assert isinstance(back, paddle.Tensor) and str(back.dtype) == f"paddle.{dtype}"
    assert contract.dtype_name(back) == contract.dtype_name(t) == dtype
    assert list(back.shape) == list(a.shape)
    assert np.array_equal(_bits(F.to_numpy(back)), _bits(a))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int32"])
def test_round_trip_torch_paddle_torch_is_exact(paddle, dtype):
    from sparse_mqa_testkit.convert import to_torch

    t = to_torch(_sample(dtype))
    back = F.to_torch(F.to_paddle(t, "x"), "x")
    assert back.dtype == t.dtype and back.shape == t.shape
    assert np.array_equal(_bits(oracle.to_numpy(back)), _bits(oracle.to_numpy(t)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int32"])
def test_conversions_share_memory(paddle, dtype):
    """Zero-copy both ways: a write through one framework is seen by the other."""
    p = F.from_numpy(_sample(dtype))
    t = F.to_torch(p, "x")
    assert t.data_ptr() == p.data_ptr()
    t[1, 2] = 3
    assert F.to_numpy(p)[1, 2] == 3
    q = F.to_paddle(t, "x")
    assert q.data_ptr() == t.data_ptr()
    t[0, 0] = 5
    assert F.to_numpy(q)[0, 0] == 5


def test_strided_views_keep_their_values(paddle):
    """DLPack carries strides: a transposed or sliced view converts to the same logical values."""
    base = torch.arange(48, dtype=torch.float32).reshape(4, 12)
    for view in (base.t(), base[:, 3:9:2], base.reshape(4, 3, 4).permute(2, 0, 1)):
        p = F.to_paddle(view, "x")
        assert list(p.shape) == list(view.shape)
        assert np.array_equal(F.to_numpy(p), view.numpy())
        assert torch.equal(F.to_torch(p, "x"), view)


def test_tensors_that_require_grad_convert(paddle):
    """Both frameworks refuse DLPack export of a tensor that requires grad; the frontend detaches."""
    p = F.from_numpy(np.ones((2, 3), np.float32))
    p.stop_gradient = False
    assert torch.equal(F.to_torch(p, "q"), torch.ones(2, 3))
    t = torch.ones(2, 3, requires_grad=True)
    assert np.array_equal(F.to_numpy(F.to_paddle(t, "q")), np.ones((2, 3), np.float32))


def test_none_passes_and_wrong_types_are_named(paddle):
    assert F.to_torch(None, "attn_sink") is None and F.to_paddle(None, "attn_sink") is None
    with pytest.raises(ValueError, match=r"^q must be a paddle\.Tensor, got torch\.Tensor"):
        F.to_torch(torch.ones(2), "q")
    with pytest.raises(ValueError, match=r"^kv must be a paddle\.Tensor, got numpy\.ndarray"):
        F.to_torch(np.ones(2), "kv")
    with pytest.raises(ValueError, match=r"^dq must be a torch\.Tensor"):
        F.to_paddle(F.from_numpy(np.ones(2, np.float32)), "dq")


@pytest.mark.parametrize("dtype, name", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"),
                                         ("float64", "float64"), ("int32", "int32"), ("int64", "int64")])
def test_contract_dtype_names_for_paddle(paddle, dtype, name):
    x = paddle.zeros([2], dtype=dtype)
    assert contract.dtype_name(x) == name
    assert contract.dtype_name(x.dtype) == name


def test_stream_scope_is_a_no_op_on_cpu(paddle):
    p = F.from_numpy(np.ones(3, np.float32))
    with F.stream_scope(p):
        assert torch.equal(F.to_torch(p, "q"), torch.ones(3))
    with F.stream_scope(None):
        pass


CASES = [
    Case(sink="finite", topk="random", invalid="mixed", duplicates=True, seed=1),
    Case(B=2, S=3, Skv=5, H=3, L=7, Dqk=12, Dv=12, sink="mixed", invalid="empty_rows", seed=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.describe())
def test_oracle_takes_paddle_tensors(paddle, case):
    """The oracle reads paddle tensors (bf16 included) exactly as it reads the same values as NumPy arrays."""
    x = case.inputs()
    p = F.case_tensors(case)
    kw = dict(sm_scale=case.scale, d_v=case.Dv, dtype=np.float64)
    args_np = dict(attn_sink=x["attn_sink"], topk_length=x["topk_length"])
    args_pd = dict(attn_sink=p["attn_sink"], topk_length=p["topk_length"])
    want = oracle.forward(x["q"], x["kv"], x["indices"], **args_np, **kw)
    got = oracle.forward(p["q"], p["kv"], p["indices"], **args_pd, **kw)
    for w, g in zip(want, got):
        assert np.array_equal(w, g, equal_nan=True)
    want = oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], **args_np, **kw)
    got = oracle.backward(p["q"], p["kv"], p["indices"], p["grad_out"], **args_pd, **kw)
    for w, g in zip(want, got):
        assert (w is None and g is None) or np.array_equal(w, g, equal_nan=True)


def test_case_tensors_match_torch_case_tensors(paddle):
    case = CASES[0]
    p, t = F.case_tensors(case), torch_case_tensors(case)
    assert p.keys() == t.keys()
    for k in p:
        if k in ("sm_scale", "d_v") or p[k] is None:
            assert p[k] == t[k]
            continue
        assert contract.dtype_name(p[k]) == contract.dtype_name(t[k]) == contract.KERNEL_DTYPES[k]
        assert torch.equal(F.to_torch(p[k], k), t[k])


def test_importing_the_subpackage_does_not_import_paddle():
    import subprocess
    import sys

    code = ("import sys, sparse_mqa_testkit.paddle as p; p.__all__; "
            "assert 'paddle' not in sys.modules, 'paddle was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _paddle_gpu():
    paddle = pytest.importorskip("paddle", reason="needs paddlepaddle-gpu")
    if not (paddle.is_compiled_with_cuda() and torch.cuda.is_available() and paddle.device.cuda.device_count()):
        pytest.skip("needs paddlepaddle-gpu and a CUDA GPU (paddlepaddle-gpu is not on our H200 test machine)")
    return paddle


@pytest.mark.gpu
def test_gpu_round_trip_and_shared_stream():
    paddle = _paddle_gpu()
    a = _sample("bfloat16")
    p = F.from_numpy(a, "gpu:0")
    stream = paddle.device.Stream()
    with paddle.device.stream_guard(stream):
        with F.stream_scope(p):
            assert torch.cuda.current_stream().cuda_stream == int(stream.stream_base.raw_stream)
            t = F.to_torch(p, "q")
            assert t.is_cuda and t.data_ptr() == p.data_ptr()
            back = F.to_paddle(t * 1, "q")  # a torch kernel queued on paddle's stream
        assert np.array_equal(_bits(F.to_numpy(back)), _bits(a))
