"""``sparse-mqa-bench``: forward and backward backends timed side by side in one process.

Per shape, every backend runs on the same few input sets (rotated, so no run is flattered by warm caches),
after warm-up, timed with CUDA events (wall clock on CPU); the table reports the median. Backward rows also say
whether the backend is bitwise stable (the backward repeated on one input set, every output ``torch.equal``)
and, when not, how far the repeats drift. Backends are registry names (``sparse_mqa_testkit.backends``); one
that fails to import or load is reported as skipped with the reason.

The backward needs ``out`` and ``lse``: they come from the first forward backend that runs at that shape, else
from ``contract_forward`` (the contract's forward in float32 torch, chunked, on the bench device).

FLOP counts (B = 1 in the issue's formulas; multiplied by B here):
    forward  2 * H * L * (Dqk + Dv) * S * B
    backward 2 * H * L * (3 * Dqk + 2 * Dv) * S * B
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from . import contract

PEER = "cudnn"  # the backward every row is compared with


@dataclass(frozen=True)
class Shape:
    S: int
    Skv: int
    H: int
    L: int
    B: int = 1
    Dqk: int = contract.DQK
    Dv: int = contract.DV

    @property
    def label(self) -> str:
        return f"B{self.B} S{self.S} Skv{self.Skv} H{self.H} L{self.L}"

    @property
    def dims(self) -> contract.Dims:
        return contract.Dims(B=self.B, S=self.S, H=self.H, Dqk=self.Dqk, Dv=self.Dv, Skv=self.Skv, L=self.L)


def flops(shape: Shape, direction: str) -> int:
    """Matmul FLOPs of one call: QK^T and PV forward; QK^T, dO V^T, dS K, dS^T Q and P^T dO backward."""
    per_dim = {"forward": shape.Dqk + shape.Dv, "backward": 3 * shape.Dqk + 2 * shape.Dv}[direction]
    return 2 * shape.H * shape.L * per_dim * shape.S * shape.B


def tflops(shape: Shape, direction: str, ms: float) -> float:
    return flops(shape, direction) / (ms * 1e-3) / 1e12


# ---- which shapes -----------------------------------------------------------------------------------------------

ANCHOR = dict(S=4096, Skv=8192)
ANCHOR_H = (64, 128)
ANCHOR_L = (512, 2048)
SWEEP_S = (1024, 2048, 4096, 8192)
SWEEP_L = (256, 512, 1024, 2048)


def plan_shapes(*, heads=ANCHOR_H, topks=ANCHOR_L, S=ANCHOR["S"], Skv=ANCHOR["Skv"], B=1, sweep_s=SWEEP_S,
                sweep_l=SWEEP_L, sweep_h=64, sweep_at_l=2048, Dqk=contract.DQK, Dv=contract.DV):
    """[(Shape, {groups})]: the anchor grid (H x L), the S sweep (at sweep_h, sweep_at_l) and the L sweep
    (at sweep_h, S); a shape that belongs to several groups is run once."""
    groups: dict[Shape, set] = {}
    for h in heads:
        for l in topks:
            groups.setdefault(Shape(S=S, Skv=Skv, H=h, L=l, B=B, Dqk=Dqk, Dv=Dv), set()).add("anchor")
    for s in sweep_s:
        groups.setdefault(Shape(S=s, Skv=Skv, H=sweep_h, L=sweep_at_l, B=B, Dqk=Dqk, Dv=Dv), set()).add("sweep_s")
    for l in sweep_l:
        groups.setdefault(Shape(S=S, Skv=Skv, H=sweep_h, L=l, B=B, Dqk=Dqk, Dv=Dv), set()).add("sweep_l")
    return list(groups.items())


# ---- inputs -----------------------------------------------------------------------------------------------------

def make_inputs(shape: Shape, device, seed: int, sink: bool = False) -> dict:
    """One input set on ``device``: q, kv, grad_out bf16 N(0, 1); distinct random top-k indices per row."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    B, S, Skv, H, L = shape.B, shape.S, shape.Skv, shape.H, shape.L
    q = torch.randn(B, S, H, shape.Dqk, generator=g, device=device).to(torch.bfloat16)
    kv = torch.randn(B, Skv, shape.Dqk, generator=g, device=device).to(torch.bfloat16)
    grad_out = torch.randn(B, S, H, shape.Dv, generator=g, device=device).to(torch.bfloat16)
    idx = torch.empty(B, S, L, dtype=torch.int32, device=device)
    rows = max(1, (1 << 24) // Skv)  # argsort of random keys, a few rows at a time: distinct slots per row
    for b in range(B):
        for i in range(0, S, rows):
            n = min(rows, S - i)
            keys = torch.rand(n, Skv, generator=g, device=device)
            idx[b, i:i + n] = keys.argsort(dim=-1)[:, :L].to(torch.int32) if L <= Skv else \
                torch.randint(0, Skv, (n, L), generator=g, device=device, dtype=torch.int32)
    attn_sink = torch.randn(H, generator=g, device=device) if sink else None
    return {"q": q, "kv": kv, "indices": idx, "grad_out": grad_out, "attn_sink": attn_sink, "topk_length": None,
            "sm_scale": 1.0 / math.sqrt(shape.Dqk), "d_v": shape.Dv}


def contract_forward(q, kv, indices, sm_scale, d_v, *, attn_sink=None, topk_length=None, chunk_rows=None):
    """The contract's forward in float32 torch, a chunk of query rows at a time (bench inputs only).

    Returns (out bf16 [B,S,H,Dv], lse fp32 [B,S,H]); used when no forward backend runs at a shape.
    """
    import torch

    B, S, H, Dqk = q.shape
    Skv, L = kv.shape[1], indices.shape[2]
    out = torch.empty(B, S, H, d_v, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(B, S, H, dtype=torch.float32, device=q.device)
    if chunk_rows is None:
        chunk_rows = max(1, (1 << 28) // (L * Dqk * 4))  # ~1 GiB of gathered fp32 kv per chunk
    slot = torch.arange(L, device=q.device)
    for b in range(B):
        kvb = kv[b].float()
        for i in range(0, S, chunk_rows):
            j = min(S, i + chunk_rows)
            idx = indices[b, i:j].long()
            valid = (idx >= 0) & (idx < Skv)
            if topk_length is not None:
                valid &= slot < topk_length[b, i:j, None]
            g = kvb[torch.where(valid, idx, 0)]  # [n, L, Dqk]
            s = torch.einsum("nhd,nld->nhl", q[b, i:j].float(), g) * sm_scale
            s = s.masked_fill(~valid[:, None, :], float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)
            row_lse = torch.where(valid.any(-1)[:, None], row_lse, torch.full_like(row_lse, float("inf")))
            denom = row_lse if attn_sink is None else torch.logaddexp(row_lse, attn_sink.float()[None, :])
            p = torch.exp(s - denom[..., None]).masked_fill(~valid[:, None, :], 0.0)
            out[b, i:j] = torch.einsum("nhl,nld->nhd", p, g[..., :d_v]).to(torch.bfloat16)
            lse[b, i:j] = row_lse
    return out, lse


# ---- timing -----------------------------------------------------------------------------------------------------

def _sync(device):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(call, n_sets: int, warmup: int, iters: int, device) -> list[float]:
    """Milliseconds of ``call(k)`` for k rotating over the input sets, after ``warmup`` untimed calls."""
    import torch

    for k in range(warmup):
        call(k % n_sets)
    _sync(device)
    if str(device).startswith("cuda"):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for k, (start, end) in enumerate(events):
            start.record()
            call(k % n_sets)
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for k in range(iters):
        t0 = time.perf_counter()
        call(k % n_sets)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def stability(call, repeats: int, names=("dq", "dkv", "d_sink")) -> tuple[bool, dict]:
    """Repeat ``call()`` and compare every output with the first by ``torch.equal``.

    Returns (all bitwise equal, {output name: max |difference| over the repeats} for those that differ).
    """
    import torch

    first = [None if t is None else t.clone() for t in call()]
    drift: dict[str, float] = {}
    for _ in range(repeats - 1):
        again = call()
        for name, a, b in zip(names, first, again):
            if a is None or torch.equal(a, b):
                continue
            d = (a.float() - b.float()).abs().nan_to_num(nan=float("inf")).max().item()
            drift[name] = max(drift.get(name, 0.0), d)
    return not drift, drift


# ---- running ----------------------------------------------------------------------------------------------------

def _row(direction, name, shape, groups, **kw) -> dict:
    row = {"direction": direction, "backend": name, "shape": shape.label, "groups": sorted(groups),
           **asdict(shape), "status": "ok", "reason": None, "ms": None, "ms_min": None, "runs": 0,
           "tflops": None, "vs_cudnn": None, "stable": None, "drift": {}}
    row.update(kw)
    return row


def _load(name: str, device: str):
    """(backend, None) or (None, reason) for a registry name; the reason ends up in the table."""
    from .backends import get_backend

    try:
        backend = get_backend(name)
        require = getattr(backend, "require", None)
        if callable(require):
            require()
    except Exception as exc:  # any import/load failure is a skip, not a crash
        return None, f"{type(exc).__name__}: {exc}"
    if getattr(backend, "device", "cpu") == "cuda" and not device.startswith("cuda"):
        return None, f"needs a CUDA device, bench device is {device}"
    return backend, None


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def run(shapes, *, backward=("cudnn", "tilelang"), forward=("tilelang",), device="cuda", sets=3, warmup=3,
        iters=20, repeats=3, sink=False, quiet=False, checkpoint=None) -> dict:
    """Time every backend at every shape; returns the JSON-able results (see ``main`` for the CLI).

    ``checkpoint(results)`` (optional) gets the results so far after each shape, so a run cut short by a time
    limit still leaves its finished rows.
    """
    import torch

    settings = {"sets": sets, "warmup": warmup, "iters": iters, "repeats": repeats, "sink": sink}
    fwd = {n: _load(n, device) for n in forward}
    bwd = {n: _load(n, device) for n in backward}
    rows = []
    total = len(shapes) * (len(fwd) + len(bwd))
    done = 0
    for shape, groups in shapes:
        _progress(f"[{shape.label}] making {sets} input sets on {device}", quiet)
        inputs = [make_inputs(shape, device, seed=k, sink=sink) for k in range(sets)]
        primal = None  # (out, lse) per set, from the first forward that runs
        source = None
        for name, (backend, reason) in fwd.items():
            done += 1
            if backend is None:
                rows.append(_row("forward", name, shape, groups, status="skipped", reason=reason))
                continue
            row, results = _time_forward(backend, name, shape, groups, inputs, warmup, iters, device)
            rows.append(row)
            _progress(f"[{done}/{total}] forward {name:10s} {shape.label}: {_fmt_status(row)}", quiet)
            if primal is None and results is not None:
                primal, source = results, name
        if primal is None:
            source = "contract_forward (torch float32)"
            primal = [contract_forward(x["q"], x["kv"], x["indices"], x["sm_scale"], x["d_v"],
                                       attn_sink=x["attn_sink"]) for x in inputs]
        for name, (backend, reason) in bwd.items():
            done += 1
            if backend is None:
                rows.append(_row("backward", name, shape, groups, status="skipped", reason=reason))
                continue
            row = _time_backward(backend, name, shape, groups, inputs, primal, warmup, iters, repeats, device)
            row["primal_from"] = source
            rows.append(row)
            _progress(f"[{done}/{total}] backward {name:10s} {shape.label}: {_fmt_status(row)}", quiet)
        del inputs, primal
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(_results(rows, device, settings))
    return _results(rows, device, settings)


def _results(rows, device, settings) -> dict:
    import torch

    rows = [dict(r) for r in rows]
    _add_ratios(rows)
    return {"device": _device_name(device), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "settings": settings, "rows": rows}


def _skip_or_error(exc) -> tuple[str, str]:
    kind = "skipped" if isinstance(exc, (ImportError, ValueError, NotImplementedError)) else "error"
    return kind, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _time_forward(backend, name, shape, groups, inputs, warmup, iters, device):
    results = []

    def call(k):
        x = inputs[k]
        return backend.forward(x["q"], x["kv"], x["indices"], x["sm_scale"], x["d_v"], attn_sink=x["attn_sink"],
                               topk_length=x["topk_length"])

    try:
        results = [call(k) for k in range(len(inputs))]  # first calls also compile
        times = time_calls(call, len(inputs), warmup, iters, device)
    except Exception as exc:
        status, reason = _skip_or_error(exc)
        return _row("forward", name, shape, groups, status=status, reason=reason), None
    ms = statistics.median(times)
    return _row("forward", name, shape, groups, ms=ms, ms_min=min(times), runs=len(times),
                tflops=tflops(shape, "forward", ms)), results


def _time_backward(backend, name, shape, groups, inputs, primal, warmup, iters, repeats, device):
    def call(k):
        x = inputs[k]
        out, lse = primal[k]
        return backend.backward(x["q"], x["kv"], out, x["grad_out"], lse, x["attn_sink"], x["indices"],
                                x["sm_scale"], topk_length=x["topk_length"])

    try:
        call(0)  # compile / JIT outside the timed runs
        times = time_calls(call, len(inputs), warmup, iters, device)
        stable, drift = stability(lambda: call(0), repeats)
    except Exception as exc:
        status, reason = _skip_or_error(exc)
        return _row("backward", name, shape, groups, status=status, reason=reason)
    ms = statistics.median(times)
    return _row("backward", name, shape, groups, ms=ms, ms_min=min(times), runs=len(times),
                tflops=tflops(shape, "backward", ms), stable=stable, drift=drift)


def _add_ratios(rows) -> None:
    """vs_cudnn = ms / cuDNN's backward ms at the same shape (lower is faster); None without a cuDNN row."""
    peer = {r["shape"]: r["ms"] for r in rows if r["backend"] == PEER and r["direction"] == "backward"
            and r["ms"]}
    for r in rows:
        if r["ms"] and r["direction"] == "backward" and r["shape"] in peer:
            r["vs_cudnn"] = r["ms"] / peer[r["shape"]]


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


# ---- output -----------------------------------------------------------------------------------------------------

def _fmt_tflops(v: float) -> str:
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def _fmt_status(row) -> str:
    if row["status"] != "ok":
        return f"{row['status']} ({row['reason']})"
    return f"{row['ms']:.3f} ms, {_fmt_tflops(row['tflops'])} TFLOP/s"


def _fmt_stable(row) -> str:
    if row["stable"] is None:
        return "-"
    if row["stable"]:
        return "yes"
    return "no (" + ", ".join(f"{k} {v:.2g}" for k, v in sorted(row["drift"].items())) + ")"


def format_table(rows) -> str:
    """A Markdown table: direction, backend, shape, ms (median), TFLOP/s, vs cuDNN, bitwise stable."""
    head = ["dir", "backend", "shape", "ms", "TFLOP/s", "vs cuDNN", "bitwise stable"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["direction"], r["backend"], r["shape"], r["status"], "-", "-", r["reason"] or "-"]
        else:
            cells = [r["direction"], r["backend"], r["shape"], f"{r['ms']:.3f}", _fmt_tflops(r["tflops"]),
                     "-" if r["vs_cudnn"] is None else f"{r['vs_cudnn']:.2f}x", _fmt_stable(r)]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """ms and TFLOP/s against S (sweep_s rows) and against L (sweep_l rows), one line per backend+direction."""
    plt = _pyplot()
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


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib, which is not installed ({exc}): pip install matplotlib "
                         "(or plot later from the JSON: sparse-mqa-bench --from-json RESULTS --plot PATH)")
    return plt


# ---- CLI --------------------------------------------------------------------------------------------------------

def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sparse-mqa-bench",
        description="Time forward and backward backends side by side (CUDA events, median over rotated input "
                    "sets); print a table, write JSON, optionally plot the S and L sweeps.")
    p.add_argument("--backward", type=_names, default=("cudnn", "tilelang"),
                   help="comma-separated backward backends (registry names; default cudnn,tilelang)")
    p.add_argument("--forward", type=_names, default=("tilelang",),
                   help="comma-separated forward backends; '' for none (default tilelang)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--heads", type=_ints, default=ANCHOR_H, help="anchor H values (default 64,128)")
    p.add_argument("--topk", type=_ints, default=ANCHOR_L, help="anchor L values (default 512,2048)")
    p.add_argument("--seq", type=int, default=ANCHOR["S"], help="anchor S (default 4096)")
    p.add_argument("--kv-len", type=int, default=ANCHOR["Skv"], help="Skv (default 8192)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dims", type=_ints, default=(contract.DQK, contract.DV), help="Dqk,Dv (default 576,512)")
    p.add_argument("--sweep-s", type=_ints, default=SWEEP_S, help="S values of the S sweep; '' for none")
    p.add_argument("--sweep-l", type=_ints, default=SWEEP_L, help="L values of the L sweep; '' for none")
    p.add_argument("--sweep-h", type=int, default=64, help="H of both sweeps (default 64)")
    p.add_argument("--sweep-at-l", type=int, default=2048, help="L of the S sweep (default 2048)")
    p.add_argument("--sets", type=int, default=3, help="input sets rotated over the runs (default 3)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20, help="timed runs per row; the median is reported")
    p.add_argument("--repeats", type=int, default=3, help="backward repeats for the bitwise-stability column")
    p.add_argument("--sink", action="store_true", help="give every head a finite attn_sink")
    p.add_argument("--json", dest="json_path", default="sparse-mqa-bench.json", help="where to write results")
    p.add_argument("--plot", default=None, help="draw the sweeps into this image (needs matplotlib)")
    p.add_argument("--from-json", default=None, help="skip running: print/plot an earlier results file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        _pyplot()  # fail before any timing if it cannot be drawn
    if args.from_json:
        with open(args.from_json) as fh:
            results = json.load(fh)
    else:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no CUDA device")
        dqk, dv = args.dims
        shapes = plan_shapes(heads=args.heads, topks=args.topk, S=args.seq, Skv=args.kv_len, B=args.batch,
                             sweep_s=args.sweep_s, sweep_l=args.sweep_l, sweep_h=args.sweep_h,
                             sweep_at_l=args.sweep_at_l, Dqk=dqk, Dv=dv)
        command = "sparse-mqa-bench " + " ".join(sys.argv[1:] if argv is None else argv)

        def save(results, partial=True):
            with open(args.json_path, "w") as fh:
                json.dump({**results, "command": command, "partial": partial}, fh, indent=1)

        results = run(shapes, backward=args.backward, forward=args.forward, device=device, sets=args.sets,
                      warmup=args.warmup, iters=args.iters, repeats=args.repeats, sink=args.sink,
                      quiet=args.quiet, checkpoint=save)
        save(results, partial=False)
    print(f"{results['device']}, {results['date']}")
    print(format_table(results["rows"]))
    if not args.from_json:
        print(f"\nresults: {args.json_path}")
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
