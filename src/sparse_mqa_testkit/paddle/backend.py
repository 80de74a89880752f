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
from ..backends.spec import BackendSpec
from ..backends.validate import check_args
from ..calls import Call
from ..contract import results_of
from .frontend import is_paddle_tensor, stream_scope, to_paddle, to_torch


def _require_paddle(call: Call) -> None:
    for name, x in call.args.items():
        if x is not None and hasattr(x, "shape") and not is_paddle_tensor(x):
            raise ValueError(f"{name} must be a paddle.Tensor, got {type(x).__module__}.{type(x).__name__}")


class _Delegating:
    """name / device / deterministic / tiles / dims / supports of the wrapped backend; each call goes through the
    subclass's ``_run``."""

    def __init__(self, backend, label: str):
        self.inner = resolve_backend(backend)
        self.spec = BackendSpec.of(self.inner)
        self.name = f"{label}[{self.spec.name}]"
        if not self.spec.has_forward:
            self.forward = None  # the protocol's forward is optional: no forward here either

    device = property(lambda self: self.spec.device)
    deterministic = property(lambda self: self.spec.deterministic)
    tiles = property(lambda self: dict(self.spec.tiles))
    dims = property(lambda self: self.spec.dims)

    def supports(self, case):
        return self.spec.supports(case)

    def backward(self, *args, **kwargs):
        return self._run("backward", Call.bind("backward", *args, **kwargs))

    def forward(self, *args, **kwargs):
        return self._run("forward", Call.bind("forward", *args, **kwargs))

    def __repr__(self) -> str:
        return f"<backend {self.name} on {self.device}{' deterministic' if self.deterministic else ''}>"


class PaddleBackend(_Delegating):
    """A torch backend (object or registered name) behind paddle tensors: paddle in, paddle out."""

    def __init__(self, backend):
        super().__init__(backend, "paddle")

    def _run(self, direction: str, call: Call):
        _require_paddle(call)
        # the contract on the paddle tensors themselves, before any conversion or device work
        check_args(direction, call.args, supported_dims=self.dims)
        with stream_scope(call["q"]):
            res = call.map_tensors(lambda n, x: to_torch(x, n)).invoke(self.inner, direction)
            return tuple(to_paddle(r, n) for n, r in zip(results_of(direction), res))


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

    def _run(self, direction: str, call: Call):
        crossed = Call({n: _torch_to_paddle(n, x) for n, x in call.args.items()})
        res = crossed.invoke(self.inner, direction)
        return tuple(to_torch(r, n) for n, r in zip(results_of(direction), res))


def through_paddle(backend="reference") -> TorchFacing:
    """A torch backend (object or registered name) seen from torch with every call routed through paddle
    tensors: ``TorchFacing(PaddleBackend(backend))``."""
    inner = resolve_backend(backend)
    facing = TorchFacing(PaddleBackend(inner))
    facing.name = f"through-paddle[{BackendSpec.of(inner).name}]"
    return facing


def reference_through_paddle() -> TorchFacing:
    """Zero-argument factory for ``--backend sparse_mqa_testkit.paddle.backend:reference_through_paddle``."""
    return through_paddle("reference")
