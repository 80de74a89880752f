"""Where a warp-specialised kernel's warps wait, warpgroup by warpgroup: Nsight Compute's per-instruction warp-state
samples (the source page as CSV, SASS), summed over each role's code. A role's code starts at its ``setmaxnreg``
(``USETMAXREG``), so the regions between them are the roles, in code order; the code before the first is the shared
prologue. For each region: its share of all samples, its stall reasons, the share spent at mbarrier waits (a
``SYNCS.PHASECHK``, then a retry branch on its predicate where the samples land: ``wait_sites``), and its costliest
instructions, with the instructions that form each wait's address, so the barrier can be told apart.

    ncu --clock-control none --profile-from-start off --set full --import-source no -k regex:sparse_mqa_bwd_ws -c 1 \\
        --export ws python benchmarks/profile_backward.py --backward tilelang --preset anchor --sink
    ncu --import ws.ncu-rep --page source --csv --print-source sass | gzip > ws-sass.csv.gz
    python benchmarks/ncu_warpgroups.py ws-sass.csv.gz [--top 8] [--smem]

``--smem`` adds each role's shared-memory wavefronts by instruction kind (the page's ``L1 Wavefronts Shared`` and its
``Excessive`` part: bank conflicts and split lines), the wgmma operand reads (``HGMMA``) among them, with ``--set
full``'s counters.

In ``sparse_mqa_bwd_ws`` the sender's region is the one whose setmaxnreg gives registers back (``DEALLOC``); WG0's
is the one with the KV gather (``LDGSTS``) and the [64 heads x BI slots] products (``HGMMA.64xBI``).
"""

from __future__ import annotations

import argparse
import collections
import csv
import functools
import gzip
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
WAVEFRONTS = ("L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive")


@functools.lru_cache(maxsize=2)  # the stall report and --smem read the same page: parsed once
def _rows(path: str):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    header = next(r for r in rows if r and r[0] == "Address")
    body = [r for r in rows[rows.index(header) + 1:] if len(r) >= len(header) and r[0].startswith("0x")]
    return {h: i for i, h in enumerate(header)}, body


def _int(text: str) -> int:
    return int(float(text.replace(",", ""))) if text and text != "-" else 0


def read(path: str) -> list[tuple[int, str, int, int, dict]]:
    """(address, SASS, samples, executions, {stall reason: samples}) per instruction, in address order."""
    col, body = _rows(path)
    reasons = [h for h in col if h.startswith("stall_") and "(Not Issued)" not in h]
    out = [(int(r[0], 16), r[1].strip(), _int(r[col[SAMPLES]]), _int(r[col[EXECUTED]]),
            {k[len("stall_"):]: _int(r[col[k]]) for k in reasons}) for r in body]
    return sorted(out)


def smem_wavefronts(path: str) -> list[tuple[str, dict]]:
    """Per role (cut as ``regions`` cuts them): {instruction kind: [shared-memory wavefronts, excessive ones]}."""
    col, body = _rows(path)
    ins = sorted((int(r[0], 16), r[1].strip(), *(_int(r[col[w]]) for w in WAVEFRONTS)) for r in body)
    out = []
    for reg in regions([(a, sass, 0, 0, {}) for a, sass, *_ in ins]):
        kinds = collections.defaultdict(lambda: [0, 0])
        for a, sass, wf, excessive in ins:
            if reg["ins"][0][0] <= a <= reg["ins"][-1][0] and wf:
                op = _unguarded(sass).split(None, 1)[0].split(".")[0]
                kinds[op][0] += wf
                kinds[op][1] += excessive
        out.append((reg["name"], dict(kinds)))
    return out


def smem_report(path: str) -> str:
    roles = smem_wavefronts(path)
    total = sum(v[0] for _, kinds in roles for v in kinds.values()) or 1
    lines = [f"== shared-memory wavefronts: {total / 1e6:.1f} M"]
    for name, kinds in roles:
        for op, (wf, excessive) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"   {name[:40]:40s} {op:8s} {wf / 1e6:8.1f} M ({100 * wf / total:4.1f} %), "
                         f"excessive {excessive / 1e6:.1f} M")
    return "\n".join(lines)


