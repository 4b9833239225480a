"""A process's freeze watch: when its Python threads stop running, say where the CPU went.

A stopped process sends no heartbeats, so its leases expire and good requests fail; logs
after the fact cannot tell a GIL held in C code, page faults under memory pressure and no CPU
at all apart. So a thread of our own ticks every ``tick_s``; a tick ``report_after_s`` late is
logged with the process's CPU use and major page faults during the gap per thread (Linux
``/proc/self/task``), the busiest threads named, and the host's CPU, memory and I/O pressure
(PSI) over the gap. With ``NIXL_PD_FREEZE_WATCH=stacks`` each tick also arms
``faulthandler.dump_traceback_later``, so a tick ``dump_after_s`` late prints every thread's
stack while the process is still stopped; off by default, as that C thread reads frames
without the GIL. faulthandler has one such timer per process and this watch re-arms it every
tick: arm it only where nothing else uses ``dump_traceback_later`` (``=0`` turns the watch
off). The log line, the verdicts and why the watch exists: docs/metrics.md, "Frozen processes".

``judge_freeze`` is the decision (pure); ``FreezeWatch`` the thread that reads and logs.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TICK_S = 1.0
REPORT_AFTER_S = 5.0  # a tick this late is logged
DUMP_AFTER_S = 10.0  # a tick this late has faulthandler print every thread's stack
GIL_HOLDER_SHARE = 0.5  # one thread used at least this share of the gap: it held the GIL
MANY_MAJOR_FAULTS = 100  # the process's major faults in a gap that say it waited on paging
ENV_SWITCH = "NIXL_PD_FREEZE_WATCH"  # "0": no watch; "stacks": faulthandler dumps too

# thread id -> (its name, CPU seconds it used so far, major page faults so far)
ThreadCpu = Mapping[int, tuple[str, float, int]]
# PSI "some" totals, seconds: (cpu, memory, io); None where the kernel has no PSI
Pressure = tuple[float | None, float | None, float | None]


@dataclass(frozen=True)
class Freeze:
    """A gap in which this process's Python threads did not run."""

    late_s: float  # how much later than due the tick came
    process_cpu_s: float  # CPU the process used in the gap (all threads)
    busiest: tuple[tuple[str, float], ...]  # (thread, CPU seconds), the most first
    major_faults: int  # the process's page faults that had to read from disk, in the gap
    cpu_pressure_s: float | None  # host: time some runnable task waited for a CPU
    memory_pressure_s: float | None  # host: time some task stalled on memory (reclaim)
    io_pressure_s: float | None  # host: time some task waited on I/O
    dumped: bool  # faulthandler printed the threads' stacks during the gap

    def verdict(self) -> str:
        if self.busiest and self.busiest[0][1] >= GIL_HOLDER_SHARE * self.late_s:
            return (
                f"thread {self.busiest[0][0]} ran all along: a call there that holds the GIL "
                "(C code) kept this process's other Python threads out"
            )
        if self.major_faults >= MANY_MAJOR_FAULTS:
            return (
                f"the process hardly ran and took {self.major_faults} major page faults: its "
                "threads waited for pages memory pressure had evicted (see the host's memory "
                "and I/O pressure)"
            )
        return (
            "the process hardly ran: it got no CPU (an overloaded host; see the CPU pressure) "
            "or every thread was blocked"
        )

    def describe(self) -> str:
        threads = ", ".join(f"{name} {cpu_s:.1f} s" for name, cpu_s in self.busiest) or "none"
        pressures = (
            ("CPU", self.cpu_pressure_s),
            ("memory", self.memory_pressure_s),
            ("I/O", self.io_pressure_s),
        )
        host = ", ".join(
            f"{kind} pressure {seconds:.1f} s" for kind, seconds in pressures if seconds is not None
        )
        dump = (
            " faulthandler printed every thread's stack above ('Timeout')." if self.dumped else ""
        )
        return (
            f"this process's Python threads did not run for {self.late_s:.1f} s; it used "
            f"{self.process_cpu_s:.1f} s of CPU and took {self.major_faults} major page faults "
            f"meanwhile (busiest threads: {threads}); "
            f"host over the gap: {host or 'no PSI'}. Verdict: {self.verdict()}.{dump}"
        )


def judge_freeze(
    late_s: float,
    before: ThreadCpu,
    after: ThreadCpu,
    pressure_before: Pressure,
    pressure_after: Pressure,
    *,
    dumped: bool,
    max_threads: int = 3,
) -> Freeze:
    """The freeze a late tick saw, from the per-thread CPU and PSI read before and after it.
    A thread not in ``before`` counts from zero (it started in the gap)."""
    used = {
        f"{name} (tid {tid})": cpu_s - before.get(tid, (name, 0.0, 0))[1]
        for tid, (name, cpu_s, _) in after.items()
    }
    faults = sum(
        major - before.get(tid, (name, 0.0, 0))[2] for tid, (name, _, major) in after.items()
    )
    busiest = sorted(((n, s) for n, s in used.items() if s > 0.0), key=lambda x: -x[1])
    return Freeze(
        late_s=late_s,
        process_cpu_s=sum(max(s, 0.0) for s in used.values()),
        busiest=tuple(busiest[:max_threads]),
        major_faults=max(faults, 0),
        cpu_pressure_s=_delta(pressure_before[0], pressure_after[0]),
        memory_pressure_s=_delta(pressure_before[1], pressure_after[1]),
        io_pressure_s=_delta(pressure_before[2], pressure_after[2]),
        dumped=dumped,
    )


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


