"""The training-step entry point: our forward and a chosen backward as one ``torch.autograd.Function``.

``backward_backend="tilelang"`` is our deterministic backward (bitwise reproducible steps, precision aligned with
the oracle); ``"cudnn"`` is cuDNN frontend's DSA backward (throughput, not deterministic on Hopper). Both take
the forward's ``out`` and ``lse`` as the contract defines them, so only the backward changes.

The kernels are found by their registered backend names through the testkit's registry, the door every
user's kernel comes through; ``LOADED`` keeps one backend object per name for the process (cuDNN caches its
plans on it), and is where tests put stand-ins.
"""

from __future__ import annotations

import torch
from sparse_mqa_testkit.backends import get_backend
from sparse_mqa_testkit.backends.validate import check_forward_args
from sparse_mqa_testkit.cases import Case

FORWARD = "tilelang"  # whose forward runs
BACKWARDS = ("tilelang", "cudnn")  # the backward_backend choices
LOADED: dict = {}


def backend(name: str):
    """The registered backend ``name``, loaded once per process."""
    if name not in LOADED:
        LOADED[name] = get_backend(name)
    return LOADED[name]


def check_choice(backward_backend) -> None:
    if backward_backend not in BACKWARDS:
        raise ValueError(f"backward_backend must be one of {', '.join(map(repr, BACKWARDS))}, "
                         f"got {backward_backend!r}")


def choose(backward_backend, dims, *, attn_sink, topk_length):
    """(forward backend, backward backend) for a call, or ValueError before any work: an unknown choice, or
    sizes the backward backend declares it does not support."""
    check_choice(backward_backend)
    chosen = backend(backward_backend)
    supports = getattr(chosen, "supports", None)
    if callable(supports):
        reason = supports(Case(B=dims.B, S=dims.S, Skv=dims.Skv, H=dims.H, L=dims.L, Dqk=dims.Dqk, Dv=dims.Dv,
                               sink="none" if attn_sink is None else "finite",
                               topk="none" if topk_length is None else "random"))
        if reason is not None:
            raise ValueError(f"backward_backend={backward_backend!r} cannot run this call: {reason}")
    return backend(FORWARD), chosen


class SparseMQAAttention(torch.autograd.Function):
    """out = attention(q, kv, indices); gradients for q, kv and attn_sink from the backward chosen at forward."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, topk_length, sm_scale, d_v, forward_backend, backward_backend):
        out, lse = forward_backend.forward(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink,
                                           topk_length=topk_length)
        ctx.save_for_backward(q, kv, attn_sink, indices, topk_length, out, lse)
        ctx.sm_scale = sm_scale
        ctx.backward_backend = backward_backend  # the backward of this very step, whatever LOADED holds later
        ctx.has_sink = attn_sink is not None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, kv, attn_sink, indices, topk_length, out, lse = ctx.saved_tensors
        dq, dkv, d_sink = ctx.backward_backend.backward(q, kv, out, grad_out.contiguous(), lse, attn_sink, indices,
                                                        ctx.sm_scale, topk_length=topk_length)
        if ctx.has_sink and d_sink is None:
            raise RuntimeError(f"backward backend {ctx.backward_backend.name!r} returned no d_sink although "
                               "attn_sink was given")
        return dq, dkv, (d_sink if ctx.has_sink else None), None, None, None, None, None, None


def sparse_mqa_attention(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None,
                         backward_backend="tilelang", return_lse=False):
    """Sparse MQA attention for training: our forward, and ``backward_backend``'s backward.

    Arguments follow ``sparse_mqa_testkit.contract``. Returns ``out`` [B, S, H, Dv] (and the contract's ``lse``
    [B, S, H], not differentiable, when ``return_lse``). Gradients flow to q, kv and attn_sink.
    ``backward_backend`` is ``"tilelang"`` (deterministic) or ``"cudnn"``; anything else is a ValueError.
    """
    check_choice(backward_backend)
    dims = check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
    fwd, bwd = choose(backward_backend, dims, attn_sink=attn_sink, topk_length=topk_length)
    out, lse = SparseMQAAttention.apply(q, kv, attn_sink, indices, topk_length, sm_scale, d_v, fwd, bwd)
    return (out, lse) if return_lse else out
