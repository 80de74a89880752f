"""The training-step entry point for Paddle: a ``paddle.autograd.PyLayer`` twin of the torch one.

``sparse_mqa_attention`` here takes and returns paddle tensors and has the same arguments, the same
``backward_backend`` switch and the same errors as ``sparse_mqa_testkit.kernels.autograd.sparse_mqa_attention``.
It runs the very same kernels: the forward and the backwards are looked up at call time in the torch entry
point's tables (``kernels.autograd.FORWARD`` and ``kernels.autograd.BACKWARDS``), so there is one registry
for both frameworks and one injection point: put a callable there (e.g. the ``reference`` backend's
methods) and both entry points run it, which is how the CPU tests compare them. Tensors cross to torch
through DLPack without a copy, inside ``frontend.stream_scope`` (see there for the stream handling).
"""

from __future__ import annotations

import importlib

from ..backends.validate import check_forward_args
from ..kernels import autograd as _torch_entry
from .frontend import import_paddle, is_paddle_tensor, stream_scope, to_paddle, to_torch

PyLayer = import_paddle().autograd.PyLayer


def _resolve(spec):
    if callable(spec):
        return spec
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)


class SparseMQAAttention(PyLayer):
    """out = attention(q, kv, indices); gradients for q, kv and attn_sink from the recorded backward."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, topk_length, sm_scale, d_v, backward_backend, forward_fn,
                backward_fn):
        with stream_scope(q):
            out, lse = forward_fn(to_torch(q, "q"), to_torch(kv, "kv"), to_torch(indices, "indices"), sm_scale,
                                  d_v, attn_sink=to_torch(attn_sink, "attn_sink"),
                                  topk_length=to_torch(topk_length, "topk_length"))
            out, lse = to_paddle(out, "out"), to_paddle(lse, "lse")
        ctx.save_for_backward(q, kv, attn_sink, indices, topk_length, out, lse)
        ctx.sm_scale = sm_scale
        # what this forward ran with; backward refuses to mix in anything else
        ctx.backward_backend = backward_backend
        ctx.backward_fn = backward_fn
        # PyLayer.backward returns one entry per tensor argument of forward, in order, and must return None
        # for one that needs no gradient (stop_gradient): record which is which
        ctx.tensor_args = [(name, not x.stop_gradient) for name, x in
                           (("q", q), ("kv", kv), ("attn_sink", attn_sink), ("indices", indices),
                            ("topk_length", topk_length)) if is_paddle_tensor(x)]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        name = ctx.backward_backend
        table = _torch_entry.BACKWARDS
        if name not in table or _resolve(table[name]) is not ctx.backward_fn:
            raise RuntimeError(f"backward backend {name!r} recorded by the forward is no longer the registered "
                               f"one; forward and backward must use the same registry entry")
        q, kv, attn_sink, indices, topk_length, out, lse = ctx.saved_tensor()
        with stream_scope(q):
            args = [to_torch(x, n) for n, x in (("q", q), ("kv", kv), ("out", out))]
            dq, dkv, d_sink = ctx.backward_fn(*args, to_torch(grad_out, "grad_out").contiguous(),
                                              to_torch(lse, "lse"), to_torch(attn_sink, "attn_sink"),
                                              to_torch(indices, "indices"), ctx.sm_scale,
                                              topk_length=to_torch(topk_length, "topk_length"))
            if attn_sink is not None and d_sink is None:
                raise RuntimeError(f"backward backend {name!r} returned no d_sink although attn_sink was given")
            grads = {"q": to_paddle(dq, "dq"), "kv": to_paddle(dkv, "dkv"),
                     "attn_sink": to_paddle(d_sink, "d_sink") if attn_sink is not None else None}
        return tuple(grads.get(n) if wanted else None for n, wanted in ctx.tensor_args)


def sparse_mqa_attention(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None,
                         backward_backend="tilelang", return_lse=False):
    """Sparse MQA attention for training on paddle tensors: our forward, and ``backward_backend``'s backward.

    Arguments follow ``sparse_mqa_testkit.contract``. Returns ``out`` [B, S, H, Dv] (and the contract's ``lse``
    [B, S, H], not differentiable, when ``return_lse``) as paddle tensors. Gradients flow to q, kv and
    attn_sink. ``backward_backend`` takes the names of ``kernels.autograd.BACKWARDS`` (``"tilelang"``,
    ``"cudnn"``); anything else is a ValueError.
    """
    table = _torch_entry.BACKWARDS
    if backward_backend not in table:
        raise ValueError(f"backward_backend must be one of {', '.join(map(repr, table))}, "
                         f"got {backward_backend!r}")
    for arg, x in (("q", q), ("kv", kv), ("indices", indices), ("attn_sink", attn_sink),
                   ("topk_length", topk_length)):
        if x is not None and not is_paddle_tensor(x):
            raise ValueError(f"{arg} must be a paddle.Tensor, got {type(x).__module__}.{type(x).__name__}")
    dims = check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
    refusal = getattr(_torch_entry, "_refusal", None)  # the torch entry point's early refusal, shared
    reason = refusal(backward_backend, dims) if refusal is not None else None
    if reason is not None:
        raise ValueError(f"backward_backend={backward_backend!r} cannot run this call: {reason}")
    forward_fn = _resolve(_torch_entry.FORWARD)
    backward_fn = _resolve(table[backward_backend])
    out, lse = SparseMQAAttention.apply(q, kv, attn_sink, indices, topk_length, sm_scale, d_v, backward_backend,
                                        forward_fn, backward_fn)
    return (out, lse) if return_lse else out
