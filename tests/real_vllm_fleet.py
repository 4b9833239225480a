"""Real vLLM engines as fleets run them: N prefill and M decode engines behind vllm-router.

Builds on tests/real_vllm_harness.py (its engines, requests and connector choice): a `Fleet`
is a single reference engine and N prefill and M decode engines loaded with the connector
under test, all started at once; `Router` is one vllm-router process (the router vLLM fleets
run, a Rust binary in a wheel, pinned in scripts/setup_vllm_cpu.sh) in front of some of them;
`fleet_problems` is the verdict on a run from each engine's counters (`EngineCounters`).

Stdlib only, like the harness: this module runs in the test environment (.venv).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.real_vllm_harness import (
    HOST,
    VLLM_VENV,
    Engine,
    EngineError,
    EngineSpec,
    cleanup_all,
    free_port,
    kv_transfer_config,
    start_together,
)

# vllm-router, the Rust P/D router vLLM fleets run, pinned in scripts/setup_vllm_cpu.sh. Its
# wheel puts a `vllm-router` launcher in .venv-vllm that runs the router in-process.
ROUTER_BIN = VLLM_VENV / "bin" / "vllm-router"
# Each engine of a fleet gets this many KV blocks (32 MiB with the tiny model), not the 1 GiB
# of VLLM_CPU_KVCACHE_SPACE: five engines share two cores and the tests send small prompts.
FLEET_NUM_BLOCKS = 128
FLEET_READY_TIMEOUT_S = 600.0  # five engines starting at once on two busy cores
STOP_GRACE_S = 5.0


def router_command(
    port: int,
    metrics_port: int,
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    policy: str = "round_robin",
) -> list[str]:
    """vllm-router in vLLM P/D mode over NIXL-style kv_transfer_params: for each request it
    picks a prefill and a decode engine by ``policy``, sends prefill the request with
    ``max_tokens=1`` and ``{"do_remote_decode": true}``, then decode the original request with
    the ``kv_transfer_params`` prefill returned. Retries off: a failed request must show, not
    be sent again. Metrics on a port of its own (the default, 29000, may be taken)."""
    cmd = [str(ROUTER_BIN), "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    cmd += ["--policy", policy, "--host", HOST, "--port", str(port)]
    cmd += ["--prometheus-host", HOST, "--prometheus-port", str(metrics_port)]
    cmd += ["--disable-retries"]
    for url in prefill_urls:
        cmd += ["--prefill", url]
    for url in decode_urls:
        cmd += ["--decode", url]
    return cmd


class Router:
    """One vllm-router process in front of engines that are already up; `stop` is idempotent."""

    def __init__(
        self, name: str, prefills: Sequence[Engine], decodes: Sequence[Engine], log_dir: Path
    ) -> None:
        self.name = name
        self.prefills = tuple(prefills)
        self.decodes = tuple(decodes)
        port = free_port()
        self.url = f"http://{HOST}:{port}"
        self.command = router_command(
            port, free_port(), [e.url for e in prefills], [e.url for e in decodes]
        )
        self.log_path = log_dir / f"router-{name}-{uuid.uuid4().hex[:12]}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        """Start it and poll /health until 200 (it checks every engine's /health first)."""
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineError(self._explain(f"exited with {self._proc.returncode}"))
            if self.healthy():
                return
            time.sleep(0.2)
        raise EngineError(self._explain(f"not healthy after {timeout_s:.0f} s"))

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):  # its own process group, stopped as one
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=STOP_GRACE_S)
        self._proc = None

    def _explain(self, what: str) -> str:
        try:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        except OSError:
            tail = "(no log)"
        return f"vllm-router {self.name} at {self.url} {what}; log {self.log_path}:\n{tail}"


@dataclass
class Fleet:
    """A reference engine, N prefill and M decode engines with the connector under test, and
    the vllm-router replicas started with `add_router`; `close` stops everything."""

    connector: str
    reference: Engine
    prefills: tuple[Engine, ...]
    decodes: tuple[Engine, ...]
    log_dir: Path
    routers: list[Router] = field(default_factory=list)
    owns_reference: bool = True  # False: a shared single engine, started and stopped elsewhere
    borrowed: tuple[Engine, ...] = ()  # started and stopped elsewhere (a shared prefill)

    @classmethod
    @contextlib.contextmanager
    def running(
        cls,
        model_dir: Path,
        connector: str,
        log_dir: Path,
        *,
        num_prefills: int = 2,
        num_decodes: int = 2,
        reference: Engine | None = None,
        borrowed_prefills: Sequence[Engine] = (),
    ) -> Iterator[Fleet]:
        """Start every engine at once (startup dominates) and wait until all are up.
        ``reference``: a started single engine to compare with instead of one of our own
        (tests/real_vllm_workspace.py's shared one); waited for, not started or stopped.
        ``borrowed_prefills``: started prefill engines of ``connector`` (the workspace's shared
        pair's), the first of the ``num_prefills``; waited for, not started or stopped."""
        sized = ("--num-gpu-blocks-override", str(FLEET_NUM_BLOCKS))

        def engine(name: str, role: str | None) -> Engine:
            config = None if role is None else kv_transfer_config(connector, role)
            side_channel_port = None if role is None else free_port()
            spec = EngineSpec(name, model_dir, free_port(), config, side_channel_port, sized)
            return Engine(spec, log_dir)

        fleet = cls(
            connector=connector,
            reference=reference or engine("reference", None),
            prefills=(
                *borrowed_prefills,
                *(
                    engine(f"prefill{i}", "kv_producer")
                    for i in range(len(borrowed_prefills), num_prefills)
                ),
            ),
            decodes=tuple(engine(f"decode{i}", "kv_consumer") for i in range(num_decodes)),
            log_dir=log_dir,
            owns_reference=reference is None,
            borrowed=tuple(borrowed_prefills),
        )
        try:
            own = fleet.own_engines()
            others = [each for each in fleet.engines() if each not in own]
            start_together(own, also_wait=others, timeout_s=FLEET_READY_TIMEOUT_S)
            yield fleet
        finally:
            fleet.close()

    def engines(self) -> tuple[Engine, ...]:
        return (self.reference, *self.prefills, *self.decodes)

    def own_engines(self) -> tuple[Engine, ...]:
        """The engines this fleet started and stops (not a shared reference or prefill)."""
        own = self.engines() if self.owns_reference else (*self.prefills, *self.decodes)
        return tuple(engine for engine in own if engine not in self.borrowed)

    def add_router(
        self, name: str, prefills: Sequence[Engine], decodes: Sequence[Engine]
    ) -> Router:
        """Start a vllm-router over these engines (in this order: round-robin follows it)."""
        router = Router(name, prefills, decodes, self.log_dir)
        self.routers.append(router)
        router.start()
        return router

    def close(self) -> None:
        for router in self.routers:
            router.stop()
        cleanup_all(self.own_engines())


