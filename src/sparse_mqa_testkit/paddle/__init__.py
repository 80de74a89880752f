"""Paddle frontend: paddle tensors in and out of any backend, and a ``paddle.autograd.PyLayer`` entry point.

Importing this package does not import paddle; each function imports it when called. Install the CPU build
with ``pip install "sparse-mqa-testkit[paddle]"``.
"""

import importlib

_LAZY = {
    "to_torch": "sparse_mqa_testkit.paddle.frontend",
    "to_paddle": "sparse_mqa_testkit.paddle.frontend",
    "to_numpy": "sparse_mqa_testkit.paddle.frontend",
    "from_numpy": "sparse_mqa_testkit.paddle.frontend",
    "case_tensors": "sparse_mqa_testkit.paddle.frontend",
    "stream_scope": "sparse_mqa_testkit.paddle.frontend",
    "PaddleBackend": "sparse_mqa_testkit.paddle.backend",
    "through_paddle": "sparse_mqa_testkit.paddle.backend",
    "TorchFacing": "sparse_mqa_testkit.paddle.backend",
    "import_paddle": "sparse_mqa_testkit.paddle.frontend",
    "sparse_mqa_attention": "sparse_mqa_testkit.paddle.autograd",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
