"""tests/spinners.py: a spinning thread is found and lowered, a sleeping one is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.spinners import NICE, lower_spinners

CHILD = """
import sys, threading, time
def spin():
    while True:
        pass
def sleep():
    while True:
        time.sleep(0.05)
threads = [threading.Thread(target=f, daemon=True) for f in (spin, sleep)]
for thread in threads:
    thread.start()
time.sleep(0.2)
print(threads[0].native_id, threads[1].native_id, threading.get_native_id(), flush=True)
time.sleep(60)
"""


def test_only_the_spinning_thread_runs_at_nice_19() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        spinner, sleeper, main = map(int, child.stdout.readline().split())
        assert lower_spinners([child.pid]) == [spinner]
        assert os.getpriority(os.PRIO_PROCESS, spinner) == NICE
        assert os.getpriority(os.PRIO_PROCESS, sleeper) == os.getpriority(os.PRIO_PROCESS, main)
        assert os.getpriority(os.PRIO_PROCESS, main) != NICE
    finally:
        child.kill()
        child.wait(timeout=10)
