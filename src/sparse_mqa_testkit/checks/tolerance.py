"""Tolerance from an error model: a kernel may be k times as far from the float64 oracle as a bf16 pipeline
has to be, plus a small floor; over the whole result, and row by row.

Per result (and per row of it: a (query, head) of dq, out and lse, a KV row of dkv, a head of d_sink), over
the entries the oracle has finite:
    error    = ||kernel - oracle64||                         (relative L2 for the whole result)
    rounding = ||ref - oracle64||       ref: float32 math rounded to the output's kernel dtype
    delta, repeats, operands: the error model's terms (``error_model``): Delta from the bf16 out a backward is
               given, the coherent rounding of repeated rows, and the rounding of P and sm_scale dS before
               their products. Output rounding is about as large as the operands' while a result's terms do
               not cancel (k was calibrated there); where they cancel the operands' is the larger, and k
               applies to it instead
    allowed  = k * max(hypot(rounding, delta, repeats), operands) + floor
The floor is relative to the larger of the result's norm and its ``unsummed`` norm (the norm its terms would
have without cancelling: a float32 sum is accurate relative to that). A row's floor is the same on the row's
own (or unsummed) norm plus the same share of a typical row's norm, so a row that is nearly zero is not held to
a relative measure it cannot have. The whole result's
measure sees a systematic error; a row's sees a local one (one KV row of 8192 off by 5 % moves the whole
dkv's relative L2 by 5.5e-4, far inside its allowance, and its own row's by 5 %).
A zero oracle tensor (every row empty, every sink +inf, ...) has no scale: then all are absolute L2 norms.
A bf16 result (or row) within one ulp of the exact value everywhere passes too (the best a bf16 output can
do, even where the exact value is representable and ``rounding`` is 0). NaN / +inf / -inf positions must
match the oracle exactly; shapes, dtypes and devices must be the contract's.

Calibration (issue 3, 2026-11-30, S256 Skv512 H16 L128 576/512): bf16 rounding of the exact gradients costs
1.66e-3 relative L2; cuDNN's and TileLang's backward kernels on an H200 land at 2.26e-3 to 2.39e-3, about
1.4x, hence k = 2.5. The CPU emulation of such a kernel in tests/broken_backends.py (``EmulatedKernel``: P and
dS rounded to bf16 before their matmuls, Delta from the bf16 out, fp32 accumulation) lands at 2.32e-3 (dq)
and 2.35e-3 (dkv) on that shape, and there ``delta`` adds 2% to the bound (dq: allowed 4.24e-3 against
2.5 x 1.66e-3 = 4.15e-3). The operand term stays below the others on 576/512 cases (a survey of 60 drawn
cases: never the larger); on small dims it was the larger in 44 of 1200 cases, by 1.13x (median) to 1.8x.
"""

from __future__ import annotations

import math

import torch

from .. import contract
from .error_model import ALL_TERMS, ROW_DIMS
from .inputs import BACKWARD_OUTPUTS, FORWARD_OUTPUTS, as_f64, backend_inputs, call, has_forward, reference, truth_device
from .result import exception_summary, fmt_index, fmt_value, result

K_DEFAULT = 2.5

