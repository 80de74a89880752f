"""Any backend driven with paddle tensors, and the same thing seen from torch (for the conformance checks).

``PaddleBackend(backend)`` takes paddle tensors, validates them against the contract (so a bad dtype is
named in paddle's terms: ``grad_out must be bfloat16, got float16``), hands them to the torch backend through
DLPack without a copy, and gives paddle tensors back.

``TorchFacing(paddle_backend)`` is the other direction: a backend that speaks paddle (a Paddle kernel) seen
from torch, so the checks in ``sparse_mqa_testkit.checks`` (which speak torch) run on it unchanged.

``through_paddle(backend)`` is both together: every call goes torch -> paddle -> ``PaddleBackend`` -> torch
backend -> paddle -> torch. Run the checks on ``through_paddle("reference")`` and each input and result
crosses the Paddle frontend both ways, as real ``paddle.Tensor`` objects validated by the paddle path.
"""

from __future__ import annotations

import torch

from ..backends.registry import resolve_backend
from ..backends.validate import check_backward_args, check_forward_args
from .frontend import is_paddle_tensor, stream_scope, to_paddle, to_torch

_BACKWARD_ARGS = ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices")


def _require_paddle(**tensors) -> None:
    for name, x in tensors.items():
        if x is not None and not is_paddle_tensor(x):
            raise ValueError(f"{name} must be a paddle.Tensor, got {type(x).__module__}.{type(x).__name__}")


class _Delegating:
    """name / device / deterministic / tiles / dims / supports of the wrapped backend."""

    def __init__(self, backend, label: str):
        self.inner = resolve_backend(backend)
        self.name = f"{label}[{self.inner.name}]"
        if not callable(getattr(self.inner, "forward", None)):
            self.forward = None  # the protocol's forward is optional: no forward here either

    device = property(lambda self: self.inner.device)
    deterministic = property(lambda self: bool(self.inner.deterministic))
    tiles = property(lambda self: dict(getattr(self.inner, "tiles", {}) or {}))
    dims = property(lambda self: getattr(self.inner, "dims", None))

    def supports(self, case):
        fn = getattr(self.inner, "supports", None)
        return fn(case) if callable(fn) else None

    @property
    def has_forward(self) -> bool:
        return callable(getattr(self.inner, "forward", None))

    def __repr__(self) -> str:
        return f"<backend {self.name} on {self.device}{' deterministic' if self.deterministic else ''}>"


class PaddleBackend(_Delegating):
    """A torch backend (object or registered name) behind paddle tensors: paddle in, paddle out."""

    def __init__(self, backend):
        super().__init__(backend, "paddle")

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        _require_paddle(q=q, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=attn_sink, indices=indices,
                        topk_length=topk_length)
        # the contract on the paddle tensors themselves, before any conversion or device work
        check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length,
                            supported_dims=self.dims)
        with stream_scope(q):
            t = [to_torch(x, n) for n, x in zip(_BACKWARD_ARGS, (q, kv, out, grad_out, lse, attn_sink, indices))]
            res = self.inner.backward(*t, sm_scale, topk_length=to_torch(topk_length, "topk_length"))
            return tuple(to_paddle(r, n) for n, r in zip(("dq", "dkv", "d_sink"), res))

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        _require_paddle(q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length)
        check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length,
                           supported_dims=self.dims)
        with stream_scope(q):
            out, lse = self.inner.forward(to_torch(q, "q"), to_torch(kv, "kv"), to_torch(indices, "indices"),
                                          sm_scale, d_v, attn_sink=to_torch(attn_sink, "attn_sink"),
                                          topk_length=to_torch(topk_length, "topk_length"))
            return to_paddle(out, "out"), to_paddle(lse, "lse")


def _torch_to_paddle(name, x):
    """Tensors cross to paddle; anything else (None, a number, a wrong type) goes on as is to be judged."""
    return to_paddle(x, name) if isinstance(x, torch.Tensor) else x


class TorchFacing(_Delegating):
    """A backend that speaks paddle, seen from torch: tensors cross to paddle, results cross back.

    Use it to run the conformance checks (which speak torch) on a Paddle kernel:
    ``check_backward_tolerance(TorchFacing(my_paddle_backend), case)``.
    """

    def __init__(self, paddle_backend, label: str = "torch-facing"):
        super().__init__(paddle_backend, label)

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        p = [_torch_to_paddle(n, x) for n, x in zip(_BACKWARD_ARGS, (q, kv, out, grad_out, lse, attn_sink, indices))]
        res = self.inner.backward(*p, sm_scale, topk_length=_torch_to_paddle("topk_length", topk_length))
        return tuple(to_torch(r, n) for n, r in zip(("dq", "dkv", "d_sink"), res))

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        out, lse = self.inner.forward(_torch_to_paddle("q", q), _torch_to_paddle("kv", kv),
                                      _torch_to_paddle("indices", indices), sm_scale, d_v,
                                      attn_sink=_torch_to_paddle("attn_sink", attn_sink),
                                      topk_length=_torch_to_paddle("topk_length", topk_length))
        return to_torch(out, "out"), to_torch(lse, "lse")


def through_paddle(backend="reference") -> TorchFacing:
    """A torch backend (object or registered name) seen from torch with every call routed through paddle
    tensors: ``TorchFacing(PaddleBackend(backend))``."""
    inner = resolve_backend(backend)
    facing = TorchFacing(PaddleBackend(inner))
    facing.name = f"through-paddle[{inner.name}]"
    return facing


def reference_through_paddle() -> TorchFacing:
    """Zero-argument factory for ``--backend sparse_mqa_testkit.paddle.backend:reference_through_paddle``."""
    return through_paddle("reference")
