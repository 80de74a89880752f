"""Argument validation every backend runs before any GPU work (torch tensors in, ValueError out).

Shapes and dtypes come from ``sparse_mqa_testkit.contract``; this adds what only tensors have: devices.
"""

from __future__ import annotations

from .. import contract


def _same_device(**tensors) -> None:
    ref_name, ref_dev = None, None
    for name, t in tensors.items():
        if t is None or not hasattr(t, "device"):
            continue
        dev = str(t.device)
        if ref_dev is None:
            ref_name, ref_dev = name, dev
        elif dev != ref_dev:
            raise ValueError(f"{name} must be on {ref_dev} like {ref_name}, got {dev}")


def _on_device_type(q, device_type) -> None:
    if device_type is not None and getattr(getattr(q, "device", None), "type", None) != device_type:
        raise ValueError(f"q must be on a {device_type.upper()} device, got {getattr(q, 'device', None)}")


def _dims_supported(dims: contract.Dims, supported) -> None:
    if supported is not None and (dims.Dqk, dims.Dv) not in tuple(map(tuple, supported)):
        raise ValueError(f"(Dqk, Dv) = ({dims.Dqk}, {dims.Dv}) from q and d_v is not supported; "
                         f"supported: {tuple(map(tuple, supported))}")


def check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None,
                        supported_dims=None, device_type=None) -> contract.Dims:
    """Validate a ``Backend.backward`` call; returns its Dims. d_v is read off ``out``.

    device_type: "cuda" for a kernel that runs only there (the others must be on q's device anyway).
    """
    for name, t in (("out", out), ("grad_out", grad_out), ("lse", lse)):
        if t is None:
            raise ValueError(f"{name} is required, got None")
    if not hasattr(out, "shape") or len(out.shape) != 4:
        raise ValueError(f"out must have rank 4 [B, S, H, Dv], got shape {tuple(getattr(out, 'shape', ()))}")
    dims = contract.validate_shapes(q, kv, indices, d_v=int(out.shape[-1]), attn_sink=attn_sink,
                                    topk_length=topk_length, out=out, grad_out=grad_out, lse=lse)
    contract.validate_kernel_dtypes(q=q, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=attn_sink,
                                    indices=indices, topk_length=topk_length)
    contract.validate_sm_scale(sm_scale)
    _same_device(q=q, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=attn_sink, indices=indices,
                 topk_length=topk_length)
    _dims_supported(dims, supported_dims)
    _on_device_type(q, device_type)
    return dims


def check_forward_args(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None,
                       supported_dims=None, device_type=None) -> contract.Dims:
    """Validate a ``Backend.forward`` call; returns its Dims."""
    dims = contract.validate_shapes(q, kv, indices, d_v=d_v, attn_sink=attn_sink, topk_length=topk_length)
    contract.validate_kernel_dtypes(q=q, kv=kv, attn_sink=attn_sink, indices=indices, topk_length=topk_length)
    contract.validate_sm_scale(sm_scale)
    _same_device(q=q, kv=kv, attn_sink=attn_sink, indices=indices, topk_length=topk_length)
    _dims_supported(dims, supported_dims)
    _on_device_type(q, device_type)
    return dims
