"""Public names of a package loaded on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, names: dict[str, str]):
    """The module-level ``__getattr__`` of ``package``: each of ``names`` (name -> the module defining it) is
    imported when first read, then kept on the package."""

    def __getattr__(name):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