# Relative-L2 floors per tensor. A kernel rounds P and dS to bf16 before its matmuls: an error of the same
# order as the output rounding the model measures (the real kernels: 1.4x), which k covers on any
# tensor of more than a few elements. On a tensor of a handful of elements the output rounding can be nearly
# exact by luck while the intermediate rounding is not, so bf16 outputs also get SMALL_SAMPLE / sqrt(n): one
# 2^-7 relative unit spread over n elements (3.9e-3 at n = 4, 2.4e-4 at n = 1024, ~0 at production sizes).
# Survey with the emulation in tests/broken_backends.py (EmulatedKernel), 2026-11-30, whole model: 150 drawn
# 576/512 cases, worst ratio 0.87 (dkv), lse 0.04; 500 drawn small-dim cases, worst 0.90, except dkv with
# Dqk = 1 and Skv = 1 (one value summing every slot's dS with cancellation, no kernel has Dqk = 1): 3.6, and
# 1.03 (160 cases, one above 1) once the repeat term counted the coherent rounding of repeated rows.
FLOORS = {
    "dq": 1e-5,
    "dkv": 1e-5,
    "out": 1e-5,
    "d_sink": 1e-5,  # fp32 output: float32 math error ~1e-7; what a kernel adds comes from Delta (see below)
    "lse": 1e-5,     # fp32 exp/log (or exp2/log2 with approximate intrinsics): a few float32 ulps, 10x margin
}
SMALL_SAMPLE = 2.0 ** -7  # bf16 outputs only; divided by sqrt(number of finite elements)
COMPARE_BYTES = 1 << 30  # float64 temporaries of a comparison, per slice of the leading dimension


def structural_problem(name: str, value, expected_shape, *, device: str | None = None) -> str | None:
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


ULP_PASS = 1.5  # differences between bf16 values of one binade are whole ulps: < 1.5 means at most one


def bf16_ulp(x):
    """Spacing of bfloat16 values at |x| (float64 torch), at least the smallest subnormal 2^-133."""
    _, e = torch.frexp(x)
    ulp = torch.ldexp(torch.ones_like(x), (e - 8).to(torch.int32))
    return torch.where(x == 0, torch.full_like(x, 2.0 ** -133), ulp).clamp_min(2.0 ** -133)


