"""What a run prints and writes: the header line (backends, profile, versions, GPUs), the conformance table at the
end, the JSON file, and which GPU each xdist worker used."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from . import gpu_workers, profiles
from .recording import PROPERTY
from .state import SuiteState, run_state, selected
from .table import format_table, summarize, timings, verdict_line, write_json


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _gpus_line() -> str:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            names = sorted({x.split(",")[0].strip() for x in out})
            driver = out[0].split(",")[-1].strip()
            return f"GPU: {len(out)} x {', '.join(names)}, driver {driver}"
    return "GPU: absent, driver absent"


def header(config) -> list[str]:
    try:
        profile = profiles.profile_name(config.getoption("smqa_profile"))
        chosen = profiles.profile_settings(profile, config.getoption("smqa_database"))
    except ValueError as e:  # a usage error once a suite test or fixture is used; nothing else here
        return [f"sparse-mqa-testkit: {e}"]
    import torch

    return [f"sparse-mqa-testkit: backends {', '.join(run_state(config).names)}; profile {profile} "
            f"({chosen.max_examples} examples/test, database {profiles.describe_database(chosen.database)})",
            f"{_gpus_line()}; CUDA {torch.version.cuda or 'absent'}; torch {torch.__version__}; "
            f"tilelang {_version('tilelang')}; cudnn-frontend {_version('nvidia-cudnn-frontend')}; "
            f"TILELANG_CACHE_DIR {os.environ.get('TILELANG_CACHE_DIR', 'unset')}"]


class Reports:
    """Collects the reports of suite tests (the controller receives every worker's under xdist). With
    ``--smqa-verdicts`` it prints each test's verdict line as it finishes; with ``--smqa-json`` it rewrites the
    JSON as results arrive. With either, SIGTERM ends the run as Ctrl-C does, so pytest still prints the table
    and the JSON says what finished."""

    def __init__(self, config):
        self.config = config
        controller = getattr(config, "workerinput", None) is None  # under xdist, the one that gets every report
        self.live = controller and bool(config.getoption("smqa_verdicts"))
        self.written = 0.0
        self.signals = {}
        if controller and (self.live or config.getoption("smqa_json")):
            self.signals = stop_on_signals()

    def pytest_runtest_logreport(self, report):
        state = run_state(self.config)
        if report.when == "call" or not report.passed:
            state.finished.add(report.nodeid)
        if not any(k == PROPERTY for k, _ in report.user_properties):
            return
        state.reports.append(report)
        row = summarize([report])
        if not row:
            return  # a setup that passed: the test is still running
        if self.live:
            tr = self.config.pluginmanager.getplugin("terminalreporter")
            for line in verdict_line(row[0]).splitlines():
                if tr is not None:
                    tr.write_line(line)
                else:
                    print(line, file=sys.stderr, flush=True)
        if time.monotonic() - self.written > WRITE_EVERY:
            write(self.config, None)
            self.written = time.monotonic()

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        state = run_state(self.config)
        if not state.collected:  # the workers collect the same tests; the controller runs none itself
            state.collected = list(ids)

    def pytest_unconfigure(self, config):
        watch = self.signals.pop("watch", None)
        for sig, handler in self.signals.items():
            signal.signal(sig, handler)
        if watch is not None:
            watch()


WRITE_EVERY = 1.0  # seconds between rewrites of the JSON while the run goes on
REPEAT_S = 5.0  # a second signal this soon after the first is the same stop
STUCK_S = 30.0  # how long a stop signal may wait for the main thread to come back to Python


def stop_on_signals() -> dict:
    """SIGTERM (and SIGINT) raise KeyboardInterrupt, which pytest answers by reporting what finished; a repeat
    within ``REPEAT_S`` is the same stop (``timeout`` signals the whole process group and sparse-mqa-check
    forwards what it receives) and is ignored. Returns the handlers it replaced (restored at unconfigure; under
    "watch", what disarms ``watch_stuck``); only the main thread can install them, and a handler the user
    installed is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    ran = [float("-inf")]  # when the handler last ran
    first: list[float] = []

    def handler(signum, frame):
        now = ran[0] = time.monotonic()
        if first and now - first[0] < REPEAT_S:
            return
        first[:] = [now]
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    replaced = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            replaced[sig] = signal.signal(sig, handler)
    if replaced:
        disarm = watch_stuck(ran, STUCK_S)
        if disarm is not None:
            replaced["watch"] = disarm
    return replaced


def watch_stuck(ran: list, stuck_s: float):
    """A Python signal handler runs only when the main thread comes back to the interpreter, and a thread waiting
    on a kernel that never finishes (``torch.cuda.synchronize`` behind a hung kernel) never does: the stop would
    be lost and ``timeout`` would wait forever. So a helper thread hears each signal through
    ``signal.set_wakeup_fd``; if the handler has not run ``stuck_s`` seconds after the signal (``ran[0]``, its
    last run, is older than it), it prints every thread's stack (where the run is stuck) and ends the process with
    128 + the signal's number, as the signal itself would have. Returns what disarms it, or None where another
    wakeup fd is in use (left alone)."""
    import faulthandler

    r, w = os.pipe()
    os.set_blocking(w, False)
    theirs = signal.set_wakeup_fd(w)
    if theirs != -1:  # an event loop's: put back, and do not watch
        signal.set_wakeup_fd(theirs)
        os.close(r)
        os.close(w)
        return None

    def watch():
        while True:
            since = time.monotonic()
            got = os.read(r, 64)
            if not got:  # disarmed: the write end is closed
                os.close(r)
                return
            stops = [b for b in got if b in (signal.SIGINT, signal.SIGTERM)]
            if not stops:
                continue
            deadline = time.monotonic() + stuck_s  # the signal came after ``since``, just before this
            while ran[0] < since and time.monotonic() < deadline:
                time.sleep(0.1)
            if ran[0] < since:
                name = signal.Signals(stops[0]).name
                print(f"\nsparse-mqa-testkit: {name} came {stuck_s:.0f} s ago and the main thread has not returned "
                      f"to Python since (a kernel that never finishes?); every thread's stack follows, then the "
                      f"process ends", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(128 + stops[0])

    threading.Thread(target=watch, name="smqa-stuck-watch", daemon=True).start()

    def disarm():
        signal.set_wakeup_fd(-1)
        os.close(w)

    return disarm


def summary(terminalreporter) -> None:
    state = run_state(terminalreporter.config)
    if state.workers:
        terminalreporter.section("sparse-mqa-testkit: xdist workers and their GPUs")
        for wid, info in sorted(state.workers.items()):
            terminalreporter.write_line(f"{wid}: CUDA_VISIBLE_DEVICES={info['pinned']} -> "
                                        f"{info.get('device', 'CUDA not used by its tests')}")
    rows = summarize(state.reports)
    if rows:
        terminalreporter.section("sparse-mqa-testkit conformance")
        terminalreporter.write_line(format_table(rows, timings(rows, state.compile)))


def worker_gpu() -> dict:
    """What this worker ran on: its pin, and the GPU CUDA gave it (if a test used CUDA)."""
    info = {"pinned": os.environ.get(gpu_workers.ENV)}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        p = torch.cuda.get_device_properties(0)
        bus = "{:04x}:{:02x}:{:02x}".format(*(getattr(p, f"pci_{k}_id", 0) for k in ("domain", "bus", "device")))
        info["device"] = f"{p.name}, pci {bus}, {torch.cuda.device_count()} visible"
    return info


def merge_worker(state: SuiteState, worker_id: str, out: dict) -> None:
    """What an xdist worker sent back: its GPU, and its warm-up times (each worker warms up on its own: the
    longest counts)."""
    info = out.get("smqa_gpu")
    if info and info.get("pinned") is not None:
        state.workers[worker_id] = info
    for name, done in (out.get("smqa_compile") or {}).items():
        have = state.compile.get(name)
        if have is None or done["seconds"] > have["seconds"]:
            state.compile[name] = done


def write(config, exitstatus, final: bool = False) -> None:
    """The JSON file of --smqa-json (controller only, once the run used the suite): ``status`` "running" while
    the run goes on, then "finished", or "interrupted" (Ctrl-C, SIGTERM); ``unfinished``: the suite tests that
    have no result."""
    if getattr(config, "workerinput", None) is not None:
        return  # an xdist worker sees its own tests only: the controller writes
    path = config.getoption("smqa_json")
    state = run_state(config)
    if path and state.profile is None and state.reports:
        try:  # an xdist controller given its backends by $SMQA_BACKEND alone has not loaded them yet
            selected(config)
        except pytest.UsageError:
            pass  # the run reported it
    if path and state.profile is not None:
        rows = summarize(state.reports)
        status = "running" if not final else \
            "interrupted" if exitstatus == pytest.ExitCode.INTERRUPTED else "finished"
        write_json(path, rows, backends=state.names, profile=state.profile,
                   exitstatus=None if exitstatus is None else int(exitstatus), status=status,
                   unfinished=[n for n in state.collected if n not in state.finished],
                   timing=timings(rows, state.compile))
