"""Repeats: the same inputs, called many times, give the same bits every time (a backend that claims determinism)
or stay within the tolerance model every time (one that does not).

A race that loses once in a few hundred calls passes the four calls of ``determinism``; cuDNN frontend's own suite
repeats a call 1000 times. Before each call the previous outputs are filled with NaN and so is the allocator's
free memory, in blocks sized like the declared workspace (``workspace_bytes``) and the outputs, so that every call
starts from a freshly poisoned workspace. How many calls: ``repeats`` (the suite passes the profile's count:
``harness.profiles.REPEATS``). The first call that differs ends the check and is reported with its number.
"""

from __future__ import annotations

import math

import torch

from ..backends.spec import BackendSpec
from ..compare import Expected, bitwise_equal, compare_outputs, difference
from ..compare.bitwise import snapshot
from ..compare.model import K_DEFAULT
from .determinism import poison_allocator, poison_outputs
from .execution import device_of, not_here, output_bytes
from .judge import bitwise_entry, keep_worst
from .result import exception_summary, result


def repeated(spec: BackendSpec, exp: Expected, which: str, repeats: int, k: float):
    """Call ``which`` ``repeats`` times on one set of inputs with poisoned outputs and allocator between calls:
    (problems, per_tensor, worst ratio, calls made). Runs on any device (the check itself is CUDA only)."""
    call = exp.call(spec.device)
    outs = call.results(spec.backend, which)
    base = snapshot(outs)
    sizes = [output_bytes(base), *(v.numel() * v.element_size() for v in base.values() if v is not None)]
    if spec.declares_workspace:
        sizes.append(spec.workspace_bytes(exp.case, which))
    problems, per_tensor, worst = [], {}, 0.0
    if not spec.deterministic:  # the first call is judged like every later one
        per_tensor, probs, worst = compare_outputs(base, exp, k=k, device=spec.device)
        problems += [f"{which} call 1 of {repeats}: {p}" for p in probs]
    for i in range(2, repeats + 1):
        if problems:
            return problems, per_tensor, worst, i - 1
        poison_outputs(outs)
        del outs
        poison_allocator(spec.device, sizes)
        outs = call.results(spec.backend, which)
        differ = [n for n, v in base.items() if not bitwise_equal(outs.get(n), v)]
        if not differ:
            continue
        if spec.deterministic:
            for name in differ:
                text = difference(outs.get(name), base[name], got_label=f"call {i}", want_label="call 1")
                problems.append(f"{which} {name}: call {i} of {repeats} {text} (backend claims determinism)")
            worst = math.inf
            continue
        pt, probs, w = compare_outputs(snapshot(outs), exp, k=k, device=spec.device)
        problems += [f"{which} call {i} of {repeats}: {p}" for p in probs]
        keep_worst(per_tensor, pt)
        worst = max(worst, w)
    if spec.deterministic:
        per_tensor = {n: bitwise_entry(True) for n in base}
    return problems, per_tensor, worst, repeats


REPLAY_REPEATS = 4  # what a replay runs unless told (sparse-mqa-check --repeats)


def check_repeats(backend, case, *, repeats: int = REPLAY_REPEATS, k: float = K_DEFAULT,
                  expected: Expected | None = None):
    """``repeats`` calls of the backward (and forward) on the same inputs, each after its predecessor's outputs and
    the allocator's free memory were poisoned with NaN: the same bits every time for a backend that claims
    determinism, within tolerance every time otherwise."""
    check = "repeats"
    spec = BackendSpec.of(backend)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"repeats must be an int >= 2, got {repeats!r}")
    skip = not_here(check, spec, case)
    if skip is not None:
        return skip
    problems, per_tensor, worst = [], {}, 0.0
    notes = {"repeats": repeats, "claims_deterministic": spec.deterministic,
             "poisoned": "outputs and allocator filled with NaN before every call"}
    exp = expected
    for which in spec.directions:
        try:
            exp = exp or Expected.for_backend(spec, case)
            probs, pt, w, made = repeated(spec, exp, which, repeats, k)
        except Exception as exc:
            problems.append(f"{which} raised {exception_summary(exc)}")
            worst = math.inf
            continue
        problems += probs
        per_tensor.update({f"{which}.{n}": e for n, e in pt.items()})
        worst = max(worst, w)
        notes[f"{which}_calls"] = made
    if problems and repeats != REPLAY_REPEATS:
        problems.append(f"(made with {repeats} calls: replay with --repeats {repeats})")
    torch.cuda.synchronize(device_of(spec))
    return result(check, spec, case, problems, ratio=worst if problems or not spec.deterministic else 0.0,
                  per_tensor=per_tensor, notes=notes)
