"""Bad input raises ValueError whose message names the offending argument, from forward and backward alike."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from sparse_mqa_testkit import oracle
from sparse_mqa_testkit.cases import Case

X = Case(B=2, S=3, Skv=5, H=2, L=4, Dqk=8, Dv=4, sink="finite", topk="random").inputs()


def _call(which, **over):
    a = {**X, **over}
    kw = dict(sm_scale=a["sm_scale"], d_v=a["d_v"], attn_sink=a["attn_sink"], topk_length=a["topk_length"])
    if "dtype" in a:
        kw["dtype"] = a["dtype"]
    if which == "forward":
        return oracle.forward(a["q"], a["kv"], a["indices"], **kw)
    return oracle.backward(a["q"], a["kv"], a["indices"], a["grad_out"], **kw)


BAD = {
    # argument named in the message: (overrides, message pattern)
    "q rank": (dict(q=X["q"][0]), r"^q must have rank 4"),
    "q int": (dict(q=X["q"].astype(np.int32)), r"^q must be a floating-point array, got int32"),
    "q empty": (dict(q=X["q"][:, :, :0]), r"^q must have every size >= 1"),
    "kv rank": (dict(kv=X["kv"][0]), r"^kv must have rank 3"),
    "kv batch": (dict(kv=X["kv"][:1]), r"^kv must have shape \(2, Skv, 8\)"),
    "kv width": (dict(kv=X["kv"][..., :6]), r"^kv must have shape \(2, Skv, 8\)"),
    "kv no rows": (dict(kv=X["kv"][:, :0]), r"^kv must have Skv >= 1"),
    "kv int": (dict(kv=X["kv"].astype(np.int16)), r"^kv must be a floating-point array"),
    "indices rank": (dict(indices=X["indices"][..., 0]), r"^indices must have rank 3"),
    "indices rows": (dict(indices=X["indices"][:, :2]), r"^indices must have shape \(2, 3, L\)"),
    "indices no slots": (dict(indices=X["indices"][..., :0]), r"^indices must have L >= 1"),
    "indices float": (dict(indices=X["indices"].astype(np.float32)), r"^indices must be an integer array"),
    "d_v > Dqk": (dict(d_v=9), r"^d_v must satisfy 1 <= d_v <= Dqk = 8, got 9"),
    "d_v zero": (dict(d_v=0), r"^d_v must satisfy"),
    "d_v float": (dict(d_v=4.0), r"^d_v must be an int"),
    "d_v bool": (dict(d_v=True), r"^d_v must be an int"),
    "topk_length shape": (dict(topk_length=X["topk_length"][:, :2]), r"^topk_length must have shape \(2, 3\)"),
    "topk_length rank": (dict(topk_length=X["topk_length"][0]), r"^topk_length must have rank 2"),
    "topk_length float": (dict(topk_length=X["topk_length"].astype(np.float64)),
                          r"^topk_length must be an integer array"),
    "attn_sink shape": (dict(attn_sink=np.zeros(3, np.float32)), r"^attn_sink must have shape \(2,\)"),
    "attn_sink rank": (dict(attn_sink=np.zeros((1, 2), np.float32)), r"^attn_sink must have rank 1"),
    "attn_sink int": (dict(attn_sink=np.zeros(2, np.int32)), r"^attn_sink must be a floating-point array"),
    "sm_scale nan": (dict(sm_scale=math.nan), r"^sm_scale must be finite"),
    "sm_scale inf": (dict(sm_scale=-math.inf), r"^sm_scale must be finite"),
    "sm_scale str": (dict(sm_scale="0.5"), r"^sm_scale must be a float, got str"),
    "sm_scale None": (dict(sm_scale=None), r"^sm_scale must be a float, got NoneType"),
    "sm_scale bool": (dict(sm_scale=True), r"^sm_scale must be a float, got bool"),
    "dtype float16": (dict(dtype=np.float16), r"^dtype must be float32 or float64, got float16"),
    "dtype bfloat16": (dict(dtype=ml_dtypes.bfloat16), r"^dtype must be float32 or float64, got bfloat16"),
    "dtype int": (dict(dtype=np.int32), r"^dtype must be float32 or float64, got int32"),
    "dtype None": (dict(dtype=None), r"^dtype must be float32 or float64, got None"),
    "dtype nonsense": (dict(dtype="fp32x"), r"^dtype must be float32 or float64, got 'fp32x'"),
}


@pytest.mark.parametrize("which", ["forward", "backward"])
@pytest.mark.parametrize("label", list(BAD))
def test_bad_input_names_the_argument(which, label):
    over, pattern = BAD[label]
    with pytest.raises(ValueError, match=pattern):
        _call(which, **over)


@pytest.mark.parametrize("label, over, pattern", [
    ("grad_out shape", dict(grad_out=X["grad_out"][..., :3]), r"^grad_out must have shape \(2, 3, 2, 4\)"),
    ("grad_out rank", dict(grad_out=X["grad_out"][0]), r"^grad_out must have rank 4"),
    ("grad_out None", dict(grad_out=None), r"^grad_out is required"),
    ("grad_out int", dict(grad_out=X["grad_out"].astype(np.int8)), r"^grad_out must be a floating-point array"),
])
def test_bad_grad_out_names_it(label, over, pattern):
    with pytest.raises(ValueError, match=pattern):
        _call("backward", **over)


def test_not_an_array():
    with pytest.raises(ValueError, match=r"^q must have rank 4"):
        _call("forward", q=[[1.0]])
    with pytest.raises(ValueError, match=r"^kv is required, got None"):
        _call("forward", kv=None)
