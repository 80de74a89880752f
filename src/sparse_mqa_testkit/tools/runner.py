"""The suite run as a child pytest (a crashing kernel cannot take the report with it): what ``sparse-mqa-check``
and the nightly driver both call."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..harness.options import CLI, FRONT_END_ENV
from ..harness.table import write_json

SUITE = "sparse_mqa_testkit.property_tests"


def suite_command(backends, *, profile=None, database=None, json_path=None, extra=()) -> list[str]:
    """The pytest command line the main job runs (in the working directory, as its rootdir)."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", SUITE, "-q", "-p", "no:cacheprovider",
           "--rootdir", os.getcwd(), "-c", os.devnull, "-p", "sparse_mqa_testkit.plugin"]
    for b in backends:
        cmd += ["--smqa-backend", b]
    if profile:
        cmd += ["--smqa-profile", profile]
    if database:
        cmd += ["--smqa-database", str(database)]
    if json_path:
        cmd += ["--smqa-json", str(json_path)]
    return cmd + list(extra)


def run_suite(backends, *, profile=None, database=None, json_path=None, extra=(), env=None, timeout=None):
    """Run the suite in a child pytest; returns (exit status, the JSON the plugin wrote, or {}).

    The child prints each test's verdict as it finishes and rewrites the JSON as results arrive. SIGINT or SIGTERM
    here (or ``timeout`` running out) stops it the way Ctrl-C does: it prints and writes what finished, marked
    interrupted; the exit status is then 128 + the signal (124 for ``timeout``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(json_path or Path(tmp) / "smqa.json")
        cmd = suite_command(backends, profile=profile, database=database, json_path=path,
                            extra=["--smqa-verdicts", *extra])
        env = {**(os.environ if env is None else env), FRONT_END_ENV: CLI}  # its messages name the CLI's flags
        stop = _Stop(subprocess.Popen(cmd, env=env))
        with stop.on_signals():
            rc = stop.wait(timeout)
        data = json.loads(path.read_text()) if path.exists() else {}
        if stop.why and data.get("status") != "interrupted":  # the child could not say so itself
            data.update(status="interrupted")
            if json_path:
                write_json(path, data.pop("rows", []), **{k: v for k, v in data.items() if k != "coverage"})
        if stop.why:
            data["stopped_by"] = stop.why
    return rc, data


class _Stop:
    """The child pytest, and how this process stops it: the first SIGINT / SIGTERM it receives is passed on (the
    child takes a repeat of one it already got as the same stop), then the child has ``GRACE`` seconds to write
    what finished before it is killed."""

    GRACE = 60.0

    def __init__(self, proc):
        self.proc, self.why, self.status = proc, None, None

    @contextlib.contextmanager
    def on_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self._signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _signal(self, signum, frame):
        if self.why is None:
            self.why, self.status = signal.Signals(signum).name, 128 + signum
            self._send(signum)

    def _send(self, signum):
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signum)

    def wait(self, timeout) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"sparse-mqa-check: the suite ran past {timeout:.0f} s and was stopped", file=sys.stderr)
            self.why, self.status = f"the {timeout:.0f} s limit", 124
            self._send(signal.SIGTERM)
            rc = None
        if self.why is not None:
            try:
                rc = self.proc.wait(timeout=self.GRACE)
            except subprocess.TimeoutExpired:
                print(f"sparse-mqa-check: the suite did not stop within {self.GRACE:.0f} s of {self.why}; killed",
                      file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
            return self.status
        return rc
