"""The suite run as a child pytest (a crashing kernel cannot take the report with it): what ``sparse-mqa-check``
and the nightly driver both call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..harness.options import CLI, FRONT_END_ENV

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
    """Run the suite in a child pytest; returns (exit status, the JSON the plugin wrote, or {})."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(json_path or Path(tmp) / "smqa.json")
        cmd = suite_command(backends, profile=profile, database=database, json_path=path, extra=extra)
        env = {**(os.environ if env is None else env), FRONT_END_ENV: CLI}  # its messages name the CLI's flags
        try:
            rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            print(f"sparse-mqa-check: the suite ran past {timeout:.0f} s and was stopped", file=sys.stderr)
            rc = 124
        data = json.loads(path.read_text()) if path.exists() else {}
    return rc, data