def regions(ins) -> list[dict]:
    """The instructions cut at each ``USETMAXREG``: name, samples, stall reasons, instructions (code order)."""
    out = [{"name": "prologue", "ins": []}]
    for item in ins:
        if "USETMAXREG" in item[1]:
            kind = "DEALLOC" if "DEALLOC" in item[1] else "ALLOC"
            out.append({"name": f"role {len(out)} (setmaxnreg {kind} {item[1].split()[-1]})", "ins": []})
        out[-1]["ins"].append(item)
    for reg in out:
        reg["samples"] = sum(i[2] for i in reg["ins"])
        reg["reasons"] = collections.Counter()
        for i in reg["ins"]:
            reg["reasons"].update(i[4])
    return [r for r in out if r["ins"]]


def _unguarded(sass: str) -> str:
    """An instruction without its guard predicate."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", sass)


def _writes(sass: str, pred: str) -> bool:
    """Whether an instruction writes predicate ``pred``: SASS lists destinations first (a predicate destination can
    follow a register one, as a carry-out)."""
    ops = _unguarded(sass).split(None, 1)
    dests = ops[1].split(",")[:2] if len(ops) > 1 else []
    return any(d.strip() == pred for d in dests)


def wait_sites(body, window: int = 48) -> dict[int, int]:
    """Index of each mbarrier wait's retry branch in a region's instructions -> index of its ``SYNCS.PHASECHK``: a
    ``@!Pn BRA`` whose predicate was last written, within ``window`` instructions, by a ``SYNCS.PHASECHK`` (the
    compiler may hoist the check well before the branch, where the waiting warps' samples land)."""
    sites = {}
    for k, item in enumerate(body):
        m = re.match(r"@!(P\d)\s+BRA\b", item[1])
        if not m:
            continue
        for j in range(k - 1, max(-1, k - 1 - window), -1):
            if _writes(body[j][1], m.group(1)):
                if body[j][1].startswith("SYNCS.PHASECHK"):
                    sites[k] = j
                break
    return sites


def report(ins, top: int = 8, context: int = 3) -> str:
    total = sum(i[2] for i in ins) or 1
    lines = []
    for reg in regions(ins):
        n = reg["samples"] or 1
        body = reg["ins"]
        sites = wait_sites(body)
        lines.append(f"== {reg['name']}: {reg['samples']} samples ({100 * reg['samples'] / total:.1f} % of all)")
        lines.append("   " + ", ".join(f"{k} {100 * v / n:.0f} %" for k, v in reg["reasons"].most_common(6)))
        waited = sum(body[k][2] for k in sites)
        lines.append(f"   at mbarrier waits: {100 * waited / n:.1f} % of its samples, {len(sites)} sites")
        for k in sorted(range(len(body)), key=lambda j: -body[j][2])[:top]:
            addr, sass, samples, executed, why = body[k]
            reason = max(why, key=why.get) if samples else "-"
            share = 100 * samples / n
            lines.append(f"   {samples:8d} ({share:4.1f} %) {hex(addr)} x{executed} {sass[:60]}  [{reason}]")
            if k in sites:  # an mbarrier wait's retry branch: the wait and what formed its address
                for a, s, *_ in body[max(0, sites[k] - context):sites[k] + 1]:
                    lines.append(f"        {hex(a)} {s[:70]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz or plain)")
    p.add_argument("--top", type=int, default=8, help="costliest instructions shown a region")
    p.add_argument("--smem", action="store_true", help="also each role's shared-memory wavefronts by instruction kind")
    args = p.parse_args(argv)
    print(report(read(args.csv), args.top))
    if args.smem:
        print(smem_report(args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
