"""Streams: a call does all its work on the caller's current stream, ordered after what the caller made.

Trainers overlap the backward with communication on other streams. Two situations, each compared with a plain
call (bitwise for a backend that claims determinism, within tolerance otherwise):

1. parked: the inputs are made on the ambient stream, which then sleeps (``torch.cuda._sleep``); the call runs on a
   side stream that waits for the inputs through an event, as a trainer's does. Work the backend puts on the
   default (ambient) stream instead of the current one, say a zero-fill of its accumulator (cuDNN frontend
   PR #429), runs only after the sleep, after the side stream's kernels: the results come back zero or garbage.
   The allocator's free memory is poisoned with NaN first, so a fill that lands late cannot hide behind memory
   that happened to be zero.
2. produced: the inputs are written on a side stream that sleeps first, the current stream waits for them through
   an event, and the call runs on the current stream. Work on a stream of the backend's own that does not wait for
   the current one reads the inputs before they exist (NaN and zeros) and shows.

The sleep lasts several times a plain call's host time; if it ends before the call returns, the call is retried
with a longer one, and a call that outlasts that too waits for the parked stream (a device-wide synchronization
or default-stream work it waits for): a failure.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from ..backends.spec import BackendSpec
from ..compare import Expected
from ..compare.bitwise import snapshot
from ..compare.model import K_DEFAULT
from .determinism import poison_allocator
from .execution import device_of, not_here, output_bytes
from .judge import same
from .result import exception_summary, result

MIN_PARK_MS = 20.0
PARK_PER_CALL = 4.0  # the sleep lasts this many plain calls' host time (plus MIN_PARK_MS)
LONGER = 8.0  # the retry's sleep, in units of the first
CALIBRATION_CYCLES = 1 << 22


@functools.lru_cache(maxsize=None)
def cycles_per_ms(index: int) -> float:
    """``torch.cuda._sleep`` cycles per millisecond on device ``index`` (measured once)."""
    with torch.cuda.device(index):
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        return CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)


@functools.lru_cache(maxsize=None)
def side_stream(index: int) -> torch.cuda.Stream:
    """One side stream per device for the check, so the NaN blocks it poisons stay in one stream's pool."""
    return torch.cuda.Stream(device=index)


def _park(dev, ms: float) -> None:
    """Keep the current stream of ``dev`` busy for about ``ms`` milliseconds."""
    torch.cuda._sleep(int(ms * cycles_per_ms(dev.index)))


def parked_ambient(spec: BackendSpec, call, which: str, dev, ms: float, poison: list[int]):
    """Situation 1: (results, whether the ambient stream was still asleep when the call returned)."""
    ambient = torch.cuda.current_stream(dev)
    side = side_stream(dev.index)
    with torch.cuda.stream(side):  # free blocks are per stream: NaN blocks of the call's sizes in the side's pool
        poison_allocator(dev, poison, free_blocks=False)
    ready = torch.cuda.Event()
    ready.record(ambient)  # the inputs, made on the ambient stream, are complete here
    _park(dev, ms)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        outs = call.results(spec.backend, which)
    asleep = not ambient.query()
    ambient.wait_stream(side)
    for v in outs.values():
        if v is not None:
            v.record_stream(ambient)
    got = snapshot(outs)
    torch.cuda.synchronize(dev)
    return got, asleep


def produced_on_side(spec: BackendSpec, call, which: str, dev, ms: float):
    """Situation 2: (results, whether the producing stream was still asleep when the call returned)."""
    ambient = torch.cuda.current_stream(dev)

    def unready(name, t):  # what a buffer holds before the producer writes it: NaN, or zeros for integers
        return torch.full_like(t, math.nan if t.dtype.is_floating_point else 0)

    made = call.map_tensors(unready)
    side = side_stream(dev.index)
    side.wait_stream(ambient)
    with torch.cuda.stream(side):
        _park(dev, ms)  # a slow producer (a collective, say)
        for name, t in made.tensors().items():
            t.copy_(call[name])
        ready = torch.cuda.Event()
        ready.record(side)
    ambient.wait_event(ready)
    outs = made.results(spec.backend, which)
    asleep = not side.query()
    got = snapshot(outs)
    torch.cuda.synchronize(dev)
    return got, asleep


def _host_ms(spec: BackendSpec, call, which: str, dev) -> float:
    """Host time of a warmed-up plain call, in ms (the device finishes it before this returns)."""
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    call.results(spec.backend, which)
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize(dev)
    return ms


SITUATIONS = {
    "parked": "on a side stream while the ambient stream was parked behind a sleep",
    "produced": "on the current stream with its inputs written by a sleeping side stream",
}


def check_streams(backend, case, *, k: float = K_DEFAULT, expected: Expected | None = None):
    """The backward (and forward) on a side stream beside a parked ambient stream, and on the current stream with
    inputs made on another: the results of a plain call."""
    check = "streams"
    spec = BackendSpec.of(backend)
    skip = not_here(check, spec, case)
    if skip is not None:
        return skip
    dev = device_of(spec)
    problems, per_tensor, worst, notes = [], {}, 0.0, {}
    exp = expected
    for which in spec.directions:
        try:
            exp = exp or Expected.for_backend(spec, case)
            call = exp.call(spec.device)
            plain = snapshot(call.results(spec.backend, which))  # also the warm-up
            ms = MIN_PARK_MS + PARK_PER_CALL * _host_ms(spec, call, which, dev)
            poison = [output_bytes(plain), spec.workspace_bytes(case, which)]
            for name, label in SITUATIONS.items():
                for park in (ms, ms * LONGER):
                    if name == "parked":
                        got, asleep = parked_ambient(spec, call, which, dev, park, poison)
                    else:
                        got, asleep = produced_on_side(spec, call, which, dev, park)
                    if asleep:
                        break
                notes[f"{which}.{name}"] = {"park_ms": round(park, 1), "overlapped": asleep}
                if not asleep:
                    problems.append(f"{which} {label}: the call returned only after the {park:.0f} ms sleep had "
                                    "ended (twice): it waits for the other stream (a device-wide synchronization, "
                                    "or work on the default stream that it waits for)")
                    worst = math.inf
                probs, pt, w = same(f"{which} {label}", got, plain, spec, exp, k, want_label="plain call")
                problems += probs
                per_tensor.update({f"{which}.{name}.{n}": e for n, e in pt.items()})
                worst = max(worst, w)
        except Exception as exc:
            problems.append(f"{which} raised {exception_summary(exc)}")
            worst = math.inf
    torch.cuda.synchronize(dev)
    return result(check, spec, case, problems, ratio=worst if (problems or not spec.deterministic) else 0.0,
                  per_tensor=per_tensor, notes=notes)
