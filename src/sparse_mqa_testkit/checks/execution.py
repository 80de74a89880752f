"""What the execution checks share (``graph``, ``streams``, ``host_sync``, ``allocations``, ``repeats``): they
judge how a call runs on a CUDA device (capture, streams, host round trips, memory, many repeats), not only the
values it returns, so a backend on the CPU is outside their scope: "CUDA only", a skip, never a pass."""

from __future__ import annotations

import torch

from ..backends.spec import BackendSpec
from .result import skipped_result

CUDA_ONLY = "CUDA only"


def cuda_only(spec: BackendSpec) -> str | None:
    """None for a CUDA backend, else why an execution check does not apply (``Check.applies_to`` reads it)."""
    return None if spec.is_cuda else f"{CUDA_ONLY}: backend {spec.name!r} runs on {spec.device}"


def not_here(check: str, spec: BackendSpec, case, reason: str | None = None):
    """The skip result when the check cannot run: ``reason`` (a declaration), a CPU backend, or no GPU here;
    None when it can."""
    reason = reason or cuda_only(spec)
    if reason is None and not torch.cuda.is_available():
        reason = f"{CUDA_ONLY}: torch.cuda.is_available() is False on this machine"
    return None if reason is None else skipped_result(check, spec, case, reason)


def device_of(spec: BackendSpec) -> torch.device:
    """The backend's device with its index (the current device when it names none)."""
    dev = torch.device(spec.device)
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def output_bytes(outs: dict) -> int:
    """The bytes of a call's results as the contract sizes them (a view into a larger buffer counts its view)."""
    return sum(v.numel() * v.element_size() for v in outs.values() if v is not None)
