"""Finding a backend by name: ``reference``, the ``sparse_mqa_testkit.backends`` entry-point group, or
``module:attr``. The testkit knows no kernel: every other backend, ours included, comes in through the
entry-point group (``[project.entry-points."sparse_mqa_testkit.backends"]`` in its package's pyproject.toml)."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import torch

from .base import MissingDependency
from .reference import ReferenceBackend
from .spec import BackendSpec

ENTRY_POINT_GROUP = "sparse_mqa_testkit.backends"
REFERENCE = "reference"


class BackendNotFound(LookupError):
    pass


def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_backends() -> list[str]:
    """Names that ``get_backend`` knows (``reference`` and installed entry points), whether or not they load."""
    return sorted({REFERENCE} | set(_entry_points()))


def _load(spec: str):
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise BackendNotFound(f"backend spec must be 'module:attr', got {spec!r}")
    try:
        obj = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod == e.name or mod.startswith(e.name + ".")):
            raise  # the module exists and something it imports is missing: an error showing where it broke
        raise BackendNotFound(f"no module named {e.name!r} on this Python's path (sys.path, PYTHONPATH)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise BackendNotFound(f"{getattr(obj, '__name__', mod)!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _instantiate(obj, label: str):
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "backward")):
        obj = obj()
    if not callable(getattr(obj, "backward", None)):
        raise BackendNotFound(f"{label} is not a backend: it has no backward()")
    return obj


def get_backend(name: str):
    """A backend by registered name or ``module:attr`` (a backend object, class or zero-argument factory)."""
    if name == REFERENCE:
        return ReferenceBackend()
    eps = _entry_points()
    if name in eps:
        return _instantiate(eps[name].load(), name)
    if ":" in name:
        return _instantiate(_load(name), name)
    raise BackendNotFound(f"unknown backend {name!r}; known: {', '.join(available_backends())}, "
                          "or give 'module:attr'")


def describe_backends() -> list[dict]:
    """Every backend ``get_backend`` knows: name, origin, device, and whether it loads here (the reason if
    not). Loading imports each backend's module and asks its optional ``require()``."""
    eps = _entry_points()
    out = []
    for name in available_backends():
        origin = "built-in" if name == REFERENCE else f"entry point {eps[name].value}" + (
            f" ({eps[name].dist.name})" if getattr(eps[name], "dist", None) else "")
        row = {"name": name, "origin": origin, "device": "?", "loads": True, "reason": ""}
        try:
            spec = BackendSpec.of(get_backend(name))
            row["device"] = spec.device
            spec.require()
        except MissingDependency as e:
            row.update(loads=False, reason=f"missing package: {e}")
        except Exception as e:
            row.update(loads=False, reason=f"{type(e).__name__}: {e}")
        out.append(row)
    return out


def resolve_backend(backend):
    """A backend object as given, or the one a registered name or ``module:attr`` names."""
    return get_backend(backend) if isinstance(backend, str) else backend


def default_backend_name() -> str:
    """On a machine with CUDA, the installed backend that declares ``default_for = "cuda"`` (the first by name
    if several do); else ``reference``."""
    if torch.cuda.is_available():
        for name, ep in sorted(_entry_points().items()):
            try:
                # read on what the entry point names (a class, often): a spec is made of a loaded backend
                if getattr(ep.load(), "default_for", None) == "cuda":
                    return name
            except Exception:  # a backend that cannot load here is no default; naming it reports why
                continue
    return REFERENCE
