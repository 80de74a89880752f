"""Guards: a kernel reads only the KV rows valid slots reference, and writes every output element.

1. KV rows no valid slot references (which include kv[b, Skv-1] and kv[b, 0], where -1 and clamped invalid
   indices would land, whenever those are unreferenced) are filled with NaN: the results must equal the
   clean run (bitwise for a deterministic backend, within tolerance otherwise).
2. Outputs fully written: no NaN/inf where the oracle has none, and no stale values: a call with other inputs
   of the same shapes, then the case again, must give what a fresh run gave.
"""

from __future__ import annotations

import math

import torch

from .. import contract
from .inputs import (OUTPUTS, backend_inputs, bits_differ, bitwise_equal, call_named, directions, first_difference,
                     reference, snapshot, truth_device)
from .result import exception_summary, fmt_index, result
from .tolerance import K_DEFAULT, compare_outputs


def unreferenced_rows(case, device=None):
    """Boolean [B, Skv] torch mask of KV rows that no valid slot of ``case`` references, on the device the
    case's reference lives on for a backend on ``device``."""
    x = reference(case, truth_device(device, case)).inputs
    idx = x["indices"]
    valid = contract.valid_mask(idx, case.Skv, x["topk_length"])
    batch = torch.arange(case.B, device=idx.device)[:, None, None] * case.Skv
    used = torch.zeros(case.B * case.Skv, dtype=torch.bool, device=idx.device)
    used[(batch + idx.long())[valid]] = True
    return ~used.reshape(case.B, case.Skv)


def other_case(case):
    """Same shapes and modes, other tensors: the earlier call whose leftovers a stale output would show."""
    return case.replace(seed=(case.seed + 1) % (2**32))


def _same(label, got: dict, ref: dict, claims: bool, case, backend, which, k, t) -> tuple[list[str], dict, float]:
    """Bitwise against ``ref`` for a deterministic backend, the tolerance model otherwise."""
    if claims:
        probs, pt = [], {}
        for name, r in ref.items():
            g = got.get(name)
            eq = bitwise_equal(g, r)
            pt[name] = {"error": 0.0 if eq else math.inf, "allowed": 0.0, "bitwise_equal": eq,
                        "ratio": 0.0 if eq else math.inf}
            if eq:
                continue
            if g is None or r is None or g.shape != r.shape:
                probs.append(f"{name}: {label}: got {None if g is None else tuple(g.shape)}, "
                             f"clean run {None if r is None else tuple(r.shape)}")
                continue
            idx = first_difference(g, r)
            n = int(bits_differ(g, r).sum())
            probs.append(f"{name}: {label}: differs from the clean run at {n} / {g.numel()} elements\n"
                         f"  first at index {fmt_index(idx)}: got {float(g[idx]):.6g}, clean run "
                         f"{float(r[idx]):.6g}")
        return probs, pt, math.inf if probs else 0.0
    pt, probs, worst = compare_outputs(OUTPUTS[which], got, case, k=k, device=getattr(backend, "device", None),
                                       sink_given=(t["attn_sink"] is not None) if which == "backward" else None)
    return [f"{label}: {p}" for p in probs], pt, worst


def check_guards(backend, case, *, k: float = K_DEFAULT):
    """Poisoned unreferenced KV rows change nothing; every output element is written on every call."""
    check = "guards"
    claims = bool(getattr(backend, "deterministic", False))
    unref = unreferenced_rows(case, getattr(backend, "device", None))
    notes = {"poisoned_rows": int(unref.sum()), "rows": int(unref.numel())}
    if not unref.any():
        notes["poison"] = "every KV row is referenced: nothing to poison in this case"
    problems, per_tensor, worst = [], {}, 0.0
    for which in directions(backend):
        try:
            t = backend_inputs(backend, case)
            clean = snapshot(call_named(backend, which, t))
            # 1. poisoned unreferenced rows
            if unref.any():
                tp = dict(t)
                kv = t["kv"].clone()
                kv[unref.to(kv.device)] = math.nan
                tp["kv"] = kv
                probs, pt, w = _same("with unreferenced KV rows set to NaN", snapshot(call_named(backend, which, tp)),
                                     clean, claims, case, backend, which, k, t)
                problems += [f"{which} {p}" for p in probs]
                per_tensor.update({f"poison.{n}": e for n, e in pt.items()})
                worst = max(worst, w)
            # 2a. no NaN / inf where the oracle has none (the clean run against the oracle's positions)
            pt, probs, _ = compare_outputs(OUTPUTS[which], clean, case, k=math.inf, device=getattr(backend, "device", None),
                                           sink_given=(t["attn_sink"] is not None) if which == "backward"
                                           else None)
            nonfinite = [p for p in probs if "positions differ" in p or "shape" in p or "dtype" in p]
            problems += [f"{which} clean run: {p}" for p in nonfinite]
            if nonfinite:
                worst = math.inf
            # 2b. stale values: other inputs of the same shapes first, then this case again
            t_other = backend_inputs(backend, other_case(case))
            call_named(backend, which, t_other)
            again = snapshot(call_named(backend, which, t))
            probs, pt, w = _same("after a call with other inputs of the same shapes", again, clean, claims, case,
                                 backend, which, k, t)
            problems += [f"{which} {p}" for p in probs]
            per_tensor.update({f"stale.{n}": e for n, e in pt.items()})
            worst = max(worst, w)
        except Exception as exc:
            problems.append(f"{which} raised {exception_summary(exc)}")
            worst = math.inf
    return result(check, backend, case, problems, ratio=worst if (problems or not claims) else 0.0,
                  per_tensor=per_tensor, notes=notes)
