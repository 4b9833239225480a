"""A remote engine's handshake: fetched on background threads, then checked against ours.

Fetching. Handshake threads only talk ZMQ (through the injected ``fetch``) and put
``HandshakeResult`` values on a queue; they never touch the NIXL agent or any connector
state. The engine thread submits jobs and drains results with ``poll()``; everything done with
a result (the checks below, add_remote_agent, planning) happens there.

Each job fetches the handshake of every remote rank this rank needs, naming the boot the
requests' params name: a prefill restarted since is refused by its first answer (PeerRestarted,
never retried). A failed fetch is retried ``retries`` times with exponential backoff
(``backoff_s``, doubled per attempt), except a side channel that did not answer within the
per-attempt timeout (``fetch``'s): that fails the job at once, so the loads waiting on a dead
prefill fail after one timeout instead of every retry's, and the peer table's background
probes (worker/peers.py) find it again when it is back. A job always ends in exactly one
result, success or error: an unexpected exception in a thread is logged and reported, never lost.
Every result carries the job's phase timings (queued for a thread, each rank's fetch with its
attempts): a slow handshake says where its time went, in a failed job's error too.

Checking (pure, the handshake's last step): the remote ranks' handshakes must agree with the
request and with themselves (``validate_handshakes``), share a NIXL backend that reads both
ranks' memory (``check_transport``), and match our compatibility fingerprint
(``check_compatible``). The fingerprint covers the facts both sides must share for a byte copy
to mean the same thing: model, dtypes, protocol version and, per cache group, its kind, layers,
heads, head sizes and (a cache quantized per tensor) each layer's K and V scales. Tensor
parallelism, block sizes and memory layout are deliberately left out: they may differ between
engines and the transfer planner knows how to serve (or refuse) each difference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

from connector.errors import (
    ConnectorError,
    HandshakeError,
    PeerRestarted,
    SideChannelTimeout,
    UnsupportedConfiguration,
)
from connector.layout import GroupKind, GroupSpec, KVCacheSpec
from connector.memory import HOST_MEMORY, Memory
from connector.protocol import PROTOCOL_VERSION, WorkerHandshake

logger = logging.getLogger(__name__)

_NOT_RETRIED = (
    " (a silent side channel is not asked again while requests wait: they fail now, and a "
    "background probe finds the engine when it answers again)"
)

# (host, port, remote tp_rank) -> that rank's handshake; raises HandshakeError.
Fetcher = Callable[[str, int, int], WorkerHandshake]
# The same, for the side channel's boot ``boot_id`` ("": any boot); PeerRestarted if another.
BootFetcher = Callable[[str, int, int, str], WorkerHandshake]


def any_boot(fetch: Fetcher) -> BootFetcher:
    """A BootFetcher that does not check the boot (injected fetchers: tests)."""
    return lambda host, port, tp_rank, boot_id: fetch(host, port, tp_rank)


@dataclass(frozen=True)
class HandshakeJob:
    """Fetch the handshakes of ``remote_ranks`` from the side channel at host:port."""

    engine_id: str  # the engine the requests expect to find there
    host: str
    port: int
    remote_ranks: tuple[int, ...]
    job_id: int = 0  # unique per submitted job: two jobs to one address never collide
    retries: int | None = None  # None: the client's setting; probes of a dead peer use 0
    boot_id: str = ""  # the boot the requests' params name ("": any)


@dataclass(frozen=True)
class Phase:
    """One step of a handshake and how long it took (seconds)."""

    name: str
    seconds: float


def describe_phases(phases: Sequence[Phase]) -> str:
    """``handshake phases: queued 0.00 s, fetch rank 0 30.12 s, ...; 30.14 s in all``."""
    steps = ", ".join(f"{phase.name} {phase.seconds:.2f} s" for phase in phases)
    return f"handshake phases: {steps}; {sum(p.seconds for p in phases):.2f} s in all"


@dataclass(frozen=True)
class HandshakeResult:
    """A finished job: every requested rank's handshake, or the reason it failed."""

    job: HandshakeJob
    handshakes: dict[int, WorkerHandshake] = field(default_factory=dict)
    error: str | None = None
    restarted: bool = False  # the side channel is another boot than the params name
    phases: tuple[Phase, ...] = ()  # queued, then each rank's fetch
    finished_s: float = 0.0  # the client's clock when the result was queued


