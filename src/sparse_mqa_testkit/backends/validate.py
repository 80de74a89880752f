"""Argument validation every backend runs before any GPU work (torch or paddle tensors in, ValueError out).

What each argument must be comes from ``contract.ARGUMENTS`` (shapes, dtypes); this adds what only tensors
have: devices.
"""

from __future__ import annotations

from .. import contract


def _same_device(tensors: dict) -> None:
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


def check_args(direction: str, args: dict, *, supported_dims=None, device_type=None) -> contract.Dims:
    """Validate the arguments of a ``direction`` call ("backward" or "forward"), by name; returns its Dims.

    A backward reads d_v off ``out``. Required arguments must be present; every tensor argument the call takes
    is checked for shape, dtype and device.
    """
    names = contract.inputs_of(direction)
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise TypeError(f"a {direction} call takes no argument {', '.join(unknown)}")
    for name in names:
        if args.get(name) is None and not contract.argument(name).optional:
            raise ValueError(f"{name} is required, got None")
    if direction == "backward":
        out = args["out"]
        if not hasattr(out, "shape") or len(out.shape) != 4:
            raise ValueError(f"out must have rank 4 [B, S, H, Dv], got shape {tuple(getattr(out, 'shape', ()))}")
        d_v = int(out.shape[-1])
    else:
        d_v = args["d_v"]
    tensors = {n: args.get(n) for n in names if contract.argument(n).is_tensor}
    dims = contract.validate_shapes(tensors["q"], tensors["kv"], tensors["indices"], d_v=d_v,
                                    **{n: v for n, v in tensors.items() if n not in contract.SIZED_BY})
    contract.validate_kernel_dtypes(**tensors)
    contract.validate_sm_scale(args["sm_scale"])
    _same_device(tensors)
    _dims_supported(dims, supported_dims)
    _on_device_type(tensors["q"], device_type)
    return dims


def check_backward_args(q, kv, out, grad_out, lse, attn_sink, indices, sm_scale, *, topk_length=None,
                        supported_dims=None, device_type=None, **more) -> contract.Dims:
    """Validate a ``Backend.backward`` call; returns its Dims. d_v is read off ``out``.

    supported_dims: the (Dqk, Dv) pairs the kernel takes (refuses the rest). device_type: "cuda" for a kernel
    that runs only there (the others must be on q's device anyway). more: any further contract input by name.
    """
    args = dict(q=q, kv=kv, out=out, grad_out=grad_out, lse=lse, attn_sink=attn_sink, indices=indices,
                sm_scale=sm_scale, topk_length=topk_length, **more)
    return check_args("backward", args, supported_dims=supported_dims, device_type=device_type)


def check_forward_args(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None, supported_dims=None,
                       device_type=None, **more) -> contract.Dims:
    """Validate a ``Backend.forward`` call; returns its Dims."""
    args = dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink,
                topk_length=topk_length, **more)
    return check_args("forward", args, supported_dims=supported_dims, device_type=device_type)
