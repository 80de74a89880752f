"""What a check feeds a backend and compares with: inputs, the reference results, calls, and bitwise helpers.

The reference is computed once per case and device (cached): the float64 oracle is the truth, float32 math
rounded to each output's kernel dtype is the bf16-output oracle whose error sets the tolerance, and the error
model's terms come with them. For a CPU backend the NumPy oracle computes them on the host (the root of
trust); for a CUDA backend, and for every ``large`` case, the device oracle does, on the backend's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .. import contract, device_oracle, oracle
from ..torch_io import case_tensors, to_torch

BACKWARD_OUTPUTS = ("dq", "dkv", "d_sink")
FORWARD_OUTPUTS = ("out", "lse")
OUTPUTS = {"backward": BACKWARD_OUTPUTS, "forward": FORWARD_OUTPUTS}


def _frozen(a):
    if a is not None:
        a = np.array(a)
        a.setflags(write=False)
    return a


@lru_cache(maxsize=16)
def oracle_results(case) -> dict:
    """The NumPy oracle's {"f64": {...}, "f32": {...}}: out, lse, dq, dkv, d_sink as read-only arrays."""
    x = case.inputs()
    kw = dict(sm_scale=x["sm_scale"], d_v=x["d_v"], attn_sink=x["attn_sink"], topk_length=x["topk_length"])
    res = {}
    for key, dt in (("f64", np.float64), ("f32", np.float32)):
        out, lse = oracle.forward(x["q"], x["kv"], x["indices"], dtype=dt, **kw)
        dq, dkv, d_sink = oracle.backward(x["q"], x["kv"], x["indices"], x["grad_out"], dtype=dt, **kw)
        res[key] = {k: _frozen(v) for k, v in dict(out=out, lse=lse, dq=dq, dkv=dkv, d_sink=d_sink).items()}
    return res


RESULTS = ("out", "lse", "dq", "dkv", "d_sink")


@dataclass(frozen=True)
class Reference:
    """A case on one device: its inputs, the float64 oracle's results (``o64``), the bf16-output oracle's
    (``ref``: float32 math in each result's kernel dtype) and the error model's terms per row (``terms``)."""

    inputs: dict
    o64: dict
    ref: dict
    terms: dict


def truth_device(backend_device, case) -> str:
    """Where a case's reference is computed: the host for a CPU backend (NumPy), else the backend's device."""
    dev = str(backend_device or "cpu")
    return "cpu" if dev == "cpu" and not case.large else dev


def _kernel_dtype(name: str):
    return getattr(torch, contract.KERNEL_DTYPES[name])


@lru_cache(maxsize=2)
def reference(case, device: str = "cpu") -> Reference:
    """The case's reference on ``device`` ("cpu": the NumPy oracle, unless the case is large)."""
    from .error_model import row_terms

    t = case_tensors(case, device)
    if device == "cpu" and not case.large:
        res = oracle_results(case)
        o64 = {k: to_torch(v, device) for k, v in res["f64"].items() if k in RESULTS}
        ref = {k: to_torch(v, device, _kernel_dtype(k)) for k, v in res["f32"].items() if k in RESULTS}
    else:
        kw = dict(sm_scale=t["sm_scale"], d_v=t["d_v"], attn_sink=t["attn_sink"], topk_length=t["topk_length"])
        o64, ref = {}, {}
        for store, dtype in ((o64, torch.float64), (ref, torch.float32)):
            store["out"], store["lse"] = device_oracle.forward(t["q"], t["kv"], t["indices"], dtype=dtype, **kw)
            store["dq"], store["dkv"], store["d_sink"] = device_oracle.backward(
                t["q"], t["kv"], t["indices"], t["grad_out"], dtype=dtype, **kw)
        ref = {k: None if v is None else v.to(_kernel_dtype(k)) for k, v in ref.items()}
    terms = row_terms(t, o64["out"])
    return Reference(t, o64, ref, terms)


def backend_inputs(backend, case) -> dict:
    """Torch inputs for ``backend.backward`` (and ``forward``) on ``backend.device``.

    Keys: q, kv, out, grad_out, lse, attn_sink, indices, topk_length (tensors or None), sm_scale, d_v.
    out and lse come from the float64 oracle forward, rounded to what a forward returns (out bfloat16, lse
    float32, natural log, sink excluded); an empty row's lse is +inf, or -inf for ``case.empty_lse="neg_inf"``.
    The tensors are the backend's own copies: a backend that writes into them leaves the reference alone.
    """
    dev = getattr(backend, "device", "cpu")
    r = reference(case, truth_device(dev, case))
    t = {k: (v.to(dev, copy=True) if isinstance(v, torch.Tensor) else v) for k, v in r.inputs.items()}
    lse = r.o64["lse"].to(dev, torch.float32)
    if case.empty_lse == "neg_inf":
        lse = torch.where(torch.isposinf(lse), -torch.inf, lse)
    t["out"] = r.o64["out"].to(dev).to(torch.bfloat16)
    t["lse"] = lse
    return t


def has_forward(backend) -> bool:
    return callable(getattr(backend, "forward", None))


def directions(backend) -> list[str]:
    """What a backend can be called for: its backward, and its forward when it has one."""
    return ["backward"] + (["forward"] if has_forward(backend) else [])


def call(backend, which: str, t: dict):
    """One call of ``backend.backward`` or ``backend.forward`` on the argument dict ``t``, as it returned."""
    if which == "backward":
        return backend.backward(t["q"], t["kv"], t["out"], t["grad_out"], t["lse"], t["attn_sink"], t["indices"],
                                t["sm_scale"], topk_length=t["topk_length"])
    return backend.forward(t["q"], t["kv"], t["indices"], t["sm_scale"], t["d_v"], attn_sink=t["attn_sink"],
                           topk_length=t["topk_length"])


def call_named(backend, which: str, t: dict) -> dict:
    """``call``'s results by output name (dq, dkv, d_sink or out, lse)."""
    return dict(zip(OUTPUTS[which], call(backend, which, t)))


def snapshot(outs: dict) -> dict:
    """Detached copies of named results, safe from a backend that reuses its output buffers."""
    return {k: (None if v is None else v.detach().clone()) for k, v in outs.items()}


def as_f64(x):
    """A tensor or array as a float64 CPU torch tensor (bf16 widens exactly)."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x, dtype=np.float64))  # a writable copy
    return x.detach().to("cpu", torch.float64)


def clone_tensors(t: dict) -> dict:
    return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in t.items()}


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x):
    """A tensor's raw bits as an integer tensor: NaN-aware bitwise comparison (NaN payloads included)."""
    if x.dtype.is_floating_point:
        return x.detach().contiguous().view(_INT_VIEW[x.element_size()])
    return x.detach()


def bitwise_equal(a, b) -> bool:
    """Same shape, dtype and bits (NaN equals NaN with the same payload)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a).cpu(), bits(b).cpu())


def bits_differ(a, b):
    """Boolean tensor (CPU): where the bits of two same-shaped tensors differ."""
    return bits(a).cpu() != bits(b).cpu()


def first_difference(a, b):
    """Index of the first element whose bits differ, or None."""
    diff = bits_differ(a, b)
    if not bool(diff.any()):
        return None
    return tuple(int(i) for i in torch.nonzero(diff)[0])
