"""pytest plugin (``pytest11`` entry point): the conformance suite in any repo that installs the package.

    pytest --pyargs sparse_mqa_testkit.property_tests --smqa-backend mypkg.kernels:MyBackend

Options: ``--smqa-backend`` (repeatable or comma-separated; the suite runs once per backend and test ids name
it; default $SMQA_BACKEND, else ``backends.default_backend_name()``), ``--smqa-profile`` (dev / ci / nightly,
default $SMQA_PROFILE or dev), ``--smqa-database DIR`` (Hypothesis example database, default $SMQA_DATABASE),
``--smqa-require-gpu`` (a ``gpu`` test fails instead of skipping when CUDA is absent).

Markers: ``gpu`` (skipped with the reason when CUDA is absent), ``slow``, ``smqa_cases(n)`` (how many drawn cases
``smqa_case`` is parametrized with, default 3).

Fixtures: ``smqa_backend`` (session; warmed up once per worker via the backend's optional ``warmup()``),
``smqa_case`` (a drawn case with its tensors on the backend's device), ``smqa_oracle`` (NumPy oracle on a case),
``smqa_checks`` (the checks bound to the backend: ``smqa_checks.tolerance(case)``...). A downstream
``@given`` test gets the selected profile with ``@settings(sparse_mqa_testkit.profiles.active())``.

xdist: ``-n auto`` starts one worker per visible GPU (the CPU count without CUDA), and each worker pins its own
GPU through ``CUDA_VISIBLE_DEVICES`` in ``pytest_configure``, before CUDA is initialised.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest

from . import gpu_workers, profiles, strategies, suite

BACKEND_ENV = "SMQA_BACKEND"
SUITE_PACKAGE = "sparse_mqa_testkit.property_tests"
_STATE = pytest.StashKey[dict]()


def pytest_addoption(parser):
    g = parser.getgroup("sparse-mqa-testkit", "sparse-mqa-testkit conformance suite")
    g.addoption("--smqa-backend", action="append", default=[], metavar="NAME",
                help="backend to run the suite on: a registered name or module:attr (repeatable; "
                     f"default ${BACKEND_ENV} or the machine's default backend)")
    g.addoption("--smqa-profile", choices=profiles.PROFILES, default=None,
                help=f"Hypothesis profile for the suite (default ${profiles.PROFILE_ENV} or dev)")
    g.addoption("--smqa-database", default=None, metavar="DIR",
                help=f"Hypothesis example database directory (default ${profiles.DATABASE_ENV})")
    g.addoption("--smqa-check", action="append", default=[], metavar="NAME",
                help="run only these checks of the suite (tolerance, forward_tolerance, determinism, rejection, "
                     "guards, boundary_coverage; repeatable)")
    g.addoption("--smqa-json", default=None, metavar="PATH",
                help="write the conformance table (per test: cases, worst ratio, coverage, failure) as JSON")
    g.addoption("--smqa-require-gpu", action="store_true",
                help="fail gpu-marked tests and CUDA backends when CUDA is absent instead of skipping them")


def backend_names(config) -> list[str]:
    given = config.getoption("smqa_backend") or [os.environ.get(BACKEND_ENV, "")]
    names = [n.strip() for arg in given for n in arg.split(",") if n.strip()]
    if not names:
        from .backends import default_backend_name

        names = [default_backend_name()]
    return list(dict.fromkeys(names))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    winput = getattr(config, "workerinput", None)
    if winput is not None and winput.get("smqa_gpus"):
        # first thing in the worker: CUDA must not have started yet
        gpu_workers.pin(winput.get("workerid", ""), list(winput["smqa_gpus"]))
    for line in ("gpu: needs a CUDA GPU (skipped with the reason when CUDA is absent)",
                 "slow: long-running",
                 "smqa_cases(n): number of drawn cases the smqa_case fixture is parametrized with"):
        config.addinivalue_line("markers", line)
    profile = profiles.select(config.getoption("smqa_profile"), config.getoption("smqa_database"))
    config.stash[_STATE] = {"names": backend_names(config), "profile": profile, "backends": {}, "drawn": {},
                           "reports": []}
    config.pluginmanager.register(_Reports(config.stash[_STATE]), "smqa-reports")


# ---- xdist: one worker per GPU, each pinned ------------------------------------------------------------------
# tryfirst: xdist's own implementation (the CPU count) is a plain firstresult hook, so which one answers would
# otherwise depend on the order the two plugins happened to be registered in
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # the user's explicit count (xdist reads it)
    return gpu_workers.auto_num_workers(_controller_gpus(config))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["smqa_gpus"] = _controller_gpus(node.config)


def _controller_gpus(config) -> list[str]:
    cache = config.__dict__.setdefault("_smqa_gpus", [])
    if not cache:
        cache.append(gpu_workers.visible_gpus())
    return cache[0]


# ---- header ---------------------------------------------------------------------------------------------------
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


def pytest_report_header(config):
    if getattr(config, "workerinput", None) is not None:
        return None
    try:
        import torch

        torch_v, cuda_v = torch.__version__, torch.version.cuda or "absent"
    except ImportError:
        torch_v = cuda_v = "absent"
    state = config.stash[_STATE]
    db = profiles.active().database
    return [f"sparse-mqa-testkit: backends {', '.join(state['names'])}; profile {state['profile']} "
            f"({profiles.active().max_examples} examples/test, database "
            f"{getattr(db, 'path', None) or 'none'})",
            f"{_gpus_line()}; CUDA {cuda_v}; torch {torch_v}; tilelang {_version('tilelang')}; "
            f"cudnn-frontend {_version('nvidia-cudnn-frontend')}; "
            f"TILELANG_CACHE_DIR {os.environ.get('TILELANG_CACHE_DIR', 'unset')}"]


# ---- parametrization and fixtures -----------------------------------------------------------------------------
def pytest_generate_tests(metafunc):
    state = metafunc.config.stash[_STATE]
    own = {a for m in metafunc.definition.iter_markers("parametrize") for a in _argnames(m)}
    if "smqa_backend" in metafunc.fixturenames and "smqa_backend" not in own:
        metafunc.parametrize("smqa_backend", state["names"], ids=state["names"], indirect=True, scope="session")
    if "smqa_case" in metafunc.fixturenames and "smqa_case" not in own:
        marker = metafunc.definition.get_closest_marker("smqa_cases")
        n = int(marker.args[0]) if marker and marker.args else 3
        metafunc.parametrize("smqa_case", range(n), ids=[f"case{i}" for i in range(n)], indirect=True)


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if gpu_items and not config.getoption("smqa_require_gpu") and not _cuda_available():
        skip = pytest.mark.skip(reason=_NO_GPU.format(what="this test"))  # reported at the test, not here
        for item in gpu_items:
            item.add_marker(skip)
    wanted = [c.removeprefix("check_") for c in config.getoption("smqa_check")]
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        name = getattr(item, "originalname", item.name)
        chosen = any(name == f"test_{c}" or name.startswith(f"test_{c}_") for c in wanted)
        (keep if chosen or not _is_suite(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _argnames(marker) -> list[str]:
    names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


_NO_GPU = "{what} needs a CUDA GPU: torch.cuda.is_available() is False on this machine"


def _no_gpu(config, what: str):
    msg = _NO_GPU.format(what=what)
    if config.getoption("smqa_require_gpu"):
        pytest.fail(msg + " (--smqa-require-gpu)", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def smqa_backend(request):
    """The backend under test (one per ``--smqa-backend``), warmed up once per worker."""
    from .backends import BackendNotFound, get_backend

    state = request.config.stash[_STATE]
    name = getattr(request, "param", None) or state["names"][0]
    if name not in state["backends"]:
        try:
            backend = get_backend(name)
        except BackendNotFound as e:
            raise pytest.UsageError(f"--smqa-backend {name}: {e}") from None
        except ImportError as e:
            pytest.skip(f"backend {name!r} unavailable: {e} (a package it needs is not installed)")
        if getattr(backend, "device", "cpu") != "cpu" and not _cuda_available():
            _no_gpu(request.config, f"backend {name!r} (device {backend.device})")
        warmup = getattr(backend, "warmup", None)
        if callable(warmup):
            warmup()  # compiles each kernel variant once per worker (from TileLang's cache when warm)
        state["backends"][name] = backend
    return state["backends"][name]


@pytest.fixture
def smqa_case(request, smqa_backend):
    """A case drawn (deterministically) inside the backend's domain, with its tensors on the backend's device."""
    state = request.config.stash[_STATE]
    marker = request.node.get_closest_marker("smqa_cases")
    n = int(marker.args[0]) if marker and marker.args else 3
    key = (id(smqa_backend), n)
    if key not in state["drawn"]:
        state["drawn"][key] = suite.draw_examples(strategies.cases_for(smqa_backend), n)
    drawn = state["drawn"][key]
    return suite.drawn_case(smqa_backend, drawn[getattr(request, "param", 0) % len(drawn)])


@pytest.fixture(scope="session")
def smqa_oracle():
    """The NumPy oracle on a case: ``smqa_oracle.forward(case)``, ``smqa_oracle.backward(case)`` (float64)."""
    return suite.Oracle()


@pytest.fixture(scope="session")
def smqa_checks(smqa_backend):
    """The checks bound to the backend: ``smqa_checks.tolerance(case)``, ``.determinism(case)``, ``.guards``,
    ``.rejection``, ``.forward_tolerance``; each records, raises ``CheckFailure`` on failure, returns the result."""
    return suite.Checks(smqa_backend)


# ---- running: gpu marker, the active backend, recording ------------------------------------------------------
def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not _cuda_available():
        _no_gpu(item.config, "this test")
    if _is_suite(item):
        params = getattr(item, "callspec", None)
        name = params.params.get("smqa_backend") if params else None
        rec = suite.Recorder(check=item.originalname.removeprefix("test_"), backend=str(name))
        item.stash[_REC] = rec
        item.user_properties.append((suite.PROPERTY, rec.data()))


_REC = pytest.StashKey[suite.Recorder]()


def _is_suite(item) -> bool:
    return getattr(item, "module", None) is not None and item.module.__name__.startswith(SUITE_PACKAGE + ".")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    backend = getattr(item, "funcargs", {}).get("smqa_backend")
    rec = item.stash.get(_REC, None)
    if backend is None:
        yield
        return
    if rec is None:  # a downstream test using the fixtures: record what its checks saw, too
        params = getattr(item, "callspec", None)
        name = params.params.get("smqa_backend") if params else getattr(backend, "name", "?")
        rec = suite.Recorder(check=item.originalname.removeprefix("test_"), backend=str(name))
        item.user_properties.append((suite.PROPERTY, rec.data()))
        item.stash[_REC] = rec
    rec.tiles = dict(getattr(backend, "tiles", None) or {})
    strategies.set_active_backend(backend)
    suite.current = rec
    try:
        yield
    finally:
        suite.current = None
        strategies.set_active_backend(None)
        props = [(k, v) for k, v in item.user_properties if k != suite.PROPERTY]
        keep = rec.cases or _is_suite(item)  # a downstream test that ran no check gets no row
        item.user_properties[:] = props + ([(suite.PROPERTY, rec.data())] if keep else [])


class _Reports:
    """Collects the reports of suite tests (the controller receives every worker's under xdist)."""

    def __init__(self, state: dict):
        self.state = state

    def pytest_runtest_logreport(self, report):
        if any(k == suite.PROPERTY for k, _ in report.user_properties):
            self.state["reports"].append(report)


def pytest_terminal_summary(terminalreporter):
    state = terminalreporter.config.stash[_STATE]
    if state.get("workers"):
        terminalreporter.section("sparse-mqa-testkit: xdist workers and their GPUs")
        for wid, info in sorted(state["workers"].items()):
            terminalreporter.write_line(f"{wid}: CUDA_VISIBLE_DEVICES={info['pinned']} -> "
                                        f"{info.get('device', 'CUDA not used by its tests')}")
    rows = suite.summarize(state["reports"])
    if rows:
        terminalreporter.section("sparse-mqa-testkit conformance")
        terminalreporter.write_line(suite.format_table(rows))


def _worker_gpu() -> dict:
    """What this worker ran on: its pin, and the GPU CUDA gave it (if a test used CUDA)."""
    info = {"pinned": os.environ.get(gpu_workers.ENV)}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        p = torch.cuda.get_device_properties(0)
        bus = "{:04x}:{:02x}:{:02x}".format(*(getattr(p, f"pci_{k}_id", 0) for k in ("domain", "bus", "device")))
        info["device"] = f"{p.name}, pci {bus}, {torch.cuda.device_count()} visible"
    return info


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    info = getattr(node, "workeroutput", {}).get("smqa_gpu")
    if info and info.get("pinned") is not None:
        node.config.stash[_STATE].setdefault("workers", {})[node.gateway.id] = info


def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "workerinput", None) is not None:
        session.config.workeroutput["smqa_gpu"] = _worker_gpu()
        return
    path = session.config.getoption("smqa_json")
    if path:
        state = session.config.stash[_STATE]
        suite.write_json(path, suite.summarize(state["reports"]), backends=state["names"],
                         profile=state["profile"], exitstatus=int(exitstatus))
