"""Rejection: a declarative registry of bad inputs (in the manner of PyTorch OpInfo ``error_inputs``), each
with the exception a backend must raise and a regex its message must match, naming the argument.

The caller's tensors must be unchanged after any call, rejected or not; a case outside the backend's declared
domain (``backend.supports(case)`` gives a reason) must be refused, never answered.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import contract
from ..backends.spec import BackendSpec
from ..calls import Call
from ..compare import Expected, bitwise_equal, difference
from .result import exception_summary, result


@dataclass(frozen=True)
class ErrorInput:
    """One bad input. ``build(valid)`` takes the valid ``Call`` and returns a new one with the bad argument in
    place; the call must raise ``exc_type`` with a message matching ``match``."""

    name: str
    description: str
    build: Callable[[Call], Call]
    exc_type: type = ValueError
    match: str = ""
    argument: str = ""
    applies_to: tuple = ("backward",)
    requires_cuda: bool = False
    tags: tuple = field(default=())


def _names(arg: str, *also: str) -> str:
    """Regex: the message names the argument (as a whole word) and, when given, one of ``also``."""
    word = rf"(?<![A-Za-z0-9_]){re.escape(arg)}(?![A-Za-z0-9_])"
    if not also:
        return word
    alt = "|".join(re.escape(a) for a in also)
    return rf"(?s)(?=.*{word}).*(?:{alt})"


def _present(valid: Call, arg: str):
    """The argument's tensor, or a valid stand-in (``Argument.fill``) for an optional one the case leaves out."""
    x = valid[arg] if arg in valid else None
    if x is not None:
        return x
    a = contract.argument(arg)
    dims = valid.dims
    fill = getattr(dims, a.fill) if isinstance(a.fill, str) else a.fill
    return torch.full(dims.shape(arg), fill, dtype=getattr(torch, a.dtype), device=valid["q"].device)


def _with(arg: str, fn) -> Callable[[Call], Call]:
    def build(valid: Call) -> Call:
        return valid.replace(**{arg: fn(_present(valid, arg))})

    return build


def _grow(dim: int):
    """One more element along ``dim``: a wrong size that only this argument's check can see."""
    def make(x):
        pad = list(x.shape)
        pad[dim] = 1
        return torch.cat([x, torch.zeros(pad, dtype=x.dtype, device=x.device)], dim=dim)

    return make


def _dv_gt_dqk(valid: Call) -> Call:
    q = valid["q"]
    shape = tuple(q.shape[:3]) + (q.shape[3] + 1,)
    return valid.replace(out=torch.zeros(shape, dtype=valid["out"].dtype, device=q.device),
                         grad_out=torch.zeros(shape, dtype=valid["grad_out"].dtype, device=q.device), d_v=shape[-1])


def _other_device(x):
    return x.to("cpu") if x.device.type == "cuda" else x.to("cuda")


def error_inputs(case) -> list[ErrorInput]:
    """The registry of bad inputs (its valid inputs are the starting point of each entry), derived from the
    contract's argument table: each tensor argument in its bad dtypes, with one more dimension, one larger in its
    own dim, on another device where declared; then what no table column says (Dv > Dqk, a non-finite sm_scale)."""
    entries: list[ErrorInput] = []
    tensors = [a for a in contract.ARGUMENTS if a.is_tensor and a.takes]
    for a in tensors:
        app = tuple(d for d in ("backward", "forward") if a.position(d) is not None)
        want = "int" if a.dtype.startswith("int") else None
        for dt in a.bad_dtypes:
            also = (a.dtype, want, dt) if want else (a.dtype, dt)
            entries.append(ErrorInput(
                f"{a.name}_{dt}", f"{a.name} as {dt} (must be {a.dtype})",
                _with(a.name, lambda x, dt=dt: x.to(getattr(torch, dt))), match=_names(a.name, *also),
                argument=a.name, applies_to=app, tags=("dtype",)))
    for a in tensors:
        app = tuple(d for d in ("backward", "forward") if a.position(d) is not None)
        entries.append(ErrorInput(f"{a.name}_rank", f"{a.name} with one more dimension",
                                  _with(a.name, lambda x: x.unsqueeze(0)), match=_names(a.name), argument=a.name,
                                  applies_to=app, tags=("rank",)))
        entries.append(ErrorInput(f"{a.name}_shape", f"{a.name} one larger in dim {a.own_dim}",
                                  _with(a.name, _grow(a.own_dim)), match=_names(a.name), argument=a.name,
                                  applies_to=app, tags=("shape",)))
    entries.append(ErrorInput("dv_gt_dqk", "Dv = Dqk + 1 > Dqk (out and grad_out, or d_v for a forward)",
                              _dv_gt_dqk, match=r"(?<![A-Za-z0-9_])(d_v|Dv|out|grad_out)(?![A-Za-z0-9_])",
                              argument="out", applies_to=contract.BOTH, tags=("shape",)))
    for name, value in (("sm_scale_nan", math.nan), ("sm_scale_inf", math.inf)):
        entries.append(ErrorInput(name, f"sm_scale = {value}", lambda v, value=value: v.replace(sm_scale=value),
                                  match=_names("sm_scale"), argument="sm_scale", applies_to=contract.BOTH,
                                  tags=("value",)))
    for a in tensors:
        if a.other_device:
            app = tuple(d for d in ("backward", "forward") if a.position(d) is not None)
            entries.append(ErrorInput(f"{a.name}_other_device", f"{a.name} on another device than q",
                                      _with(a.name, _other_device), match=_names(a.name), argument=a.name,
                                      applies_to=app, requires_cuda=True, tags=("device",)))
    return entries


