"""Bitwise comparison of tensors (NaN payloads included) and the one message that says where two differ."""

from __future__ import annotations

import torch

from .messages import fmt_index

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x):
    """A tensor's raw bits as an integer tensor: NaN-aware bitwise comparison (NaN payloads included)."""
    if x.dtype.is_floating_point:
        return x.detach().contiguous().view(_INT_VIEW[x.element_size()])
    return x.detach()


def bitwise_equal(a, b) -> bool:
    """Same shape, dtype and bits (NaN equals NaN with the same payload); None equals only None."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a).cpu(), bits(b).cpu())


def bits_differ(a, b):
    """Boolean tensor (CPU): where the bits of two same-shaped tensors differ."""
    return bits(a).cpu() != bits(b).cpu()


def first_difference(a, b):
    """Index of the first element whose bits differ, or None."""
    diff = bits_differ(a, b)
    if not bool(diff.any()):
        return None
    return tuple(int(i) for i in torch.nonzero(diff)[0])


def describe(v) -> str:
    return "None" if v is None else f"{tuple(v.shape)} {str(v.dtype).rsplit('.', 1)[-1]}"


def difference(got, want, *, got_label: str = "got", want_label: str = "expected") -> str:
    """Where ``got`` differs bitwise from ``want``: "differs bitwise at n / N elements, first at index (i, j):
    <got_label> x, <want_label> y", or what each is when they are not comparable (None, shape, dtype)."""
    if got is None or want is None or got.shape != want.shape or got.dtype != want.dtype:
        return f"is {describe(got)} ({got_label}), {describe(want)} ({want_label})"
    idx = first_difference(got, want)
    n = int(bits_differ(got, want).sum())
    return (f"differs bitwise at {n} / {got.numel()} elements, first at index {fmt_index(idx)}: {got_label} "
            f"{float(got[idx]):.6g}, {want_label} {float(want[idx]):.6g}")


def snapshot(outs: dict) -> dict:
    """Detached copies of named results, safe from a backend that reuses its output buffers."""
    return {k: (None if v is None else v.detach().clone()) for k, v in outs.items()}
