"""The one module that uses Hypothesis's private APIs: it works on the installed Hypothesis, and a Hypothesis that
lacks what it needs fails loudly, naming the API, instead of silently dropping the profile or the example keys."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_mqa_testkit.harness import hypothesis_compat as compat


def test_the_installed_hypothesis_has_what_the_compat_module_needs():
    compat.check()


def test_own_settings_tell_a_chosen_profile_from_none():
    @given(st.none())
    def plain(x):
        pass

    @settings(max_examples=3)
    @given(st.none())
    def chosen(x):
        pass

    assert compat.own_settings(plain) is None
    assert compat.own_settings(chosen).max_examples == 3
    compat.use_settings(plain, settings(max_examples=7))
    assert plain._hypothesis_internal_use_settings.max_examples == 7
    compat.set_example_key(plain, b"key")
    assert compat.inner_test(plain)._hypothesis_internal_add_digest == b"key"


def test_a_missing_private_api_is_named(monkeypatch):
    real = importlib.import_module

    def no_patching(name, *a, **kw):
        if name == "hypothesis.extra._patching":
            raise ImportError("No module named 'hypothesis.extra._patching'")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", no_patching)
    with pytest.raises(RuntimeError, match=r"hypothesis.extra._patching .*update harness/hypothesis_compat.py"):
        compat.check()
    monkeypatch.setattr(compat, "_EXPLICIT", "_renamed_attribute")
    with pytest.raises(RuntimeError, match="a test's own @settings"):
        compat.check()


def test_an_example_patch_names_the_failing_case():
    from sparse_mqa_testkit.property_tests import test_checks

    patch = compat.example_patch(test_checks.test_check, "test_check(case=Case(H=3, seed=1))")
    assert patch is not None and "+@example(case=Case(H=3, seed=1))" in patch
