"""The doctor's loopback READ: two agent processes on this host, and what UCX says it used.

Starts ``connector.tools.doctor_peer`` twice (a target holding a pattern, a reader that READs it),
relays the target's agent metadata to the reader, and reads the reader's UCX protocol tables
(``UCX_PROTO_INFO=y`` into its own ``UCX_LOG_FILE``) to name the transport that moved the
bytes. Both processes start at once (each pays NIXL's start-up cost in parallel), every wait
has a deadline, and both are always stopped (killed if they do not quit in time).
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, NamedTuple

import msgspec

from connector.errors import TransferFailed
from connector.tools.doctor_checks import Loopback
from connector.tools.doctor_ucx import message_lanes, parse_proto_tables, read_lanes, slowest_class

DEFAULT_NET_DEVICES = "lo"
# How long a peer gets to exit cleanly before it is killed (a busy host slows it). The reader
# writes out its UCX log (the lanes its READs took) before its RESULT line: a kill loses none.
STOP_TIMEOUT_S = 10.0
KILLED_EXIT_TIMEOUT_S = 60.0  # a killed peer only has to be reaped
IDLE_WINDOW_S = 0.5  # how long the target is watched doing nothing, for the spinning check


class PeerProcess:
    """One doctor_peer child: send it a line, wait for a tagged line, always stop it."""

    def __init__(
        self,
        role: str,
        env: Mapping[str, str],
        stderr: IO[bytes],
        *,
        num_bytes: int,
        timeout_s: float,  # the parent's wait: the child quits on its own STOP_TIMEOUT_S later
        num_reads: int = 0,  # the reader's
    ) -> None:
        self.role = role
        self._stderr = stderr
        args = [role, "--num-bytes", str(num_bytes), "--reads", str(num_reads)]
        lifetime = ["--lifetime-s", str(timeout_s + STOP_TIMEOUT_S)]
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "connector.tools.doctor_peer", *args, *lifetime],
            env=dict(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        self._pending = b""

    def send(self, line: str) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()

    def wait_line(self, tag: str, deadline_s: float) -> list[str]:
        """The words after ``tag`` on the next line starting with it; skips NIXL's own lines.

        Raises TransferFailed on ``ERROR``, on exit, or at ``deadline_s`` (monotonic).
        """
        stdout = self._proc.stdout
        if stdout is None:
            raise TransferFailed(f"doctor {self.role} process has no stdout")
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            while True:
                line, newline, rest = self._pending.partition(b"\n")
                if newline:
                    self._pending = rest
                    words = line.decode(errors="replace").split()
                    if words[:1] == [tag]:
                        return words[1:]
                    if words[:1] == ["ERROR"]:
                        raise TransferFailed(f"{self.role}: {' '.join(words[1:])}")
                    continue
                remaining_s = deadline_s - time.monotonic()
                if remaining_s <= 0:
                    raise TransferFailed(f"{self.role} gave no {tag} line in time")
                if selector.select(remaining_s):
                    chunk = os.read(stdout.fileno(), 65536)
                    if not chunk:
                        raise TransferFailed(f"{self.role} exited: {self._stderr_tail()}")
                    self._pending += chunk

    def stop(self) -> None:
        """Close stdin (the child's cue to quit), then kill it if it has not exited in time."""
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        except OSError:
            pass  # it already exited: the pipe is broken
        try:
            self._proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=KILLED_EXIT_TIMEOUT_S)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _stderr_tail(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        lines = self._stderr.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or f"exit code {self._proc.poll()}, nothing on stderr"


def run_loopback(
    env: Mapping[str, str], *, num_bytes: int, num_reads: int, timeout_s: float
) -> Loopback:
    """READ ``num_bytes`` ``num_reads`` times (after one warm-up) between two processes.

    ``env`` is the environment the engines would run with; UCX_NET_DEVICES defaults to lo.
    """
    child_env = {**env, "PYTHONUNBUFFERED": "1"}
    child_env.setdefault("UCX_NET_DEVICES", DEFAULT_NET_DEVICES)
    child_env.setdefault("NIXL_LOG_LEVEL", "WARN")
    failed = Loopback(
        ok=False,
        ucx_net_devices=child_env["UCX_NET_DEVICES"],
        net_devices_from_env="UCX_NET_DEVICES" in env,
        ucx_tls=env.get("UCX_TLS"),
    )
    with tempfile.TemporaryDirectory(prefix="nixl-pd-doctor-") as tmp:
        ucx_log = Path(tmp) / "ucx-reader.log"
        reader_env = {**child_env, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(ucx_log)}
        try:
            result, idle_cpu = _transfer(child_env, reader_env, num_bytes, num_reads, timeout_s)
        except TransferFailed as exc:
            return msgspec.structs.replace(failed, error=str(exc))
        ucx_text = ucx_log.read_text(errors="replace") if ucx_log.exists() else ""
    tables = parse_proto_tables(ucx_text)
    lanes = read_lanes(tables, min(num_bytes, result.descriptor_bytes))
    return msgspec.structs.replace(
        failed,
        ok=True,
        num_bytes=num_bytes,
        num_reads=result.num_reads,
        num_descriptors=result.num_descriptors,
        seconds=result.seconds,
        gbps=round(num_bytes * result.num_reads / max(result.seconds, 1e-9) / 1e9, 3),
        bytes_matched=result.matched,
        read_lanes=lanes,
        transport_class=slowest_class(lanes),
        message_lanes=message_lanes(tables),
        idle_cpu_fraction=idle_cpu,
    )


class ReaderResult(NamedTuple):
    """The reader's RESULT line."""

    num_reads: int
    seconds: float
    num_descriptors: int
    descriptor_bytes: int
    matched: bool

    @classmethod
    def parse(cls, words: list[str]) -> ReaderResult:
        try:
            num_bytes, seconds, num_reads, num_descriptors, matched = words
            descriptors = max(1, int(num_descriptors))
            descriptor_bytes = -(-int(num_bytes) // descriptors)  # ceil: the largest one
            return cls(
                int(num_reads), float(seconds), descriptors, descriptor_bytes, matched == "1"
            )
        except ValueError:
            raise TransferFailed(f"reader: malformed RESULT line {words[:6]!r}") from None


def _transfer(
    env: Mapping[str, str],
    reader_env: Mapping[str, str],
    num_bytes: int,
    num_reads: int,
    timeout_s: float,
) -> tuple[ReaderResult, float | None]:
    deadline_s = time.monotonic() + timeout_s
    with tempfile.TemporaryFile() as target_err, tempfile.TemporaryFile() as reader_err:
        target = PeerProcess("target", env, target_err, num_bytes=num_bytes, timeout_s=timeout_s)
        try:
            reader = PeerProcess(
                "reader", reader_env, reader_err,
                num_bytes=num_bytes, num_reads=num_reads, timeout_s=timeout_s,
            )  # fmt: skip
            try:
                address, metadata_hex = target_ready(target.wait_line("READY", deadline_s))
                reader.send(f"{address} {metadata_hex}")
                result = ReaderResult.parse(reader.wait_line("RESULT", deadline_s))
            finally:
                reader.stop()
            # Only now, with the reader gone, is the target truly idle.
            target.send(f"idle {IDLE_WINDOW_S}")
            idle_words = target.wait_line("IDLE_CPU", time.monotonic() + STOP_TIMEOUT_S)
            return result, float(idle_words[0]) if idle_words else None
        finally:
            target.stop()


def target_ready(words: list[str]) -> tuple[str, str]:
    """The target's READY line: its buffer's address and its agent metadata (hex)."""
    if len(words) != 2:
        raise TransferFailed(f"target: malformed READY line {words[:2]!r}")
    return words[0], words[1]
