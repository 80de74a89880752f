"""The backend protocol: what the conformance suite needs to know about a kernel and how to call it."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class MissingDependency(ImportError):
    """An optional package a backend needs is not installed here; the message names what to install.

    A backend raises it (from ``require()``, its constructor or its first call) instead of a bare ImportError,
    so that tools can tell "not installed here" from a backend module that is broken.
    """


@runtime_checkable
class Backend(Protocol):
    """A backward kernel (and optionally its forward) under test.

    Attributes
        name            registered name, used in test ids and reports
        device          "cpu" or "cuda": where its tensors live
        deterministic   it claims bitwise run-to-run stability of every output
        tiles           {"head_group": .., "query_chunk": .., "topk_block": ..} (any subset) for the strategies
        dims            the (Dqk, Dv) pairs it supports, or None for any

    ``supports(case)`` returns None for a case inside the declared domain, else a reason (e.g. "H > 128");
    for such cases the backend must raise ValueError, never answer.

    ``backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None)``
    -> ``(dq, dkv, d_sink)`` on torch tensors with the contract's shapes and dtypes (lse natural-log and
    sink-exclusive; attn_sink None gives d_sink None).

    Optional
        ``forward(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None) -> (out, lse)``
        ``require()``: raise ``MissingDependency`` when a package it needs is not installed
        ``warmup()``: compile its kernels once, before any check (called once per process)
        ``precompile(directory)``: compile every kernel variant into a cache directory, on a machine
        without a GPU too; returns a description per variant
        ``default_for = "cuda"``: run it when nothing is named on a machine with that device
        ``graph_safe = False`` with ``graph_unsafe_reason = "..."``: it cannot be captured in a CUDA graph (the
        graph check then reports SKIP with the reason; a CUDA backend is expected to be capturable otherwise)
        ``workspace_bytes(case, direction="backward") -> int``: bytes beyond its outputs one call may hold at
        once in torch's caching allocator (the allocations check allows outputs + this; 0 when absent); a
        ``workspace_bytes(case)`` without the direction bounds both
    """

    name: str
    device: str
    deterministic: bool
    tiles: dict
    dims: Any

    def supports(self, case) -> str | None: ...

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None): ...


class BackendBase:
    """Defaults for the optional parts of the protocol; subclass and set the attributes."""

    name = "unnamed"
    device = "cpu"
    deterministic = False
    tiles: dict = {}
    dims = None  # any (Dqk, Dv)

    def supports(self, case) -> str | None:
        if self.dims is not None and (case.Dqk, case.Dv) not in tuple(map(tuple, self.dims)):
            return f"(Dqk, Dv) = ({case.Dqk}, {case.Dv}) not in {tuple(map(tuple, self.dims))}"
        return None

    def __repr__(self) -> str:
        return f"<backend {self.name} on {self.device}{' deterministic' if self.deterministic else ''}>"