@dataclass(frozen=True)
class EngineCounters:
    """One engine's cumulative counters from its /metrics, compared before and after a run.
    vLLM's own: requests served and prompt tokens a connector loaded. The connector's
    (docs/metrics.md): prefill's leases by how they ended, decode's loads and handshakes."""

    served: float = 0.0  # vllm:request_success_total
    external_tokens: float = 0.0  # vllm:prompt_tokens_by_source_total{source=external_kv_transfer}
    leases_completed: float = 0.0  # ended by every reader's free notification
    leases_expired: float = 0.0
    leases_released: float = 0.0
    loads_finished: float = 0.0
    loads_failed: float = 0.0
    handshakes: float = 0.0  # nixl_pd_handshake_seconds_count: remote engines handshaked

    @classmethod
    def read(cls, engine: Engine) -> EngineCounters:
        return cls(
            served=engine.metric("vllm:request_success_total"),
            external_tokens=engine.prompt_tokens_by_source().get("external_kv_transfer", 0.0),
            leases_completed=engine.metric("nixl_pd_leases_completed_total"),
            leases_expired=engine.metric("nixl_pd_leases_expired_total"),
            leases_released=engine.metric("nixl_pd_leases_released_total"),
            loads_finished=engine.metric("nixl_pd_loads_finished_total"),
            loads_failed=engine.metric("nixl_pd_loads_failed_total"),
            handshakes=engine.metric("nixl_pd_handshake_seconds_count"),
        )

    def minus(self, earlier: EngineCounters) -> EngineCounters:
        """What happened between ``earlier`` and this reading."""
        return EngineCounters(
            **{
                name: getattr(self, name) - getattr(earlier, name)
                for name in self.__dataclass_fields__
            }
        )


def fleet_problems(
    prefills: Mapping[str, tuple[EngineCounters, EngineCounters]],
    decodes: Mapping[str, tuple[EngineCounters, EngineCounters]],
    num_requests: int,
    *,
    connector_metrics: bool = True,
) -> list[str]:
    """Every broken promise of a P/D run through a router, from each engine's counters
    (before, after) the run. Empty when every engine served some requests, prefill served each
    request once and decode loaded each once over the connector; and, with
    ``connector_metrics`` (ours), when every prefill lease was ended by its readers (none
    expired or released), no load failed, and each decode engine has handshaked with every
    prefill engine since it started (it read from each)."""
    problems: list[str] = []
    for name, (before, after) in prefills.items():
        delta = after.minus(before)
        if delta.served <= 0:
            problems.append(f"{name} served no request")
        if not connector_metrics:
            continue
        if delta.leases_completed != delta.served:
            problems.append(
                f"{name} served {delta.served:g} requests but {delta.leases_completed:g} "
                "leases were ended by their readers' notifications"
            )
        for how, count in (("expired", delta.leases_expired), ("released", delta.leases_released)):
            if count:
                problems.append(f"{name}: {count:g} leases {how} instead of being read")
    for name, (before, after) in decodes.items():
        delta = after.minus(before)
        if delta.served <= 0 or delta.external_tokens <= 0:
            problems.append(
                f"{name} served {delta.served:g} requests with {delta.external_tokens:g} "
                "prompt tokens loaded over the connector"
            )
        if not connector_metrics:
            continue
        if delta.loads_failed:
            problems.append(f"{name}: {delta.loads_failed:g} loads failed")
        if after.handshakes != len(prefills):
            problems.append(
                f"{name} has handshaked with {after.handshakes:g} remote engines, not with "
                f"each of the {len(prefills)} prefill engines"
            )
    served = sum(after.served - before.served for before, after in prefills.values())
    if served != num_requests:
        problems.append(f"prefill engines served {served:g} requests, not {num_requests}")
    loaded = sum(after.loads_finished - before.loads_finished for before, after in decodes.values())
    if connector_metrics and loaded != num_requests:
        problems.append(f"decode engines loaded {loaded:g} requests, not {num_requests}")
    return problems
