"""``cudnn``: cuDNN frontend's DSA backward (nvidia-cudnn-frontend 1.32, CuTe DSL) behind the backend protocol.

What the adapter does, and why (read from the 1.32 sources of ``cudnn.DSA.SparseAttentionBackward``):

- Layout: cuDNN takes unbatched tensors, q (S_q, H, D), kv (S_kv, D), out/dout (S_q, H, Dv), lse (S_q, H),
  topk_idxs (S_q, L) with GLOBAL kv rows, topk_length (S_q,). We flatten the batch and offset each batch's
  indices by b * Skv. cuDNN skips entries outside [0, S_kv_total), so -1 is its invalid value; an index that is
  invalid in our contract (say Skv in batch 0) would name a valid row of the next batch after the offset, so
  every invalid slot is mapped to -1 first. With B = 1 nothing needs mapping and the indices pass through.
- topk_length is native: the kernel clamps it to [0, L], which is the contract's rule (t < topk_length).
- lse is the contract's: natural log, sink excluded, +inf for an empty row (cuDNN gives such rows p_sink 0 and
  P 0, which is what the contract's gradients are). No conversion.
- attn_sink is required by cuDNN: None becomes -inf per head (p_sink = 0) and the returned d_sink is dropped.
  cuDNN computes d_sink from the bf16 ``out`` it is given (Delta = <dO, out>), as the contract does.
- Dims: head_dim must be 512 or 576 and Dv is then 512; H >= 2 (an MQA kernel: it asserts H > 1).
  Global indices are int32, so B * Skv must stay below 2**31.
- No deterministic mode on SM90 (dkv is accumulated with float atomics): ``deterministic = False``.
- Execution (1.32 on SM90, read from its sources; the execution checks hold it to this on a GPU): the two memsets
  and three kernels of a call go on torch's current stream (``resolve_stream`` of no stream), nothing is read back
  to the host and ``topk_length`` is read on the device only, and ``execute`` allocates no tensor (its fp32
  scratch is carved from the ``workspace`` we pass). So it declares itself capturable (``graph_safe``; cuDNN's own
  suite captures only SM100) once each kernel key has run eagerly, and ``workspace_bytes`` is cuDNN's scratch plus
  what this adapter allocates per call.
- Plans: one ``SparseAttentionBackward`` per shape, cached here (the scale is passed per call, so it is not
  part of the key). On SM90 the CuTe kernels are JIT-compiled on the first execute of each (head dim, H, L,
  topk_length or not) and cached by cuDNN from then on: ``compile_keys`` says so to the suite, and ``warmup``
  executes one call per pooled key before any check.
"""

from __future__ import annotations

import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends import BackendBase, MissingDependency
from sparse_mqa_testkit.backends.validate import check_backward_args
from sparse_mqa_testkit.calls import Call
from sparse_mqa_testkit.cases.tensors import case_tensors

GPU_EXTRA_HINT = "pip install 'sparse-mqa-testkit[gpu]'"
CUDNN_DIMS = ((576, 512), (512, 512))  # cuDNN's head_dim in {576, 512}, Dv = 512 for both
INDEX_LIMIT = 2**31  # global kv rows are int32


def load_dsa():
    """``cudnn.DSA`` (the frontend's DeepSeek sparse attention namespace), or MissingDependency."""
    try:
        import cutlass  # noqa: F401  (the CuTe DSL, nvidia-cutlass-dsl, that the DSA kernels are written in)
    except ImportError as exc:
        raise MissingDependency(
            f"the cudnn backend needs the NVIDIA CUTLASS DSL (nvidia-cutlass-dsl), which did not import "
            f"({exc}); install the gpu extra: {GPU_EXTRA_HINT}") from exc
    try:
        # the DSL hands tensors to its kernels through TVM FFI (apache-tvm-ffi, a requirement of cudnn-frontend
        # 1.32 that a partial install can lack); without it cuDNN fails only at the first execute, in from_dlpack
        import tvm_ffi  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(
            f"the cudnn backend needs apache-tvm-ffi (the CUTLASS DSL's tensor interface), which did not import "
            f"({exc}); install the gpu extra: {GPU_EXTRA_HINT}") from exc
    try:
        from cudnn import DSA
    except ImportError as exc:
        raise MissingDependency(
            f"the cudnn backend needs cuDNN frontend 1.32 (nvidia-cudnn-frontend==1.32.0), which did not import "
            f"({exc}); install the gpu extra: {GPU_EXTRA_HINT}") from exc
    return DSA


