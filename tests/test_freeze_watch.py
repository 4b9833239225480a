"""The freeze watch (connector/observability/freeze_watch.py): a process whose Python threads
stopped is logged with where its CPU went, and faulthandler is armed to print the stacks.

The judging is driven with made-up CPU and pressure readings; the ticking thread with a fake
clock; then a real GIL-holding call on the main thread (a regular expression's catastrophic
backtracking: the ``re`` engine never releases the GIL) must be caught by a real watch.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest

from connector.observability import freeze_watch
from connector.observability.freeze_watch import (
    DUMP_AFTER_S,
    TICK_S,
    FreezeWatch,
    judge_freeze,
    read_pressure,
    read_thread_cpu,
    start_freeze_watch,
)
from worker.stall_watch import connector_thread_stacks

BEFORE = {1: ("MainThread", 10.0, 0), 2: ("nixl-pd-side-channel-5600", 1.0, 0), 3: ("ucx", 0.5, 0)}
NO_PSI = (None, None, None)


@pytest.mark.parametrize(
    ("after", "verdict_words"),
    [
        pytest.param(
            {1: ("MainThread", 28.7, 0), 2: ("side-channel", 1.0, 0), 3: ("ucx", 0.6, 0)},
            "thread MainThread (tid 1) ran all along: a call there that holds the GIL",
            id="one-thread-ran-the-whole-gap-it-held-the-GIL",
        ),
        pytest.param(
            {1: ("MainThread", 10.1, 2), 2: ("side-channel", 1.0, 0), 3: ("ucx", 0.6, 0)},
            "the process hardly ran: it got no CPU",
            id="nothing-ran-the-process-was-starved",
        ),
        pytest.param(
            {1: ("MainThread", 10.3, 900), 2: ("side-channel", 1.0, 250), 3: ("ucx", 0.6, 0)},
            "the process hardly ran and took 1150 major page faults: its threads waited for "
            "pages memory pressure had evicted",
            id="nothing-ran-many-major-faults-the-process-waited-on-paging",
        ),
    ],
)
def test_the_verdict_tells_a_GIL_holder_from_a_paging_or_starved_process(
    after: dict[int, tuple[str, float, int]], verdict_words: str
) -> None:
    freeze = judge_freeze(19.3, BEFORE, after, (100.0, 5.0, 1.0), (118.0, 5.5, 1.25), dumped=True)

    text = freeze.describe()
    assert text.startswith("this process's Python threads did not run for 19.3 s; it used ")
    assert verdict_words in text
    assert "host over the gap: CPU pressure 18.0 s, memory pressure 0.5 s, I/O pressure 0.2" in text
    assert "faulthandler printed every thread's stack above" in text


def test_busiest_threads_come_first_and_a_thread_born_in_the_gap_counts_from_zero() -> None:
    after = {1: ("MainThread", 12.0, 0), 3: ("ucx", 0.5, 0), 4: ("handshake_0", 3.0, 7)}

    freeze = judge_freeze(6.0, BEFORE, after, NO_PSI, NO_PSI, dumped=False)

    assert freeze.busiest == (("handshake_0 (tid 4)", 3.0), ("MainThread (tid 1)", 2.0))
    assert freeze.process_cpu_s == pytest.approx(5.0)
    assert freeze.major_faults == 7
    assert "host over the gap: no PSI" in freeze.describe()
    assert "faulthandler" not in freeze.describe()


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def fake_watch(clock: FakeClock, armed: list[float]) -> FreezeWatch:
    def read_cpu() -> dict[int, tuple[str, float, int]]:
        return {1: ("MainThread", clock.now_s - 1000.0, 0)}  # the main thread ran all along

    return FreezeWatch(
        context="decode of engine d: ",
        clock=clock,
        tick_s=1.0,
        report_after_s=5.0,
        dump_after_s=10.0,
        read_cpu=read_cpu,
        read_host=lambda: NO_PSI,
        arm_dump=armed.append,
    )


def test_an_on_time_tick_logs_nothing_and_re_arms_the_dump(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, armed = FakeClock(), []
    watch = fake_watch(clock, armed)
    caplog.set_level(logging.WARNING, logger="connector.observability.freeze_watch")
    clock.now_s += 1.2

    assert watch.tick() is None

    assert armed == [11.0]
    assert caplog.records == []


def test_a_tick_that_came_late_is_logged_with_the_thread_that_ran(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, armed = FakeClock(), []
    watch = fake_watch(clock, armed)
    caplog.set_level(logging.WARNING, logger="connector.observability.freeze_watch")
    clock.now_s += 21.0  # due at +1 s: 20 s late, past the 10 s at which the dump fires

    freeze = watch.tick()

    assert freeze is not None and freeze.late_s == pytest.approx(20.0) and freeze.dumped
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("decode of engine d: froze: this process's Python threads ")
    assert "thread MainThread (tid 1) ran all along" in warning
    clock.now_s += 1.0
    assert watch.tick() is None  # the next tick is on time again: one warning per freeze


def test_a_real_gil_holding_call_on_the_main_thread_is_caught(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``re``'s backtracking holds the GIL for seconds; the watch thread cannot tick meanwhile
    and must report the gap, with the main thread among the busiest."""
    caplog.set_level(logging.WARNING, logger="connector.observability.freeze_watch")
    armed: list[float] = []
    watch = FreezeWatch(tick_s=0.05, report_after_s=0.5, dump_after_s=60.0, arm_dump=armed.append)
    watch.start()
    try:
        started_s = time.monotonic()
        assert re.match(r"(a+)+b", "a" * 27) is None  # about 2-10 s, never releasing the GIL
        held_s = time.monotonic() - started_s
        deadline_s = time.monotonic() + 5.0
        while not caplog.records and time.monotonic() < deadline_s:
            time.sleep(0.05)
    finally:
        watch.stop()
    assert held_s > 1.0, f"the regular expression took only {held_s:.2f} s: no freeze to see"
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings, f"no freeze reported across a {held_s:.1f} s GIL hold"
    busiest = warnings[0][warnings[0].index("busiest threads: ") :]
    assert f"MainThread (tid {threading.main_thread().native_id})" in busiest