class HandshakeClient:
    """A pool of four handshake threads and the queue that brings their results back."""

    def __init__(
        self,
        fetch: BootFetcher,
        *,
        retries: int,
        backoff_s: float = 0.05,
        wait: Callable[[float], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self._retries = retries
        self._backoff_s = backoff_s
        self._stop = threading.Event()  # set by close(): backoff waits end, no new attempts
        self._wait = wait or self._stop.wait  # the backoff pause; tests record it instead
        self._results: queue.SimpleQueue[HandshakeResult] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="handshake")
        self._num_in_flight = 0  # the polling thread only (the transfer thread)

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def submit(self, job: HandshakeJob) -> None:
        """Start a job on a handshake thread; its result comes back from poll()."""
        self._num_in_flight += 1
        future = self._pool.submit(self._run, job, self._clock())
        future.add_done_callback(lambda done: self._surface_crash(job, done))

    def poll(self, wait_s: float = 0.0) -> list[HandshakeResult]:
        """Results finished since the last call; waits up to ``wait_s`` for the first one."""
        results: list[HandshakeResult] = []
        if self._num_in_flight == 0:  # nothing submitted is unanswered: nothing can arrive
            return results
        if wait_s > 0:
            try:
                results.append(self._results.get(timeout=wait_s))
            except queue.Empty:
                return results
        while not self._results.empty():  # one consumer (the caller): empty() is exact
            results.append(self._results.get_nowait())
        self._num_in_flight -= len(results)
        return results

    def close(self) -> None:
        """Stop retrying and wait for running fetches (each bounded by its own timeout)."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, job: HandshakeJob, submitted_s: float) -> None:
        phases = [Phase("queued", self._clock() - submitted_s)]
        try:
            handshakes = {
                rank: self._fetch_with_retries(job, rank, phases) for rank in job.remote_ranks
            }
            result = HandshakeResult(job, handshakes, phases=tuple(phases))
        except ConnectorError as error:
            restarted = isinstance(error.__cause__, PeerRestarted)
            error_text = f"{error} ({describe_phases(phases)})"
            result = HandshakeResult(
                job, error=error_text, restarted=restarted, phases=tuple(phases)
            )
        except Exception as error:  # a bug in a fetcher must not vanish with its thread
            logger.exception("handshake with %s:%d crashed", job.host, job.port)
            result = HandshakeResult(job, error=f"handshake crashed: {error!r}")
        self._results.put(dataclasses.replace(result, finished_s=self._clock()))

    def _fetch_with_retries(
        self, job: HandshakeJob, remote_rank: int, phases: list[Phase]
    ) -> WorkerHandshake:
        """One rank's handshake; its fetch time (every attempt, backoffs included) is appended
        to ``phases``, whether it succeeds or not."""
        started_s = self._clock()
        attempt = 0
        retries = self._retries if job.retries is None else job.retries
        while True:
            try:
                handshake = self._fetch(job.host, job.port, remote_rank, job.boot_id)
                phases.append(_fetch_phase(remote_rank, attempt, self._clock() - started_s))
                return handshake
            except ConnectorError as error:
                final = isinstance(error, (PeerRestarted, SideChannelTimeout))
                if final or attempt >= retries or self._stop.is_set():
                    phases.append(_fetch_phase(remote_rank, attempt, self._clock() - started_s))
                    note = _NOT_RETRIED if isinstance(error, SideChannelTimeout) else ""
                    raise HandshakeError(
                        f"rank {remote_rank} at {job.host}:{job.port} failed after "
                        f"{attempt + 1} attempt(s): {error}{note}"
                    ) from error
                delay_s = self._backoff_s * 2**attempt
                logger.info(
                    "handshake with %s:%d rank %d failed (%s); retrying in %.3f s",
                    job.host, job.port, remote_rank, error, delay_s,
                )  # fmt: skip
                self._wait(delay_s)
                attempt += 1

    def _surface_crash(self, job: HandshakeJob, future: Future[None]) -> None:
        """_run catches everything it can; this reports what escaped it (or a cancelled job)."""
        if future.cancelled():
            self._results.put(HandshakeResult(job, error="handshake cancelled: shutting down"))
            return
        error = future.exception()
        if error is not None:
            logger.error("handshake thread for %s:%d died: %r", job.host, job.port, error)
            self._results.put(HandshakeResult(job, error=f"handshake thread died: {error!r}"))


def _fetch_phase(remote_rank: int, attempt: int, seconds: float) -> Phase:
    tries = f" ({attempt + 1} attempts)" if attempt else ""
    return Phase(f"fetch rank {remote_rank}{tries}", seconds)


# --- checking a fetched handshake ----------------------------------------------------------

PROTOCOL_FACT = "protocol_version"


class Fingerprint(NamedTuple):
    """A digest of the compatibility facts, and the facts themselves for error messages."""

    digest: str
    facts: Mapping[str, str]


def _per_layer(values: Sequence[object]) -> str:
    """ "8" when every layer agrees, else "8,8,4" layer by layer (floats exactly, as repr)."""
    texts = [repr(value) if isinstance(value, float) else str(value) for value in values]
    return texts[0] if len(set(texts)) == 1 else ",".join(texts)


def _scale_facts(prefix: str, group: GroupSpec) -> dict[str, str]:
    """Per-tensor quantized layers' K and V scales: equal bytes mean equal values only under
    equal scales. None where no layer is quantized (or its scales are not known here)."""
    scales = [layer.kv_scales for layer in group.layers]
    if all(scale is None for scale in scales):
        return {}
    return {
        f"{prefix}.k_scale": _per_layer([s[0] if s else None for s in scales]),
        f"{prefix}.v_scale": _per_layer([s[1] if s else None for s in scales]),
    }


def _group_facts(index: int, group: GroupSpec) -> dict[str, str]:
    layers = group.layers
    prefix = f"group{index}"
    facts = {
        f"{prefix}.kind": group.kind.value,
        f"{prefix}.window": str(group.window),
        f"{prefix}.num_layers": str(len(layers)),
        f"{prefix}.num_kv_heads": _per_layer([layer.num_kv_heads for layer in layers] or [0]),
        f"{prefix}.head_dim": _per_layer([layer.head_dim for layer in layers] or [0]),
        f"{prefix}.dtype_bytes": _per_layer([layer.dtype_bytes for layer in layers] or [0]),
        f"{prefix}.num_planes": _per_layer([layer.num_planes for layer in layers] or [0]),
    }
    facts.update(_scale_facts(prefix, group))
    if group.kind is GroupKind.SSM and not group.block_format.token_addressable:
        # An opaque state page is described per rank (its size follows TP): the pairing
        # compares it with both TP sizes in view and says so, instead of "models differ".
        del facts[f"{prefix}.num_kv_heads"], facts[f"{prefix}.head_dim"]
    return facts


def digest_of(facts: Mapping[str, str]) -> str:
    """SHA-256 over the facts in a canonical (sorted JSON) form."""
    canonical = json.dumps(dict(facts), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def fingerprint(spec: KVCacheSpec, protocol_version: int = PROTOCOL_VERSION) -> Fingerprint:
    """The compatibility fingerprint of an engine's KV cache spec."""
    facts: dict[str, str] = {
        PROTOCOL_FACT: str(protocol_version),
        "model": spec.model,
        "dtype": spec.dtype,
        "cache_dtype": spec.cache_dtype,
        "num_groups": str(len(spec.groups)),
    }
    for index, group in enumerate(spec.groups):
        facts.update(_group_facts(index, group))
    return Fingerprint(digest_of(facts), facts)


def _differences(
    local: Mapping[str, str], remote: Mapping[str, str], keys: Sequence[str] | None = None
) -> list[str]:
    """One "key: local 'a', remote 'b'" per differing fact (of ``keys``, if given)."""
    missing = "<missing>"
    return [
        f"{key}: local {local.get(key, missing)!r}, remote {remote.get(key, missing)!r}"
        for key in sorted(set(local) | set(remote) if keys is None else keys)
        if local.get(key) != remote.get(key)
    ]


# Facts that say what a cache byte means. A difference is never tolerated: a load would
# succeed and every value in it would be wrong.
VALUE_FACTS = ("cache_dtype",)
VALUE_FACT_SUFFIXES = (".dtype_bytes", ".k_scale", ".v_scale")


def _is_value_fact(key: str) -> bool:
    return key in VALUE_FACTS or key.endswith(VALUE_FACT_SUFFIXES)


def check_compatible(
    local: Fingerprint, remote: Fingerprint, enforce: bool = True
) -> tuple[str, ...]:
    """Check a remote engine's fingerprint against ours; returns the differences it tolerated.

    Raises HandshakeError when the peer speaks another protocol version or its digest does not
    match its own facts (a corrupt or tampered handshake): these are never tolerated. Raises
    UnsupportedConfiguration naming every differing fact when ``enforce`` is set; otherwise
    the differences are returned for the caller to log, except those of the facts saying what
    a cache byte means (cache dtype, element size, KV scales): they always raise.
    """
    local_version = local.facts.get(PROTOCOL_FACT)
    remote_version = remote.facts.get(PROTOCOL_FACT)
    if local_version != remote_version:
        raise HandshakeError(
            f"protocol version mismatch: local {local_version!r}, remote {remote_version!r}; "
            "run the same nixl-pd-connector version on prefill and decode"
        )
    if digest_of(remote.facts) != remote.digest:
        raise HandshakeError(
            f"the peer's compatibility fingerprint {remote.digest[:16]!r} does not match the "
            "facts it sent; the handshake is corrupt, check the peer's connector version"
        )
    if local.digest == remote.digest:
        return ()
    value_keys = [key for key in set(local.facts) | set(remote.facts) if _is_value_fact(key)]
    value_facts = _differences(local.facts, remote.facts, value_keys)
    if value_facts:
        raise UnsupportedConfiguration(
            "prefill and decode KV caches encode values differently: "
            + "; ".join(value_facts)
            + ". The same bytes would load as other values, so this is refused even with "
            "enforce_handshake_compat=false: serve both with the same --kv-cache-dtype and "
            "the same checkpoint's KV scales"
        )
    reasons = tuple(_differences(local.facts, remote.facts))
    if enforce:
        raise UnsupportedConfiguration(
            "prefill and decode engines are not compatible: "
            + "; ".join(reasons)
            + ". Serve the same model with the same dtypes on both sides, or set "
            "enforce_handshake_compat=false to proceed at your own risk"
        )
    return reasons


def check_transport(
    local_backends: Sequence[str],
    remote_backends: Sequence[str],
    *,
    local_memory: Memory = HOST_MEMORY,
    remote_memory: Memory = HOST_MEMORY,
    backend_memory_types: Mapping[str, Sequence[str]] | None = None,
) -> tuple[str, ...]:
    """The NIXL backends both ranks have, in the local order.

    Raises UnsupportedConfiguration when there is none, or, given what each backend can
    register (NIXL's ``get_backend_mem_types``), when no common backend handles both ranks'
    memory kinds (say a UCX built without CUDA, facing a GPU peer).
    """
    common = tuple(backend for backend in local_backends if backend in remote_backends)
    if not common:
        raise UnsupportedConfiguration(
            f"no NIXL backend in common: this rank has {list(local_backends)}, the peer "
            f"{list(remote_backends)}; list a shared backend (e.g. UCX) in "
            'kv_connector_extra_config["backends"] on both engines'
        )
    if backend_memory_types is None:
        return common
    needed = {local_memory.kind.nixl_name, remote_memory.kind.nixl_name}
    usable = tuple(b for b in common if needed <= set(backend_memory_types.get(b, ())))
    if not usable:
        raise UnsupportedConfiguration(
            f"no common NIXL backend ({', '.join(common)}) handles both this rank's "
            f"{local_memory.describe()} ({local_memory.kind.nixl_name}) and the peer's "
            f"{remote_memory.describe()} ({remote_memory.kind.nixl_name}); use a backend built "
            'with GPU support, or stage through host memory ("kv_buffer_device": "cpu")'
        )
    return usable


def validate_handshakes(
    source_engine_id: str, remote_tp_size: int, handshakes: dict[int, WorkerHandshake]
) -> None:
    """Check what the remote ranks sent agrees with the request and with itself."""
    for remote_rank, handshake in sorted(handshakes.items()):
        where = f"remote rank {remote_rank}"
        if handshake.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"{where} speaks protocol version {handshake.protocol_version}, we speak "
                f"{PROTOCOL_VERSION}; run the same connector version on both engines"
            )
        if handshake.engine_id != source_engine_id:
            raise HandshakeError(
                f"{where} belongs to engine {handshake.engine_id!r}, but the request's KV is on "
                f"engine {source_engine_id!r}: the prefill engine restarted and its KV is gone"
            )
        ranks = {
            (handshake.tp_rank, handshake.tp_size),
            (handshake.layout.tp_rank, handshake.layout.tp_size),
        }
        if ranks != {(remote_rank, remote_tp_size)}:
            raise HandshakeError(
                f"{where} says it is rank {handshake.tp_rank} of {handshake.tp_size} (its "
                f"layout: {handshake.layout.tp_rank} of {handshake.layout.tp_size}), but the "
                f"request says the prefill engine has tp_size {remote_tp_size}"
            )
        if len(handshake.region_addresses) != len(handshake.layout.region_bytes):
            raise HandshakeError(
                f"{where} sent {len(handshake.region_addresses)} region addresses for a layout "
                f"of {len(handshake.layout.region_bytes)} regions; its handshake is corrupt"
            )
