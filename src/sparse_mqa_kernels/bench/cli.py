"""``sparse-mqa-bench``: forward and backward backends timed side by side in one process.

Per shape, every backend runs on the same few input sets (rotated, so no run is flattered by warm caches),
after warm-up, timed with CUDA events (wall clock on CPU); the table reports the median. With ``--rounds`` the
backward backends take turns (ABBA, each turn after its own warm-up), so drift over the run weighs on them alike,
and the ratio to cuDNN comes with its range over the rounds. Backward rows also say
whether the backend is bitwise stable (the backward repeated on one input set, every output ``torch.equal``)
and, when not, how far the repeats drift. Backends are registry names (``sparse_mqa_testkit.backends``); one
that fails to import or load is reported as skipped with the reason.

The backward needs ``out`` and ``lse``: they come from the first forward backend that runs at that shape, else
from the testkit's device oracle (float64 on the bench device, rounded to the kernel dtypes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from sparse_mqa_testkit import contract
from sparse_mqa_testkit.backends import BackendSpec, get_backend
from sparse_mqa_testkit.calls import Call
from sparse_mqa_testkit.oracle import device as device_oracle

from .report import add_ratios, fmt_status, format_table, plot, pyplot, row
from .shapes import ANCHOR, ANCHOR_H, ANCHOR_L, INDICES, PRESETS, SWEEP_L, SWEEP_S, make_inputs, plan_shapes, tflops
from .timing import stability, time_calls, time_rounds


def oracle_primal(x: dict) -> tuple:
    """(out bf16, lse fp32) of one input set from the device oracle: what a forward kernel would return."""
    out, lse = device_oracle.forward(**Call(x).oracle_args("forward"))
    return out.to(torch.bfloat16), lse.to(torch.float32)


def _load(name: str, device: str):
    """(backend, None) or (None, reason) for a registry name; the reason ends up in the table."""
    try:
        spec = BackendSpec.of(get_backend(name))
        spec.require()
    except Exception as exc:  # any import/load failure is a skip, not a crash
        return None, f"{type(exc).__name__}: {exc}"
    if spec.is_cuda and not device.startswith("cuda"):
        return None, f"needs a CUDA device, bench device is {device}"
    return spec.backend, None


def _progress(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def run(shapes, *, backward=("cudnn", "tilelang"), forward=("tilelang",), device="cuda", sets=3, warmup=3,
        iters=20, rounds=1, repeats=3, sink=False, indices="random", quiet=False, checkpoint=None) -> dict:
    """Time every backend at every shape; returns the JSON-able results (see ``main`` for the CLI).

    ``checkpoint(results)`` (optional) gets the results so far after each shape, so a run cut short by a time
    limit still leaves its finished rows.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    rounds = min(rounds, iters)  # a round has at least one call of each backend
    settings = {"sets": sets, "warmup": warmup, "iters": iters, "rounds": rounds, "repeats": repeats, "sink": sink,
                "indices": indices}
    fwd = {n: _load(n, device) for n in forward}
    bwd = {n: _load(n, device) for n in backward}
    rows = []
    total = len(shapes) * (len(fwd) + len(bwd))
    done = 0
    for shape, groups in shapes:
        _progress(f"[{shape.label}] making {sets} input sets on {device}", quiet)
        inputs = [make_inputs(shape, device, seed=k, sink=sink, indices=indices) for k in range(sets)]
        primal = None  # (out, lse) per set, from the first forward that runs
        source = None
        for name, (backend, reason) in fwd.items():
            done += 1
            if backend is None:
                rows.append(row("forward", name, shape, groups, status="skipped", reason=reason))
                continue
            timed, results = _time_forward(backend, name, shape, groups, inputs, warmup, iters, device)
            rows.append(timed)
            _progress(f"[{done}/{total}] forward {name:10s} {shape.label}: {fmt_status(timed)}", quiet)
            if primal is None and results is not None:
                primal, source = results, name
        if primal is None:
            source = "device oracle (float64)"
            primal = [oracle_primal(x) for x in inputs]
        loaded = {}
        for name, (backend, reason) in bwd.items():
            if backend is None:
                done += 1
                rows.append(row("backward", name, shape, groups, status="skipped", reason=reason))
            else:
                loaded[name] = backend
        for timed in _time_backwards(loaded, shape, groups, inputs, primal, warmup, iters, rounds, repeats, device):
            done += 1
            timed["primal_from"] = source
            rows.append(timed)
            _progress(f"[{done}/{total}] backward {timed['backend']:10s} {shape.label}: {fmt_status(timed)}", quiet)
        del inputs, primal
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(_results(rows, device, settings))
    return _results(rows, device, settings)


def _results(rows, device, settings) -> dict:
    rows = [dict(r) for r in rows]
    add_ratios(rows)
    return {"device": _device_name(device), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "settings": settings, "rows": rows}