def unsupported_reason(dims: contract.Dims) -> str | None:
    """Why cuDNN's DSA backward refuses these sizes beyond the dims check, or None."""
    if (dims.Dqk, dims.Dv) not in CUDNN_DIMS:
        return f"(Dqk, Dv) = ({dims.Dqk}, {dims.Dv}) not in {CUDNN_DIMS}"
    if dims.H < 2:
        return f"H = {dims.H}: cuDNN's DSA backward is an MQA kernel and needs H >= 2"
    if dims.B * dims.Skv > INDEX_LIMIT:
        return f"B * Skv = {dims.B * dims.Skv} exceeds cuDNN's int32 global kv index range ({INDEX_LIMIT})"
    return None


def to_cudnn_layout(q, kv, out, grad_out, lse, attn_sink, indices, topk_length=None) -> dict:
    """Our batched contract tensors -> the keyword arguments of cuDNN's flat layout (a pure function).

    Returns q (B*S, H, Dqk), kv (B*Skv, Dqk), out, dout (B*S, H, Dv), lse (B*S, H), attn_sink (H,) with -inf
    when None, topk_idxs (B*S, L) int32 global rows with -1 for every invalid slot, topk_length (B*S,) or None.
    All contiguous; sizes come from the (already validated) arguments.
    """
    B, S, H, Dqk = q.shape
    Skv = kv.shape[1]
    L = indices.shape[2]
    Dv = out.shape[-1]
    if B == 1:  # cuDNN itself ignores anything outside [0, Skv): the contract's rule, no mapping needed
        idx = indices.reshape(S, L).to(torch.int32).contiguous()
    else:
        idx64 = indices.to(torch.int64)
        valid = contract.valid_mask(idx64, Skv)
        offset = (torch.arange(B, device=indices.device, dtype=torch.int64) * Skv).view(B, 1, 1)
        idx = torch.where(valid, idx64 + offset, torch.full_like(idx64, -1)).to(torch.int32).reshape(B * S, L)
    if attn_sink is None:
        sink = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        sink = attn_sink.contiguous()
    tl = None if topk_length is None else topk_length.reshape(B * S).to(torch.int32).contiguous()
    return {
        "q": q.reshape(B * S, H, Dqk).contiguous(),
        "kv": kv.reshape(B * Skv, Dqk).contiguous(),
        "out": out.reshape(B * S, H, Dv).contiguous(),
        "dout": grad_out.reshape(B * S, H, Dv).contiguous(),
        "lse": lse.reshape(B * S, H).contiguous(),
        "attn_sink": sink,
        "topk_idxs": idx.contiguous(),
        "topk_length": tl,
    }


def from_cudnn_layout(dq, dkv, d_sink, dims: contract.Dims, attn_sink) -> tuple:
    """cuDNN's flat (dq, dkv, d_sink) -> the contract's (dq [B,S,H,Dqk], dkv [B,Skv,Dqk], d_sink [H] or None)."""
    return (dq.view(dims.B, dims.S, dims.H, dims.Dqk), dkv.view(dims.B, dims.Skv, dims.Dqk),
            None if attn_sink is None else d_sink)


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def scratch_workspace_bytes(dims: contract.Dims) -> int:
    """cuDNN frontend 1.32's SM90 scratch for one call (``SparseAttentionBackward.scratch_workspace_bytes``, i.e.
    ``flash_attn_bwd_sm90_workspace_size``): two fp32 [Sq, H] buffers (Delta, and the base-2 LSE with the sink
    folded in) and the fp32 dKV accumulator [Skv, D], with Sq = B*S and Skv = B*Skv rounded up to 64 rows, D to
    32 columns and each buffer to 128 bytes."""
    sq, skv, d = _up(dims.B * dims.S, 64), _up(dims.B * dims.Skv, 64), _up(dims.Dqk, 32)
    return 2 * _up(sq * dims.H * 4, 128) + _up(skv * d * 4, 128)


def adapter_bytes(dims: contract.Dims, *, sink_given: bool) -> int:
    """What ``CudnnBackend.backward`` allocates per call beside its outputs and cuDNN's scratch: with B > 1 the
    global indices (int64 copies, the validity mask and the int32 result while they are made: 33 bytes per slot, and
    B offsets), without a sink the -inf stand-in and the d_sink cuDNN writes that is dropped (8 bytes per head)."""
    slots = dims.B * dims.S * dims.L
    return (33 * slots + 8 * dims.B if dims.B > 1 else 0) + (0 if sink_given else 8 * dims.H)


