"""Determinism: repeated calls give the same bits, also when the environment is hostile.

Between calls the previous outputs and the allocator's free memory are filled with NaN (so a kernel that
reads an uninitialised or stale buffer shows it); on a GPU one call runs on a non-default stream and one
while an unrelated kernel runs on another stream. A backend that does not claim determinism has its
run-to-run drift measured and reported, and every run must stay inside the tolerance model.
"""

from __future__ import annotations

import math

import torch

from ..backends.spec import BackendSpec
from ..compare import Expected, bitwise_equal, compare_outputs, difference
from ..compare.bitwise import snapshot
from ..compare.model import K_DEFAULT
from .judge import bitwise_entry, keep_worst
from .result import exception_summary, result

POISON_BYTES = 256 << 20  # per block; a poisoning round fills at most 4x this


def _cuda_ok(spec: BackendSpec) -> bool:
    return spec.is_cuda and torch.cuda.is_available()


def _cached_free_blocks(dev) -> list[int]:
    """Sizes of the CUDA caching allocator's free (inactive) blocks on ``dev``, largest first."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    sizes = []
    try:
        for seg in torch.cuda.memory_snapshot():
            if seg.get("device", index) != index:
                continue
            sizes += [int(b["size"]) for b in seg.get("blocks", []) if b.get("state") == "inactive"]
    except Exception:  # older torch: fall back to the total the stats report
        stats = torch.cuda.memory_stats(dev)
        sizes = [stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)]
    return sorted(sizes, reverse=True)


def poison_allocator(device, sizes_bytes, *, free_blocks: bool = True) -> None:
    """Fill freed memory with NaN: allocate NaN blocks of the given sizes (on CUDA, with ``free_blocks``, also one
    per free cached block, largest first, so best-fit hands each block out), then free them all. The blocks go to
    the current stream's pool, which only that stream's allocations draw from.

    The caching allocator hands freed blocks out again without clearing them (``empty_cache`` only returns
    whole unused segments to the driver), so the kernel's next allocations start full of NaN.
    """
    dev = torch.device(device)
    sizes = [int(s) for s in sizes_bytes if s]
    if dev.type == "cuda" and free_blocks:
        sizes = _cached_free_blocks(dev) + sizes
    held, total = [], 0
    for s in sizes:
        n = max(1, min(s, POISON_BYTES) // 4)
        if total + 4 * n > 4 * POISON_BYTES:
            break
        held.append(torch.full((n,), math.nan, dtype=torch.float32, device=dev))
        total += 4 * n
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    del held


def poison_outputs(outs: dict) -> None:
    for v in outs.values():
        if v is not None and v.dtype.is_floating_point:
            with torch.no_grad():
                v.fill_(math.nan)


def _busy_kernel(device):
    """Start unrelated work on a side stream; returns the stream (GPU only)."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # allocated on the side stream, so its blocks stay tied to that stream
        a = torch.randn(2048, 2048, device=device)
        for _ in range(8):
            a = a @ a
            a = a / a.norm()
    return side


def _call(spec: BackendSpec, call, which, mode: str):
    """One call in a given environment: "plain", "side_stream" or "concurrent"."""
    if mode == "plain":
        return call.results(spec.backend, which)
    dev = torch.device(spec.device)
    if mode == "side_stream":
        s = torch.cuda.Stream(device=dev)
        s.wait_stream(torch.cuda.current_stream(dev))  # inputs were made on the default stream
        with torch.cuda.stream(s):
            outs = call.results(spec.backend, which)
        torch.cuda.current_stream(dev).wait_stream(s)
        for v in outs.values():
            if v is not None:
                v.record_stream(torch.cuda.current_stream(dev))
        torch.cuda.synchronize(dev)
        return outs
    if mode == "concurrent":
        side = _busy_kernel(dev)
        outs = call.results(spec.backend, which)
        side.synchronize()
        torch.cuda.synchronize(dev)
        return outs
    raise ValueError(f"unknown mode {mode!r}")