# ---- reading the process and the host (Linux; empty or None elsewhere) --------------------


def read_thread_cpu(
    task_dir: Path = Path("/proc/self/task"),
) -> dict[int, tuple[str, float, int]]:
    """Every thread of this process: (Python name if it has one, else the kernel's), CPU
    seconds, major page faults."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    threads: dict[int, tuple[str, float, int]] = {}
    try:
        entries = list(task_dir.iterdir())
    except OSError:
        return threads
    for entry in entries:
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        tid = int(entry.name)
        comm = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / ticks_per_s  # utime + stime
        threads[tid] = (names.get(tid, comm), cpu_s, int(fields[9]))  # majflt
    return threads


def read_pressure(root: Path = Path("/proc/pressure")) -> Pressure:
    """The host's PSI "some" totals for CPU, memory and I/O, seconds (None without PSI)."""
    return _psi_some_s(root / "cpu"), _psi_some_s(root / "memory"), _psi_some_s(root / "io")


def _psi_some_s(path: Path) -> float | None:
    try:
        first = path.read_text().splitlines()[0]
        return int(first.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def _arm_faulthandler(timeout_s: float) -> None:
    """Print every thread's stack to the process's real stderr (fd 2: the engine's log) if
    not re-armed within ``timeout_s``; a stderr without a file descriptor arms nothing."""
    stderr = sys.__stderr__
    if stderr is None:
        return
    with contextlib.suppress(OSError, ValueError):  # io.UnsupportedOperation is both
        faulthandler.dump_traceback_later(timeout_s, repeat=False, file=stderr, exit=False)


class FreezeWatch:
    """Ticks on its own daemon thread; ``tick`` is its body (tests call it with a fake clock).

    ``clock`` is monotonic seconds; ``read_cpu``, ``read_host`` and ``arm_dump`` replace the
    /proc reads and faulthandler (tests); ``arm_dump`` None: no stack dump.
    """

    def __init__(
        self,
        *,
        context: str = "",  # names the process in the warning
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = TICK_S,
        report_after_s: float = REPORT_AFTER_S,
        dump_after_s: float = DUMP_AFTER_S,
        read_cpu: Callable[[], ThreadCpu] = read_thread_cpu,
        read_host: Callable[[], Pressure] = read_pressure,
        arm_dump: Callable[[float], None] | None = None,
    ) -> None:
        self._context = context
        self._clock = clock
        self._tick_s = tick_s
        self._report_after_s = report_after_s
        self._dump_after_s = dump_after_s
        self._read_cpu = read_cpu
        self._read_host = read_host
        self._arm_dump = arm_dump
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nixl-pd-freeze-watch", daemon=True)
        # The ticking thread's own (tick() is called from one thread at a time):
        self._due_s = clock() + tick_s
        self._cpu: ThreadCpu = read_cpu()
        self._host: Pressure = read_host()

    def start(self) -> None:
        self._arm()
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        faulthandler.cancel_dump_traceback_later()

    def tick(self) -> Freeze | None:
        """Log the freeze if this tick came ``report_after_s`` late; re-arm the dump."""
        late_s = self._clock() - self._due_s
        cpu, host = self._read_cpu(), self._read_host()
        freeze = None
        if late_s >= self._report_after_s:
            dumped = self._arm_dump is not None and late_s >= self._dump_after_s
            freeze = judge_freeze(late_s, self._cpu, cpu, self._host, host, dumped=dumped)
            logger.warning("%sfroze: %s", self._context, freeze.describe())
        self._cpu, self._host = cpu, host
        self._due_s = self._clock() + self._tick_s
        self._arm()
        return freeze

    def _arm(self) -> None:
        if self._arm_dump is not None:
            self._arm_dump(self._tick_s + self._dump_after_s)

    def _run(self) -> None:
        while not self._stopping.wait(max(0.0, self._due_s - self._clock())):
            try:
                self.tick()
            except Exception:  # a diagnostic must never take the process down
                logger.exception("freeze watch: unexpected error")


_started: FreezeWatch | None = None
_start_lock = threading.Lock()  # guards _started: one watch per process


def start_freeze_watch(context: str = "") -> FreezeWatch | None:
    """Start this process's one freeze watch (later calls return it); None if
    ``NIXL_PD_FREEZE_WATCH=0``; with ``=stacks`` it arms faulthandler's dump too."""
    global _started
    switch = os.environ.get(ENV_SWITCH, "1")
    if switch == "0":
        return None
    with _start_lock:
        if _started is None:
            arm_dump = _arm_faulthandler if switch == "stacks" else None
            _started = FreezeWatch(context=context, arm_dump=arm_dump)
            _started.start()
            atexit.register(faulthandler.cancel_dump_traceback_later)  # no dump while exiting
        return _started