def plan_key(flat: dict) -> tuple:
    """What a cuDNN plan is specialised on: device, dtypes and shapes, and whether topk_length is given."""
    return (str(flat["q"].device), tuple(flat["q"].shape), tuple(flat["kv"].shape), tuple(flat["out"].shape),
            tuple(flat["topk_idxs"].shape), flat["topk_length"] is not None)


class CudnnBackend(BackendBase):
    name = "cudnn"
    device = "cuda"
    deterministic = False  # SM90 has no deterministic mode: dkv is summed with float atomics
    dims = CUDNN_DIMS
    tiles = {"head_group": 64, "topk_block": 64}  # SM90: 64-head MMA tiles, 64 gathered kv rows per block
    compile_keys = ("Dqk", "H", "L", "topk_given")  # what its CuTe kernels are JIT-compiled for
    graph_safe = True  # after one eager call per kernel key (see the module docstring)

    def __init__(self):
        self._plans: dict = {}

    def warmup(self, cases=()) -> list[str]:
        """One backward call per case (synthetic values: only the shapes and flags matter), so cuDNN compiles
        each kernel key before the checks time anything."""
        done = []
        for case in cases:
            out = torch.zeros(case.dims.shape("out"), dtype=torch.bfloat16, device="cuda")
            lse = torch.zeros(case.dims.shape("lse"), dtype=torch.float32, device="cuda")
            Call({**case_tensors(case, "cuda"), "out": out, "lse": lse}).invoke(self, "backward")
            done.append(f"cudnn Dqk{case.Dqk} H{case.H} L{case.L} topk_length={case.topk != 'none'}")
        torch.cuda.synchronize()
        return done

    def supports(self, case) -> str | None:
        return unsupported_reason(case.dims)

    def workspace_bytes(self, case, direction: str = "backward") -> int:
        """cuDNN's scratch (the ``workspace`` each call allocates) plus the adapter's own temporaries."""
        return scratch_workspace_bytes(case.dims) + adapter_bytes(case.dims, sink_given=case.sink != "none")

    def require(self) -> None:
        """Raise MissingDependency (naming the ``gpu`` extra) unless cudnn-frontend and the CUTLASS DSL import."""
        load_dsa()

    @property
    def plan_count(self) -> int:
        return len(self._plans)

    def _plan(self, dsa, flat: dict):
        key = plan_key(flat)
        plan = self._plans.get(key)
        if plan is None:
            plan = dsa.SparseAttentionBackward(
                sample_q=flat["q"], sample_kv=flat["kv"], sample_out=flat["out"], sample_dout=flat["dout"],
                sample_lse=flat["lse"], sample_attn_sink=flat["attn_sink"], sample_topk_idxs=flat["topk_idxs"],
                sample_topk_length=flat["topk_length"], deterministic=False)
            plan.check_support()  # raises ValueError / RuntimeError with cuDNN's own reason
            plan.compile()
            self._plans[key] = plan
        return plan

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                   topk_length=topk_length, supported_dims=self.dims)
        reason = unsupported_reason(dims)
        if reason is not None:
            raise ValueError(f"cudnn backend: {reason}")
        if q.device.type != "cuda":
            raise ValueError(f"q must be on a CUDA device for the cudnn backend, got {q.device}")
        dsa = load_dsa()
        flat = to_cudnn_layout(q, kv, out, grad_out, lse, attn_sink, indices, topk_length)
        plan = self._plan(dsa, flat)
        dq = torch.empty_like(flat["q"])
        dkv = torch.empty_like(flat["kv"])
        d_sink = torch.empty_like(flat["attn_sink"])
        ws_bytes = plan.scratch_workspace_bytes()
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
        dq, dkv, d_sink = plan.execute(flat["q"], flat["kv"], flat["out"], flat["dout"], flat["lse"],
                                       flat["attn_sink"], flat["topk_idxs"], dq, dkv,
                                       topk_length=flat["topk_length"], softmax_scale=float(sm_scale),
                                       workspace=workspace, d_sink=d_sink)
        return from_cudnn_layout(dq, dkv, d_sink, dims, attn_sink)
