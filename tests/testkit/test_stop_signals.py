"""A stop signal (``timeout``'s SIGTERM, Ctrl-C) ends a run whose main thread is stuck where Python's handler cannot
run: a thread waiting on a GPU kernel that never finishes never comes back to the interpreter, so the handler that
turns the signal into KeyboardInterrupt (for the report of what finished) would wait forever, and so would
``timeout``. Here the stuck thread is libc's ``system()``, which waits on its child through signals."""

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = '''
import ctypes, sys, time
from sparse_mqa_testkit.harness import report
report.STUCK_S = 2.0
report.stop_on_signals()
print("ready", flush=True)
if sys.argv[1] == "stuck":
    ctypes.CDLL(None).system(b"exec sleep 12 </dev/null >/dev/null 2>&1")  # no Python handler runs until it returns
else:
    try:
        while True:  # back in Python every second: the handler runs, up to a second late
            ctypes.CDLL(None).system(b"exec sleep 1 </dev/null >/dev/null 2>&1")
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}", flush=True)
        time.sleep(4)  # twice STUCK_S: the watch must leave a run that heard the signal alone
        print("reported and left", flush=True)
'''

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux (libc's system(), signals)")


def run_child(tmp_path, mode, wait_s=0.5):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONFAULTHANDLER=""))
    assert proc.stdout.readline() == "ready\n"
    time.sleep(wait_s)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    took = time.monotonic() - t0
    return proc.returncode, proc.stdout.read(), proc.stderr.read(), took


def test_a_stop_ends_a_run_stuck_outside_python(tmp_path):
    rc, out, err, took = run_child(tmp_path, "stuck")
    assert rc == 128 + signal.SIGTERM, (rc, out, err)
    assert took < 8, f"ended {took:.1f} s after SIGTERM; the stuck call alone lasts 12 s"
    assert "SIGTERM came 2 s ago and the main thread has not returned to Python" in err
    assert 'child.py", line 8 in <module>' in err  # where it was stuck: the system() call


def test_a_stop_the_handler_heard_is_left_to_the_run(tmp_path):
    """The handler runs up to a second after the signal, which comes 3 s into the run (past STUCK_S): the watch
    counts from the signal, and leaves the run alone once the handler has run."""
    rc, out, err, took = run_child(tmp_path, "python", wait_s=3.0)
    assert rc == 0 and "interrupted: stopped by SIGTERM" in out and "reported and left" in out, (rc, out, err)
    assert "has not returned to Python" not in err


def test_another_wakeup_fd_is_left_alone():
    """An event loop's wakeup fd (asyncio sets one) stays in place, and then nothing is watched."""
    from sparse_mqa_testkit.harness import report

    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    try:
        assert report.watch_stuck([0.0], 1.0) is None
        assert signal.set_wakeup_fd(w) == w
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)
