"""A/B of kernel builds on one call's inputs: module files of the 64-head backward's main kernel (``backward_ws``) or
its bound pass (``bwd_rows``), each built for the shape's variant and timed against the first, in one process.

    python benchmarks/ab_kernels.py main base=src/sparse_mqa_kernels/backward_ws.py new=/tmp/backward_ws.py \\
        --preset anchor,l512,h128
    python benchmarks/ab_kernels.py bound base=src/sparse_mqa_kernels/bwd_rows.py new=/tmp/bwd_rows.py
    python benchmarks/ab_kernels.py main new=/tmp/backward_ws.py --compile-only   # no GPU: fill TILELANG_CACHE_DIR

The bound pass, the row scales and ``out`` / ``lse`` come from the tree's kernels, so every build sees the same inputs.
Each build runs twice (its repeat is checked bitwise) and its outputs are compared with the first build's: dq and the
int32 sums for the main kernel, Delta and the octave counts for the bound pass ("equal" is bitwise). Then rounds of
calls alternate between builds (CUDA events, medians) and each build's median is printed against the first's. A copy
that ablates part of a kernel (results wrong, timing only) shows what that part costs, if it costs only that part:
ptxas deletes a wgmma whose accumulator nothing reads, so a copy that drops a product's consumer loses the product
too (count ``HGMMA`` in each build's SASS first; BENCHMARKS.md, 2026-12-02 15:35 UTC). A module's ``PASS_CONFIGS``
(a dict, where it has one) goes to ``tilelang.compile``, e.g. to switch off TileLang's automatic barriers; its
``canonical_sums(acc)`` (where it has one) maps its integer output to the int32 sums before any comparison.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
import time


def load(path: str, name: str):
    """A kernel module from its file, as a submodule of ``sparse_mqa_kernels`` (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location(f"sparse_mqa_kernels._ab_{name}", pathlib.Path(path))
    if spec is None:
        raise SystemExit(f"{path}: not a Python module file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_builds(items: list[str]) -> list[tuple[str, str]]:
    """``name=path`` pairs, in order; the first is the reference."""
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{item!r}: give each build as name=path/to/module.py")
        if not pathlib.Path(path).is_file():
            raise SystemExit(f"{item!r}: {path} is not a file")
        out.append((name, path))
    if len({n for n, _ in out}) != len(out):
        raise SystemExit("build names must differ")
    return out


def build(kernel: str, mod, dqk: int, dv: int, key):
    import tilelang

    from sparse_mqa_kernels.target import EXECUTION_BACKEND, TARGET

    if kernel == "main":
        program = mod.build_program(key)
    else:  # the bound pass that stores P and dS where the shape's plan does
        program = mod.build_bound(dqk, dv, stored=key is not None and key.stored_pds)
    return tilelang.compile(program, out_idx=None, target=TARGET, pass_configs=getattr(mod, "PASS_CONFIGS", None),
                            execution_backend=EXECUTION_BACKEND)


def _inputs(preset: str, indices: str = "random"):
    """One input set of ``preset`` (top-k pattern ``indices``) and everything the two kernels take, from the tree's
    forward, bound pass and row scales."""
    import torch

    from sparse_mqa_kernels import backward, bwd_plan, bwd_rows, forward
    from sparse_mqa_kernels.bench.shapes import PRESETS, make_inputs
    from sparse_mqa_kernels.target import sm_count

    shape = PRESETS[preset]
    x = make_inputs(shape, "cuda", seed=0, sink=True, indices=indices)
    q, kv, do, idx, sm = x["q"], x["kv"], x["grad_out"], x["indices"], x["sm_scale"]
    out, lse = forward.sparse_mqa_forward(q, kv, idx, sm, shape.Dv, attn_sink=x["attn_sink"])
    B, S, H, Dqk = q.shape
    Skv = kv.shape[1]
    plan = bwd_plan.make_plan(B, S, Skv, H, shape.L, Dqk, shape.Dv)
    tl = torch.full((B, S), shape.L, dtype=torch.int32, device="cuda")
    rows = torch.arange(S, dtype=torch.int32, device="cuda")
    split = plan.bound_split(S, sm_count(q.device))
    bound, scales, _ = bwd_rows.compiled(Dqk, shape.Dv, plan.stored_pds)
    delta, lse2, sink_delta = (torch.empty((B, S, H), dtype=torch.float32, device="cuda") for _ in range(3))
    hist = torch.zeros((B, Skv, bwd_plan.OCTAVES), dtype=torch.int32, device="cuda")
    pds, pds_len = backward.stored_pds_buffer(plan, q)
    bound(q, out, do, kv, idx, tl, lse, x["attn_sink"], rows, delta, lse2, sink_delta, hist, pds, sm, 1, pds_len,
          *split)
    scale, inv = (torch.empty((B, Skv), dtype=torch.float32, device="cuda") for _ in range(2))
    scales(hist, scale, inv)
    return dict(q=q, kv=kv, do=do, idx=idx, out=out, tl=tl, lse=lse, sink=x["attn_sink"], lse2=lse2, rows=rows,
                delta=delta, scale=scale, sm=sm, split=split, pds=pds, pds_len=pds_len)


def _runner(kernel: str, x: dict):
    """(fresh outputs, call(kernel, outputs, before)) for one kernel kind on ``x``: ``call`` zeroes the integer
    output, then runs ``before`` (the timer's start) and the kernel."""
    import torch

    q = x["q"]
    B, S, H, Dqk = q.shape
    Skv = x["kv"].shape[1]
    if kernel == "main":
        def fresh():
            return (torch.empty((B, S, H, Dqk), dtype=torch.bfloat16, device="cuda"),
                    torch.zeros((B, Skv, Dqk), dtype=torch.int32, device="cuda"))

        def call(k, o, before=lambda: None):
            o[1].zero_()
            before()
            k(q, x["kv"], x["do"], x["idx"], x["tl"], x["lse2"], x["delta"], x["rows"], x["scale"], o[0], o[1],
              x["pds"], x["sm"], x["pds_len"])
    else:
        from sparse_mqa_kernels import bwd_plan

        def fresh():  # Delta, the octave counts, the kernel LSE, p_sink Delta, and stored P and dS (zeroed: a
            # build writes only the slots its blocks cover)
            return (torch.empty((B, S, H), dtype=torch.float32, device="cuda"),
                    torch.zeros((B, Skv, bwd_plan.OCTAVES), dtype=torch.int32, device="cuda"),
                    *(torch.empty((B, S, H), dtype=torch.float32, device="cuda") for _ in range(2)),
                    *((torch.zeros_like(x["pds"]),) if x["pds_len"] else ()))

        def call(k, o, before=lambda: None):
            o[1].zero_()
            before()
            k(q, x["out"], x["do"], x["kv"], x["idx"], x["tl"], x["lse"], x["sink"], x["rows"], o[0], o[2], o[3], o[1],
              o[4] if x["pds_len"] else q.view(-1), x["sm"], 1, x["pds_len"], *x["split"])
    return fresh, call


def canonical(mod, outs):
    """A build's outputs with its integer output as int32 sums: through the module's ``canonical_sums``, where it has
    one (a build that writes another encoding of the same sums, e.g. column pairs added as 64-bit words)."""
    fix = getattr(mod, "canonical_sums", None)
    return outs if fix is None else (outs[0], fix(outs[1]), *outs[2:])


def compare(ref, outs, names=("dq", "sums")) -> str:
    """``equal`` or what differs, output by output (bitwise)."""
    import torch

    parts = []
    for name, a, b in zip(names, ref, outs):
        if torch.equal(a, b):
            continue
        total = a.shape[0] * a.shape[1] if a.dim() > 1 else a.numel()  # rows (elements of a flat output)
        rows = (a != b).reshape(total, -1).any(-1).sum().item()
        a64 = a.double()  # (dq at the anchor: 151 M elements; made once)
        diff = (a64 - b.double()).abs().max().item()
        parts.append(f"{name}: {rows} of {total} rows differ (by up to {diff:.3g}, max |first| "
                     f"{a64.abs().max().item():.3g})")
    return "; ".join(parts) or "equal"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", choices=("main", "bound"))
    p.add_argument("builds", nargs="+", help="name=module.py, the first the reference")
    p.add_argument("--preset", default="anchor", help="comma-separated sparse-mqa-bench presets")
    p.add_argument("--indices", default="random", help="the top-k pattern (sparse-mqa-bench's --indices)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=5, help="calls of each build a round")
    p.add_argument("--compile-only", action="store_true", help="build for sm_90a into TILELANG_CACHE_DIR, no GPU")
    args = p.parse_args(argv)
    builds = parse_builds(args.builds)
    import torch

    from sparse_mqa_kernels import bwd_plan
    from sparse_mqa_kernels.bench.shapes import PRESETS

    presets = args.preset.split(",")
    unknown = sorted(set(presets) - set(PRESETS))
    if unknown:
        raise SystemExit(f"--preset {', '.join(unknown)}: choose from {', '.join(PRESETS)}")
    mods = {name: load(path, name) for name, path in builds}
    kernels, by_key = {}, {}  # presets of one variant share its builds
    for preset in presets:
        s = PRESETS[preset]
        key = bwd_plan.make_plan(s.B, s.S, s.Skv, s.H, s.L, s.Dqk, s.Dv).key()
        if key not in by_key:
            t0 = time.monotonic()
            by_key[key] = {n: build(args.kernel, m, s.Dqk, s.Dv, key) for n, m in mods.items()}
            print(f"[{preset}] built {', '.join(mods)} in {time.monotonic() - t0:.1f} s", flush=True)
        kernels[preset] = by_key[key]
    if args.compile_only:
        return 0
    names = ("dq", "sums") if args.kernel == "main" else ("Delta", "counts", "kernel LSE", "p_sink Delta", "P and dS")
    for preset in presets:
        x = _inputs(preset, args.indices)
        fresh, call = _runner(args.kernel, x)
        ref = None
        for name, k in kernels[preset].items():
            a, b = fresh(), fresh()
            call(k, a)
            call(k, b)
            a, b = canonical(mods[name], a), canonical(mods[name], b)
            repeat = compare(a, b, names)
            verdict = "reference" if ref is None else compare(ref, a, names)
            ref = a if ref is None else ref
            print(f"[{preset}] {name}: repeat {'bitwise' if repeat == 'equal' else repeat}; against the first: "
                  f"{verdict}", flush=True)
        o = fresh()
        times = {n: [] for n in kernels[preset]}
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.rounds):
            for name, k in kernels[preset].items():
                for _ in range(args.calls):
                    call(k, o, start.record)
                    stop.record()
                    torch.cuda.synchronize()
                    times[name].append(start.elapsed_time(stop))
        med = {n: statistics.median(t) for n, t in times.items()}
        first = med[builds[0][0]]
        print(f"[{preset}] ms, median of {args.rounds * args.calls}: "
              + " | ".join(f"{n} {v:.3f} ({100 * (v / first - 1):+.1f} %)" for n, v in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
