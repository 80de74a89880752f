"""A fleet's shared example database: Hypothesis's Redis database beside each runner's local directory, against a
real redis-server on a free loopback port. Two nightly runners each replay the other's failure; an unreachable
server is an error naming the URL, never a quiet local-only run."""

from __future__ import annotations

import os

import pytest

from sparse_mqa_testkit.harness import profiles
from sparse_mqa_testkit.tools import runner
from sparse_mqa_testkit.tools.nightly import run_nightly
from support import DKV_DOUBLED_SOURCE, DQ_DOUBLED_SOURCE, free_port


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    (tmp_path / "kernels_p.py").write_text(DQ_DOUBLED_SOURCE)
    (tmp_path / "kernels_q.py").write_text(DKV_DOUBLED_SOURCE)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SMQA_DATABASE", raising=False)
    return tmp_path


def test_an_unreachable_server_is_an_error_naming_the_url():
    import importlib.util
    import re

    url = f"redis://127.0.0.1:{free_port()}/0"
    # without the redis client (a GPU runner without the test extra) the error says what to install
    why = " is unreachable" if importlib.util.find_spec("redis") else \
        ": a Redis database needs the redis client: pip install 'hypothesis[redis]'"
    with pytest.raises(ValueError, match=re.escape(f"example database {url}{why}")):
        profiles.profile_settings("nightly", url)


def test_a_url_keeps_the_local_directory_too(redis_url, tmp_path):
    db = profiles.profile_settings("dev", f"{tmp_path / 'local'},{redis_url}").database
    assert profiles.describe_database(db) == f"{tmp_path / 'local'} + {redis_url}"
    db.save(b"k", b"v")
    assert list(db.fetch(b"k")) == [b"v"]
    assert list(profiles.example_database(redis_url).fetch(b"k")) == [b"v"]  # read back through the server alone


def test_two_nightly_runners_see_each_others_failures(redis_url, fleet, monkeypatch):
    a, b = fleet / "runner-a", fleet / "runner-b"
    only = ["--smqa-check", "tolerance"]
    assert run_nightly(["kernels_p:Broken"], budget=25, out=a, database=redis_url, extra=only) == 1
    assert run_nightly(["kernels_q:Broken"], budget=25, out=b, database=redis_url, extra=only) == 1
    # one derandomized example, which passes on its own: each runner fails only by replaying the other's find
    monkeypatch.setenv("SMQA_MAX_EXAMPLES", "1")
    for backend, own_dir in (("kernels_p:Broken", b), ("kernels_q:Broken", a)):
        rc, _ = runner.run_suite([backend], profile="ci", database=own_dir / "examples", extra=only)
        assert rc == 0, f"{backend}: its own runner's directory alone should not know the failure"
        rc, data = runner.run_suite([backend], profile="ci", database=f"{own_dir / 'examples'},{redis_url}",
                                    extra=only)
        assert rc == 1 and "failed" in {r["outcome"] for r in data["rows"]}, backend
