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

from .inputs import backend_inputs, bits_differ, bitwise_equal, call, clone_tensors, directions, first_difference
from .result import exception_summary, fmt_index, result

TENSOR_ARGS = ("q", "kv", "out", "grad_out", "lse", "attn_sink", "indices", "topk_length")
BACKWARD_ARGS = TENSOR_ARGS
FORWARD_ARGS = ("q", "kv", "attn_sink", "indices", "topk_length")


@dataclass(frozen=True)
class ErrorInput:
    """One bad input. ``build(valid)`` takes the valid argument dict (``backend_inputs``) and returns a new
    dict with the bad argument in place; the call must raise ``exc_type`` with a message matching ``match``."""

    name: str
    description: str
    build: Callable[[dict], dict]
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


def _with(arg: str, fn) -> Callable[[dict], dict]:
    def build(valid: dict) -> dict:
        bad = dict(valid)
        bad[arg] = fn(valid)
        return bad

    return build


def _dtype(arg: str, dtype_name: str):
    dt = getattr(torch, dtype_name)

    def make(valid):
        x = valid[arg]
        if x is None:  # optional argument absent in this case: make a valid-shaped one of the bad dtype
            x = _default(arg, valid)
        return x.to(dt)

    return make


def _default(arg: str, valid: dict):
    """A valid value for an optional argument the case leaves out."""
    q = valid["q"]
    if arg == "attn_sink":
        return torch.zeros(q.shape[2], dtype=torch.float32, device=q.device)
    if arg == "topk_length":
        return torch.full(q.shape[:2], valid["indices"].shape[-1], dtype=torch.int32, device=q.device)
    raise KeyError(arg)


def _unsqueeze(arg):
    def make(valid):
        x = valid[arg] if valid[arg] is not None else _default(arg, valid)
        return x.unsqueeze(0)

    return make


def _grow(arg: str, dim: int):
    """One more element along ``dim``: a wrong size that only this argument's check can see."""
    def make(valid):
        x = valid[arg] if valid[arg] is not None else _default(arg, valid)
        pad = list(x.shape)
        pad[dim] = 1
        return torch.cat([x, torch.zeros(pad, dtype=x.dtype, device=x.device)], dim=dim)

    return make


# the dim of each argument whose change is this argument's own mistake (not read as another's size)
_SHAPE_DIM = {"q": 3, "kv": 2, "out": 2, "grad_out": 2, "lse": 2, "attn_sink": 0, "indices": 0,
              "topk_length": 1}


def _dv_gt_dqk(valid: dict) -> dict:
    bad = dict(valid)
    q = valid["q"]
    shape = tuple(q.shape[:3]) + (q.shape[3] + 1,)
    bad["out"] = torch.zeros(shape, dtype=valid["out"].dtype, device=q.device)
    bad["grad_out"] = torch.zeros(shape, dtype=valid["grad_out"].dtype, device=q.device)
    bad["d_v"] = shape[-1]
    return bad


def _other_device(arg: str):
    def make(valid):
        x = valid[arg]
        return x.to("cpu") if x.device.type == "cuda" else x.to("cuda")

    return make


def _sm_scale(value):
    def build(valid):
        bad = dict(valid)
        bad["sm_scale"] = value
        return bad

    return build


def error_inputs(case) -> list[ErrorInput]:
    """The registry of bad inputs for ``case`` (its valid inputs are the starting point of each entry)."""
    entries: list[ErrorInput] = []
    both = ("backward", "forward")
    for arg in ("q", "kv", "out", "grad_out"):
        for dt in ("float16", "float32"):
            entries.append(ErrorInput(
                f"{arg}_{dt}", f"{arg} as {dt} (must be bfloat16)", _with(arg, _dtype(arg, dt)),
                match=_names(arg, "bfloat16", dt), argument=arg,
                applies_to=both if arg in FORWARD_ARGS else ("backward",), tags=("dtype",)))
    for arg in ("lse", "attn_sink"):
        for dt in ("bfloat16", "float64"):
            entries.append(ErrorInput(
                f"{arg}_{dt}", f"{arg} as {dt} (must be float32)", _with(arg, _dtype(arg, dt)),
                match=_names(arg, "float32", dt), argument=arg,
                applies_to=both if arg in FORWARD_ARGS else ("backward",), tags=("dtype",)))
    for arg in ("indices", "topk_length"):
        for dt in ("int64", "float32"):
            entries.append(ErrorInput(
                f"{arg}_{dt}", f"{arg} as {dt} (must be int32)", _with(arg, _dtype(arg, dt)),
                match=_names(arg, "int32", "int", dt), argument=arg, applies_to=both, tags=("dtype",)))
    for arg in TENSOR_ARGS:
        app = both if arg in FORWARD_ARGS else ("backward",)
        entries.append(ErrorInput(f"{arg}_rank", f"{arg} with one more dimension", _with(arg, _unsqueeze(arg)),
                                  match=_names(arg), argument=arg, applies_to=app, tags=("rank",)))
        d = _SHAPE_DIM[arg]
        entries.append(ErrorInput(f"{arg}_shape", f"{arg} one larger in dim {d}", _with(arg, _grow(arg, d)),
                                  match=_names(arg), argument=arg, applies_to=app, tags=("shape",)))
    entries.append(ErrorInput("dv_gt_dqk", "Dv = Dqk + 1 > Dqk (out and grad_out, or d_v for a forward)",
                              _dv_gt_dqk, match=r"(?<![A-Za-z0-9_])(d_v|Dv|out|grad_out)(?![A-Za-z0-9_])",
                              argument="out", applies_to=both, tags=("shape",)))
    for name, value in (("sm_scale_nan", math.nan), ("sm_scale_inf", math.inf)):
        entries.append(ErrorInput(name, f"sm_scale = {value}", _sm_scale(value), match=_names("sm_scale"),
                                  argument="sm_scale", applies_to=both, tags=("value",)))
    for arg in ("kv", "indices", "grad_out"):
        entries.append(ErrorInput(f"{arg}_other_device", f"{arg} on another device than q",
                                  _with(arg, _other_device(arg)), match=_names(arg), argument=arg,
                                  applies_to=both if arg in FORWARD_ARGS else ("backward",),
                                  requires_cuda=True, tags=("device",)))
    return entries