def _slices(t):
    """Slices of the leading dimension whose float64 copies stay within COMPARE_BYTES."""
    per = max(1, t[0].numel() * 8) if t.dim() and t.shape[0] else 1
    step = max(1, COMPARE_BYTES // per)
    return [slice(i, i + step) for i in range(0, t.shape[0], step)] if t.dim() else [slice(None)]


def _whole_index(sl, idx) -> tuple:
    """An index into ``o[sl]`` as an index into ``o``."""
    idx = tuple(int(i) for i in idx)
    return (idx[0] + (sl.start or 0),) + idx[1:] if idx else idx


def _finite_slices(a, o):
    """Per slice of the leading dimension (``_slices``): (slice, the oracle in float64, where it is finite,
    kernel - oracle with 0 where it is not), on the oracle's device."""
    zero = torch.zeros((), dtype=torch.float64, device=o.device)
    for sl in _slices(o):
        oo = o[sl].to(torch.float64)
        fin = torch.isfinite(oo)
        yield sl, oo, fin, torch.where(fin, a[sl].to(o.device, torch.float64) - oo, zero)


def _nonfinite_mismatch(name, a, o):
    """The first class of NaN / +inf / -inf whose positions differ, as (entry fields, message), else None."""
    for label, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        count, first = 0, None
        for sl in _slices(o):
            bad = fn(a[sl]) != fn(o[sl])
            n = int(bad.sum())
            if n and first is None:
                first = _whole_index(sl, torch.nonzero(bad)[0])
            count += n
        if count:
            idx = first
            fields = dict(mismatches=count, worst_index=idx, worst_kernel=float(a[idx]), worst_oracle=float(o[idx]),
                          mode="nonfinite")
            return fields, (f"{name}: {label} positions differ from the oracle at {count} / {o.numel()} elements\n"
                            f"  first at index {fmt_index(idx)}: kernel {fmt_value(a[idx])}, "
                            f"oracle {fmt_value(o[idx])}")
    return None


def _row_sums(name, a, o, r):
    """Per row (``ROW_DIMS``): squared error, squared rounding, squared oracle norm, finite count and the
    largest difference in bf16 ulps; over the finite entries of the oracle. Float64 on o's device."""
    lead = ROW_DIMS.get(name, o.dim())
    out = {k: torch.zeros(o.shape[:lead], dtype=torch.float64, device=o.device) for k in ("err2", "ref2", "o2", "ulps")}
    out["n"] = torch.zeros(o.shape[:lead], dtype=torch.int64, device=o.device)
    red = tuple(range(lead, o.dim()))

    def total(x):
        return x.sum(red) if red else x

    for sl, oo, fin, d in _finite_slices(a, o):
        rz = torch.where(fin, r[sl].to(o.device, torch.float64) - oo, 0.0)
        oz = torch.where(fin, oo, 0.0)
        out["err2"][sl], out["ref2"][sl], out["o2"][sl] = total(d * d), total(rz * rz), total(oz * oz)
        out["n"][sl] = total(fin.long())
        if contract.KERNEL_DTYPES.get(name) == "bfloat16":
            ulps = (d.abs() / bf16_ulp(torch.maximum(a[sl].to(o.device, torch.float64).abs(), oo.abs())))
            ulps = ulps.masked_fill(~fin, 0)
            out["ulps"][sl] = ulps.amax(red) if red else ulps
    return out


def compare_tensor(name: str, kernel, oracle64, ref64, *, k: float = K_DEFAULT, floor: float | None = None,
                   terms: dict | None = None):
    """Compare one result with the float64 oracle under the error model, over the whole result and per row.

    terms: the error model's squared absolute errors per row ({"delta", "repeat", "operand"}: tensors of the
    result's row shape, ``error_model.row_terms``); none means zero.
    Returns (entry, problem): entry has error, allowed, ratio (the larger of the whole result's and the worst
    row's), reference_error, floor, k, mode, worst_row (index, error, allowed, ratio), mismatches, numel,
    worst_index, worst_kernel, worst_oracle; problem is a message block or None when it passes.
    """
    a = kernel.detach() if isinstance(kernel, torch.Tensor) else as_f64(kernel)
    o = oracle64.detach() if isinstance(oracle64, torch.Tensor) else as_f64(oracle64)
    r = ref64.detach() if isinstance(ref64, torch.Tensor) else as_f64(ref64)
    is_bf16 = contract.KERNEL_DTYPES.get(name) == "bfloat16"
    if floor is None:
        floor = FLOORS.get(name, 1e-5)
        small = SMALL_SAMPLE if is_bf16 else 0.0
    else:
        floor, small = float(floor), 0.0
    entry = {"error": math.inf, "allowed": floor, "ratio": math.inf, "reference_error": 0.0, "floor": floor,
             "k": k, "numel": int(o.numel())}
    if tuple(a.shape) != tuple(o.shape):
        return entry, f"{name}: shape {tuple(a.shape)} is not the oracle's {tuple(o.shape)}"
    bad = _nonfinite_mismatch(name, a, o)
    if bad is not None:
        entry.update(bad[0])
        return entry, bad[1]
    if math.isinf(k):  # no bound on the values: the structure and the nonfinite positions only
        entry.update(error=0.0, allowed=math.inf, ratio=0.0, mode="nonfinite only")
        return entry, None
    sums = _row_sums(name, a, o, r)
    zero = torch.zeros_like(sums["o2"])
    t2 = {t: (terms or {}).get(t, zero).to(zero.device, torch.float64) for t in ALL_TERMS}
    n_fin = int(sums["n"].sum())
    norm_o = math.sqrt(float(sums["o2"].sum()))
    scale = norm_o if norm_o > 0 else 1.0
    mode = "relative" if norm_o > 0 else "absolute"
    err = math.sqrt(float(sums["err2"].sum())) / scale
    ref_err = math.sqrt(float(sums["ref2"].sum())) / scale
    extras = {"Delta": math.sqrt(float(t2["delta"].sum())) / scale,
              "repeated rows": math.sqrt(float(t2["repeat"].sum())) / scale}
    operand = math.sqrt(float(t2["operand"].sum())) / scale
    # the whole result: output rounding and, independent of it, Delta from the bf16 out and coherent operand
    # rounding on repeated rows; or the operands' rounding where the result cancels
    model_err = max(math.hypot(ref_err, *extras.values()), operand)
    unsummed = (terms or {}).get("unsummed")
    u_norm = torch.zeros_like(sums["o2"]) if unsummed is None else unsummed.to(zero.device, torch.float64).sqrt()
    spread = max(1.0, float(u_norm.square().sum().sqrt()) / scale)  # cancellation: the floor on the terms' norm
    whole_floor = floor * spread + small / math.sqrt(max(n_fin, 1))
    allowed = k * model_err + whole_floor
    ratio = err / allowed if allowed > 0 else (0.0 if err == 0 else math.inf)
    ulps = float(sums["ulps"].max()) if sums["ulps"].numel() and is_bf16 else None
    if ulps is not None:
        ratio = min(ratio, ulps / ULP_PASS)
    # row by row: the same model on each row, the floor on the row's own norm plus a typical row's share
    # an all-zero oracle has no row scale: the absolute whole-result measure is the only one
    rows = sums["o2"].numel() if mode == "relative" else 0
    row_norm = sums["o2"].sqrt()
    typical = norm_o / math.sqrt(max(rows, 1))
    row_model = torch.maximum((sums["ref2"] + t2["delta"] + t2["repeat"]).sqrt(), t2["operand"].sqrt())
    row_floor = floor * (torch.maximum(row_norm, u_norm) + typical) + small / sums["n"].clamp_min(1).sqrt() * row_norm
    row_allowed = k * row_model + row_floor
    row_err = sums["err2"].sqrt()
    row_ratio = torch.where(row_allowed > 0, row_err / row_allowed.clamp_min(1e-300),
                            torch.where(row_err > 0, math.inf, 0.0))
    if is_bf16:
        row_ratio = torch.minimum(row_ratio, sums["ulps"] / ULP_PASS)
    worst_flat = int(torch.argmax(row_ratio.reshape(-1))) if rows else 0
    worst_row = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst_flat), tuple(row_ratio.shape))) \
        if rows else ()
    w_ratio = float(row_ratio.reshape(-1)[worst_flat]) if rows else 0.0
    over = int((row_ratio >= 1).sum()) if rows else 0
    entry.update(error=err, allowed=allowed, reference_error=ref_err, mode=mode, delta_error=extras["Delta"],
                 repeat_error=extras["repeated rows"], operand_error=operand,
                 whole_ratio=ratio, ratio=max(ratio, w_ratio), rows_over=over,
                 worst_row={"index": worst_row, "ratio": w_ratio, "rows": rows,
                            "error": float(row_err.reshape(-1)[worst_flat]) if rows else 0.0,
                            "allowed": float(row_allowed.reshape(-1)[worst_flat]) if rows else 0.0,
                            "norm": float(row_norm.reshape(-1)[worst_flat]) if rows else 0.0})
    if ulps is not None:
        entry["max_ulps"] = ulps
    if entry["ratio"] < 1:
        return entry, None
    parts = "".join(f", {src} {v:.3e}" for src, v in extras.items() if v)
    if operand:
        parts += f"; operands rounded {operand:.3e}" + (", the larger" if model_err == operand else "")
    lines = []
    if ratio >= 1:
        what = "relative L2 error" if mode == "relative" else "absolute L2 error (oracle is all zero)"
        lines.append(f"{name}: {what} {err:.3e} > allowed {allowed:.3e} "
                     f"(= {k:g} x bf16 model error {model_err:.3e} [output rounding {ref_err:.3e}{parts}] "
                     f"+ floor {whole_floor:.2e}); ratio {ratio:.3g}")
    if w_ratio >= 1:
        wr = entry["worst_row"]
        rel = f" ({wr['error'] / wr['norm']:.3e} of its norm)" if wr["norm"] > 0 else ""
        lines.append(f"{name}: {over} of {rows} rows over their allowance; the worst, row {fmt_index(worst_row)}"
                     f" ({_row_names(name)}), is off by {wr['error']:.3e}{rel} > allowed {wr['allowed']:.3e} "
                     f"for that row; ratio {w_ratio:.3g}")
    fields, text = _worst_elements(a, o, allowed, norm_o, n_fin, mode)
    entry.update(fields)
    lines.append(text)
    if ulps is not None:
        lines.append(f"  Largest difference in bf16 ulps: {ulps:.3g} (a result within 1 ulp everywhere would pass)")
    return entry, "\n".join(lines)


