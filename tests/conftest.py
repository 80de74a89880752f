# Fixtures shared by the repo's own tests; tests/support.py is importable from every test folder.
import os
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def paddle():
    """The paddle module, imported only by the tests that ask for it (skipped when paddlepaddle is absent)."""
    from sparse_mqa_testkit.paddle import frontend

    try:
        return frontend.import_paddle()
    except ImportError:
        pytest.skip("needs paddlepaddle (pip install '.[paddle]')")


@pytest.fixture
def redis_url(tmp_path):
    """A real redis-server on a free loopback port, for the test: its URL."""
    from support import free_port

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("needs redis-server (Debian package redis-server; .ci/run installs it)")
    redis = pytest.importorskip("redis", reason="needs the redis client: pip install 'hypothesis[redis]'")
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not answer within 5 s")
    yield url
    proc.terminate()
    proc.wait(timeout=10)
