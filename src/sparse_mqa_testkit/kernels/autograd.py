"""The training-step entry point: our forward and a chosen backward as one ``torch.autograd.Function``.

``backward_backend="tilelang"`` is our deterministic backward (bitwise reproducible steps, precision aligned with
the oracle); ``"cudnn"`` is cuDNN frontend's DSA backward (throughput, not deterministic on Hopper). Both take
the forward's ``out`` and ``lse`` as the contract defines them, so only the backward changes.

``FORWARD`` and ``BACKWARDS`` hold ``"module:attr"`` specs, resolved when called; tests (or a trainer) may put
a callable in their place, e.g. the ``reference`` backend's methods to run the whole path on CPU.
"""

from __future__ import annotations

import importlib

import torch

from ..backends.validate import check_forward_args

FORWARD = "sparse_mqa_testkit.kernels.forward:sparse_mla_forward"
BACKWARDS = {
    "tilelang": "sparse_mqa_testkit.kernels.backward:sparse_mla_backward",
    "cudnn": "sparse_mqa_testkit.backends.cudnn:cudnn_backward",
}


def _resolve(spec):
    if callable(spec):
        return spec
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _refusal(backward_backend: str, dims) -> str | None:
    """A reason the chosen backward would refuse these sizes, found before the forward runs (or None)."""
    if backward_backend == "cudnn" and BACKWARDS["cudnn"] == "sparse_mqa_testkit.backends.cudnn:cudnn_backward":
        from ..backends.cudnn import unsupported_reason

        return unsupported_reason(dims)
    return None


class SparseMQAAttention(torch.autograd.Function):
    """out = attention(q, kv, indices); gradients for q, kv and attn_sink from the recorded backward."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, topk_length, sm_scale, d_v, backward_backend, forward_fn,
                backward_fn):
        out, lse = forward_fn(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
        ctx.save_for_backward(q, kv, attn_sink, indices, topk_length, out, lse)
        ctx.sm_scale = sm_scale
        # what this forward ran with; backward refuses to mix in anything else
        ctx.backward_backend = backward_backend
        ctx.backward_fn = backward_fn
        ctx.has_sink = attn_sink is not None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        name = ctx.backward_backend
        if name not in BACKWARDS or _resolve(BACKWARDS[name]) is not ctx.backward_fn:
            raise RuntimeError(f"backward backend {name!r} recorded by the forward is no longer the registered "
                               f"one; forward and backward must use the same registry entry")
        q, kv, attn_sink, indices, topk_length, out, lse = ctx.saved_tensors
        dq, dkv, d_sink = ctx.backward_fn(q, kv, out, grad_out.contiguous(), lse, attn_sink, indices,
                                          ctx.sm_scale, topk_length=topk_length)
        if ctx.has_sink and d_sink is None:
            raise RuntimeError(f"backward backend {name!r} returned no d_sink although attn_sink was given")
        return dq, dkv, (d_sink if ctx.has_sink else None), None, None, None, None, None, None, None


def sparse_mqa_attention(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None,
                         backward_backend="tilelang", return_lse=False):
    """Sparse MQA attention for training: our forward, and ``backward_backend``'s backward.

    Arguments follow ``sparse_mqa_testkit.contract``. Returns ``out`` [B, S, H, Dv] (and the contract's ``lse``
    [B, S, H], not differentiable, when ``return_lse``). Gradients flow to q, kv and attn_sink.
    ``backward_backend`` is ``"tilelang"`` (deterministic) or ``"cudnn"``; anything else is a ValueError.
    """
    if backward_backend not in BACKWARDS:
        raise ValueError(f"backward_backend must be one of {', '.join(map(repr, BACKWARDS))}, "
                         f"got {backward_backend!r}")
    dims = check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
    reason = _refusal(backward_backend, dims)
    if reason is not None:
        raise ValueError(f"backward_backend={backward_backend!r} cannot run this call: {reason}")
    forward_fn = _resolve(FORWARD)
    backward_fn = _resolve(BACKWARDS[backward_backend])
    out, lse = SparseMQAAttention.apply(q, kv, attn_sink, indices, topk_length, sm_scale, d_v, backward_backend,
                                        forward_fn, backward_fn)
    return (out, lse) if return_lse else out
