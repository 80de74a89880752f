"""``reference``: the NumPy oracle behind the backend protocol (float32 math, bf16 outputs, CPU or CUDA)."""

from __future__ import annotations

import numpy as np
import torch

from .. import oracle
from ..convert import to_torch
from .base import BackendBase
from .validate import check_backward_args, check_forward_args


def _result(a, like, dtype):
    return to_torch(np.asarray(a, dtype=np.float32), like.device, dtype)


class ReferenceBackend(BackendBase):
    name = "reference"
    deterministic = True

    def __init__(self, device: str = "cpu"):
        self.device = device

    def forward(self, q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None):
        check_forward_args(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length)
        out, lse = oracle.forward(q, kv, indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
                                  topk_length=topk_length, dtype=np.float32)
        return _result(out, q, torch.bfloat16), _result(lse, q, torch.float32)

    def backward(self, q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None):
        dims = check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale,
                                   topk_length=topk_length)
        # the oracle recomputes P from the primal inputs; out and lse are validated but not trusted
        dq, dkv, d_sink = oracle.backward(q, kv, indices, grad_out, sm_scale=sm_scale, d_v=dims.Dv,
                                          attn_sink=attn_sink, topk_length=topk_length, dtype=np.float32)
        return (_result(dq, q, torch.bfloat16), _result(dkv, q, torch.bfloat16),
                None if d_sink is None else _result(d_sink, q, torch.float32))
