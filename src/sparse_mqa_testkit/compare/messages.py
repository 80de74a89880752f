"""How comparisons read, in the manner of ``torch.testing.assert_close``: the result, measured vs allowed,
the mismatch count, the worst row and element with its index and both values."""

from __future__ import annotations


def fmt_index(idx) -> str:
    return "(" + ", ".join(str(int(i)) for i in idx) + ("," if len(idx) == 1 else "") + ")"


def fmt_value(v) -> str:
    return f"{float(v):.6g}"


ROW_NAMES = {"dq": "b, query, head", "out": "b, query, head", "lse": "b, query, head", "dkv": "b, KV row",
             "d_sink": "head"}


def nonfinite(name: str, nf, numel: int, kernel, oracle) -> str:
    idx = nf.index
    return (f"{name}: {nf.label} positions differ from the oracle at {nf.count} / {numel} elements\n"
            f"  first at index {fmt_index(idx)}: kernel {fmt_value(kernel[idx])}, oracle {fmt_value(oracle[idx])}")


def over_tolerance(name: str, m, al, v, el, kernel, oracle) -> str:
    """The failure block of one result: the whole result's line and/or the worst row's, then the elements."""
    parts = "".join(f", {src} {x:.3e}" for src, x in al.extras.items() if x)
    if al.operand:
        parts += f"; operands rounded {al.operand:.3e}" + (", the larger" if al.model_err == al.operand else "")
    lines = []
    if v.whole_ratio >= 1:
        what = "relative L2 error" if m.mode == "relative" else "absolute L2 error (oracle is all zero)"
        lines.append(f"{name}: {what} {m.err:.3e} > allowed {al.allowed:.3e} "
                     f"(= {al.k:g} x bf16 model error {al.model_err:.3e} [output rounding {m.ref_err:.3e}{parts}] "
                     f"+ floor {al.floor:.2e}); ratio {v.whole_ratio:.3g}")
    if v.row_ratio >= 1:
        wr = v.worst_row
        rel = f" ({wr['error'] / wr['norm']:.3e} of its norm)" if wr["norm"] > 0 else ""
        lines.append(f"{name}: {v.rows_over} of {wr['rows']} rows over their allowance; the worst, row "
                     f"{fmt_index(wr['index'])} ({ROW_NAMES.get(name, 'row')}), is off by {wr['error']:.3e}{rel} > "
                     f"allowed {wr['allowed']:.3e} for that row; ratio {v.row_ratio:.3g}")
    idx, amax = el.worst_index, el.top_index
    pct = 100.0 * el.mismatches / max(oracle.numel(), 1)
    lines.append(f"  Mismatched elements: {el.mismatches} / {oracle.numel()} ({pct:.1f}%) [bound per element: "
                 f"allowed x (|oracle| + rms(oracle))]\n"
                 f"  Worst element at index {fmt_index(idx)}: kernel {fmt_value(kernel[idx])}, oracle "
                 f"{fmt_value(oracle[idx])} (abs diff {fmt_value(abs(float(kernel[idx]) - float(oracle[idx])))}, "
                 f"{fmt_value(el.worst_excess)}x its bound)\n"
                 f"  Greatest absolute difference: {fmt_value(el.top_diff)} at index {fmt_index(amax)}")
    if m.max_ulps is not None:
        lines.append(f"  Largest difference in bf16 ulps: {m.max_ulps:.3g} (a result within 1 ulp everywhere would "
                     "pass)")
    return "\n".join(lines)
