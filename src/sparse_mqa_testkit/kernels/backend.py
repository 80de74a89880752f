"""``tilelang``: our forward and deterministic backward kernels behind the backend protocol."""

from __future__ import annotations

from .. import contract
from ..backends.base import BackendBase


class TileLangBackend(BackendBase):
    name = "tilelang"
    device = "cuda"
    deterministic = True
    dims = contract.KERNEL_DIMS

    @property
    def tiles(self) -> dict:
        from . import bwd_plan

        return dict(bwd_plan.TILES)

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        from .forward import sparse_mla_forward

        return sparse_mla_forward(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        from .backward import sparse_mla_backward

        return sparse_mla_backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                   topk_length=topk_length)

    def warmup(self) -> list[str]:
        """Compile (or load from TILELANG_CACHE_DIR) every kernel variant once, before any timed or parallel
        test: the plugin calls this once per worker."""
        from . import backward, forward

        return forward.precompile() + backward.precompile()
