"""pytest plugin (``pytest11`` entry point): the conformance suite in any repo that installs the package.

    pytest --pyargs sparse_mqa_testkit.property_tests --smqa-backend mypkg.kernels:MyBackend

Options: ``--smqa-backend`` (repeatable or comma-separated; the suite runs once per backend and test ids name
it; default $SMQA_BACKEND, else ``backends.default_backend_name()``), ``--smqa-profile`` (dev / ci / nightly /
scale, default $SMQA_PROFILE or dev), ``--smqa-database`` (Hypothesis example database, default $SMQA_DATABASE),
``--smqa-check NAME`` (only these checks), ``--smqa-json PATH``, ``--smqa-require-gpu`` (a ``gpu`` test fails
instead of skipping when CUDA is absent), ``--smqa-allow-missing``, ``--smqa-scale``, ``--smqa-limits``,
``--smqa-compile-budget``, ``--smqa-fuzz`` (the fixture-free fuzz entry HypoFuzz runs, ``harness.fuzzing``).

Markers: ``gpu`` (skipped with the reason when CUDA is absent), ``slow``, ``smqa_cases(n)`` (how many drawn cases
``smqa_case`` is parametrized with, default 3), ``smqa_outside_domain`` (``smqa_check`` runs the checks that
judge cases outside the backend's declared domain), ``smqa_scale``.

Fixtures (``harness.fixtures``): ``smqa_backend``, ``smqa_plan``, ``smqa_case``, ``smqa_oracle``, ``smqa_checks``,
``smqa_check`` (the test parametrized over ``checks.CHECKS``), ``smqa_scale_case``. Every test that takes one of
them gets a row in the conformance table.

xdist (``harness.gpu_workers``): ``-n auto`` starts one worker per visible GPU plus CPU workers (the CPU count
without CUDA); each pins a GPU through ``CUDA_VISIBLE_DEVICES`` in ``pytest_configure``, before CUDA starts, and
the tests that need a GPU run on the GPU workers only.
"""

from __future__ import annotations

import os

import pytest

from .harness import fuzzing, gpu_workers, options, profiles, report
from .harness.fixtures import (  # noqa: F401
    NO_GPU,
    SUITE_FIXTURES,
    n_cases,
    no_gpu,
    not_applicable,
    recorded,
    recorder,
    say,
    smqa_backend,
    smqa_bind,
    smqa_case,
    smqa_check,
    smqa_checks,
    smqa_oracle,
    smqa_plan,
    smqa_scale_case,
    uses_suite,
)
from .harness.recording import PROPERTY
from .harness.state import run_state, selected

SUITE_PACKAGE = "sparse_mqa_testkit.property_tests"


def pytest_addoption(parser):
    options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    winput = getattr(config, "workerinput", None)
    if winput is not None and winput.get("smqa_gpus"):
        # first thing in the worker: CUDA must not have started yet
        gpu_workers.pin(winput.get("workerid", ""), list(winput["smqa_gpus"]))
        if winput.get("smqa_route"):
            config.option.loadgroup = True  # xdist then tags each test's node id with its group
    elif winput is None and config.getoption("dist", "no") != "no":
        config.option.tx = gpu_workers.with_threads(config.getoption("tx") or [])  # before the workers start
    for line in ("gpu: needs a CUDA GPU (skipped with the reason when CUDA is absent)",
                 "slow: long-running",
                 "smqa_cases(n): number of drawn cases the smqa_case fixture is parametrized with",
                 "smqa_outside_domain: smqa_check runs the checks that judge cases outside the declared domain",
                 "smqa_scale: the scale tier (runs with --smqa-scale or --smqa-profile scale)"):
        config.addinivalue_line("markers", line)
    config.pluginmanager.register(report.Reports(config), "smqa-reports")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    # the xdist controller collects nothing: it validates here, once, for a run that names its backends on its
    # command line (it means to use the suite); $SMQA_BACKEND alone is checked where a test uses the suite
    if getattr(session.config, "workerinput", None) is None and session.config.getoption("smqa_backend"):
        selected(session.config)
    fuzzing.use_database(session.config)  # before collection imports any test module


# ---- xdist: a worker per GPU, each pinned, and CPU workers ----------------------------------------------------
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
    node.workerinput["smqa_route"] = _routes(node.config)


def _routes(config) -> bool:
    """GPU tests go to GPU workers: with GPUs and xdist's default per-test distribution."""
    return bool(_controller_gpus(config)) and config.getoption("dist", "no") == "load"


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    return gpu_workers.make_scheduler(config, log, _controller_gpus(config)) if _routes(config) else None


def _controller_gpus(config) -> list[str]:
    cache = config.__dict__.setdefault("_smqa_gpus", [])
    if not cache:
        cache.append(gpu_workers.gpu_slots(gpu_workers.visible_gpus()))  # one entry per GPU worker
    return cache[0]


def pytest_report_header(config):
    return None if getattr(config, "workerinput", None) is not None else report.header(config)


# ---- parametrization and selection ----------------------------------------------------------------------------
def pytest_generate_tests(metafunc):
    if fuzzing.ARG in metafunc.fixturenames:
        fuzzing.parametrize(metafunc)
        return
    if not any(f in metafunc.fixturenames for f in SUITE_FIXTURES):
        return
    names = run_state(metafunc.config).names
    own = {a for m in metafunc.definition.iter_markers("parametrize") for a in _argnames(m)}
    if "smqa_scale_case" in metafunc.fixturenames:
        pairs = _scale_pairs(metafunc.config, names)
        metafunc.parametrize("smqa_backend,smqa_scale_case", pairs, indirect=True, scope="session",
                             ids=[f"{n}-{c.describe()}" if c else n for n, c in pairs])
        return
    if "smqa_backend" not in own:
        metafunc.parametrize("smqa_backend", names, ids=names, indirect=True, scope="session")
    if "smqa_check" in metafunc.fixturenames and "smqa_check" not in own:
        from .checks.registry import CHECKS

        outside = metafunc.definition.get_closest_marker("smqa_outside_domain") is not None
        checks = [n for n, c in CHECKS.items() if c.outside_domain or not outside]
        metafunc.parametrize("smqa_check", checks, ids=checks, indirect=True)
    if "smqa_case" in metafunc.fixturenames and "smqa_case" not in own:
        n = n_cases(metafunc.definition)
        metafunc.parametrize("smqa_case", range(n), ids=[f"case{i}" for i in range(n)], indirect=True)


