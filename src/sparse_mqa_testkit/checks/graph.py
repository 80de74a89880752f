"""Graph: the backward (and forward) captured in a CUDA graph gives, on replay, what an eager call gives, also
after every captured input was overwritten in place with other values.

Trainers capture the backward in ``torch.cuda.CUDAGraph`` and replay it with new data in the same buffers. A value
read on the host at capture time (``topk_length.max().item()``, a plan chosen from the data) is baked into the
graph and is wrong on the next batch. The check warms the backend up on a side stream, captures one call on case
A, fills the captured outputs with NaN and replays; then copies a second case B into every captured input in
place (same shapes, sm_scale and optional inputs; new q, kv, out, grad_out, lse, attn_sink, indices and
topk_length, with rows that had valid slots going empty and, where A has empty rows, some filling up) and replays
again. Each replay is compared with an eager call on its inputs: bitwise for a backend that claims determinism,
within tolerance otherwise. A capture or replay that raises fails with the error; a backend that cannot be
captured declares ``graph_safe = False`` with ``graph_unsafe_reason`` and the check is skipped with that reason.
"""

from __future__ import annotations

import math

import torch

from .. import contract
from ..backends.spec import BackendSpec
from ..compare import Expected
from ..compare.bitwise import snapshot
from ..compare.model import K_DEFAULT
from .determinism import poison_outputs
from .execution import cuda_only, device_of, not_here
from .judge import same
from .result import exception_summary, result

WARMUP_CALLS = 2  # on a side stream before capture, as torch's CUDA-graph notes advise
SECOND_CASE_TRIES = 32


def unavailable(spec: BackendSpec) -> str | None:
    """Why the graph check does not apply: a CPU backend, or one that declares it cannot be captured."""
    reason = cuda_only(spec)
    if reason is None and not spec.graph_safe:
        reason = (f"backend {spec.name!r} declares graph_safe = False: "
                  f"{spec.graph_unsafe_reason or 'no reason given (graph_unsafe_reason)'}")
    return reason


def _rows_with_slots(exp: Expected):
    """[B, S] bool: the query rows of a case that have at least one valid slot."""
    x = exp.inputs
    return contract.valid_mask(x["indices"], exp.case.Skv, x["topk_length"]).any(-1)


def second_case(first: Expected) -> tuple[Expected, dict]:
    """Case B for case A (``first``): same shapes, sm_scale and optional inputs, every value new, some rows
    emptied (always row (0, 0), by the ``empty_rows`` mode) and, where A has empty rows, some filled; among a few
    seeds the first that does both. Returns B's Expected on A's device and the counts."""
    case, rows_a = first.case, _rows_with_slots(first)
    best = None
    for k in range(1, SECOND_CASE_TRIES + 1):
        exp = Expected(case.replace(seed=(case.seed + k) % 2**32, invalid="empty_rows"), first.device)
        rows_b = _rows_with_slots(exp)
        emptied, filled = int((rows_a & ~rows_b).sum()), int((~rows_a & rows_b).sum())
        score = (emptied > 0) + (filled > 0)
        if best is None or score > best[0]:
            best = (score, exp, {"rows_emptied": emptied, "rows_filled": filled})
        if emptied > 0 and (filled > 0 or bool(rows_a.all())):
            break
    return best[1], best[2]


def _root_error(exc: BaseException) -> str:
    """The first error of a chain (a failed capture raises again when it ends) and the last, summarised."""
    first = exc
    while first.__context__ is not None and first.__context__ is not first:
        first = first.__context__
    text = exception_summary(first)
    last = (str(exc).splitlines() or [""])[0]
    return text if first is exc else f"{text}\n  then: {type(exc).__name__}: {last}"


def _settle(dev) -> None:
    """Wait for the device after a failed capture; an error it reports now belongs to that failure."""
    try:
        torch.cuda.synchronize(dev)
    except Exception:
        pass


def captured(spec: BackendSpec, call_a, call_b, which: str, dev) -> tuple[dict, dict]:
    """Capture ``which`` on ``call_a``'s tensors, replay; overwrite them with ``call_b``'s in place, replay again:
    the results of both replays."""
    ambient = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(ambient)
    with torch.cuda.stream(side):
        for _ in range(WARMUP_CALLS):
            call_a.results(spec.backend, which)
    ambient.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        try:
            with torch.cuda.graph(graph):
                static = call_a.results(spec.backend, which)
        finally:
            torch.cuda.set_stream(ambient)  # a capture that fails to end leaves its own stream current
        poison_outputs(static)  # nothing ran during capture: the replay must write every element
        graph.replay()
        first = snapshot(static)
        for name, t in call_a.tensors().items():
            t.copy_(call_b[name])
        poison_outputs(static)
        graph.replay()
        second = snapshot(static)
        torch.cuda.synchronize(dev)
    finally:
        del graph
    return first, second


def check_graph(backend, case, *, k: float = K_DEFAULT, expected: Expected | None = None):
    """Capture the backward (and forward) in a CUDA graph; replay on the case, then on a second case copied into
    the captured inputs in place: each replay equals an eager call on its inputs."""
    check = "graph"
    spec = BackendSpec.of(backend)
    skip = not_here(check, spec, case, unavailable(spec))
    if skip is not None:
        return skip
    dev = device_of(spec)
    problems, per_tensor, worst, notes = [], {}, 0.0, {}
    exp_a, exp_b = expected, None
    for which in spec.directions:
        try:
            exp_a = exp_a or Expected.for_backend(spec, case)
            if exp_b is None:
                exp_b, counts = second_case(exp_a)
                notes.update(second_case=exp_b.case.repro(), **counts)
            call_a, call_b = exp_a.call(spec.device), exp_b.call(spec.device)
            eager_a = snapshot(call_a.results(spec.backend, which))  # also the first warm-up
            eager_b = snapshot(call_b.results(spec.backend, which))
        except Exception as exc:
            problems.append(f"{which} (eager calls) raised {exception_summary(exc)}")
            worst = math.inf
            continue
        try:
            first, second = captured(spec, call_a, call_b, which, dev)
        except Exception as exc:
            problems.append(f"{which}: capturing or replaying it in a CUDA graph raised {_root_error(exc)}")
            worst = math.inf
            _settle(dev)
            continue
        overwritten = (f"graph replay after the captured inputs were overwritten in place with "
                       f"{exp_b.case.repro()} ({counts['rows_emptied']} rows emptied, {counts['rows_filled']} filled)")
        for tag, label, got, want, exp in (("replay", "graph replay on the captured case", first, eager_a, exp_a),
                                           ("overwritten", overwritten, second, eager_b, exp_b)):
            probs, pt, w = same(f"{which} {label}", got, want, spec, exp, k, want_label="eager call")
            problems += probs
            per_tensor.update({f"{which}.{tag}.{n}": e for n, e in pt.items()})
            worst = max(worst, w)
    return result(check, spec, case, problems, ratio=worst if (problems or not spec.deterministic) else 0.0,
                  per_tensor=per_tensor, notes=notes)
