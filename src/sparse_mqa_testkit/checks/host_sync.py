"""Host sync: a warmed-up call must not make the host wait for the device.

Trainers run with ``torch.cuda.set_sync_debug_mode("error")``: a ``.item()``, ``.cpu()``, ``.tolist()``, a
``nonzero`` or a stream synchronization inside the kernel's call stalls the pipeline, and there it is an error.
The check makes one call to warm the backend up (compilation and lazy set-up may synchronize once), then calls
again in that mode, with ``torch.cuda.synchronize()`` and ``torch.cuda.Event.synchronize()`` (which torch's mode
does not flag) made to raise too. A failure shows torch's message and the frames that made the call.

Out of its sight: a synchronization torch does not make (``cudaDeviceSynchronize`` or a blocking copy inside a
library's own code, or a sync function imported under another name before the call).
"""

from __future__ import annotations

import contextlib

import torch

from ..backends.spec import BackendSpec
from ..compare import Expected
from .execution import device_of, not_here
from .result import exception_summary, result

MODE = "error"
SYNC_WORDS = ("synchroniz",)  # torch's error reads "called a synchronizing CUDA operation"


class HostSync(RuntimeError):
    """A device-wide synchronization that torch's sync debug mode does not flag, made inside the call."""


@contextlib.contextmanager
def python_syncs_flagged():
    """``torch.cuda.synchronize()`` and ``torch.cuda.Event.synchronize()`` raise ``HostSync`` inside the block."""
    def refuse(what):
        def raiser(*args, **kwargs):
            raise HostSync(f"called {what}: the host waits for the device")
        return raiser

    module_fn, own = torch.cuda.synchronize, torch.cuda.Event.__dict__.get("synchronize")
    torch.cuda.synchronize = refuse("torch.cuda.synchronize()")
    torch.cuda.Event.synchronize = refuse("torch.cuda.Event.synchronize()")
    try:
        yield
    finally:
        torch.cuda.synchronize = module_fn
        if own is None:
            del torch.cuda.Event.synchronize
        else:
            torch.cuda.Event.synchronize = own


def is_sync_error(exc: BaseException) -> bool:
    return isinstance(exc, HostSync) or any(w in str(exc) for w in SYNC_WORDS)


def check_host_sync(backend, case, *, expected: Expected | None = None):
    """A warmed-up backward (and forward) under ``torch.cuda.set_sync_debug_mode("error")`` must not synchronize."""
    check = "host_sync"
    spec = BackendSpec.of(backend)
    skip = not_here(check, spec, case)
    if skip is not None:
        return skip
    dev = device_of(spec)
    problems = []
    notes = {"mode": f'torch.cuda.set_sync_debug_mode("{MODE}"), torch.cuda.synchronize and '
                     "Event.synchronize refused"}
    exp = expected
    for which in spec.directions:
        try:
            exp = exp or Expected.for_backend(spec, case)
            call = exp.call(spec.device)
            call.results(spec.backend, which)  # warm-up: first-call work may synchronize once
            torch.cuda.synchronize(dev)
        except Exception as exc:
            problems.append(f"{which} (warm-up call) raised {exception_summary(exc)}")
            continue
        previous = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode(MODE)
            with python_syncs_flagged():
                call.results(spec.backend, which)
        except Exception as exc:
            what = "synchronized with the host" if is_sync_error(exc) else "raised"
            problems.append(f"{which} {what} in a warmed-up call under torch.cuda.set_sync_debug_mode"
                            f"(\"{MODE}\"): {exception_summary(exc, frames=6)}")
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(dev)
    return result(check, spec, case, problems, ratio=float("inf") if problems else 0.0, per_tensor={}, notes=notes)
