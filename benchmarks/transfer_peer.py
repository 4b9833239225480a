"""The "prefill" side of transfer_bench: a child process serving KV regions over real NIXL.

The child (``python -m benchmarks.transfer_peer --region-bytes B,B,...``) allocates one numpy
buffer per region, fills region r with int64 values ``r * 2**40 + index`` (so the parent can
check any byte range it read without a copy), registers them with a RealNixlAgent (progress
delay 1000 us, our default) and talks in lines on stdout (NIXL's own log lines are skipped):

    READY <agent metadata hex> <address of region 0>,<address of region 1>,...
    NOTIF <message hex> <time.monotonic_ns() when get_new_notifs returned it>

It polls ``get_new_notifs()`` every ``poll`` microseconds (parent sends "poll <us>" on stdin),
exits on "quit", on stdin closing, or after --lifetime-s. PeerChild always stops it.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

REPO_ROOT = Path(__file__).resolve().parent.parent
REGION_TAG_SHIFT = 40  # region r holds r << 40 plus the int64 index


def expected_words(region: int, offset_bytes: int, length_bytes: int) -> npt.NDArray[np.int64]:
    """The int64 words the child serves at [offset_bytes, offset_bytes + length_bytes)."""
    start = offset_bytes // 8
    words = np.arange(start, start + length_bytes // 8, dtype=np.int64)
    return words + (region << REGION_TAG_SHIFT)


class PeerChild:
    """The parent's handle on the child; use as a context manager (it always stops the child)."""

    def __init__(self, region_bytes: tuple[int, ...], lifetime_s: float) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.transfer_peer",
             "--region-bytes", ",".join(str(n) for n in region_bytes),
             "--lifetime-s", str(lifetime_s)],
            cwd=REPO_ROOT,
            env={**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        self._pending = b""

    def __enter__(self) -> PeerChild:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.stop()

    def wait_ready(self, timeout_s: float) -> tuple[bytes, tuple[int, ...]]:
        """(agent metadata, region base addresses) of the child."""
        metadata_hex, addresses = self._read_line("READY", timeout_s)
        return bytes.fromhex(metadata_hex), tuple(int(a) for a in addresses.split(","))

    def wait_notif(self, timeout_s: float) -> tuple[bytes, int]:
        """(message, monotonic ns when the child's get_new_notifs returned it)."""
        message_hex, seen_ns = self._read_line("NOTIF", timeout_s)
        return bytes.fromhex(message_hex), int(seen_ns)

    def set_poll_us(self, poll_us: int) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(f"poll {poll_us}\n".encode())
        self._proc.stdin.flush()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the child to quit; kill it if it has not exited within timeout_s."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(b"quit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def _read_line(self, tag: str, timeout_s: float) -> list[str]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            line, newline, rest = self._pending.partition(b"\n")
            if newline:
                self._pending = rest
                fields = line.decode(errors="replace").split()
                if fields and fields[0] == tag:
                    return fields[1:]
                continue
            readable, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0.0))
            chunk = os.read(fd, 65536) if readable else b""
            if not chunk:
                raise TimeoutError(f"no {tag} line from the child within {timeout_s} s "
                                   f"(exit code {self._proc.poll()})")  # fmt: skip
            self._pending += chunk


def _serve(region_bytes: list[int], lifetime_s: float) -> None:
    from worker.nixl_real import RealNixlAgent

    agent = RealNixlAgent(f"bench-prefill-{uuid.uuid4().hex[:8]}")
    regions = []
    for index, num_bytes in enumerate(region_bytes):
        words = np.arange(num_bytes // 8, dtype=np.int64)
        words += index << REGION_TAG_SHIFT
        regions.append(words)
    agent.register_regions([(r.ctypes.data, r.nbytes) for r in regions])
    addresses = ",".join(str(r.ctypes.data) for r in regions)
    _say("READY", agent.get_agent_metadata().hex(), addresses)
    poll_s = 0.001
    deadline = time.monotonic() + lifetime_s
    while time.monotonic() < deadline:
        for messages in agent.get_new_notifs().values():
            seen_ns = time.monotonic_ns()
            for message in messages:
                _say("NOTIF", message.hex(), str(seen_ns))
        if select.select([sys.stdin], [], [], poll_s)[0]:
            commands = os.read(sys.stdin.fileno(), 4096).decode().split("\n")
            if commands == [""] or "quit" in commands:
                break
            for command in commands:
                if command.startswith("poll "):
                    poll_s = int(command.split()[1]) / 1e6
    agent.close()


def _say(*fields: str) -> None:
    sys.stdout.write(" ".join(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--region-bytes", required=True, help="comma-separated region sizes")
    parser.add_argument("--lifetime-s", type=float, default=300.0)
    args = parser.parse_args()
    _serve([int(n) for n in args.region_bytes.split(",")], args.lifetime_s)
