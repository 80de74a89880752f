"""Every use of a private Hypothesis API, in one place.

Hypothesis has no public way to (a) tell whether a test chose its own ``@settings``, (b) give an already
decorated test other settings, (c) give one of several parametrizations of a test its own example-database key
(and read that key back), (d) write an ``@example`` patch for a test. These use the attributes Hypothesis itself
sets (its own pytest plugin does (b) and (c) the same way, and HypoFuzz (c)), ``function_digest`` and
``hypothesis.extra._patching``. ``check()`` raises, naming what is missing, on a Hypothesis where any of them
changed; the suite's tests call it, so an incompatible release fails loudly instead of silently dropping the
profile or the example keys.
"""

from __future__ import annotations

import importlib

_SETTINGS = "_hypothesis_internal_use_settings"  # the settings a @given test runs with
_EXPLICIT = "_hypothesis_internal_settings_applied"  # set when @settings decorated the test
_DIGEST = "_hypothesis_internal_add_digest"  # bytes added to the test's example-database key


def inner_test(fn):
    """The undecorated function of a @given test, or None for anything else."""
    return getattr(getattr(fn, "hypothesis", None), "inner_test", None)


def own_settings(fn):
    """The settings a @given test chose itself with ``@settings``, or None when it chose none."""
    inner = inner_test(fn)
    explicit = hasattr(fn, _EXPLICIT) or hasattr(inner, _EXPLICIT)
    return getattr(fn, _SETTINGS) if explicit else None


def use_settings(fn, chosen) -> None:
    """Run the @given test ``fn`` under ``chosen`` settings from now on."""
    setattr(getattr(fn, "__func__", fn), _SETTINGS, chosen)


def set_example_key(fn, key: bytes) -> None:
    """Key the example database of the @given test ``fn`` by ``key`` beside its source (as Hypothesis's pytest
    plugin keys each parametrization by its node id)."""
    setattr(inner_test(fn), _DIGEST, key)


def example_key(fn) -> bytes:
    """The example-database key the @given test ``fn`` saves its failures under (as Hypothesis and HypoFuzz
    compute it: a digest of its source, signature and ``set_example_key``'s bytes)."""
    reflection = importlib.import_module("hypothesis.internal.reflection")
    return reflection.function_digest(inner_test(fn))


def example_patch(func, call: str) -> str | None:
    """A patch (unified diff) adding ``@example(<call's arguments>)`` above the @given test ``func``, as Hypothesis
    writes for a failure it found; ``call`` is like ``"test_check(case=Case(...))"``. None when the test's source
    cannot be located."""
    patching = importlib.import_module("hypothesis.extra._patching")
    triple = patching.get_patch_for(func, [(call, patching.FAIL_MSG)])
    return None if triple is None else patching.make_patch([triple])


def check() -> None:
    """Raise RuntimeError naming each private API this module needs that the installed Hypothesis lacks."""
    import hypothesis
    from hypothesis import given, settings, strategies

    missing = []

    @settings(max_examples=1)
    @given(strategies.none())
    def probe(x):
        pass

    if own_settings(probe) is None:
        missing.append(f"{_EXPLICIT} (a test's own @settings)")
    if not hasattr(probe, _SETTINGS):
        missing.append(f"{_SETTINGS} (a test's settings)")
    if inner_test(probe) is None:
        missing.append("test.hypothesis.inner_test")
    from hypothesis.internal import reflection

    if _DIGEST not in open(reflection.__file__).read() or not hasattr(reflection, "function_digest"):
        missing.append(f"{_DIGEST} and function_digest (a test's example-database key)")
    try:
        patching = importlib.import_module("hypothesis.extra._patching")
        for name in ("get_patch_for", "make_patch", "FAIL_MSG"):
            getattr(patching, name)
    except (ImportError, AttributeError) as e:
        missing.append(f"hypothesis.extra._patching ({e})")
    if missing:
        raise RuntimeError(f"sparse-mqa-testkit needs private Hypothesis APIs that Hypothesis "
                           f"{hypothesis.__version__} lacks: {'; '.join(missing)}. Install a Hypothesis this "
                           "release supports (see its pyproject.toml) or update harness/hypothesis_compat.py")
