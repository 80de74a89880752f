"""Tolerance from an error model: a kernel may be k times as far from the float64 oracle as the oracle's own
outputs rounded to the kernel's output dtype are, plus a small floor.

Per tensor, over entries the oracle has finite:
    error    = ||kernel - oracle64|| / ||oracle64||         (relative L2)
    allowed  = k * ||ref - oracle64|| / ||oracle64|| + floor (ref: float32 math rounded to the output dtype)
A zero oracle tensor (every row empty, every sink +inf, ...) has no scale: then both are absolute L2 norms.
NaN / +inf / -inf positions must match the oracle exactly; shapes, dtypes and devices must be the contract's.

Calibration (issue 3, 2026-11-30, S256 Skv512 H16 L128 576/512): bf16 rounding of the exact gradients costs
1.66e-3 relative L2; cuDNN's and TileLang's backward kernels land at about 1.4x that, hence k = 2.5.

Floors (see ``FLOORS``) cover what the bf16-output oracle does not: a kernel feeds bf16 P and dS to its tensor
cores and reads the bf16 ``out`` for Delta, so fp32 outputs (d_sink, lse) carry more than float32 math error,
and a tiny bf16 tensor can round with almost no error by luck.
"""

from __future__ import annotations

import math

from .. import contract
from .inputs import (BACKWARD_OUTPUTS, FORWARD_OUTPUTS, as_f64, backend_inputs, call_backward, call_forward,
                     has_forward, oracle_results)
from .report import exception_summary, fmt_index, fmt_value, result

K_DEFAULT = 2.5

# Relative-L2 floors per tensor, measured with a NumPy emulation of a bf16 tensor-core kernel (P and dS rounded
# to bf16 before their matmuls, Delta from the bf16 out, fp32 accumulation in a random order) over drawn
# cases; see tests/test_checks_tolerance.py::test_emulated_kernel_within_model for the measurement.
FLOORS = {
    "dq": 1e-4,      # bf16 output: k x rounding error dominates; floor only for tensors with a handful of values
    "dkv": 1e-4,
    "out": 1e-4,
    "d_sink": 2e-3,  # fp32 output, but sum of p_sink * Delta with Delta from bf16 out: ~2^-9 / sqrt(n) relative
    "lse": 1e-5,     # fp32 output from fp32 exp/log (exp2 and log2 in base-2 kernels): a few float32 ulps
}

_TORCH_DTYPES = None


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _numel(shape) -> int:
    return int(math.prod(shape))


def structural_problem(name: str, value, expected_shape, dims_case, *, device: str | None = None) -> str | None:
    """Shape / dtype / device of one result against the contract, as a problem line (None when fine)."""
    want_dtype = contract.KERNEL_DTYPES[name]
    if value is None:
        return f"{name}: missing (got None), expected a {want_dtype} tensor of shape {tuple(expected_shape)}"
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return f"{name}: expected a tensor, got {type(value).__name__}"
    shape = tuple(int(d) for d in value.shape)
    if shape != tuple(expected_shape):
        return f"{name}: shape {shape} is not the contract's {tuple(expected_shape)}"
    got = contract.dtype_name(value)
    if got != want_dtype:
        return f"{name}: dtype {got} is not the contract's {want_dtype}"
    if device is not None and hasattr(value, "device"):
        if str(value.device).split(":")[0] != str(device).split(":")[0]:
            return f"{name}: on device {value.device}, expected {device} like the inputs"
    return None


def compare_tensor(name: str, kernel, oracle64, ref64, *, k: float = K_DEFAULT, floor: float | None = None):
    """Compare one result with the float64 oracle under the error model.

    Returns (entry, problem): entry has error, allowed, ratio, reference_error, floor, k, mode, mismatches,
    numel, worst_index, worst_kernel, worst_oracle; problem is a message block or None when it passes.
    """
    import torch

    floor = FLOORS.get(name, 1e-4) if floor is None else float(floor)
    a, o, r = as_f64(kernel), as_f64(oracle64), as_f64(ref64)
    entry = {"error": math.inf, "allowed": floor, "ratio": math.inf, "reference_error": 0.0, "floor": floor,
             "k": k, "numel": int(o.numel())}
    # non-finite positions must match exactly, class by class
    for label, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        ma, mo = fn(a), fn(o)
        bad = ma != mo
        if bool(bad.any()):
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            entry.update(mismatches=int(bad.sum()), worst_index=idx, worst_kernel=float(a[idx]),
                         worst_oracle=float(o[idx]), mode="nonfinite")
            return entry, (f"{name}: {label} positions differ from the oracle at {int(bad.sum())} / {o.numel()} "
                           f"elements\n  first at index {fmt_index(idx)}: kernel {fmt_value(a[idx])}, "
                           f"oracle {fmt_value(o[idx])}")
    fin = torch.isfinite(o)
    d = torch.where(fin, a - o, torch.zeros((), dtype=torch.float64))
    oz = torch.where(fin, o, torch.zeros((), dtype=torch.float64))
    rz = torch.where(fin, r - o, torch.zeros((), dtype=torch.float64))
    n_fin = int(fin.sum())
    norm_o = float(torch.linalg.vector_norm(oz))
    if norm_o > 0:
        mode = "relative"
        err = float(torch.linalg.vector_norm(d)) / norm_o
        ref_err = float(torch.linalg.vector_norm(rz)) / norm_o
    else:  # a zero reference has no scale: absolute L2 against the floor
        mode = "absolute"
        err = float(torch.linalg.vector_norm(d))
        ref_err = float(torch.linalg.vector_norm(rz))
    allowed = k * ref_err + floor
    # elementwise bound from the same model: allowed relative error on each element's own scale or the rms
    rms = norm_o / math.sqrt(max(n_fin, 1))
    bound = allowed * (oz.abs() + rms) if mode == "relative" else torch.full_like(oz, allowed)
    excess = d.abs() / bound.clamp_min(1e-300)
    mism = int((d.abs() > bound).sum())
    if o.numel():
        flat = int(torch.argmax(excess.reshape(-1)))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(o.shape)))
    else:
        idx = ()
    ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else math.inf)
    entry.update(error=err, allowed=allowed, ratio=ratio, reference_error=ref_err, mode=mode,
                 mismatches=mism, worst_index=idx,
                 worst_kernel=float(a[idx]) if o.numel() else math.nan,
                 worst_oracle=float(o[idx]) if o.numel() else math.nan)
    if err <= allowed:
        return entry, None
    what = "relative L2 error" if mode == "relative" else "absolute L2 error (oracle is all zero)"
    pct = 100.0 * mism / max(o.numel(), 1)
    msg = (f"{name}: {what} {err:.3e} > allowed {allowed:.3e} "
           f"(= {k:g} x bf16-output oracle error {ref_err:.3e} + floor {floor:.1e}); ratio {ratio:.3g}\n"
           f"  Mismatched elements: {mism} / {o.numel()} ({pct:.1f}%) "
           f"[bound per element: allowed x (|oracle| + rms(oracle))]\n"
           f"  Worst element at index {fmt_index(idx)}: kernel {fmt_value(a[idx])}, oracle {fmt_value(o[idx])} "
           f"(abs diff {fmt_value(abs(float(a[idx]) - float(o[idx])))}, "
           f"{fmt_value(float(excess.reshape(-1)[flat]))}x its bound)")
    return entry, msg