class Snapshot:
    """The caller's tensors before a call: their values and their version counters (torch bumps a tensor's
    ``_version`` on every in-place write, even one that leaves the values as they were)."""

    def __init__(self, args: dict):
        self.args = args
        self.values = clone_tensors(args)
        self.versions = {k: v._version for k, v in args.items() if isinstance(v, torch.Tensor)}

    def writes(self) -> list[str]:
        """One line per caller tensor the call wrote into: how many elements changed and the first, or that
        it was written with the values left as they were."""
        out = []
        for k, version in self.versions.items():
            now, was = self.args[k], self.values[k]
            if not bitwise_equal(now, was):
                diff = bits_differ(now, was)
                idx = first_difference(now, was)
                out.append(f"{k} ({int(diff.sum())} / {now.numel()} elements changed, first at index "
                           f"{fmt_index(idx)}: was {float(was[idx]):.6g}, now {float(now[idx]):.6g})")
            elif now._version != version:
                out.append(f"{k} (written in place: its version counter went from {version} to {now._version}, "
                           "its values are as they were)")
        return out


def _try(backend, which, args, exc_type, match) -> str | None:
    """None when the call raised as required, else what went wrong."""
    try:
        call(backend, which, args)
    except exc_type as exc:
        if match and not re.search(match, str(exc)):
            return f"raised {type(exc).__name__} but its message does not match /{match}/: {str(exc)!r}"
        return None
    except Exception as exc:
        return f"raised {exception_summary(exc, frames=2)}, expected {exc_type.__name__}"
    return f"returned a result, expected {exc_type.__name__}"


def check_rejection(backend, case):
    """Every registry entry raises as declared; out-of-domain cases are refused; inputs stay untouched."""
    check = "rejection"
    problems, per_tensor, notes = [], {}, {"skipped": [], "entries": 0}
    reason = backend.supports(case) if callable(getattr(backend, "supports", None)) else None
    whichs = directions(backend)
    try:
        # the oracle takes any sizes, so out and lse exist for an outside-domain case too
        valid = backend_inputs(backend, case)
    except Exception as exc:
        return result(check, backend, case, [f"building inputs raised {exception_summary(exc)}"],
                      ratio=math.inf, per_tensor={})
    if reason is not None:  # outside the declared domain: must be refused
        notes["outside_domain"] = reason
        for which in whichs:
            before = Snapshot(valid)
            msg = _try(backend, which, valid, ValueError, "")
            if msg:
                problems.append(f"{which} on a case outside the declared domain ({reason}) {msg} "
                                f"(check_{which}_args(..., supported_dims=self.dims) raises it)")
            problems += [f"{which} modified the caller's {w} (outside-domain call)" for w in before.writes()]
        return result(check, backend, case, problems, ratio=math.inf if problems else 0.0, per_tensor={},
                      notes=notes)
    # a valid call must not touch the caller's tensors either
    for which in whichs:
        before = Snapshot(valid)
        try:
            call(backend, which, valid)
        except Exception as exc:
            problems.append(f"valid {which} call raised {exception_summary(exc)}")
        problems += [f"valid {which} call modified the caller's {w}" for w in before.writes()]
    cuda = torch.cuda.is_available()
    crashes: dict[str, list[str]] = {}  # an unexpected exception -> the entries it was raised for (it repeats)
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
            msg = _try(backend, which, args, entry.exc_type, entry.match)
            if msg:
                label = f"{entry.name} ({which}: {entry.description})"
                if msg.startswith("raised ") and " expected " in msg:
                    crashes.setdefault(msg, []).append(label)
                else:
                    problems.append(f"{label} {msg}")
                per_tensor[entry.argument] = {"error": math.inf, "allowed": 0.0, "entry": entry.name}
            problems += [f"{entry.name} ({which}): the call modified the caller's {w}" for w in before.writes()]
    for msg, labels in crashes.items():
        if len(labels) == 1:
            problems.append(f"{labels[0]} {msg}")
        else:
            names = ", ".join(label.split(" (")[0] for label in labels[:4]) + (", ..." if len(labels) > 4 else "")
            problems.append(f"{len(labels)} bad inputs ({names}) each {msg}")
    return result(check, backend, case, problems, ratio=math.inf if problems else 0.0, per_tensor=per_tensor,
                  notes=notes)

