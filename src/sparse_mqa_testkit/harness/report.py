"""What a run prints and writes: the header line (backends, profile, versions, GPUs), the conformance table at the
end, the JSON file, and which GPU each xdist worker used."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys

from . import gpu_workers, profiles
from .recording import PROPERTY
from .state import SuiteState, run_state
from .table import format_table, summarize, timings, write_json


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
    """Collects the reports of suite tests (the controller receives every worker's under xdist)."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        if any(k == PROPERTY for k, _ in report.user_properties):
            run_state(self.config).reports.append(report)


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


def write(config, exitstatus) -> None:
    """The JSON file of --smqa-json (controller only, once the run used the suite)."""
    path = config.getoption("smqa_json")
    state = run_state(config)
    if path and state.profile is not None:
        rows = summarize(state.reports)
        write_json(path, rows, backends=state.names, profile=state.profile, exitstatus=int(exitstatus),
                   timing=timings(rows, state.compile))