def rounded_reference(name: str, f32_value):
    """The bf16-output oracle: float32 math rounded to the result's kernel dtype, as float64 torch."""
    import torch

    t = as_f64(f32_value).to(torch.float32)
    return t.to(_torch_dtype(contract.KERNEL_DTYPES[name])).to(torch.float64)


def compare_outputs(names, results: dict, case, *, k=K_DEFAULT, floor=None, device=None, sink_given=None):
    """Structure + error model for a set of named results. Returns (per_tensor, problems, worst_ratio)."""
    dims = case.dims
    ores = oracle_results(case)
    per_tensor, problems, worst = {}, [], 0.0
    floors = floor if isinstance(floor, dict) else {n: floor for n in names}
    for name in names:
        val = results.get(name)
        if name == "d_sink" and sink_given is not None:
            if not sink_given:
                if val is not None:
                    problems.append("d_sink: must be None when attn_sink is None, got a tensor")
                    per_tensor[name] = {"error": math.inf, "allowed": 0.0, "ratio": math.inf}
                    worst = math.inf
                continue
        prob = structural_problem(name, val, dims.shape(name), case, device=device)
        if prob:
            problems.append(prob)
            per_tensor[name] = {"error": math.inf, "allowed": 0.0, "ratio": math.inf, "problem": prob}
            worst = math.inf
            continue
        entry, prob = compare_tensor(name, val, ores["f64"][name], rounded_reference(name, ores["f32"][name]),
                                     k=k, floor=floors.get(name))
        per_tensor[name] = entry
        worst = max(worst, entry["ratio"])
        if prob:
            problems.append(prob)
    return per_tensor, problems, worst


def _unpack(out, n: int, what: str):
    if not isinstance(out, (tuple, list)) or len(out) != n:
        raise TypeError(f"{what} must return a tuple of {n} tensors, got {type(out).__name__}"
                        + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    return out


def check_backward_tolerance(backend, case, *, k: float = K_DEFAULT, floor=None):
    """dq, dkv, d_sink of ``backend.backward`` against the float64 oracle under the error model.

    floor: None (``FLOORS``), a number for every tensor, or {tensor: floor}.
    """
    check = "tolerance"
    try:
        t = backend_inputs(backend, case)
        dq, dkv, d_sink = _unpack(call_backward(backend, t), 3, "backward")
    except Exception as exc:  # a crash is a failure, reported with where it came from
        return result(check, backend, case, [f"backward raised {exception_summary(exc)}"], ratio=math.inf,
                      per_tensor={})
    per_tensor, problems, worst = compare_outputs(
        BACKWARD_OUTPUTS, {"dq": dq, "dkv": dkv, "d_sink": d_sink}, case, k=k, floor=floor,
        device=getattr(backend, "device", None), sink_given=t["attn_sink"] is not None)
    return result(check, backend, case, problems, ratio=worst, per_tensor=per_tensor)


def check_forward_tolerance(backend, case, *, k: float = K_DEFAULT, floor=None):
    """out and lse of ``backend.forward`` against the float64 oracle; passes with a note if it has no forward."""
    check = "forward_tolerance"
    if not has_forward(backend):
        return result(check, backend, case, [], ratio=0.0, per_tensor={},
                      notes={"skipped": "backend has no forward"})
    try:
        t = backend_inputs(backend, case)
        out, lse = _unpack(call_forward(backend, t), 2, "forward")
    except Exception as exc:
        return result(check, backend, case, [f"forward raised {exception_summary(exc)}"], ratio=math.inf,
                      per_tensor={})
    per_tensor, problems, worst = compare_outputs(FORWARD_OUTPUTS, {"out": out, "lse": lse}, case, k=k,
                                                  floor=floor, device=getattr(backend, "device", None))
    return result(check, backend, case, problems, ratio=worst, per_tensor=per_tensor)
