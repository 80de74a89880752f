"""``sparse-mqa-bench``'s results as a Markdown table and as plots of the S and L sweeps."""

from __future__ import annotations

from dataclasses import asdict

PEER = "cudnn"  # the backward every row is compared with


def row(direction, name, shape, groups, **kw) -> dict:
    """One result row: a backend at a shape, its timing or why it has none."""
    return {"direction": direction, "backend": name, "shape": shape.label, "groups": sorted(groups),
            **asdict(shape), "status": "ok", "reason": None, "ms": None, "ms_min": None, "runs": 0,
            "tflops": None, "vs_cudnn": None, "vs_cudnn_rounds": None, "ms_rounds": [], "stable": None, "drift": {},
            **kw}


def add_ratios(rows) -> None:
    """vs_cudnn = ms / cuDNN's backward ms at the same shape (lower is faster); None without a cuDNN row.
    vs_cudnn_rounds = [lowest, highest] of the same ratio round by round (the backends' per-round medians), where
    both rows have the same rounds, more than one (None on cuDNN's own row)."""
    peer = {r["shape"]: r for r in rows if r["backend"] == PEER and r["direction"] == "backward" and r["ms"]}
    for r in rows:
        if r["ms"] and r["direction"] == "backward" and r["shape"] in peer:
            p = peer[r["shape"]]
            r["vs_cudnn"] = r["ms"] / p["ms"]
            mine, theirs = r.get("ms_rounds") or [], p.get("ms_rounds") or []
            if r is not p and len(mine) > 1 and len(mine) == len(theirs):
                ratios = [a / b for a, b in zip(mine, theirs)]
                r["vs_cudnn_rounds"] = [min(ratios), max(ratios)]


def _fmt_tflops(v: float) -> str:
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def fmt_status(row) -> str:
    if row["status"] != "ok":
        return f"{row['status']} ({row['reason']})"
    return f"{row['ms']:.3f} ms, {_fmt_tflops(row['tflops'])} TFLOP/s"


def _fmt_ratio(row) -> str:
    if row["vs_cudnn"] is None:
        return "-"
    spread = row.get("vs_cudnn_rounds")
    if not spread:
        return f"{row['vs_cudnn']:.2f}x"
    return f"{row['vs_cudnn']:.2f}x ({spread[0]:.2f}-{spread[1]:.2f})"


def _fmt_stable(row) -> str:
    if row["stable"] is None:
        return "-"
    if row["stable"]:
        return "yes"
    return "no (" + ", ".join(f"{k} {v:.2g}" for k, v in sorted(row["drift"].items())) + ")"


def format_table(rows) -> str:
    """A Markdown table: direction, backend, shape, ms (median), TFLOP/s, vs cuDNN (with the range of the
    per-round ratios), bitwise stable."""
    head = ["dir", "backend", "shape", "ms", "TFLOP/s", "vs cuDNN", "bitwise stable"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["direction"], r["backend"], r["shape"], r["status"], "-", "-", r["reason"] or "-"]
        else:
            cells = [r["direction"], r["backend"], r["shape"], f"{r['ms']:.3f}", _fmt_tflops(r["tflops"]),
                     _fmt_ratio(r), _fmt_stable(r)]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """ms and TFLOP/s against S (sweep_s rows) and against L (sweep_l rows), one line per backend+direction."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (group, x) in enumerate((("sweep_s", "S"), ("sweep_l", "L"))):
        series: dict[str, list] = {}
        for r in results["rows"]:
            if group in r["groups"] and r["status"] == "ok":
                series.setdefault(f"{r['backend']} {r['direction']}", []).append(r)
        for label, rs in sorted(series.items()):
            rs.sort(key=lambda r: r[x])
            axes[0][col].plot([r[x] for r in rs], [r["ms"] for r in rs], marker="o", label=label)
            axes[1][col].plot([r[x] for r in rs], [r["tflops"] for r in rs], marker="o", label=label)
        axes[0][col].set(xlabel=x, ylabel="ms (median)", title=f"time vs {x}", yscale="log")
        axes[1][col].set(xlabel=x, ylabel="TFLOP/s", title=f"throughput vs {x}")
        ticks = sorted({r[x] for rs in series.values() for r in rs})
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)  # the sweeps double; label the measured points themselves
            if ticks:
                ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.suptitle(f"sparse MQA on {results['device']} ({results['date']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib, which is not installed ({exc}): pip install matplotlib "
                         "(or plot later from the JSON: sparse-mqa-bench --from-json RESULTS --plot PATH)")
    return plt