def _row_names(name: str) -> str:
    return {"dq": "b, query, head", "out": "b, query, head", "lse": "b, query, head", "dkv": "b, KV row",
            "d_sink": "head"}.get(name, "row")


def _largest(sl, x) -> tuple:
    """(the largest value of ``x``, shaped like ``o[sl]``; its index into ``o``)."""
    flat = int(torch.argmax(x.reshape(-1)))
    return float(x.reshape(-1)[flat]), _whole_index(sl, torch.unravel_index(torch.tensor(flat), tuple(x.shape)))


def _worst_elements(a, o, allowed, norm_o, n_fin, mode):
    """The elementwise view of a failure: mismatches against allowed x (|oracle| + rms), the worst element and
    the greatest absolute difference, as (entry fields, message lines)."""
    rms = norm_o / math.sqrt(max(n_fin, 1))
    mism, worst, top = 0, (-1.0, None), (-1.0, None)
    for sl, oo, fin, d in _finite_slices(a, o):
        d = d.abs()
        bound = allowed * (torch.where(fin, oo, 0.0).abs() + rms) if mode == "relative" else \
            torch.full_like(oo, allowed)
        excess = torch.nan_to_num(d / bound.clamp_min(1e-300), nan=math.inf)
        mism += int((d > bound).sum())
        worst = max(worst, _largest(sl, excess), key=lambda t: t[0])  # ties keep the first
        top = max(top, _largest(sl, d), key=lambda t: t[0])
    idx, amax = worst[1], top[1]
    pct = 100.0 * mism / max(o.numel(), 1)
    fields = dict(mismatches=mism, worst_index=idx, worst_kernel=float(a[idx]), worst_oracle=float(o[idx]))
    return fields, (f"  Mismatched elements: {mism} / {o.numel()} ({pct:.1f}%) [bound per element: allowed x "
            f"(|oracle| + rms(oracle))]\n"
            f"  Worst element at index {fmt_index(idx)}: kernel {fmt_value(a[idx])}, oracle {fmt_value(o[idx])} "
            f"(abs diff {fmt_value(abs(float(a[idx]) - float(o[idx])))}, {fmt_value(worst[0])}x its bound)\n"
            f"  Greatest absolute difference: {fmt_value(top[0])} at index {fmt_index(amax)}")


