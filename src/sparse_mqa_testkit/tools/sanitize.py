"""``sparse-mqa-check --sanitize``: a backend's explicit boundary cases once more, under NVIDIA's
compute-sanitizer, in a child process per tool.

memcheck finds out-of-bounds and misaligned accesses, racecheck shared-memory races, initcheck reads of memory
never written, synccheck barrier misuse. PyTorch's caching allocator is off in the child
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), so an access past a tensor is past its allocation; host-API noise is
filtered out (``--report-api-errors no``). Each finding is reported with the tool, the kernel and the case's
replay line, and fails the run. A missing tool, or one that cannot read the device, is said in one line and is
not a pass.

The child prints a line as each case starts, and the parent shows it at once, so a slow case is seen while it
runs. A case that runs past the per-case limit (``$SMQA_SANITIZE_CASE_LIMIT`` seconds, default 300) is stopped,
named with the tool, and the child starts again at the next case; past the per-tool limit
(``$SMQA_SANITIZE_TOOL_LIMIT``, default none) the cases left are named as not sanitized. Either is not a pass.
``$SMQA_SANITIZE_BUDGET`` bounds a whole run (every backend, every tool): each tool run may take an equal share of
what is left when it starts, so the time a fast backend leaves goes to a slow one after it.

racecheck records every shared-memory access and synchronisation of every instrumented kernel and analyses them on
the host, so its cost grows with the blocks launched and the kernels instrumented (TMA and bulk copies, wgmma
operand reads, mbarrier waits: each an event). It runs on fewer, smaller launches: each case with B = S = 1 (a
race is within one block, and a block's code is the same for every query), only the kernels the backend names
(``sanitize_kernels``: the input and oracle kernels of torch are not its own) and analysis reports without
backtraces. Its deadlock detector is off (``RACECHECK_DEADLOCK_MS``): it is a timer on each barrier wait, and under
racecheck a warp-specialised kernel's mbarrier waits outlast any timer short enough to help, each reported as a
deadlock and held for the full timeout. A kernel that really hangs is stopped by the per-case limit and named.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..backends import get_backend
from ..backends.spec import BackendSpec
from ..cases import Case
from ..compare import Expected

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
MARK = "[smqa-sanitize] case "
NOT_RUN = 2  # exit status when the sanitizer could not run at all: not a pass, not a finding either


def find_tool() -> str | None:
    """compute-sanitizer on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "compute-sanitizer").is_file():
            return str(Path(root) / "bin" / "compute-sanitizer")
    return None


@dataclass
class Finding:
    tool: str
    case: int | None  # index into the cases; None: before the first case (loading, warm-up)
    kernel: str
    text: str


_KERNEL = re.compile(r"(?:\bin |\bat )(?:0x[0-9a-f]+ in )?(?:[^\s:]+:\d+:)?([A-Za-z_][\w:]*)(?:<[^(]*>)?\(")
_SUMMARY = re.compile(r"^=+ (ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY)|^=+ COMPUTE-SANITIZER")


def parse(output: str, tool: str) -> tuple[list[Finding], str | None]:
    """The findings in a child's combined output (split by the case markers it printed), and why the tool could
    not run, if it could not."""
    findings: list[Finding] = []
    case, current = None, None
    for line in output.splitlines():
        if line.startswith(MARK):
            case = int(line[len(MARK):].split(":")[0])
            continue
        if not line.startswith("=="):
            continue
        body = line.lstrip("=").rstrip()
        if "Device not supported" in body or "Error: Target application terminated before first instrumented" \
                in body or "Unable to find injection library" in body:
            return findings, body.strip()
        if _SUMMARY.search(line) or not body.strip():
            current = None
            continue
        if body.startswith("     ") and current is not None:  # a report's detail lines
            current.text += "\n" + body.strip()
            if current.kernel == "?":
                m = _KERNEL.search(body)
                if m:
                    current.kernel = m.group(1)
            continue
        m = _KERNEL.search(body)
        current = Finding(tool, case, m.group(1) if m else "?", body.strip())
        findings.append(current)
    return findings, None


