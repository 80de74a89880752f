"""Allocations: a warmed-up call holds at most its outputs plus the workspace it declares.

A call that allocates beyond that fragments a trainer's caching allocator and its CUDA-graph pools. The check
reads torch's caching-allocator counters around a warmed-up call: the peak during the call minus what was held
before must not exceed the outputs (as the contract sizes them) plus ``workspace_bytes(case, direction)`` (0 when
the backend declares none); the excess is reported in bytes. Memory still held after the call beyond its
outputs (a cache that grows call after call) fails too.

It counts *requested* bytes (``requested_bytes.all``), not the allocator's blocks: a block is the request
rounded up to 512 B, and a cached block up to 1 MiB larger than asked may serve a large request unsplit, so
``allocated_bytes`` depends on what ran before (the same call measured 14.15 MB or 12.84 MB). Requested bytes are
what the call asked for, the same on every run, so no rounding allowance or allocator setting is needed.
Allocations outside torch's caching allocator (a library's own ``cudaMalloc``) are out of its sight.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch

from ..backends.spec import BackendSpec
from ..compare import Expected
from .execution import device_of, not_here, output_bytes
from .result import exception_summary, result, skipped_result

COUNTER = "requested_bytes.all"


class TorchMemory:
    """The caching allocator's requested-bytes counters on one device."""

    def __init__(self, device):
        self.device = torch.device(device)

    def _stats(self) -> dict:
        return torch.cuda.memory_stats(self.device)

    def available(self) -> bool:
        return f"{COUNTER}.peak" in self._stats()

    def current(self) -> int:
        return int(self._stats()[f"{COUNTER}.current"])

    def peak(self) -> int:
        return int(self._stats()[f"{COUNTER}.peak"])

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


@dataclass(frozen=True)
class Held:
    """Bytes around one call: held before it, at its peak, after it, and its outputs."""

    before: int
    peak: int
    after: int
    outputs: int

    @property
    def extra(self) -> int:
        """Bytes at the peak beyond what was held before and the outputs: the call's workspace."""
        return self.peak - self.before - self.outputs

    @property
    def retained(self) -> int:
        """Bytes still held after the call beyond the outputs."""
        return self.after - self.before - self.outputs


def held_by(call, memory) -> tuple[Held, dict]:
    """Run ``call()`` (returns results by name) between the counters of ``memory``: (Held, the results)."""
    before = memory.current()
    memory.reset_peak()
    outs = call()
    peak, after = memory.peak(), memory.current()
    if after - before > output_bytes(outs):  # a reference cycle may hold temporaries until collected
        gc.collect()
        after = memory.current()
    return Held(before=before, peak=peak, after=after, outputs=output_bytes(outs)), outs


def judge(which: str, held: Held, declared: int) -> tuple[list[str], dict]:
    """(problems, per_tensor entry) of one call: its workspace against what it declares, and what it kept."""
    problems = []
    if held.extra > declared:
        problems.append(f"{which}: held {held.extra:,} bytes beyond its outputs ({held.outputs:,} B) at its peak, "
                        f"declares {declared:,} B of workspace (workspace_bytes): {held.extra - declared:,} bytes "
                        "over")
    if held.retained > 0:
        problems.append(f"{which}: still holds {held.retained:,} bytes beyond its outputs after returning (memory "
                        "the warm-up call did not keep: it grows call after call)")
    ratio = held.extra / declared if declared else (math.inf if held.extra > 0 else 0.0)
    entry = {"error": float(max(held.extra, 0)), "allowed": float(declared), "ratio": ratio,
             "before": held.before, "peak": held.peak, "after": held.after, "outputs": held.outputs}
    return problems, entry


def check_allocations(backend, case, *, expected: Expected | None = None, memory=None):
    """A warmed-up backward (and forward) holds at most its outputs plus its declared workspace, and keeps
    nothing beyond its outputs. ``memory``: the counters (default: torch's caching allocator on its device)."""
    check = "allocations"
    spec = BackendSpec.of(backend)
    skip = not_here(check, spec, case)
    if skip is not None:
        return skip
    dev = device_of(spec)
    memory = memory or TorchMemory(dev)
    if not memory.available():
        return skipped_result(check, spec, case, f"torch {torch.__version__} does not report {COUNTER}")
    problems, per_tensor, worst = [], {}, 0.0
    notes = {"counter": COUNTER}
    exp = expected
    for which in spec.directions:
        try:
            exp = exp or Expected.for_backend(spec, case)
            call = exp.call(spec.device)
            declared = spec.workspace_bytes(case, which)
            warm = call.results(spec.backend, which)  # compiles, loads, makes lazily created handles
            del warm
            torch.cuda.synchronize(dev)
            held, outs = held_by(lambda: call.results(spec.backend, which), memory)
            del outs
        except Exception as exc:
            problems.append(f"{which} raised {exception_summary(exc)}")
            worst = math.inf
            continue
        probs, entry = judge(which, held, declared)
        problems += probs
        per_tensor[f"{which}.workspace"] = entry
        worst = max(worst, entry["ratio"], math.inf if held.retained > 0 else 0.0)
        notes[which] = {"workspace_bytes": held.extra, "declared": declared, "retained": held.retained}
    torch.cuda.synchronize(dev)
    return result(check, spec, case, problems, ratio=worst, per_tensor=per_tensor, notes=notes)
