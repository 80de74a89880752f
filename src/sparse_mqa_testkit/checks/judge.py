"""How a check judges results that should match a call it trusts: bitwise for a backend that claims determinism,
within the tolerance model of the case otherwise (its drift cannot be told from a bug bit by bit)."""

from __future__ import annotations

import math

from ..backends.spec import BackendSpec
from ..compare import Expected, bitwise_equal, compare_outputs, difference


def bitwise_entry(equal: bool, error: float = 0.0) -> dict:
    """A tensor's entry in ``per_tensor`` for a bitwise comparison: nothing allowed, so equal or failed."""
    return {"error": error, "allowed": 0.0, "bitwise_equal": equal, "ratio": 0.0 if equal else math.inf}


def keep_worst(per_tensor: dict, entries: dict) -> None:
    """Each tensor's entry of ``entries`` into ``per_tensor`` where its ratio is at least the one there."""
    for name, e in entries.items():
        if e.get("ratio", 0.0) >= per_tensor.get(name, {}).get("ratio", -1.0):
            per_tensor[name] = e


def same(label: str, got: dict, want: dict, spec: BackendSpec, expected: Expected, k: float, *,
         want_label: str = "clean run") -> tuple[list[str], dict, float]:
    """(problems, per_tensor, worst ratio) for results ``got``: bitwise against ``want`` (named ``want_label``) for
    a deterministic backend, against ``expected`` under the tolerance model otherwise; each problem starts with
    ``label``'s circumstances."""
    if spec.deterministic:
        probs, pt = [], {}
        for name, r in want.items():
            eq = bitwise_equal(got.get(name), r)
            pt[name] = bitwise_entry(eq, error=0.0 if eq else math.inf)
            if not eq:
                probs.append(f"{name}: {label}: {difference(got.get(name), r, want_label=want_label)}")
        return probs, pt, math.inf if probs else 0.0
    pt, probs, worst = compare_outputs(got, expected, k=k, device=spec.device)
    return [f"{label}: {p}" for p in probs], pt, worst
