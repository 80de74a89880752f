"""Guards: a kernel reads only the KV rows valid slots reference, and writes every output element.

1. KV rows no valid slot references (which include kv[b, Skv-1] and kv[b, 0], where -1 and clamped invalid
   indices would land, whenever those are unreferenced) are filled with NaN: the results must equal the
   clean run (bitwise for a deterministic backend, within tolerance otherwise).
2. Outputs fully written: no NaN/inf where the oracle has none, and no stale values: a call with other inputs
   of the same shapes, then the case again, must give what a fresh run gave.
"""

from __future__ import annotations

import math

from .. import contract
from ..backends.spec import BackendSpec
from ..compare import Expected, compare_outputs
from ..compare.bitwise import snapshot
from ..compare.model import K_DEFAULT
from .judge import same
from .result import exception_summary, result


def unreferenced_rows(expected: Expected):
    """Boolean [B, Skv] torch mask of KV rows that no valid slot of the case references, on the device its
    expected results live on."""
    x = expected.inputs
    return ~contract.referenced_rows(x["indices"], x["topk_length"], expected.case.Skv)


def other_case(case):
    """Same shapes and modes, other tensors: the earlier call whose leftovers a stale output would show."""
    return case.replace(seed=(case.seed + 1) % (2**32))


def check_guards(backend, case, *, k: float = K_DEFAULT, expected: Expected | None = None):
    """Poisoned unreferenced KV rows change nothing; every output element is written on every call."""
    check = "guards"
    spec = BackendSpec.of(backend)
    problems, per_tensor, worst, notes = [], {}, 0.0, {}
    try:
        exp = expected or Expected.for_backend(spec, case)
        unref = unreferenced_rows(exp)
    except Exception as exc:
        return result(check, spec, case, [f"building inputs raised {exception_summary(exc)}"], ratio=math.inf,
                      per_tensor={})
    notes = {"poisoned_rows": int(unref.sum()), "rows": int(unref.numel())}
    if not unref.any():
        notes["poison"] = "every KV row is referenced: nothing to poison in this case"
    for which in spec.directions:
        try:
            call = exp.call(spec.device)
            clean = snapshot(call.results(spec.backend, which))
            # 1. poisoned unreferenced rows
            if unref.any():
                kv = call["kv"].clone()
                kv[unref.to(kv.device)] = math.nan
                probs, pt, w = same("with unreferenced KV rows set to NaN",
                                    snapshot(call.replace(kv=kv).results(spec.backend, which)), clean, spec, exp, k)
                problems += [f"{which} {p}" for p in probs]
                per_tensor.update({f"poison.{n}": e for n, e in pt.items()})
                worst = max(worst, w)
            # 2a. no NaN / inf where the oracle has none (the clean run against the oracle's positions)
            pt, probs, _ = compare_outputs(clean, exp, k=math.inf, device=spec.device)
            nonfinite = [p for p in probs if "positions differ" in p or "shape" in p or "dtype" in p]
            problems += [f"{which} clean run: {p}" for p in nonfinite]
            if nonfinite:
                worst = math.inf
            # 2b. stale values: other inputs of the same shapes first, then this case again
            Expected.for_backend(spec, other_case(case)).call(spec.device).results(spec.backend, which)
            again = snapshot(call.results(spec.backend, which))
            probs, pt, w = same("after a call with other inputs of the same shapes", again, clean, spec, exp, k)
            problems += [f"{which} {p}" for p in probs]
            per_tensor.update({f"stale.{n}": e for n, e in pt.items()})
            worst = max(worst, w)
        except Exception as exc:
            problems.append(f"{which} raised {exception_summary(exc)}")
            worst = math.inf
    return result(check, spec, case, problems, ratio=worst if (problems or not spec.deterministic) else 0.0,
                  per_tensor=per_tensor, notes=notes)
