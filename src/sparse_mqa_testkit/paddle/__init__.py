"""Paddle frontend: paddle tensors in and out of any backend, and the checks on a backend that speaks paddle.

Importing this package does not import paddle; each function imports it when called. Install the CPU build
with ``pip install "sparse-mqa-testkit[paddle]"``.
"""

from ..lazy import lazy_exports

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
}

__all__ = list(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