def compare_outputs(names, results: dict, case, *, k=K_DEFAULT, floor=None, device=None, sink_given=None):
    """Structure + error model for a set of named results. Returns (per_tensor, problems, worst_ratio)."""
    dims = case.dims
    ref = reference(case, truth_device(device, case))
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
        prob = structural_problem(name, val, dims.shape(name), device=device)
        if prob:
            problems.append(prob)
            per_tensor[name] = {"error": math.inf, "allowed": 0.0, "ratio": math.inf, "problem": prob}
            worst = math.inf
            continue
        entry, prob = compare_tensor(name, val, ref.o64[name], ref.ref[name], k=k, floor=floors.get(name),
                                     terms=ref.terms.get(name))
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
        dq, dkv, d_sink = _unpack(call(backend, "backward", t), 3, "backward")
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
        out, lse = _unpack(call(backend, "forward", t), 2, "forward")
    except Exception as exc:
        return result(check, backend, case, [f"forward raised {exception_summary(exc)}"], ratio=math.inf,
                      per_tensor={})
    per_tensor, problems, worst = compare_outputs(FORWARD_OUTPUTS, {"out": out, "lse": lse}, case, k=k,
                                                  floor=floor, device=getattr(backend, "device", None))
    return result(check, backend, case, problems, ratio=worst, per_tensor=per_tensor)
