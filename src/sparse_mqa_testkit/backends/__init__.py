"""Backends: the protocol, the registry and the built-in ``reference`` backend."""

from .base import Backend, BackendBase, MissingDependency
from .registry import (
                       ENTRY_POINT_GROUP,
                       BackendNotFound,
                       available_backends,
                       default_backend_name,
                       get_backend,
                       resolve_backend,
)
from .spec import BackendSpec
from .tiles import ByHeads
from .validate import check_backward_args, check_forward_args

__all__ = ["Backend", "BackendBase", "BackendNotFound", "BackendSpec", "ByHeads", "ENTRY_POINT_GROUP",
           "MissingDependency", "available_backends", "check_backward_args", "check_forward_args",
           "default_backend_name", "get_backend", "resolve_backend"]