def child(backend_name: str, cases_json: str, start: int = 0) -> int:
    """In the sanitized process: from case ``start`` on, each case's backward (and forward), each after a marker
    line."""
    import torch

    spec = BackendSpec.of(get_backend(backend_name))
    cases = [Case(**c) for c in json.loads(Path(cases_json).read_text())]
    for i, case in enumerate(cases[start:], start=start):
        print(f"{MARK}{i}: {case.repro()}", flush=True)
        call = Expected.for_backend(spec, case).call(spec.device)
        for which in spec.directions:
            call.invoke(spec.backend, which)
        if spec.is_cuda:
            torch.cuda.synchronize()
    return 0


def replay_command(backend_name: str, tool: str, case) -> str:
    return f"sparse-mqa-check --backend {backend_name} --sanitize {tool} --replay \"{case.repro()}\""


CASE_LIMIT_ENV = "SMQA_SANITIZE_CASE_LIMIT"
TOOL_LIMIT_ENV = "SMQA_SANITIZE_TOOL_LIMIT"
BUDGET_ENV = "SMQA_SANITIZE_BUDGET"
RACECHECK_DEADLOCK_MS = 0  # racecheck's deadlock timer off (module docstring; what it cost: BENCHMARKS.md)


def tool_cases(tool: str, cases) -> list:
    """The cases a tool runs: racecheck each with B = S = 1 (once per distinct result), the others as given."""
    if tool != "racecheck":
        return list(cases)
    return list(dict.fromkeys(c.replace(B=1, S=1) for c in cases))


def tool_command(tool_path: str, tool: str, kernels: str | None) -> list[str]:
    """compute-sanitizer's command line for ``tool``, before the program it runs."""
    cmd = [tool_path, "--tool", tool, "--report-api-errors", "no", "--print-limit", "20"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "analysis", "--show-backtrace", "no",
                "--racecheck-deadlock-timeout", str(RACECHECK_DEADLOCK_MS)]
        if kernels:
            cmd += ["--kernel-name", f"kns={kernels}"]
    return cmd


def _limit(env_name: str, default: float | None) -> float | None:
    raw = os.environ.get(env_name, "").strip()
    return float(raw) if raw else default


class Budget:
    """A run's seconds (``$SMQA_SANITIZE_BUDGET``; None: unbounded) shared by its ``runs`` tool runs: each may take
    an equal share of what is left when it starts."""

    def __init__(self, seconds: float | None, runs: int, clock=time.monotonic):
        self.seconds, self.runs, self.clock, self.t0 = seconds, runs, clock, clock()

    @classmethod
    def from_env(cls, runs: int) -> Budget:
        return cls(_limit(BUDGET_ENV, None), runs)

    def skip(self, runs: int) -> None:
        """``runs`` of the runs counted will not take their share (a backend with nothing to sanitize)."""
        self.runs = max(self.runs - runs, 0)

    def share(self) -> float | None:
        """The next run's limit in seconds (None when unbounded); that run is then no longer counted."""
        if self.seconds is None:
            return None
        left = max(0.0, self.seconds - (self.clock() - self.t0))
        share = left / max(self.runs, 1)
        self.skip(1)
        return share


