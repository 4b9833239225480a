"""Find the threads of a process that spin (runnable whenever looked at) and run them at nice 19.

Why the real-vLLM tier needs it: vLLM's NixlConnector makes its NIXL agents with the progress
thread on, and nixl 1.5.1's Python API sets that thread's delay to 0 (``pthrDelay = 0`` in
nixl's ``_api.py``), so each agent, one per rank, keeps a core busy for as long as its engine
lives, idle or not (measured here: 1.0 core per idle engine of vLLM's; 0.04 per idle engine of
ours, whose progress thread waits with a 1 ms delay, worker/nixl_real.py). On two cores the tier's two to four such engines alive
at a time took their cycles from every engine under test. At nice 19 a spinner still gets
every core nobody else wants; vLLM's code and configuration stay as they ship.

A nice value weighs a thread against the others of its autogroup (Linux, on by default): one
a session. So the harness starts engines in process groups of their own, not sessions
(tests/engine_zygote.py, tests/real_vllm_harness.py): in a session of its own, a spinner at
nice 19 yielded only to its own engine's threads, and a pair of vLLM's still took 1.7 of two
cores from two busy loops (0.08 in the tier's session).

Stdlib only: the harness (tests/real_vllm_harness.py) runs in .venv.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

SAMPLES = 10
SAMPLE_INTERVAL_S = 0.1
# A waiting thread shows 'S' and one that spins 'R' (running, or runnable and queued on a
# busy machine) whenever looked at; 8 of 10 leaves room for a look that falls in a spinner's
# rare syscall. A thread wrongly taken for one only runs slower: its engine is a reference.
RUNNABLE_SAMPLES = 8
NICE = 19


def _thread_states(pids: Iterable[int]) -> dict[int, str]:
    """Every thread of ``pids`` by its id, with its scheduler state letter."""
    states = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    stat = (task / "stat").read_text()
                    # The state follows the command name, which may hold spaces and ')'.
                    states[int(task.name)] = stat[stat.rindex(")") + 2]
    return states


def spinning_threads(pids: Iterable[int]) -> list[int]:
    """The threads of ``pids`` runnable in at least RUNNABLE_SAMPLES of SAMPLES looks."""
    pids = list(pids)
    runnable: dict[int, int] = {}
    for sample in range(SAMPLES):
        if sample:
            time.sleep(SAMPLE_INTERVAL_S)
        for tid, state in _thread_states(pids).items():
            runnable[tid] = runnable.get(tid, 0) + (state == "R")
    return sorted(tid for tid, count in runnable.items() if count >= RUNNABLE_SAMPLES)


def lower_spinners(pids: Iterable[int]) -> list[int]:
    """Run every spinning thread of ``pids`` at nice NICE (a thread's nice is its own on
    Linux); returns their ids."""
    lowered = []
    for tid in spinning_threads(pids):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
            lowered.append(tid)
    return lowered
