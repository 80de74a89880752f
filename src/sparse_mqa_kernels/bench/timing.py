"""How ``sparse-mqa-bench`` times a call (CUDA events on a GPU, wall clock on CPU) and judges its stability."""

from __future__ import annotations

import time

import torch


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(call, n_sets: int, warmup: int, iters: int, device) -> list[float]:
    """Milliseconds of ``call(k)`` for k rotating over the input sets, after ``warmup`` untimed calls."""
    for k in range(warmup):
        call(k % n_sets)
    _sync(device)
    if str(device).startswith("cuda"):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for k, (start, end) in enumerate(events):
            start.record()
            call(k % n_sets)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for k in range(iters):
        t0 = time.perf_counter()
        call(k % n_sets)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def time_rounds(calls: dict, n_sets: int, iters: int, rounds: int, device, settle: int = 0) -> dict:
    """Milliseconds of each ``calls[name](k)`` by rounds: {name: [[ms of round 0], [ms of round 1], ...]}.

    The backends take turns, in ABBA order (round r runs them forwards when r is even, backwards when odd), each
    turn ``settle`` untimed calls and then ``iters // rounds`` timed ones (the first ``iters % rounds`` rounds one
    more); k rotates over the input sets, each backend's calls in turn. Slow drift over the run then weighs on every
    backend alike. The untimed calls matter on a GPU: a backend timed right after another is not in its own steady
    state (BENCHMARKS.md, 2026-12-03 16:15 UTC: ours 4 % slower right after cuDNN's calls, cuDNN 3 % faster right
    after ours). One round is each backend timed in one run after its warm-up.
    """
    names = list(calls)
    out = {n: [] for n in names}
    seen = dict.fromkeys(names, 0)
    for r in range(rounds):
        n = iters // rounds + (r < iters % rounds)
        for name in names if r % 2 == 0 else names[::-1]:
            f = calls[name]
            for _ in range(settle):
                f(seen[name] % n_sets)
                seen[name] += 1
            at = seen[name]
            out[name].append(time_calls(lambda k, f=f, at=at: f((at + k) % n_sets), n_sets, 0, n, device))
            seen[name] += n
    return out


def stability(call, repeats: int, names=("dq", "dkv", "d_sink")) -> tuple[bool, dict]:
    """Repeat ``call()`` and compare every output with the first by ``torch.equal``.

    Returns (all bitwise equal, {output name: max |difference| over the repeats} for those that differ).
    """
    first = [None if t is None else t.clone() for t in call()]
    drift: dict[str, float] = {}
    for _ in range(repeats - 1):
        again = call()
        for name, a, b in zip(names, first, again):
            if a is None or torch.equal(a, b):
                continue
            d = (a.float() - b.float()).abs().nan_to_num(nan=float("inf")).max().item()
            drift[name] = max(drift.get(name, 0.0), d)
    return not drift, drift
