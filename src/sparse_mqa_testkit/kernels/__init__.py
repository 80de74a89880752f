"""Our GPU kernels (TileLang, sm_90a) and the training-step entry point.

Imports are lazy: ``import sparse_mqa_testkit.kernels`` needs neither TileLang nor a GPU; host-side plans
(``fwd_plan``, ``bwd_plan``) and the NumPy model of the backward (``model``) run anywhere.
"""

import importlib

_LAZY = {
    "sparse_mla_forward": "sparse_mqa_testkit.kernels.forward",
    "sparse_mla_backward": "sparse_mqa_testkit.kernels.backward",
    "sparse_mqa_attention": "sparse_mqa_testkit.kernels.autograd",
    "TileLangBackend": "sparse_mqa_testkit.kernels.backend",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