def _modes(spec: BackendSpec, repeats: int, hostile: bool) -> tuple[list[str], list[str]]:
    """Environment of each repeat after the first, and what was skipped."""
    skipped = []
    cycle = ["plain"]
    if hostile:
        if _cuda_ok(spec):
            cycle = ["plain", "side_stream", "concurrent"]
        else:
            skipped = ["non-default stream", "concurrent kernel on another stream"]
    return [cycle[i % len(cycle)] for i in range(max(repeats - 1, 0))], skipped


def _rel_l2(a, b) -> float:
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    fin = torch.isfinite(a64) & torch.isfinite(b64)
    den = float(torch.linalg.vector_norm(torch.where(fin, b64, 0.0)))
    num = float(torch.linalg.vector_norm(torch.where(fin, a64 - b64, 0.0)))
    if bool((torch.isfinite(a64) != torch.isfinite(b64)).any()):
        return math.inf
    return num / den if den > 0 else num


def check_determinism(backend, case, *, repeats: int = 4, hostile: bool = True, k: float = K_DEFAULT,
                      expected: Expected | None = None):
    """Run backward (and forward when present) ``repeats`` times; a claimed-deterministic backend must give
    the same bits every time; another must stay inside the tolerance on every run (drift in ``notes``)."""
    check = "determinism"
    spec = BackendSpec.of(backend)
    claims = spec.deterministic
    modes, skipped = _modes(spec, repeats, hostile)
    notes = {"claims_deterministic": claims, "repeats": repeats, "environments": ["plain"] + modes}
    if hostile:
        notes["poisoned"] = "outputs and allocator filled with NaN between calls"
    if skipped:
        notes["skipped"] = [f"{s} (needs a CUDA backend and GPU)" for s in skipped]
    problems, per_tensor, worst, drift = [], {}, 0.0, {}
    exp = expected
    for which in spec.directions:
        try:
            exp = exp or Expected.for_backend(spec, case)
            call = exp.call(spec.device)
            first = call.results(spec.backend, which)
            base = snapshot(first)
            runs = []
            for mode in modes:
                if hostile:
                    sizes = [v.numel() * v.element_size() for v in base.values() if v is not None]
                    sizes += [v.numel() * v.element_size() for v in call.tensors().values()]
                    poison_outputs(first)
                    poison_allocator(spec.device, sizes)
                first = _call(spec, call, which, mode)
                runs.append((mode, snapshot(first)))
        except Exception as exc:
            problems.append(f"{which} raised {exception_summary(exc)}")
            worst = math.inf
            continue
        for name, b0 in base.items():
            reported, equal = False, True
            for i, (mode, r) in enumerate(runs, start=2):
                v = r[name]
                same = bitwise_equal(v, b0)
                equal &= same
                if v is not None and b0 is not None and v.shape == b0.shape:
                    drift[name] = max(drift.get(name, 0.0), 0.0 if same else _rel_l2(v, b0))
                if not claims or same or reported:
                    continue
                reported = True  # the first differing call tells the story
                worst = math.inf
                text = difference(v, b0, got_label=f"call {i}", want_label="call 1")
                if v is not None and b0 is not None and v.shape == b0.shape and v.dtype == b0.dtype:
                    text += f"; relative L2 drift {_rel_l2(v, b0):.3e}"
                problems.append(f"{name}: call {i} ({mode}) {text} (backend claims determinism)")
            if claims:
                per_tensor[name] = bitwise_entry(equal, error=drift.get(name, 0.0))
        if not claims:  # every run must pass the tolerance model
            for i, outs in enumerate([base] + [r for _, r in runs], start=1):
                pt, probs, w = compare_outputs(outs, exp, k=k, device=spec.device)
                keep_worst(per_tensor, pt)
                worst = max(worst, w)
                problems += [f"run {i}: {p}" for p in probs]
    notes["drift"] = drift  # max relative L2 between call 1 and any later call, per tensor
    return result(check, spec, case, problems, ratio=worst if problems or not claims else 0.0,
                  per_tensor=per_tensor, notes=notes)