def test_thread_cpu_names_python_threads_and_pressure_reads_psi(tmp_path: Path) -> None:
    threads = read_thread_cpu()
    assert threads[threading.main_thread().native_id or 0][0] == "MainThread"
    (tmp_path / "cpu").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=2500000\n")
    assert read_pressure(tmp_path) == (2.5, None, None)  # no file: None, not an error


def test_the_environment_switch_turns_the_watch_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(freeze_watch.ENV_SWITCH, "0")
    assert start_freeze_watch("anything: ") is None


def test_stall_reports_show_the_main_thread_stack() -> None:
    assert "--- thread MainThread:" in connector_thread_stacks()
    assert "test_stall_reports_show_the_main_thread_stack" in connector_thread_stacks()


def test_no_stack_dump_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """faulthandler's dump reads other threads' frames without the GIL: an engine core died
    in the middle of one, so by default the watch reports freezes without arming it."""
    clock, armed = FakeClock(), []
    quiet = FreezeWatch(clock=clock, read_cpu=dict, read_host=lambda: NO_PSI)
    clock.now_s += 21.0
    freeze = quiet.tick()
    assert freeze is not None and not freeze.dumped
    assert "faulthandler" not in freeze.describe()

    monkeypatch.setattr(freeze_watch, "_arm_faulthandler", armed.append)
    for switch, arms in (("1", []), ("stacks", [TICK_S + DUMP_AFTER_S])):
        monkeypatch.setenv(freeze_watch.ENV_SWITCH, switch)
        monkeypatch.setattr(freeze_watch, "_started", None)
        watch = start_freeze_watch("decode: ")
        try:
            assert watch is not None and armed == arms, switch
        finally:
            if watch is not None:
                watch.stop()
