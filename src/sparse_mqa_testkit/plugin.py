"""pytest plugin (``pytest11`` entry point): the conformance suite in any repo that installs the package.

    pytest --pyargs sparse_mqa_testkit.property_tests --smqa-backend mypkg.kernels:MyBackend

Options: ``--smqa-backend`` (repeatable or comma-separated; the suite runs once per backend and test ids name
it; default $SMQA_BACKEND, else ``backends.default_backend_name()``), ``--smqa-profile`` (dev / ci / nightly,
default $SMQA_PROFILE or dev), ``--smqa-database DIR`` (Hypothesis example database, default $SMQA_DATABASE),
``--smqa-check NAME`` (only these checks), ``--smqa-json PATH``, ``--smqa-require-gpu`` (a ``gpu`` test fails
instead of skipping when CUDA is absent).

Markers: ``gpu`` (skipped with the reason when CUDA is absent), ``slow``, ``smqa_cases(n)`` (how many drawn cases
``smqa_case`` is parametrized with, default 3), ``smqa_outside_domain`` (``smqa_check`` runs the checks that
judge cases outside the backend's declared domain).

Fixtures: ``smqa_backend`` (session; planned and warmed up once per worker: ``smqa_plan``),
``smqa_case`` (a drawn case with its tensors on the backend's device), ``smqa_oracle`` (NumPy oracle on a case),
``smqa_checks`` (the checks bound to the backend: ``smqa_checks.tolerance(case)``...), ``smqa_check`` (one
registry check, the test parametrized over ``checks.CHECKS``). Every test that takes one of them gets a row in
the conformance table, and a Hypothesis test among them runs under the selected profile's settings (unless it
sets its own) with its example database keyed by its backend.

xdist: ``-n auto`` starts one worker per visible GPU (the CPU count without CUDA), and each worker pins its own
GPU through ``CUDA_VISIBLE_DEVICES`` in ``pytest_configure``, before CUDA is initialised.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest

from . import gpu_workers, profiles

BACKEND_ENV = "SMQA_BACKEND"
LIMITS_ENV = "SMQA_LIMITS"
SUITE_PACKAGE = "sparse_mqa_testkit.property_tests"
FIXTURES = ("smqa_backend", "smqa_case", "smqa_checks", "smqa_check", "smqa_scale_case")
_STATE = pytest.StashKey[dict]()
_REC = pytest.StashKey[object]()


def pytest_addoption(parser):
    g = parser.getgroup("sparse-mqa-testkit", "sparse-mqa-testkit conformance suite")
    g.addoption("--smqa-backend", action="append", default=[], metavar="NAME",
                help="backend to run the suite on: a registered name or module:attr (repeatable; "
                     f"default ${BACKEND_ENV} or the machine's default backend)")
    g.addoption("--smqa-profile", choices=profiles.PROFILES, default=None,
                help=f"Hypothesis profile for the suite (default ${profiles.PROFILE_ENV} or dev)")
    g.addoption("--smqa-database", default=None, metavar="DIR|redis://HOST:PORT[/DB]",
                help="Hypothesis example database: directories and Redis URLs, comma-separated, all read and "
                     f"written (default ${profiles.DATABASE_ENV}, else ./.hypothesis/smqa)")
    g.addoption("--smqa-check", action="append", default=[], metavar="NAME",
                help="run only these checks of the suite (repeatable; the names of "
                     "sparse_mqa_testkit.checks.CHECKS)")
    g.addoption("--smqa-compile-budget", type=int, default=None, metavar="N",
                help="a backend that declares compile_keys compiles at most N kernel keys in the run (default "
                     "$SMQA_COMPILE_BUDGET, else 8 / 16 / 32 for dev / ci / nightly)")
    g.addoption("--smqa-json", default=None, metavar="PATH",
                help="write the conformance table (per test: cases, worst ratio, coverage, failure) as JSON")
    g.addoption("--smqa-require-gpu", action="store_true",
                help="fail gpu-marked tests and CUDA backends when CUDA is absent instead of skipping them")
    g.addoption("--smqa-allow-missing", action="store_true",
                help="skip a backend whose optional packages are not installed (MissingDependency) instead of "
                     "failing the run; a backend that fails to import for any other reason is always an error")
    g.addoption("--smqa-scale", action="store_true",
                help="also run the scale tier: production-shaped cases on each CUDA backend (the scale profile "
                     "runs only that tier)")
    g.addoption("--smqa-limits", default=None, metavar="SIZE=N,...",
                help="raise or lower the drawn size limits: B, S, Skv, H, L (largest size) and work "
                     f"(B*S*H*L*Dqk); default ${LIMITS_ENV}, e.g. L=130,H=20")


def _check_names() -> list[str]:
    from .checks.registry import CHECKS

    return list(CHECKS)


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
                 "smqa_cases(n): number of drawn cases the smqa_case fixture is parametrized with",
                 "smqa_outside_domain: smqa_check runs the checks that judge cases outside the declared domain",
                 "smqa_scale: the scale tier (runs with --smqa-scale or --smqa-profile scale)"):
        config.addinivalue_line("markers", line)
    config.stash[_STATE] = {"backends": {}, "plans": {}, "drawn": {}, "reports": []}
    config.pluginmanager.register(_Reports(config.stash[_STATE]), "smqa-reports")


def _names(config) -> list[str]:
    state = config.stash[_STATE]
    if "names" not in state:
        state["names"] = backend_names(config)
    return state["names"]


def _selected(config) -> dict:
    """The run's profile, checks, limits and backends, validated on first use (so that an unrelated repo never
    pays or fails): pytest.UsageError naming what is wrong, once."""
    state = config.stash[_STATE]
    if "error" in state:
        raise pytest.UsageError(state["error"])
    if "profile" in state:
        return state
    try:
        _validate(config, state)
    except pytest.UsageError as e:
        state["error"] = str(e)
        raise
    return state


def _validate(config, state: dict) -> None:
    from .limits import parse_limits
    from .planning import compile_budget

    try:
        profile = profiles.select(config.getoption("smqa_profile"), config.getoption("smqa_database"))
        state["limits"] = parse_limits(config.getoption("smqa_limits") or os.environ.get(LIMITS_ENV, ""),
                                       where="--smqa-limits" if config.getoption("smqa_limits") else LIMITS_ENV)
        state["budget"] = compile_budget(config.getoption("smqa_compile_budget"), profile)
    except ValueError as e:
        raise pytest.UsageError(f"sparse-mqa-testkit: {e}") from None
    wanted = [c.removeprefix("check_") for c in config.getoption("smqa_check")]
    unknown = sorted(set(wanted) - set(_check_names()))
    if unknown:
        raise pytest.UsageError(f"--smqa-check {', '.join(unknown)}: not a check; choose from "
                                f"{', '.join(_check_names())}")
    state["checks"] = wanted
    state["missing"] = {}
    for name in _names(config):
        _load(config, state, name, profile)
    state["profile"] = profile


def _load(config, state: dict, name: str, profile: str) -> None:
    """Load and plan one backend, or raise pytest.UsageError saying why it cannot be (a missing optional package
    is a skip with --smqa-allow-missing)."""
    from .backends import BackendNotFound, MissingDependency, get_backend
    from .checks.result import exception_summary
    from .planning import plan_backend

    try:
        backend = get_backend(name)
        require = getattr(backend, "require", None)
        if callable(require):
            require()
    except BackendNotFound as e:
        raise pytest.UsageError(f"--smqa-backend {name}: {e}") from None
    except MissingDependency as e:
        if config.getoption("smqa_allow_missing"):
            state["missing"][name] = str(e)
            return
        raise pytest.UsageError(f"--smqa-backend {name}: {e}\n(pass --smqa-allow-missing to skip its tests "
                                "instead)") from None
    except Exception as e:  # a broken backend module is an error, with where it broke: never a skip
        raise pytest.UsageError(f"--smqa-backend {name}: loading it raised {exception_summary(e, frames=6)}") \
            from None
    try:
        state["plans"][name] = plan_backend(backend, profile=profile, budget=state["budget"],
                                            limits=state["limits"])
    except ValueError as e:
        raise pytest.UsageError(f"--smqa-backend {name}: {e}") from None
    state["backends"][name] = backend


def _explicit(config) -> bool:
    """The run names backends itself (option or environment): it means to use the suite."""
    return bool(config.getoption("smqa_backend") or os.environ.get(BACKEND_ENV))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    # the xdist controller collects nothing: it validates here, once, for a run that names its backends
    if getattr(session.config, "workerinput", None) is None and _explicit(session.config):
        _selected(session.config)


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
        profile = profiles.profile_name(config.getoption("smqa_profile"))
        chosen = profiles.profile_settings(profile, config.getoption("smqa_database"))
    except ValueError as e:  # a usage error once a suite test or fixture is used; nothing else here
        return [f"sparse-mqa-testkit: {e}"]
    import torch

    return [f"sparse-mqa-testkit: backends {', '.join(_names(config))}; profile {profile} "
            f"({chosen.max_examples} examples/test, database {profiles.describe_database(chosen.database)})",
            f"{_gpus_line()}; CUDA {torch.version.cuda or 'absent'}; torch {torch.__version__}; "
            f"tilelang {_version('tilelang')}; cudnn-frontend {_version('nvidia-cudnn-frontend')}; "
            f"TILELANG_CACHE_DIR {os.environ.get('TILELANG_CACHE_DIR', 'unset')}"]


# ---- parametrization and fixtures -----------------------------------------------------------------------------
def pytest_generate_tests(metafunc):
    if not any(f in metafunc.fixturenames for f in FIXTURES):
        return
    names = _names(metafunc.config)
    own = {a for m in metafunc.definition.iter_markers("parametrize") for a in _argnames(m)}
    if "smqa_scale_case" in metafunc.fixturenames:
        pairs = _scale_plan(metafunc.config, names)
        metafunc.parametrize("smqa_backend,smqa_scale_case", pairs, indirect=True, scope="session",
                             ids=[f"{n}-{c.describe()}" if c else n for n, c in pairs])
        return
    if "smqa_backend" not in own:
        metafunc.parametrize("smqa_backend", names, ids=names, indirect=True, scope="session")
    if "smqa_check" in metafunc.fixturenames and "smqa_check" not in own:
        from .checks.registry import CHECKS

        outside = metafunc.definition.get_closest_marker("smqa_outside_domain") is not None
        names = [n for n, c in CHECKS.items() if c.outside_domain or not outside]
        metafunc.parametrize("smqa_check", names, ids=names, indirect=True)
    if "smqa_case" in metafunc.fixturenames and "smqa_case" not in own:
        n = _n_cases(metafunc.definition)
        metafunc.parametrize("smqa_case", range(n), ids=[f"case{i}" for i in range(n)], indirect=True)


def _scale_active(config) -> tuple[bool, str]:
    """(whether the scale tier runs, the profile name); the profile's errors are reported by _selected."""
    try:
        profile = profiles.profile_name(config.getoption("smqa_profile"))
    except ValueError:
        return False, ""
    return profile == "scale" or bool(config.getoption("smqa_scale")), profile