class Snapshot:
    """The caller's tensors before a call: their values and their version counters (torch bumps a tensor's
    ``_version`` on every in-place write, even one that leaves the values as they were)."""

    def __init__(self, call: Call):
        self.args = call.tensors()
        self.values = {k: v.clone() for k, v in self.args.items()}
        self.versions = {k: v._version for k, v in self.args.items() if isinstance(v, torch.Tensor)}

    def writes(self) -> list[str]:
        """One line per caller tensor the call wrote into: where its values changed, or that it was written
        with the values left as they were."""
        out = []
        for k, version in self.versions.items():
            now, was = self.args[k], self.values[k]
            if not bitwise_equal(now, was):
                out.append(f"{k} ({difference(now, was, got_label='now', want_label='was')})")
            elif now._version != version:
                out.append(f"{k} (written in place: its version counter went from {version} to {now._version}, "
                           "its values are as they were)")
        return out


def _try(spec: BackendSpec, which, call: Call, exc_type, match) -> str | None:
    """None when the call raised as required, else what went wrong."""
    try:
        call.invoke(spec.backend, which)
    except exc_type as exc:
        if match and not re.search(match, str(exc)):
            return f"raised {type(exc).__name__} but its message does not match /{match}/: {str(exc)!r}"
        return None
    except Exception as exc:
        return f"raised {exception_summary(exc, frames=2)}, expected {exc_type.__name__}"
    return f"returned a result, expected {exc_type.__name__}"


def check_rejection(backend, case, *, expected: Expected | None = None):
    """Every registry entry raises as declared; out-of-domain cases are refused; inputs stay untouched."""
    check = "rejection"
    spec = BackendSpec.of(backend)
    problems, per_tensor, notes = [], {}, {"skipped": [], "entries": 0}
    reason = spec.supports(case)
    whichs = spec.directions
    try:
        # the oracle takes any sizes, so out and lse exist for an outside-domain case too
        valid = (expected or Expected.for_backend(spec, case)).call(spec.device)
    except Exception as exc:
        return result(check, spec, case, [f"building inputs raised {exception_summary(exc)}"],
                      ratio=math.inf, per_tensor={})
    if reason is not None:  # outside the declared domain: must be refused
        notes["outside_domain"] = reason
        for which in whichs:
            before = Snapshot(valid)
            msg = _try(spec, which, valid, ValueError, "")
            if msg:
                problems.append(f"{which} on a case outside the declared domain ({reason}) {msg} "
                                f"(check_{which}_args(..., supported_dims=self.dims) raises it)")
            problems += [f"{which} modified the caller's {w} (outside-domain call)" for w in before.writes()]
        return result(check, spec, case, problems, ratio=math.inf if problems else 0.0, per_tensor={},
                      notes=notes)
    # a valid call must not touch the caller's tensors either
    for which in whichs:
        before = Snapshot(valid)
        try:
            valid.invoke(spec.backend, which)
        except Exception as exc:
            problems.append(f"valid {which} call raised {exception_summary(exc)}")
        problems += [f"valid {which} call modified the caller's {w}" for w in before.writes()]
    cuda = torch.cuda.is_available()
    crashes: dict[str, list[str]] = {}  # an unexpected exception -> the entries it was raised for (it repeats)
    writes: dict[tuple, list[tuple[str, str]]] = {}  # (direction, tensor) -> (entry, what changed) per write
    for entry in error_inputs(case):
        for which in whichs:
            if which not in entry.applies_to:
                continue
            if entry.requires_cuda and not cuda:
                notes["skipped"].append(f"{entry.name} ({which}): needs CUDA")
                continue
            args = entry.build(valid)
            before = Snapshot(args)
            notes["entries"] += 1
            msg = _try(spec, which, args, entry.exc_type, entry.match)
            if msg:
                label = f"{entry.name} ({which}: {entry.description})"
                if msg.startswith("raised ") and " expected " in msg:
                    crashes.setdefault(msg, []).append(label)
                else:
                    problems.append(f"{label} {msg}")
                per_tensor[entry.argument] = {"error": math.inf, "allowed": 0.0, "entry": entry.name}
            for w in before.writes():
                writes.setdefault((which, w.split(" (")[0]), []).append((entry.name, w))
    for msg, labels in crashes.items():
        if len(labels) == 1:
            problems.append(f"{labels[0]} {msg}")
        else:
            names = ", ".join(label.split(" (")[0] for label in labels[:4]) + (", ..." if len(labels) > 4 else "")
            problems.append(f"{len(labels)} bad inputs ({names}) each {msg}")
    for (which, tensor), seen in writes.items():  # a write before validation repeats for every bad input
        if len(seen) == 1:
            problems.append(f"{seen[0][0]} ({which}): the call modified the caller's {seen[0][1]}")
        else:
            names = ", ".join(n for n, _ in seen[:4]) + (", ..." if len(seen) > 4 else "")
            problems.append(f"{len(seen)} bad-input {which} calls ({names}) each modified the caller's {tensor}; "
                            f"the first: {seen[0][1]}")
    return result(check, spec, case, problems, ratio=math.inf if problems else 0.0, per_tensor=per_tensor,
                  notes=notes)