def run(backend_name: str, cases, tools=TOOLS, *, out=sys.stdout, case_limit: float | None = None,
        tool_limit: float | None = None, budget: Budget | None = None) -> int:
    """Every case under every tool; 0 when clean, 1 on a finding, ``NOT_RUN`` when a tool could not run or a case
    was stopped at a limit."""
    tool_path = find_tool()
    if tool_path is None:
        print(f"sanitize {backend_name}: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): "
              "the boundary cases were NOT sanitized", file=out)
        return NOT_RUN
    case_limit = case_limit if case_limit is not None else _limit(CASE_LIMIT_ENV, 300.0)
    tool_limit = tool_limit if tool_limit is not None else _limit(TOOL_LIMIT_ENV, None)
    kernels = BackendSpec.of(get_backend(backend_name)).sanitize_kernels
    found = not_run = False
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
        for tool in tools:
            todo = tool_cases(tool, cases)
            spec = Path(tmp) / f"cases-{tool}.json"
            spec.write_text(json.dumps([dataclasses.asdict(c) for c in todo]))
            cmd = tool_command(tool_path, tool, kernels) + [sys.executable, "-m", "sparse_mqa_testkit.tools.sanitize",
                                                            backend_name, str(spec)]
            t0 = time.monotonic()
            run_ = _ToolRun(backend_name, tool, todo, out)
            limit, limit_name = tool_limit, TOOL_LIMIT_ENV
            share = budget.share() if budget is not None else None
            if share is not None and (limit is None or share < limit):
                limit, limit_name = share, f"its share of {BUDGET_ENV}"
            output, status, stopped = run_.go(cmd, env, case_limit, limit, limit_name)
            seconds = time.monotonic() - t0
            findings, broken = parse(output, tool)
            ran = len(run_.started)
            if broken or (status not in (0, None) and not findings):
                why = broken or f"the child exited with status {status}"
                tail = "\n".join(output.splitlines()[-8:])
                print(f"sanitize {backend_name} {tool}: could not run ({why}) after {ran} of {len(todo)} cases, "
                      f"{seconds:.0f} s: NOT sanitized\n{tail}", file=out)
                not_run = True
                continue
            print(f"sanitize {backend_name} {tool}: {len(findings)} findings in {len(todo)} cases, {seconds:.1f} s "
                  f"({seconds / max(len(todo), 1):.2f} s a case)", file=out)
            for line in stopped:
                print(f"  {line}: NOT sanitized", file=out)
                not_run = True
            for f in findings:
                where = "while loading the backend" if f.case is None else \
                    replay_command(backend_name, tool, todo[f.case])
                print(f"  {f.tool}: kernel {f.kernel}: {f.text.splitlines()[0]}\n    replay: {where}", file=out)
                found = True
    return 1 if found else NOT_RUN if not_run else 0


class _ToolRun:
    """One tool over the cases, in as many children as it takes: the output read as it comes (a progress line per
    case), a case past ``case_limit`` stopped and the next child started after it, the cases left past
    ``tool_limit`` named."""

    def __init__(self, backend_name: str, tool: str, cases: list, out):
        self.tool, self.cases, self.out = tool, cases, out
        self.label = f"sanitize {backend_name} {tool}"
        self.started: list[int] = []

    def go(self, cmd, env, case_limit, tool_limit, limit_name: str = TOOL_LIMIT_ENV):
        """(the output of every child, the last child's exit status, what was stopped and why)."""
        chunks, stopped, start, status = [], [], 0, 0
        deadline = None if tool_limit is None else time.monotonic() + tool_limit
        while start < len(self.cases):
            proc = subprocess.Popen(cmd + [str(start)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace")
            lines: queue.Queue = queue.Queue()
            threading.Thread(target=lambda: ([lines.put(x) for x in proc.stdout], lines.put(None)),
                             daemon=True).start()
            current, since, why = None, time.monotonic(), None
            while True:
                try:
                    line = lines.get(timeout=0.5)
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                chunks.append(line)
                if line.startswith(MARK):
                    current, since = int(line[len(MARK):].split(":")[0]), time.monotonic()
                    self.started.append(current)
                    print(f"{self.label}: case {current + 1}/{len(self.cases)}: {self.cases[current].describe()}",
                          file=self.out, flush=True)
                now = time.monotonic()
                if current is not None and case_limit and now - since > case_limit:
                    why = (f"case {current + 1} ({self.cases[current].repro()}) ran past the {case_limit:.0f} s "
                           f"limit per case under {self.tool} ({CASE_LIMIT_ENV})")
                elif deadline is not None and now > deadline:
                    first = current if current is not None else start
                    why = (f"cases {first + 1} to {len(self.cases)} not finished within the {tool_limit:.0f} s limit "
                           f"of {self.tool} ({limit_name})")
                if why:
                    proc.kill()
                    break
            status = proc.wait()
            if why is None:
                break
            stopped.append(why)
            print(f"{self.label}: {why}: stopped", file=self.out, flush=True)
            if deadline is not None and time.monotonic() > deadline or current is None:
                break
            start = current + 1
        return "".join(chunks), (0 if stopped and status < 0 else status), stopped


if __name__ == "__main__":
    raise SystemExit(child(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0))