def _scale_plan(config, names) -> list[tuple]:
    """(backend name, case) pairs of the scale tier; (name, None) for each backend when the tier is off or the
    backends cannot load (the items are deselected, or report the load error)."""
    from . import scale
    from .planning import rotation

    active, profile = _scale_active(config)
    if not active:
        return [(n, None) for n in names]
    try:
        state = _selected(config)
    except pytest.UsageError:
        return [(n, None) for n in names]
    seed = rotation(profile) or None
    return [(n, c) for n in names if n in state["backends"]
            for c in scale.plan(state["backends"][n], profile, seed)] or [(n, None) for n in names]


def _n_cases(node) -> int:
    marker = node.get_closest_marker("smqa_cases")
    return int(marker.args[0]) if marker and marker.args else 3


def _uses_suite(item) -> bool:
    return any(f in getattr(item, "fixturenames", ()) for f in FIXTURES)


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if gpu_items and not config.getoption("smqa_require_gpu") and not _cuda_available():
        skip = pytest.mark.skip(reason=_NO_GPU.format(what="this test"))  # reported at the test, not here
        for item in gpu_items:
            item.add_marker(skip)
    if not any(_uses_suite(i) for i in items):
        return
    if getattr(config, "workerinput", None) is not None:
        try:  # an xdist worker cannot stop the run cleanly: the suite's fixtures report the error instead
            _selected(config)
        except pytest.UsageError:
            return
    wanted = _selected(config)["checks"]
    scale_on, profile = _scale_active(config)
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("smqa_scale") is not None:
            chosen = scale_on and params.get("smqa_scale_case") is not None
        elif profile == "scale" and _is_suite(item):
            chosen = False  # the scale profile runs the tier alone
        elif wanted:
            chosen = params["smqa_check"] in wanted if "smqa_check" in params else not _is_suite(item)
        else:
            chosen = True
        (keep if chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    # the compile pool is warmed up only for a run with tests that draw from it (not the scale tier alone);
    # here, after every plugin's deselection (-k included)
    session.config.stash[_STATE]["pool_used"] = any(
        _uses_suite(i) and i.get_closest_marker("smqa_scale") is None for i in session.items)


def _argnames(marker) -> list[str]:
    names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def _cuda_available() -> bool:
    import torch  # here, not at the top: the plugin loads in every pytest run where the package is installed

    return bool(torch.cuda.is_available())


_NO_GPU = "{what} needs a CUDA GPU: torch.cuda.is_available() is False on this machine"


def _no_gpu(config, what: str):
    msg = _NO_GPU.format(what=what)
    if config.getoption("smqa_require_gpu"):
        pytest.fail(msg + " (--smqa-require-gpu)", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def smqa_backend(request):
    """The backend under test (one per ``--smqa-backend``), planned and warmed up once per worker."""
    try:
        state = _selected(request.config)
    except pytest.UsageError as e:
        pytest.fail(str(e), pytrace=False)
    name = getattr(request, "param", None) or state["names"][0]
    if name in state["missing"]:
        pytest.skip(f"backend {name!r} skipped (--smqa-allow-missing): {state['missing'][name]}")
    backend = state["backends"][name]
    if getattr(backend, "device", "cpu") != "cpu" and not _cuda_available():
        _no_gpu(request.config, f"backend {name!r} (device {backend.device})")
    if not state["plans"][name].compile and state.get("pool_used", True):
        _warm_up(request.config, name, state["plans"][name])
    return backend


def _warm_up(config, name: str, plan) -> None:
    """Each pooled kernel key compiled once, before any check, timed apart from the checks."""
    from .planning import warm_up

    done = warm_up(plan)
    keys = f"{done['keys']} pooled kernel keys" if done["keys"] else "no compile keys declared"
    _say(config)(f"[smqa] warm-up {name}: {keys}, {done['seconds']:.1f} s")
    config.stash[_STATE].setdefault("compile", {})[name] = done


@pytest.fixture(scope="session")
def smqa_plan(request, smqa_backend):
    """The run's plan for the backend: ``.boundaries.examples`` (explicit cases covering every boundary class
    its domain allows), ``.boundaries.unreachable``, ``.pool`` (compile keys), ``.compile`` (warm-up time)."""
    state = request.config.stash[_STATE]
    return next(state["plans"][n] for n, b in state["backends"].items() if b is smqa_backend)


def _say(config):
    """A line to the terminal now, past pytest's capture of the test's output (progress of a long run)."""
    capman = config.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    return say


def _recorder(item):
    """The item's recorder, made on first use and listed in its ``user_properties`` for the table."""
    from .recording import PROPERTY, Recorder

    rec = item.stash.get(_REC, None)
    if rec is None:
        params = getattr(getattr(item, "callspec", None), "params", {})
        check = params.get("smqa_check") or item.originalname.removeprefix("test_")
        if params.get("smqa_check") and item.get_closest_marker("smqa_outside_domain") is not None:
            check += "_outside_domain"
        if "smqa_case" in params:
            check += f"[case{params['smqa_case']}]"
        rec = Recorder(check=check, backend=str(params.get("smqa_backend", "?")), say=_say(item.config))
        item.stash[_REC] = rec
        item.user_properties.append((PROPERTY, rec.data()))
    return rec


@pytest.fixture
def smqa_checks(request, smqa_backend):
    """The checks bound to the backend and this test: ``smqa_checks.tolerance(case)``, ``.determinism(case)``,
    ``.guards``, ``.rejection``, ``.forward_tolerance``; each records, raises ``CheckFailure`` on failure and
    returns the ``CheckResult``."""
    from .fixtures import Checks

    return Checks(smqa_backend, _recorder(request.node))


@pytest.fixture
def smqa_check(request, smqa_checks):
    """One check of the registry, bound to the backend and this test: ``smqa_check(case)``."""
    from .checks.registry import get_check
    from .fixtures import BoundCheck

    check = get_check(request.param)
    if request.node.get_closest_marker("smqa_outside_domain") is not None:
        from .strategies import outside_dims

        if not outside_dims(smqa_checks.backend):
            pytest.skip(f"backend {smqa_checks.backend.name!r} declares no (Dqk, Dv) restriction: nothing "
                        "outside its domain to refuse")
    reason = check.applies_to(smqa_checks.backend)
    if reason:
        pytest.skip(reason)
    return BoundCheck(check.name, smqa_checks)


@pytest.fixture
def smqa_case(request, smqa_backend, smqa_plan):
    """A case drawn (deterministically) inside the backend's domain, with its tensors on the backend's device."""
    from .fixtures import drawn_case
    from .strategies import cases_for, draw_examples

    state = request.config.stash[_STATE]
    n = _n_cases(request.node)
    key = (id(smqa_backend), n)
    if key not in state["drawn"]:
        state["drawn"][key] = draw_examples(cases_for(smqa_backend, pool=smqa_plan.pool), n)
    drawn = state["drawn"][key]
    _recorder(request.node)
    return drawn_case(smqa_backend, drawn[getattr(request, "param", 0) % len(drawn)])


@pytest.fixture
def smqa_scale_case(request, smqa_backend):
    """A production-shaped case of the scale tier (``sparse_mqa_testkit.scale``), checked to fit in the
    backend's device memory first (skipped with the numbers when it does not)."""
    from . import scale
    from .checks.inputs import reference

    case = request.param
    device = str(getattr(smqa_backend, "device", "cpu"))
    if not device.startswith("cuda"):
        pytest.skip(f"the scale tier runs production sizes on a CUDA backend; {smqa_backend.name!r} runs on "
                    f"{device}")
    reference.cache_clear()  # the last case's references hold tens of GiB
    import torch

    torch.cuda.empty_cache()
    reason = scale.fits(case, device)
    if reason:
        pytest.skip(reason)
    return case


@pytest.fixture(scope="session")
def smqa_oracle():
    """The NumPy oracle on a case: ``smqa_oracle.forward(case)``, ``smqa_oracle.backward(case)`` (float64)."""
    from .fixtures import Oracle

    return Oracle()


# ---- running: gpu marker, the backend the strategies draw for, Hypothesis settings, recording -----------------
def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not _cuda_available():
        _no_gpu(item.config, "this test")
    if _is_suite(item):
        _recorder(item)  # a suite test has a row even when its setup skips or fails


def _is_suite(item) -> bool:
    return getattr(item, "module", None) is not None and item.module.__name__.startswith(SUITE_PACKAGE + ".")


def _hypothesis_settings(item) -> None:
    """The selected profile for a Hypothesis test that did not choose its own settings, and an example
    database key per test id (so each backend replays only its own failures)."""
    from hypothesis import HealthCheck, settings

    fn = item.obj
    inner = getattr(getattr(fn, "hypothesis", None), "inner_test", None)
    if inner is None:
        return
    explicit = hasattr(fn, "_hypothesis_internal_settings_applied") or \
        hasattr(inner, "_hypothesis_internal_settings_applied")
    base = fn._hypothesis_internal_use_settings if explicit else profiles.active()
    # the smqa fixtures belong to the test, not to one example: they are meant to outlive the examples
    fn._hypothesis_internal_use_settings = settings(
        base, suppress_health_check=set(base.suppress_health_check) | {HealthCheck.function_scoped_fixture})
    inner._hypothesis_internal_add_digest = f"{item.module.__name__}::{item.name}".encode()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    backend = getattr(item, "funcargs", {}).get("smqa_backend")
    if backend is None:
        yield
        return
    from .recording import PROPERTY
    from .strategies import PLAN_ATTRIBUTE

    rec = _recorder(item)
    rec.tiles = dict(getattr(backend, "tiles", None) or {})
    plan = next(p for p in item.config.stash[_STATE]["plans"].values() if p.draw.backend is backend)
    setattr(item, PLAN_ATTRIBUTE, plan.draw)
    _hypothesis_settings(item)
    try:
        yield
    finally:
        props = [(k, v) for k, v in item.user_properties if k != PROPERTY]
        keep = rec.cases or _is_suite(item)  # a downstream test that ran no check gets no row
        item.user_properties[:] = props + ([(PROPERTY, rec.data())] if keep else [])


class _Reports:
    """Collects the reports of suite tests (the controller receives every worker's under xdist)."""

    def __init__(self, state: dict):
        self.state = state

    def pytest_runtest_logreport(self, report):
        from .recording import PROPERTY

        if any(k == PROPERTY for k, _ in report.user_properties):
            self.state["reports"].append(report)


def pytest_terminal_summary(terminalreporter):
    from .table import format_table, summarize, timings

    state = terminalreporter.config.stash[_STATE]
    if state.get("workers"):
        terminalreporter.section("sparse-mqa-testkit: xdist workers and their GPUs")
        for wid, info in sorted(state["workers"].items()):
            terminalreporter.write_line(f"{wid}: CUDA_VISIBLE_DEVICES={info['pinned']} -> "
                                        f"{info.get('device', 'CUDA not used by its tests')}")
    rows = summarize(state["reports"])
    if rows:
        terminalreporter.section("sparse-mqa-testkit conformance")
        terminalreporter.write_line(format_table(rows, timings(rows, state.get("compile", {}))))


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
    out = getattr(node, "workeroutput", {})
    state = node.config.stash[_STATE]
    info = out.get("smqa_gpu")
    if info and info.get("pinned") is not None:
        state.setdefault("workers", {})[node.gateway.id] = info
    for name, done in (out.get("smqa_compile") or {}).items():  # each worker warms up on its own: the longest
        have = state.setdefault("compile", {}).get(name)
        if have is None or done["seconds"] > have["seconds"]:
            state["compile"][name] = done


def pytest_sessionfinish(session, exitstatus):
    state = session.config.stash[_STATE]
    if getattr(session.config, "workerinput", None) is not None:
        session.config.workeroutput["smqa_gpu"] = _worker_gpu()
        session.config.workeroutput["smqa_compile"] = state.get("compile", {})
        return
    path = session.config.getoption("smqa_json")
    if path and "names" in state:
        from .table import summarize, timings, write_json

        rows = summarize(state["reports"])
        write_json(path, rows, backends=state["names"], profile=state["profile"], exitstatus=int(exitstatus),
                   timing=timings(rows, state.get("compile", {})))
