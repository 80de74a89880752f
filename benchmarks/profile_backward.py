"""One backward call per backend between cudaProfilerStart and cudaProfilerStop, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --set full --export bwd \
        python benchmarks/profile_backward.py --backward cudnn,tilelang --preset anchor --sink
    ncu --import bwd.ncu-rep --page details > bwd.txt

Each backend first runs the call twice outside the profiled range (compile, JIT, allocator warm-up), so the
report holds exactly the kernels of one steady-state call of each backend, in the order named, on the same
inputs (``sparse-mqa-bench``'s input sets and its forward for ``out`` and ``lse``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from sparse_mqa_kernels.bench.cli import _load, oracle_primal
from sparse_mqa_kernels.bench.shapes import INDICES, PRESETS, make_inputs
from sparse_mqa_testkit.calls import Call


def case_parser(description: str, order: str = "") -> argparse.ArgumentParser:
    """The options that name the backends and one case: --backward, --preset, --sink, --indices (also the sustained
    probe's, ``sustained_backward.py``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--backward", default="cudnn,tilelang", help="backends, comma-separated" + order)
    p.add_argument("--preset", default="anchor", choices=sorted(PRESETS))
    p.add_argument("--sink", action="store_true", help="give every head a finite attn_sink")
    p.add_argument("--indices", choices=INDICES, default="random")
    return p


def backward_args(args, seed: int = 0) -> tuple:
    """(positional, keywords) of a backward call on the case ``args`` names, input set ``seed`` (the bench's sets),
    ``out`` and ``lse`` from our forward, or from the device oracle where it does not load."""
    x = make_inputs(PRESETS[args.preset], "cuda", seed=seed, sink=args.sink, indices=args.indices)
    fwd, reason = _load("tilelang", "cuda")
    if fwd is not None:
        f_args, f_kw = Call(x).for_("forward")
        out, lse = fwd.forward(*f_args, **f_kw)
    else:
        print(f"forward from the device oracle (tilelang: {reason})", file=sys.stderr)
        out, lse = oracle_primal(x)
    return Call({**x, "out": out, "lse": lse}).for_("backward")


def main(argv=None) -> int:
    args = case_parser(__doc__.splitlines()[0], ", profiled in this order").parse_args(argv)
    shape = PRESETS[args.preset]
    args_, kw = backward_args(args)
    for name in args.backward.split(","):
        backend, reason = _load(name, "cuda")
        if backend is None:
            print(f"{name}: skipped ({reason})", file=sys.stderr)
            continue
        for _ in range(2):
            backend.backward(*args_, **kw)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        backend.backward(*args_, **kw)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"{name}: profiled one call at {shape.label}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
