"""The training-step entry point: our forward and a chosen backward as one ``torch.autograd.Function``.

``backward_backend="tilelang"`` is our deterministic backward (bitwise reproducible steps, precision aligned with
the oracle); ``"cudnn"`` is cuDNN frontend's DSA backward (throughput, not deterministic on Hopper). Both take
the forward's ``out`` and ``lse`` as the contract defines them, so only the backward changes.

The kernels are found by their registered backend names through the testkit's registry, the door every
user's kernel comes through, and loaded once per process (cuDNN caches its plans on its backend object); a
caller may pass backend objects instead (a test's stand-ins, say).
"""

from __future__ import annotations

import functools

import torch

from sparse_mqa_testkit.backends import BackendSpec, get_backend
from sparse_mqa_testkit.backends.validate import check_forward_args
from sparse_mqa_testkit.cases import Case

FORWARD = "tilelang"  # whose forward runs by default
BACKWARDS = ("tilelang", "cudnn")  # the backward_backend names


@functools.lru_cache(maxsize=None)
def backend(name: str):
    """The registered backend ``name``, loaded once per process."""
    return get_backend(name)


def check_choice(backward_backend) -> None:
    if isinstance(backward_backend, str):
        known = backward_backend in BACKWARDS
    else:
        known = callable(getattr(backward_backend, "backward", None))
    if not known:
        raise ValueError(f"backward_backend must be one of {', '.join(map(repr, BACKWARDS))} or a backend object, "
                         f"got {backward_backend!r}")


def _resolve(choice, role: str):
    obj = backend(choice) if isinstance(choice, str) else choice
    if not callable(getattr(obj, role, None)):
        raise ValueError(f"{role}_backend {choice!r} has no {role}()")
    return obj


def choose(backward_backend, dims, *, attn_sink, topk_length, forward_backend=FORWARD):
    """(forward backend, backward backend) for a call, each a registered name or a backend object, or ValueError
    before any work: an unknown choice, or sizes the backward backend declares it does not support."""
    check_choice(backward_backend)
    chosen = _resolve(backward_backend, "backward")
    reason = BackendSpec.of(chosen).supports(
        Case(B=dims.B, S=dims.S, Skv=dims.Skv, H=dims.H, L=dims.L, Dqk=dims.Dqk, Dv=dims.Dv,
             sink="none" if attn_sink is None else "finite", topk="none" if topk_length is None else "random"))
    if reason is not None:
        raise ValueError(f"backward_backend={backward_backend!r} cannot run this call: {reason}")
    return _resolve(forward_backend, "forward"), chosen


class SparseMQAAttention(torch.autograd.Function):
    """out = attention(q, kv, indices); gradients for q, kv and attn_sink from the backward chosen at forward."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, indices, topk_length, sm_scale, d_v, forward_backend, backward_backend):
        out, lse = forward_backend.forward(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink,
                                           topk_length=topk_length)
        ctx.save_for_backward(q, kv, attn_sink, indices, topk_length, out, lse)
        ctx.sm_scale = sm_scale
        ctx.backward_backend = backward_backend  # the backward of this very step, whatever is loaded later
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
                         backward_backend="tilelang", return_lse=False, forward_backend=FORWARD):
    """Sparse MQA attention for training: ``forward_backend``'s forward (ours), ``backward_backend``'s backward.

    Arguments follow ``sparse_mqa_testkit.contract``. Returns ``out`` [B, S, H, Dv] (and the contract's ``lse``
    [B, S, H], not differentiable, when ``return_lse``). Gradients flow to q, kv and attn_sink.
    ``backward_backend`` is ``"tilelang"`` (deterministic), ``"cudnn"`` or a backend object; any other name is a
    ValueError.
    """
    check_choice(backward_backend)
    dims = check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
    fwd, bwd = choose(backward_backend, dims, attn_sink=attn_sink, topk_length=topk_length,
                      forward_backend=forward_backend)
    out, lse = SparseMQAAttention.apply(q, kv, attn_sink, indices, topk_length, sm_scale, d_v, fwd, bwd)
    return (out, lse) if return_lse else out
