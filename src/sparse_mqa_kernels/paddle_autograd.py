"""The training-step entry point for Paddle: a ``paddle.autograd.PyLayer`` twin of the torch one.

``sparse_mqa_attention`` here takes and returns paddle tensors and has the same arguments, the same
``backward_backend`` switch and the same errors as ``autograd.sparse_mqa_attention``. It runs the very same
kernels: both entry points choose their backends with ``autograd.choose`` (and take backend objects in place of
names alike, which is how the CPU tests compare them). Tensors cross to torch through
DLPack without a copy, inside ``sparse_mqa_testkit.paddle.frontend.stream_scope`` (see there for the streams).
"""

from __future__ import annotations

from sparse_mqa_testkit.backends.validate import check_forward_args
from sparse_mqa_testkit.paddle.frontend import import_paddle, is_paddle_tensor, stream_scope, to_paddle, to_torch

from . import autograd

PyLayer = import_paddle().autograd.PyLayer


class SparseMQAAttention(PyLayer):
    """out = attention(q, kv, indices); gradients for q, kv and attn_sink from the backward chosen at forward."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, topk_length, sm_scale, d_v, forward_backend, backward_backend):
        with stream_scope(q):
            out, lse = forward_backend.forward(to_torch(q, "q"), to_torch(kv, "kv"), to_torch(indices, "indices"),
                                               sm_scale, d_v, attn_sink=to_torch(attn_sink, "attn_sink"),
                                               topk_length=to_torch(topk_length, "topk_length"))
            out, lse = to_paddle(out, "out"), to_paddle(lse, "lse")
        ctx.save_for_backward(q, kv, attn_sink, indices, topk_length, out, lse)
        ctx.sm_scale = sm_scale
        ctx.backward_backend = backward_backend  # the backward of this very step, whatever is loaded later
        # PyLayer.backward returns one entry per tensor argument of forward, in order, and must return None
        # for one that needs no gradient (stop_gradient): record which is which
        ctx.tensor_args = [(name, not x.stop_gradient) for name, x in
                           (("q", q), ("kv", kv), ("attn_sink", attn_sink), ("indices", indices),
                            ("topk_length", topk_length)) if is_paddle_tensor(x)]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, kv, attn_sink, indices, topk_length, out, lse = ctx.saved_tensor()
        with stream_scope(q):
            args = [to_torch(x, n) for n, x in (("q", q), ("kv", kv), ("out", out))]
            dq, dkv, d_sink = ctx.backward_backend.backward(
                *args, to_torch(grad_out, "grad_out").contiguous(), to_torch(lse, "lse"),
                to_torch(attn_sink, "attn_sink"), to_torch(indices, "indices"), ctx.sm_scale,
                topk_length=to_torch(topk_length, "topk_length"))
            if attn_sink is not None and d_sink is None:
                raise RuntimeError(f"backward backend {ctx.backward_backend.name!r} returned no d_sink although "
                                   "attn_sink was given")
            grads = {"q": to_paddle(dq, "dq"), "kv": to_paddle(dkv, "dkv"),
                     "attn_sink": to_paddle(d_sink, "d_sink") if attn_sink is not None else None}
        return tuple(grads.get(n) if wanted else None for n, wanted in ctx.tensor_args)


def sparse_mqa_attention(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None,
                         backward_backend="tilelang", return_lse=False, forward_backend=autograd.FORWARD):
    """Sparse MQA attention for training on paddle tensors: our forward, and ``backward_backend``'s backward.

    Arguments follow ``sparse_mqa_testkit.contract``. Returns ``out`` [B, S, H, Dv] (and the contract's ``lse``
    [B, S, H], not differentiable, when ``return_lse``) as paddle tensors. Gradients flow to q, kv and
    attn_sink. ``backward_backend`` and ``forward_backend`` as in ``autograd.sparse_mqa_attention``.
    """
    autograd.check_choice(backward_backend)
    for arg, x in (("q", q), ("kv", kv), ("indices", indices), ("attn_sink", attn_sink),
                   ("topk_length", topk_length)):
        if x is not None and not is_paddle_tensor(x):
            raise ValueError(f"{arg} must be a paddle.Tensor, got {type(x).__module__}.{type(x).__name__}")
    dims = check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
    fwd, bwd = autograd.choose(backward_backend, dims, attn_sink=attn_sink, topk_length=topk_length,
                               forward_backend=forward_backend)
    out, lse = SparseMQAAttention.apply(q, kv, attn_sink, indices, topk_length, sm_scale, d_v, fwd, bwd)
    return (out, lse) if return_lse else out
