"""A backend read once: what every layer of the suite needs to know about it, with the protocol's defaults
filled in, so that no layer probes the backend itself."""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackendSpec:
    """The declarations of one backend object (``Backend`` protocol), normalized.

    dims: tuple of (Dqk, Dv) pairs, or None for any. tiles: a dict (empty when none is declared).
    compile_keys: as declared (``cases.compile_keys.resolve`` turns them into keys). graph_safe: it can be
    captured in a CUDA graph (True unless it declares ``graph_safe = False``, with ``graph_unsafe_reason``).
    """

    backend: object = field(repr=False)
    name: str
    device: str
    deterministic: bool
    tiles: dict
    dims: tuple | None
    has_forward: bool
    compile_keys: tuple
    default_for: str | None
    graph_safe: bool = True
    graph_unsafe_reason: str = ""
    sanitize_kernels: str | None = None  # a substring of its kernels' names: what compute-sanitizer racechecks

    @classmethod
    def of(cls, backend) -> "BackendSpec":
        """The spec of a backend object (a spec is returned as it is)."""
        if isinstance(backend, BackendSpec):
            return backend
        dims = getattr(backend, "dims", None)
        return cls(backend=backend, name=str(getattr(backend, "name", type(backend).__name__)),
                   device=str(getattr(backend, "device", "cpu") or "cpu"),
                   deterministic=bool(getattr(backend, "deterministic", False)),
                   tiles=dict(getattr(backend, "tiles", None) or {}),
                   dims=None if dims is None else tuple(tuple(d) for d in dims),
                   has_forward=callable(getattr(backend, "forward", None)),
                   compile_keys=tuple(getattr(backend, "compile_keys", None) or ()),
                   default_for=getattr(backend, "default_for", None),
                   graph_safe=bool(getattr(backend, "graph_safe", True)),
                   graph_unsafe_reason=str(getattr(backend, "graph_unsafe_reason", "") or ""),
                   sanitize_kernels=getattr(backend, "sanitize_kernels", None) or None)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def directions(self) -> tuple[str, ...]:
        """What it can be called for: its backward, and its forward when it has one."""
        return ("backward", "forward") if self.has_forward else ("backward",)

    def supports(self, case) -> str | None:
        """None for a case inside its declared domain, else the reason it gives."""
        fn = getattr(self.backend, "supports", None)
        return fn(case) if callable(fn) else None

    @property
    def declares_workspace(self) -> bool:
        return callable(getattr(self.backend, "workspace_bytes", None))

    def workspace_bytes(self, case, direction: str = "backward") -> int:
        """Bytes beyond its outputs that one ``direction`` call on ``case`` may hold at once in torch's caching
        allocator: its optional ``workspace_bytes(case, direction)`` (or ``workspace_bytes(case)``, one bound for
        both directions); 0 when it declares none."""
        fn = getattr(self.backend, "workspace_bytes", None)
        if not callable(fn):
            return 0
        takes_direction = len(inspect.signature(fn).parameters) >= 2
        n = fn(case, direction) if takes_direction else fn(case)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"backend {self.name!r}: workspace_bytes({case.repro()}) must be an int >= 0, got {n!r}")
        return int(n)

    def require(self) -> None:
        """Its optional ``require()``: raises ``MissingDependency`` when a package it needs is absent."""
        fn = getattr(self.backend, "require", None)
        if callable(fn):
            fn()

    def warmup(self, cases) -> None:
        """Its optional ``warmup``, given ``cases`` when it takes them."""
        fn = getattr(self.backend, "warmup", None)
        if callable(fn):
            fn(list(cases)) if inspect.signature(fn).parameters else fn()

    @property
    def precompile(self):
        """Its optional ``precompile(directory[, jobs])``, or None."""
        fn = getattr(self.backend, "precompile", None)
        return fn if callable(fn) else None

    def precompile_into(self, directory, jobs: int = 1) -> list:
        """Its ``precompile`` into ``directory`` (which must exist), by ``jobs`` processes when it takes ``jobs``."""
        fn = self.precompile
        if "jobs" in inspect.signature(fn).parameters:
            return list(fn(directory, jobs=jobs))
        return list(fn(directory))
