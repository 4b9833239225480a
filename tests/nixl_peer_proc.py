"""A real NIXL peer in its own process, for two-process tests: the child side and its handle.

The child (``python -m tests.nixl_peer_proc``) registers a buffer holding ``pattern()`` and
talks to the parent in lines on stdout (NIXL's own log lines there are skipped):

    READY <address> <num_bytes> <agent name hex> <agent metadata hex>
    NOTIF <sender name hex> <message hex>        (one per notification received)

It drives its agent by polling get_new_notifs() every 2 ms and exits when stdin closes or
says "quit", or after --lifetime-s, so it never outlives a crashed test. The parent uses
PeerProcess, which always stops the child (kills it if it does not quit in time).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import TracebackType

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


def pattern(num_bytes: int, seed: int) -> np.ndarray:
    """The bytes a peer serves: reproducible in both processes from (num_bytes, seed)."""
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


class PeerProcess:
    """The parent's handle on one child peer; use as a context manager."""

    def __init__(self, *, num_bytes: int, seed: int, lifetime_s: float = 30.0) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.nixl_peer_proc", "--num-bytes", str(num_bytes),
             "--seed", str(seed), "--lifetime-s", str(lifetime_s)],
            cwd=REPO_ROOT,
            env={**os.environ, "UCX_NET_DEVICES": "lo"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )  # fmt: skip
        self._pending = b""

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.stop()

    def wait_ready(self, timeout_s: float) -> tuple[int, int, str, bytes]:
        """(buffer address, num_bytes, agent name, agent metadata) of the child's agent."""
        address, num_bytes, name_hex, metadata_hex = self._read_line("READY", timeout_s)
        return (
            int(address),
            int(num_bytes),
            bytes.fromhex(name_hex).decode(),
            bytes.fromhex(metadata_hex),
        )

    def wait_notif(self, timeout_s: float) -> tuple[str, bytes]:
        """(sender agent name, message) of the next notification the child received."""
        sender_hex, message_hex = self._read_line("NOTIF", timeout_s)
        return bytes.fromhex(sender_hex).decode(), bytes.fromhex(message_hex)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the child (and its NIXL progress thread) stops answering READs."""
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT, if it still runs (a no-op for a child that was never paused)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the child to quit; kill it if it has not exited within timeout_s."""
        self.resume()  # a paused child would not read its stdin
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()

    def _read_line(self, tag: str, timeout_s: float) -> list[str]:
        """The fields after ``tag`` of the next stdout line starting with it."""
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
            remaining_s = deadline - time.monotonic()
            readable, _, _ = select.select([fd], [], [], max(remaining_s, 0.0))
            chunk = os.read(fd, 65536) if readable else b""
            if not chunk:
                raise TimeoutError(f"no {tag} line from the NIXL peer: {self._diagnosis()}")
            self._pending += chunk

    def _diagnosis(self) -> str:
        self._stderr.seek(0)
        tail = self._stderr.read()[-2000:].decode(errors="replace")
        return f"exit code {self._proc.poll()}, stderr tail:\n{tail}"


def _serve(num_bytes: int, seed: int, lifetime_s: float) -> None:
    from worker.nixl_real import RealNixlAgent

    agent = RealNixlAgent(f"peer-{uuid.uuid4().hex[:8]}")
    buffer = pattern(num_bytes, seed)
    agent.register_regions([(buffer.ctypes.data, buffer.nbytes)])
    _say("READY", str(buffer.ctypes.data), str(num_bytes), agent.name.encode().hex(),
         agent.get_agent_metadata().hex())  # fmt: skip
    deadline = time.monotonic() + lifetime_s
    while time.monotonic() < deadline:
        for sender, messages in agent.get_new_notifs().items():
            for message in messages:
                _say("NOTIF", sender.encode().hex(), message.hex())
        readable, _, _ = select.select([sys.stdin], [], [], 0.002)
        if readable and sys.stdin.readline().strip() in ("", "quit"):
            break
    agent.close()


def _say(*fields: str) -> None:
    sys.stdout.write(" ".join(fields) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-bytes", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--lifetime-s", type=float, default=30.0)
    args = parser.parse_args()
    _serve(args.num_bytes, args.seed, args.lifetime_s)