def _scale_active(config) -> tuple[bool, str]:
    """(whether the scale tier runs, the profile name); the profile's errors are reported by ``selected``."""
    try:
        profile = profiles.profile_name(config.getoption("smqa_profile"))
    except ValueError:
        return False, ""
    return profile == "scale" or bool(config.getoption("smqa_scale")), profile


def _scale_pairs(config, names) -> list[tuple]:
    """(backend name, case) pairs of the scale tier; (name, None) for each backend when the tier is off or the
    backends cannot load (the items are deselected, or report the load error)."""
    from .cases.planning import rotation
    from .cases.scale import tier_cases

    active, profile = _scale_active(config)
    if not active:
        return [(n, None) for n in names]
    try:
        state = selected(config)
    except pytest.UsageError:
        return [(n, None) for n in names]
    seed = rotation(profile) or None
    return [(n, c) for n in names if n in state.specs
            for c in tier_cases(state.specs[n], profile, seed)] or [(n, None) for n in names]


def _is_suite(item) -> bool:
    return getattr(item, "module", None) is not None and item.module.__name__.startswith(SUITE_PACKAGE + ".")


def _cuda_available() -> bool:
    import torch  # here, not at the top: the plugin loads in every pytest run where the package is installed

    return bool(torch.cuda.is_available())


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which adds each test's xdist_group to its node id
def pytest_collection_modifyitems(config, items):
    gpu_workers.tag_gpu_tests(config, items)
    gpu_items = [i for i in items if i.get_closest_marker("gpu") is not None]
    if gpu_items and not config.getoption("smqa_require_gpu") and not _cuda_available():
        skip = pytest.mark.skip(reason=NO_GPU.format(what="this test"))  # reported at the test, not here
        for item in gpu_items:
            item.add_marker(skip)
    if not any(uses_suite(i) for i in items):
        return
    try:
        state = selected(config)
    except pytest.UsageError:
        if getattr(config, "workerinput", None) is not None:
            return  # an xdist worker cannot stop the run cleanly: the suite's fixtures report the error instead
        raise
    scale_on, profile = _scale_active(config)
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        chosen = fuzzing.select(item, state, profile)  # None: neither the fuzz entry nor a test it replaces
        if chosen is None:
            chosen = _chosen(item, params, state, scale_on, profile)
        (keep if chosen else drop).append(item)
        if chosen and _is_suite(item):
            recorder(item)  # a suite test has a row even when it is skipped
        if chosen and "smqa_check" in params:
            _skip_if_not_applicable(item, state, params)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _chosen(item, params, state, scale_on: bool, profile: str) -> bool:
    if item.get_closest_marker("smqa_scale") is not None:
        return scale_on and params.get("smqa_scale_case") is not None
    if profile == "scale" and _is_suite(item):
        return False  # the scale profile runs the tier alone
    if state.checks:
        return params["smqa_check"] in state.checks if "smqa_check" in params else not _is_suite(item)
    return True


def _skip_if_not_applicable(item, state, params) -> None:
    """A skip marker (with the reason) on a check that does not apply to the test's backend."""
    spec = state.specs.get(params.get("smqa_backend"))
    if spec is None:
        return
    reason = not_applicable(spec, params["smqa_check"], item.get_closest_marker("smqa_outside_domain") is not None)
    if reason:
        item.add_marker(pytest.mark.skip(reason=reason))


def pytest_collection_finish(session):
    # the compile pool is warmed up only for a run with tests that draw from it (not the scale tier alone);
    # here, after every plugin's deselection (-k included)
    suite = [i for i in session.items if uses_suite(i)]
    if suite:
        state = run_state(session.config)
        state.collected = [i.nodeid for i in suite]
        state.pool_used = any(i.get_closest_marker("smqa_scale") is None for i in suite)


def _argnames(marker) -> list[str]:
    names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


# ---- running and reporting ------------------------------------------------------------------------------------
def pytest_runtest_setup(item):
    gpu_workers.before_first_test(item.config, say(item.config))
    if item.get_closest_marker("gpu") is not None and not _cuda_available():
        no_gpu(item.config, "this test")
    fuzzing.setup(item)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    rec = recorded(item)
    if rec is not None:  # the table's row as it stands now (a downstream test that ran no check gets none)
        props = [(k, v) for k, v in item.user_properties if k != PROPERTY]
        item.user_properties[:] = props + ([(PROPERTY, rec.data())] if rec.cases or _is_suite(item) else [])
    yield


def pytest_terminal_summary(terminalreporter):
    report.summary(terminalreporter)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    report.merge_worker(run_state(node.config), node.gateway.id, getattr(node, "workeroutput", {}))


def pytest_sessionfinish(session, exitstatus):
    if getattr(session.config, "workerinput", None) is not None:
        session.config.workeroutput["smqa_gpu"] = report.worker_gpu()
        session.config.workeroutput["smqa_compile"] = run_state(session.config).compile
        return
    report.write(session.config, exitstatus, final=True)
