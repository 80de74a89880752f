"""Finding a backend by name: built-ins, the ``sparse_mqa_testkit.backends`` entry-point group, or ``module:attr``."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "sparse_mqa_testkit.backends"

# name -> "module:attr" of a backend or a zero-argument factory; imported only when asked for
BUILTINS = {
    "reference": "sparse_mqa_testkit.backends.reference:ReferenceBackend",
    "tilelang": "sparse_mqa_testkit.kernels.backend:TileLangBackend",
    "tilelang-model": "sparse_mqa_testkit.kernels.model:TileLangModelBackend",
    "cudnn": "sparse_mqa_testkit.backends.cudnn:CudnnBackend",
}


class BackendNotFound(LookupError):
    pass


def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_backends() -> list[str]:
    """Names that ``get_backend`` knows (built-ins and installed entry points), whether or not they load here."""
    return sorted(set(BUILTINS) | set(_entry_points()))


def _load(spec: str):
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise BackendNotFound(f"backend spec must be 'module:attr', got {spec!r}")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
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
    if name in BUILTINS:
        return _instantiate(_load(BUILTINS[name]), name)
    eps = _entry_points()
    if name in eps:
        return _instantiate(eps[name].load(), name)
    if ":" in name:
        return _instantiate(_load(name), name)
    raise BackendNotFound(f"unknown backend {name!r}; known: {', '.join(available_backends())}, "
                          "or give 'module:attr'")


def default_backend_name() -> str:
    """The deterministic GPU backend when CUDA is available, else ``reference``."""
    try:
        import torch

        if torch.cuda.is_available():
            return "tilelang"
    except ImportError:
        pass
    return "reference"
