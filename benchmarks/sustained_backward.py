"""How a backward backend's speed moves under sustained load, and with it the ratio the bench reports.

    python benchmarks/sustained_backward.py --backward cudnn,tilelang --preset anchor --sink [--seconds 2] [--idle 2]

Each backend in turn (``--rounds`` times, in ABBA order) waits ``--idle`` seconds with the GPU idle, then runs the
backward back to back for about ``--seconds`` (one CUDA event pair a call, input sets rotated as
``sparse-mqa-bench`` rotates them), while ``nvidia-smi`` samples the SM clock, power and clock-event reasons every
20 ms. For each run it prints the median of the first calls (the GPU as it left the idle pause), of the calls after
them, and of the run's last half, the best call, each input set's median, and the clock and power samples in the
run's window. On an H200 both backends draw the GPU's power cap and it takes hold within the first five calls, so the
bench's medians (a few warm-up calls, then 20 or more timed) are the sustained rate (BENCHMARKS.md, 2026-12-03).
"""

from __future__ import annotations

import datetime
import pathlib
import statistics
import subprocess
import sys
import time

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,{}.active"
SMI_REASONS = ("clocks_event_reasons", "clocks_throttle_reasons")  # the newer driver's name, then the older one's
HEAD = 5  # a run's first calls, told apart from the rest


def summarize(times: list[float], sets: int, head: int = HEAD) -> dict:
    """A run's per-call milliseconds (call k on input set k % sets) as medians: the first ``head`` calls, the calls
    after them, the last half; the best call; each set's median."""
    if len(times) <= head:
        raise ValueError(f"a run needs more than {head} calls to tell its first calls from the rest, got {len(times)}")
    return {
        "calls": len(times),
        "first": statistics.median(times[:head]),
        "after": statistics.median(times[head:]),
        "last_half": statistics.median(times[len(times) // 2:]),
        "best": min(times),
        "per_set": [statistics.median(times[s::sets]) for s in range(sets)],
    }


def parse_smi(lines, t0: datetime.datetime, t1: datetime.datetime) -> dict:
    """``nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits -lms 20`` lines inside [t0, t1]: the SM clock's
    median and minimum (MHz), the power's median and maximum (W), the temperature's maximum and the clock-event
    reason masks seen."""
    clk, pw, temp, reasons = [], [], [], set()
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            c, p, g = float(parts[1]), float(parts[2]), float(parts[3])
        except ValueError:
            continue
        if t0 <= t <= t1:
            clk.append(c)
            pw.append(p)
            temp.append(g)
            if len(parts) > 4:
                reasons.add(parts[4])
    if not clk:
        return {"samples": 0}
    return {"samples": len(clk), "sm_mhz": statistics.median(clk), "sm_mhz_min": min(clk),
            "watts": statistics.median(pw), "watts_max": max(pw), "temp_max": max(temp), "reasons": sorted(reasons)}


def _sampler():
    """nvidia-smi sampling every 20 ms into a pipe, or None where it cannot run."""
    for name in SMI_REASONS:
        query = ["nvidia-smi", f"--query-gpu={SMI_FIELDS.format(name)}", "--format=csv,noheader,nounits"]
        try:
            if subprocess.run(query, capture_output=True, timeout=30).returncode == 0:
                return subprocess.Popen(query + ["-lms", "20"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


def _run(call, n: int, sets: int):
    """``n`` calls back to back, as the bench times them (``bench.timing.time_calls``), and the wall-clock window
    they ran in (for the nvidia-smi samples)."""
    from sparse_mqa_kernels.bench.timing import time_calls

    t0 = datetime.datetime.now()
    times = time_calls(call, sets, 0, n, "cuda")
    return times, t0, datetime.datetime.now()


def main(argv=None) -> int:
    import torch

    from sparse_mqa_kernels.bench.cli import _load
    from sparse_mqa_kernels.bench.shapes import PRESETS

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import profile_backward as profile  # the case options and the backward's inputs, as it forms them

    p = profile.case_parser(__doc__.splitlines()[0])
    p.add_argument("--sets", type=int, default=3, help="input sets, rotated call by call")
    p.add_argument("--seconds", type=float, default=2.0, help="about how long each run keeps the GPU busy")
    p.add_argument("--idle", type=float, default=2.0, help="seconds the GPU idles before each run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each backend, in ABBA order")
    args = p.parse_args(argv)
    shape = PRESETS[args.preset]
    bound = [profile.backward_args(args, seed=s) for s in range(args.sets)]
    calls, per_call = {}, {}
    for name in args.backward.split(","):
        backend, reason = _load(name, "cuda")
        if backend is None:
            print(f"{name}: skipped ({reason})", file=sys.stderr)
            continue
        calls[name] = lambda k, b=backend: b.backward(*bound[k][0], **bound[k][1])
        times, _, _ = _run(calls[name], 3 * args.sets, args.sets)  # compile, JIT, allocator; then its speed
        per_call[name] = statistics.median(times[args.sets:])
    smi = _sampler()
    runs = []
    names = list(calls)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            time.sleep(args.idle)
            n = max(2 * HEAD + 1, int(args.seconds * 1e3 / per_call[name]))
            times, t0, t1 = _run(calls[name], n, args.sets)
            runs.append((name, r, summarize(times, args.sets), t0, t1))
    if smi is not None:
        time.sleep(0.1)
        smi.terminate()
        lines = smi.communicate()[0].splitlines()
    else:
        lines = []
    print(f"{torch.cuda.get_device_name()}, {shape.label}, indices {args.indices}, sink {args.sink}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; idle {args.idle} s before each run")
    print(f"| backend | round | calls | first {HEAD} | after | last half | best | per set | SM MHz (min) | W (max) "
          "| max C | clock reasons |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r, s, t0, t1 in runs:
        g = parse_smi(lines, t0, t1)
        clocks = (f"{g['sm_mhz']:.0f} ({g['sm_mhz_min']:.0f}) | {g['watts']:.0f} ({g['watts_max']:.0f}) | "
                  f"{g['temp_max']:.0f} | {' '.join(g['reasons'])}") if g["samples"] else "- | - | - | -"
        print(f"| {name} | {r} | {s['calls']} | {s['first']:.3f} | {s['after']:.3f} | {s['last_half']:.3f} | "
              f"{s['best']:.3f} | {' / '.join(f'{v:.3f}' for v in s['per_set'])} | {clocks} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
