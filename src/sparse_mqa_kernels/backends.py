"""Our kernels behind the testkit's backend protocol, registered through its entry-point group (pyproject.toml)
exactly as a user's package registers theirs:

- ``tilelang``: the TileLang forward and deterministic backward (CUDA, sm_90a);
- ``tilelang-model``: the NumPy model of that backward's algorithm (CPU, any dims), so CPU CI runs its plan
  and fixed point end to end.
"""

from __future__ import annotations

import os
import sys

import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends import BackendBase, ByHeads, MissingDependency
from sparse_mqa_testkit.backends.validate import check_backward_args
from sparse_mqa_testkit.cases.compile_keys import CompileKey
from sparse_mqa_testkit.convert import to_torch

from . import bwd_plan, fwd_plan
from .backward_model import MODEL_QUERY_CHUNK, model_backward

# the top-k block follows the head group, which follows H: 32 slots at up to 16 heads, 16 beyond
TOPK_BY_HEADS = ByHeads({hg: bwd_plan.TOPK_BLOCKS[hg] for hg in bwd_plan.HEAD_GROUPS})


def _require_tilelang() -> None:
    try:
        import tilelang  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(f"the tilelang backend needs TileLang 0.1.15, which did not import ({exc}); "
                                "install the gpu extra: pip install 'sparse-mqa-testkit[gpu]'") from exc


class TileLangBackend(BackendBase):
    name = "tilelang"
    device = "cuda"
    deterministic = True
    default_for = "cuda"  # the machine's default backend where CUDA is available
    graph_safe = True  # no host reads of the data, every kernel on the current stream: the graph check holds it to it
    dims = contract.PRODUCTION_DIMS
    tiles = {**bwd_plan.TILES, "topk_block": TOPK_BY_HEADS}
    # B, S, Skv, H and L are runtime sizes; a compiled variant depends only on these
    compile_keys = ("Dqk", "Dv", "sink_given", "topk_given", CompileKey("head_group", "H", bwd_plan.head_group_for))
    sanitize_kernels = "sparse_mqa_"  # sparse_mqa_fwd_kernel, sparse_mqa_bwd_kernel, sparse_mqa_bwd_ws_kernel, ...

    def require(self) -> None:
        _require_tilelang()

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        from .forward import sparse_mqa_forward

        return sparse_mqa_forward(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        from .backward import sparse_mqa_backward

        return sparse_mqa_backward(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                   topk_length=topk_length)

    def workspace_bytes(self, case, direction: str = "backward") -> int:
        """Bytes a call holds beside its outputs: the forward none (its kernel writes out and lse in place; the
        stand-ins for an absent sink or topk_length are made once per device), the backward
        ``BwdPlan.workspace_bytes``."""
        if direction == "forward":
            return 0
        plan = bwd_plan.make_plan(case.B, case.S, case.Skv, case.H, case.L, case.Dqk, case.Dv)
        return plan.workspace_bytes(sink=case.sink != "none", topk_given=case.topk != "none")

    def warmup(self, cases=None) -> list[str]:
        """Compile (or load from TILELANG_CACHE_DIR) the kernel variants ``cases`` need, every variant without
        cases, before any timed or parallel test: the plugin calls this once per worker."""
        from . import backward, bwd_prep, bwd_rows, forward

        if cases is None:
            return forward.precompile() + backward.precompile()
        out = []
        for c in cases:
            fkey = fwd_plan.variant_key(c.Dqk, c.Dv, has_sink=c.sink != "none", has_topk_length=c.topk != "none")
            bkey = bwd_plan.make_plan(c.B, c.S, c.Skv, c.H, c.L, c.Dqk, c.Dv).key()
            forward.compiled(fkey)
            backward.compiled(bkey)
            if bkey.warp_specialized:
                bwd_rows.compiled(c.Dqk, c.Dv, bkey.stored_pds)
            else:
                bwd_prep.compiled(c.Dqk, c.Dv)
            out += [fkey.describe(), bkey.describe()]
        return sorted(set(out))

    def precompile(self, directory, jobs: int = 1) -> list[str]:
        """Compile every kernel variant into TileLang's cache ``directory`` (for sm_90a, without a GPU too), by
        ``jobs`` processes."""
        from . import precompile

        if "tilelang" in sys.modules and os.environ.get("TILELANG_CACHE_DIR") != str(directory) and jobs <= 1:
            print("tilelang: warning: TileLang was imported before its cache directory was set; it may compile "
                  "into its old cache", file=sys.stderr)
        os.environ["TILELANG_CACHE_DIR"] = str(directory)
        _require_tilelang()
        return precompile.compile_all(directory, jobs)


class TileLangModelBackend(BackendBase):
    """The NumPy model of the ``tilelang`` backward, on CPU torch tensors."""

    name = "tilelang-model"
    device = "cpu"
    deterministic = True
    dims = None  # the algorithm takes any (Dqk, Dv); the GPU kernel is built for contract.PRODUCTION_DIMS
    tiles = {"head_group": bwd_plan.HEAD_GROUPS[0], "query_chunk": MODEL_QUERY_CHUNK, "topk_block": TOPK_BY_HEADS}

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, topk_length=topk_length)
        dq, dkv, d_sink, _ = model_backward(q, kv, out, grad_out, lse, attn_sink, indices, float(sm_scale),
                                            topk_length=topk_length)
        dev = q.device
        return (to_torch(dq, dev, torch.bfloat16), to_torch(dkv, dev, torch.bfloat16),
                None if d_sink is None else to_torch(d_sink, dev, torch.float32))
