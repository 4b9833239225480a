"""A process that imports vLLM's API server once and forks each engine's API server from it.

An engine start under `vllm serve` imports vLLM in each of its processes: about 9 s of a core
for the API server, 13 for the engine core (spawned: vLLM's CPU platform forces it).
The real-vLLM tier starts dozens of engines on two cores, so it runs this once per pytest
process (tests/real_vllm_harness.py) and each engine's API server is a fork of it that runs
`vllm.entrypoints.openai.api_server` as `python -m` would.

The engine core is forked from its API server, which has vLLM imported, and so is every
worker of a TP > 1 engine from its engine core: vLLM's default start method, the one its
engines use on a GPU host. Only the CPU platform's config check sets ``spawn``;
`_fork_engine_core` sets vLLM's default back right after it. An engine that asks for spawn
itself (``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in its environment: the harness's
CPU_PLATFORM_LAYOUT) keeps it, so both start methods stay under test.

Protocol, over a Unix socket, one connection per engine: the client sends one JSON line
{"args", "env", "cwd", "log"}; the zygote answers "<pid>\\n" once forked and, when that process
exits, "<exit status>\\n" (a negative status: killed by that signal), then closes.

Run by .venv-vllm's python: ``python tests/engine_zygote.py <socket path>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

API_SERVER = "vllm.entrypoints.openai.api_server"


def main(socket_path: str) -> None:
    __import__(API_SERVER)  # what every fork then has for free
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".new")
    listener.listen(16)
    os.rename(socket_path + ".new", socket_path)  # there only once it accepts
    print("zygote ready", flush=True)
    while True:
        conn, _ = listener.accept()
        request = json.loads(_read_line(conn))
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            _become_api_server(request)  # never returns
        conn.sendall(f"{pid}\n".encode())
        threading.Thread(target=_report_exit, args=(pid, conn), daemon=True).start()


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("client closed before its request's end")
        data += chunk
    return data.decode()


def _report_exit(pid: int, conn: socket.socket) -> None:
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    with contextlib.suppress(OSError):
        conn.sendall(f"{code}\n".encode())
    conn.close()


def _become_api_server(request: dict[str, Any]) -> None:
    """In the fork: a new process group, the engine's directory, log, environment and
    arguments, then the API server's `__main__`, as `python -m` runs it."""
    code = 1
    try:
        # Its own process group, stopped as one; not its own session, whose autogroup would
        # make a nice value count only against the engine's own threads (tests/spinners.py).
        os.setpgid(0, 0)
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[0:0] = paths
        tempfile.tempdir = None  # TMPDIR is the engine's own now
        sys.argv = [sys.modules[API_SERVER].__file__ or API_SERVER, *request["args"]]
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
            _fork_engine_core()
        runpy.run_module(API_SERVER, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fork_engine_core() -> None:
    """Start the engine core (and its workers) with vLLM's default method, fork, instead of
    the CPU platform's spawn. The platform sets VLLM_WORKER_MULTIPROC_METHOD=spawn in its
    config check, which runs in the API server before the engine core starts: this puts fork
    back right after (the engine core inherits it for its workers)."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_then_fork(cls: type, vllm_config: Any) -> None:
        check(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_then_fork)  # type: ignore[method-assign,assignment]


# ----------------------------------------------------------------------------- the client side


class ForkedServer:
    """A Popen-like handle (pid, poll, wait, returncode) on an API server the zygote forked."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_exit(timeout_s=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read_exit(timeout_s=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(API_SERVER, timeout or 0.0)
        return self.returncode

    def _read_exit(self, timeout_s: float | None) -> None:
        self._conn.settimeout(timeout_s)
        try:
            data = self._conn.recv(64)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            data = b""
        # The zygote gone without a word: the process is no longer its child to report.
        self.returncode = int(data) if data.strip() else -signal.SIGKILL
        self._conn.close()


class Zygote:
    """One zygote process (started on first use, by ``python``, in ``env``) and the forks
    it makes; `close` stops it (not the API servers it forked: each is its own group)."""

    READY_TIMEOUT_S = 300.0  # one vLLM import, on two busy cores

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self._python = python
        self._env = env
        self._dir = tempfile.mkdtemp(prefix="nixlpd-zygote-", dir="/tmp")
        self._socket = os.path.join(self._dir, "zygote.sock")
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def fork(self, args: list[str], env: dict[str, str], cwd: str, log: str) -> ForkedServer:
        """A forked API server running ``args``, as `python -m` with ``env`` in ``cwd`` would,
        its output in ``log``."""
        self._ensure_started()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self._socket)
        request = {"args": args, "env": env, "cwd": cwd, "log": log}
        conn.sendall((json.dumps(request) + "\n").encode())
        conn.settimeout(60.0)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                raise RuntimeError(f"engine zygote closed without forking; log {self.log}")
            reply += chunk
        return ForkedServer(conn, int(reply))

    @property
    def log(self) -> str:
        return os.path.join(self._dir, "zygote.log")

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
                self._proc = None
        with contextlib.suppress(OSError):
            os.unlink(self._socket)

    def _ensure_started(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            with open(self.log, "wb") as log:
                self._proc = subprocess.Popen(
                    [self._python, __file__, self._socket],
                    env=self._env,
                    cwd=self._dir,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    process_group=0,  # not a session: see _become_api_server
                )
            deadline = time.monotonic() + self.READY_TIMEOUT_S
            while not os.path.exists(self._socket):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"engine zygote did not start; log {self.log}")
                time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1])
