"""``sparse-mqa-check --sanitize``: a backend's explicit boundary cases once more, under NVIDIA's
compute-sanitizer, in a child process per tool.

memcheck finds out-of-bounds and misaligned accesses, racecheck shared-memory races, initcheck reads of memory
never written, synccheck barrier misuse. PyTorch's caching allocator is off in the child
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``), so an access past a tensor is past its allocation; host-API noise is
filtered out (``--report-api-errors no``). Each finding is reported with the tool, the kernel and the case's
replay line, and fails the run. A missing tool, or one that cannot read the device, is said in one line and is
not a pass.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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


def child(backend_name: str, cases_json: str) -> int:
    """In the sanitized process: each case's backward (and forward), each after a marker line."""
    import torch

    spec = BackendSpec.of(get_backend(backend_name))
    cases = [Case(**c) for c in json.loads(Path(cases_json).read_text())]
    for i, case in enumerate(cases):
        print(f"{MARK}{i}: {case.repro()}", flush=True)
        call = Expected.for_backend(spec, case).call(spec.device)
        for which in spec.directions:
            call.invoke(spec.backend, which)
        torch.cuda.synchronize()
    return 0


def replay_command(backend_name: str, tool: str, case) -> str:
    return f"sparse-mqa-check --backend {backend_name} --sanitize {tool} --replay \"{case.repro()}\""


def run(backend_name: str, cases, tools=TOOLS, *, timeout: float = 1800, out=sys.stdout) -> int:
    """Every case under every tool; 0 when clean, 1 on a finding, ``NOT_RUN`` when a tool could not run."""
    tool_path = find_tool()
    if tool_path is None:
        print(f"sanitize {backend_name}: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): "
              "the boundary cases were NOT sanitized", file=out)
        return NOT_RUN
    import dataclasses
    import tempfile

    found = not_run = False
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "cases.json"
        spec.write_text(json.dumps([dataclasses.asdict(c) for c in cases]))
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
        for tool in tools:
            cmd = [tool_path, "--tool", tool, "--report-api-errors", "no", "--print-limit", "20",
                   sys.executable, "-m", "sparse_mqa_testkit.tools.sanitize", backend_name, str(spec)]
            t0 = time.monotonic()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
                output, status = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:
                output, status = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), None
            seconds = time.monotonic() - t0
            findings, broken = parse(output, tool)
            ran = sum(1 for line in output.splitlines() if line.startswith(MARK))
            if broken or status is None or (status != 0 and not findings):
                why = broken or ("timed out" if status is None else f"the child exited with status {status}")
                tail = "\n".join(output.splitlines()[-8:])
                print(f"sanitize {backend_name} {tool}: could not run ({why}) after {ran} of {len(cases)} cases, "
                      f"{seconds:.0f} s: NOT sanitized\n{tail}", file=out)
                not_run = True
                continue
            print(f"sanitize {backend_name} {tool}: {len(findings)} findings in {len(cases)} cases, {seconds:.1f} s "
                  f"({seconds / max(len(cases), 1):.2f} s a case)", file=out)
            for f in findings:
                where = "while loading the backend" if f.case is None else \
                    replay_command(backend_name, tool, cases[f.case])
                print(f"  {f.tool}: kernel {f.kernel}: {f.text.splitlines()[0]}\n    replay: {where}", file=out)
                found = True
    return 1 if found else NOT_RUN if not_run else 0


if __name__ == "__main__":
    raise SystemExit(child(sys.argv[1], sys.argv[2]))
