"""Our sparse-MQA kernels: TileLang (sm_90a) forward and deterministic backward, the cuDNN frontend adapter,
the training-step entry points for torch and Paddle, and ``sparse-mqa-bench``.

They reach the conformance suite as any user's kernels do: as backends ``tilelang``, ``tilelang-model`` and
``cudnn`` registered in the ``sparse_mqa_testkit.backends`` entry-point group. Imports are lazy:
``import sparse_mqa_kernels`` needs neither TileLang nor a GPU; the host-side plans (``fwd_plan``, ``bwd_plan``)
and the NumPy model of the backward (``backward_model``) run anywhere.
"""

from sparse_mqa_testkit.lazy import lazy_exports

_LAZY = {
    "sparse_mqa_forward": "sparse_mqa_kernels.forward",
    "sparse_mqa_backward": "sparse_mqa_kernels.backward",
    "sparse_mqa_attention": "sparse_mqa_kernels.autograd",
    "BackwardConfig": "sparse_mqa_kernels.bwd_plan",
}

__all__ = list(_LAZY)

__getattr__ = lazy_exports(__name__, _LAZY)