def _skip_or_error(exc) -> tuple[str, str]:
    kind = "skipped" if isinstance(exc, (ImportError, ValueError, NotImplementedError)) else "error"
    return kind, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _time_forward(backend, name, shape, groups, inputs, warmup, iters, device):
    results = []
    bound = [Call(x).for_("forward") for x in inputs]  # (positional, keywords) per input set, formed once

    def call(k):
        return backend.forward(*bound[k][0], **bound[k][1])

    try:
        results = [call(k) for k in range(len(inputs))]  # first calls also compile
        times = time_calls(call, len(inputs), warmup, iters, device)
    except Exception as exc:
        status, reason = _skip_or_error(exc)
        return row("forward", name, shape, groups, status=status, reason=reason), None
    ms = statistics.median(times)
    return row("forward", name, shape, groups, ms=ms, ms_min=min(times), runs=len(times),
               tflops=tflops(shape, "forward", ms)), results


class _Raised(Exception):
    """A timed call of backend ``name`` raised (the cause): ``_time_backwards`` reports it and times the rest."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _guard(name: str, call):
    def guarded(k):
        try:
            return call(k)
        except Exception as exc:
            raise _Raised(name) from exc
    return guarded


def _failed(name, shape, groups, exc) -> dict:
    status, reason = _skip_or_error(exc)
    return row("backward", name, shape, groups, status=status, reason=reason)


def _time_backwards(loaded: dict, shape, groups, inputs, primal, warmup, iters, rounds, repeats, device) -> list:
    """One row per backward backend: each is compiled, then all are timed in ABBA rounds, each turn after ``warmup``
    untimed calls (``timing.time_rounds``), then each one's bitwise stability is checked. A backend that raises is
    reported as skipped or failed and leaves the others' rounds."""
    calls, done = {}, {}
    for name, backend in loaded.items():
        bound = [Call({**x, "out": out, "lse": lse}).for_("backward") for x, (out, lse) in zip(inputs, primal)]

        def call(k, backend=backend, bound=bound):
            return backend.backward(*bound[k][0], **bound[k][1])

        try:
            call(0)  # compile / JIT outside the timed runs
            calls[name] = call
        except Exception as exc:
            done[name] = _failed(name, shape, groups, exc)
    while calls:
        try:
            rounds_ms = time_rounds({n: _guard(n, c) for n, c in calls.items()}, len(inputs), iters, rounds, device,
                                    settle=warmup)
            break
        except _Raised as exc:  # drop the backend that raised, time the rest again
            done[exc.name] = _failed(exc.name, shape, groups, exc.__cause__)
            del calls[exc.name]
    else:
        rounds_ms = {}
    for name, ms_rounds in rounds_ms.items():
        try:
            stable, drift = stability(lambda: calls[name](0), repeats)
        except Exception as exc:
            done[name] = _failed(name, shape, groups, exc)
            continue
        times = [t for r in ms_rounds for t in r]
        ms = statistics.median(times)
        done[name] = row("backward", name, shape, groups, ms=ms, ms_min=min(times), runs=len(times),
                         ms_rounds=[statistics.median(r) for r in ms_rounds if r],
                         tflops=tflops(shape, "backward", ms), stable=stable, drift=drift)
    return [done[name] for name in loaded]


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"



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
    p.add_argument("--preset", type=_names, default=(),
                   help=f"named shapes instead of the grid and sweeps below ({', '.join(PRESETS)})")
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
    p.add_argument("--rounds", type=int, default=1,
                   help="the backward backends take turns in this many rounds (ABBA order, each turn after --warmup "
                        "untimed calls), iters split over them; the table then shows the range of the per-round "
                        "ratios to cuDNN (default 1: each backend timed in one run)")
    p.add_argument("--repeats", type=int, default=3, help="backward repeats for the bitwise-stability column")
    p.add_argument("--sink", action="store_true", help="give every head a finite attn_sink")
    p.add_argument("--indices", choices=INDICES, default="random",
                   help="top-k pattern: random (distinct, uniform), local (causal window plus far picks, "
                        "neighbouring queries share most slots) or hot (8 rows every query names)")
    p.add_argument("--json", dest="json_path", default="sparse-mqa-bench.json", help="where to write results")
    p.add_argument("--plot", default=None, help="draw the sweeps into this image (needs matplotlib)")
    p.add_argument("--from-json", default=None, help="skip running: print/plot an earlier results file")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        pyplot()  # fail before any timing if it cannot be drawn
    if args.from_json:
        with open(args.from_json) as fh:
            results = json.load(fh)
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("--device cuda but torch sees no CUDA device")
        unknown = sorted(set(args.preset) - set(PRESETS))
        if unknown:
            raise SystemExit(f"--preset {', '.join(unknown)}: choose from {', '.join(PRESETS)}")
        dqk, dv = args.dims
        shapes = [(PRESETS[n], {n}) for n in args.preset] or plan_shapes(
            heads=args.heads, topks=args.topk, S=args.seq, Skv=args.kv_len, B=args.batch, sweep_s=args.sweep_s,
            sweep_l=args.sweep_l, sweep_h=args.sweep_h, sweep_at_l=args.sweep_at_l, Dqk=dqk, Dv=dv)
        command = "sparse-mqa-bench " + " ".join(sys.argv[1:] if argv is None else argv)

        def save(results, partial=True):
            with open(args.json_path, "w") as fh:
                json.dump({**results, "command": command, "partial": partial}, fh, indent=1)

        results = run(shapes, backward=args.backward, forward=args.forward, device=device, sets=args.sets,
                      warmup=args.warmup, iters=args.iters, rounds=args.rounds, repeats=args.repeats, sink=args.sink,
                      indices=args.indices, quiet=args.quiet, checkpoint=save)
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
