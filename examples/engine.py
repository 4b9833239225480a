"""The example engine loop: schedule, call the connector in vLLM's order, run the model.

One engine = one scheduler-side ``SchedulerConnector`` plus, per TP rank, its own KV buffers, a
``WorkerConnector`` and a NIXL agent (all ranks live in this process). Each ``step()``:

1. schedule waiting requests: local prefix-cache hit, then
   ``get_num_new_matched_tokens``; allocate blocks (hits first); ``update_state_after_alloc``;
2. ``build_connector_meta`` (host staging: copy the holds it names device->host), then
   ``take_refused`` (params bind at allocation, as in vLLM: refused ones fail their parked
   request), and every rank's ``start_load_kv``;
3. run the model for running requests (one token each, or the whole uncomputed prompt);
4. every rank's ``get_finished`` -> ``update_connector_output`` -> ``take_finished``: loaded
   requests start running, failed loads fail their request, sent requests free their blocks;
5. finished requests go through ``request_finished`` (which may keep their blocks alive).

Without a connector the engine is a plain single engine (the reference run).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from connector.config import ConnectorConfig
from connector.errors import ConnectorError, InvalidTransferParams, UnsupportedConfiguration
from connector.metadata import FailureKind, WorkerReport
from examples.engine_api import EngineConfig, EngineRequest, RequestOutput, parse_engine_config
from examples.kv_cache import BlockManager, PagedRequestCache, RankBuffers, build_spec
from examples.metering import MeteredAgent, TransferStats
from examples.model import TinyModel
from examples.staging import HostStaging
from scheduler.requests import FinishedRequests, RequestInfo

__all__ = ["Engine", "EngineConfig", "EngineRequest", "RequestOutput", "parse_engine_config"]

AgentFactory = Callable[[str], Any]  # agent name -> NixlAgent
logger = logging.getLogger(__name__)


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"


@dataclass
class _Request:
    spec: EngineRequest
    info: RequestInfo
    token_ids: list[int]
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_external_tokens: int = 0
    output: list[int] = field(default_factory=list)
    kv_digest: str | None = None
    known_to_connector: bool = False  # get_num_new_matched_tokens accepted it

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_kv_tokens(self) -> int:
        """Prompt tokens whose KV exists when the first token is produced (or arrives)."""
        return int(self.info.num_prompt_tokens)


class Engine:
    """A paged-KV engine over TinyModel with an optional P/D connector (see module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        connector_config: ConnectorConfig | None = None,
        agent_factory: AgentFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kind, memory_layout = parse_engine_config(config)
        self.model = TinyModel(self.kind, config.seed)
        self.model.check_tp(config.tp_size)
        self.spec = build_spec(
            self.kind,
            block_size=config.block_size,
            kernel_block_size=config.kernel_block_size or config.block_size,
            num_blocks=config.num_blocks,
            memory_layout=memory_layout,
        )
        self.ranks = [
            RankBuffers(self.spec, rank, config.tp_size) for rank in range(config.tp_size)
        ]
        self.blocks = BlockManager(self.spec)
        self.waiting: list[_Request] = []
        self.loading: dict[str, _Request] = {}
        self.running: list[_Request] = []
        self.held: dict[str, _Request] = {}  # finished, blocks kept alive for remote readers
        self.stats = TransferStats(clock)
        self.scheduler: Any = None
        self.workers: list[Any] = []
        self.agents: list[MeteredAgent] = []
        self.staging: HostStaging | None = None
        if config.staged and config.role != "local":
            self.staging = HostStaging(self.spec, config.tp_size)
        if config.role != "local":
            try:
                self._start_connector(connector_config, agent_factory, clock)
            except BaseException:
                self.shutdown()  # agents and workers created so far
                raise

    def _start_connector(
        self,
        connector_config: ConnectorConfig | None,
        agent_factory: AgentFactory | None,
        clock: Callable[[], float],
    ) -> None:
        from scheduler.connector import SchedulerConnector
        from scheduler.requests import Role
        from worker.connector import WorkerConnector

        roles = {"prefill": Role.PRODUCER, "decode": Role.CONSUMER, "both": Role.BOTH}
        if self.config.role not in roles:
            raise UnsupportedConfiguration(
                f"engine role {self.config.role!r} is unknown: use local, prefill, decode or both"
            )
        if connector_config is None or agent_factory is None:
            raise UnsupportedConfiguration(
                f"engine role {self.config.role!r} needs a connector config and an agent factory"
            )
        suffix = uuid.uuid4().hex[:8]  # fresh agent names per start (NIXL pitfall)
        for rank, buffers in enumerate(self.ranks):
            agent = MeteredAgent(
                agent_factory(f"{self.config.engine_id}-r{rank}-{suffix}"), self.stats
            )
            self.agents.append(agent)
            worker = WorkerConnector(
                connector_config,
                engine_id=self.config.engine_id,
                tp_rank=rank,
                tp_size=self.config.tp_size,
                spec=self.spec,
                agent=agent,
                clock=clock,
            )
            registered = self.staging.region_addresses(rank) if self.staging else None
            worker.register_kv_caches(registered or buffers.region_addresses)
            self.workers.append(worker)
        self.scheduler = SchedulerConnector(
            connector_config,
            engine_id=self.config.engine_id,
            role=roles[self.config.role],
            spec=self.spec,
            tp_size=self.config.tp_size,
            clock=clock,
            host_staging=self.staging is not None,
        )
        self._verify_kv = connector_config.verify_kv
        self.scheduler.start_side_channel([w.get_handshake_metadata() for w in self.workers])

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> RequestOutput | None:
        """Queue ``request``; returns an error output at once if it can never run."""
        num_tokens = len(request.prompt_token_ids)
        error = _check_request(request, num_tokens)
        if error is not None:
            return RequestOutput(request.request_id, [], error=error)
        params = request.kv_transfer_params
        if params and "transfer_key" in params:
            refused = _overlap_refused()
            return RequestOutput(
                request.request_id,
                [],
                error=f"{type(refused).__name__}: {refused}",
                error_kind=FailureKind.PARAMS.value,
            )
        remote_prefill = bool(params and params.get("do_remote_prefill"))
        # A decode request carries prefill's first output token last: its KV is not remote.
        num_kv_tokens = num_tokens - 1 if remote_prefill else num_tokens
        token_ids = list(request.prompt_token_ids)  # grows with the output: leases bind to it
        info = RequestInfo(request.request_id, num_kv_tokens, params, token_ids=token_ids)
        self.waiting.append(_Request(request, info, token_ids))
        return None

    def has_work(self) -> bool:
        """Requests to serve, or connector work that needs steps (loads, releases, leases)."""
        connector_busy = self.scheduler is not None and self.scheduler.has_pending_work()
        return bool(self.waiting or self.loading or self.running or self.held or connector_busy)

    @property
    def num_leaked_blocks(self) -> int:
        """Blocks still referenced (neither free nor merely evictable in the prefix cache)."""
        return self.blocks.num_used_blocks

    # ---- one engine step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = self._schedule()
        staged: list[
            WorkerReport
        ] = []  # host staging: the ranks' reports of this step's hold copies
        if self.scheduler is not None:
            metadata = self.scheduler.build_connector_meta()
            # Params bind at allocation: refused ones parked their request; fail it now.
            refused = FinishedRequests(failed_recving=self.scheduler.take_refused())
            outputs += self._apply_finished(refused)
            self.stats.note_loads(metadata)
            if self.staging is not None:
                self.staging.note_loads(metadata)
                if metadata.stage_out:
                    staged = self.staging.save_holds(
                        self.ranks, metadata.stage_out, verify=self._verify_kv
                    )
            for worker in self.workers:
                worker.start_load_kv(metadata)
        outputs += self._run_model()
        if self.scheduler is not None:
            reports = [worker.get_finished() for worker in self.workers]
            if staged:
                reports = [
                    _with_staged(report, copied)
                    for report, copied in zip(reports, staged, strict=True)
                ]
            self.scheduler.update_connector_output(reports)
            outputs += self._apply_finished(self.scheduler.take_finished())
        return outputs

    def _schedule(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        still_waiting: list[_Request] = []
        for request in self.waiting:
            try:
                if not self._schedule_one(request):
                    still_waiting.append(request)
            except ConnectorError as exc:
                outputs.append(self._fail(request, f"{type(exc).__name__}: {exc}"))
            except Exception as exc:  # a bug on one request's path must not stop the engine
                logger.exception("request %s: scheduling failed", request.request_id)
                outputs.append(self._fail(request, f"internal error: {type(exc).__name__}"))
        self.waiting = still_waiting
        return outputs

    def _schedule_one(self, request: _Request) -> bool:
        """Allocate and start ``request``; False if the pools are too full (retry next step).

        Admission reserves every block the request can grow to (prompt + max_tokens), so a
        running request never finds the pool empty; the rest wait for blocks to come back.
        """
        max_num_tokens = len(request.token_ids) + request.spec.max_tokens
        if self.blocks.blocks_for(max_num_tokens) > self.config.num_blocks - 1:
            raise UnsupportedConfiguration(
                f"request {request.request_id} needs {self.blocks.blocks_for(max_num_tokens)} "
                f"blocks for {max_num_tokens} tokens; the pool has {self.config.num_blocks - 1}: "
                "raise num_blocks or shorten the request"
            )
        num_cached = self.blocks.find_prefix_hit(request.token_ids, len(request.token_ids) - 1)
        if not self.blocks.can_admit(request.token_ids, num_cached, max_num_tokens=max_num_tokens):
            return False
        num_external, load_async = 0, False
        if self.scheduler is not None:
            matched, load_async = self.scheduler.get_num_new_matched_tokens(
                request.info, num_cached
            )
            request.known_to_connector = True
            if matched is None:  # another request's load reads its lease: ask next step
                return False
            num_external = matched
        request.num_cached_tokens = num_cached
        request.num_external_tokens = num_external
        # Like vLLM: an async load allocates only the tokens that arrive; more blocks later.
        num_tokens = num_cached + num_external if load_async else len(request.token_ids)
        block_ids = self.blocks.allocate(
            request.request_id,
            request.token_ids,
            num_cached,
            num_tokens,
            remote_tokens=num_external,
            max_num_tokens=max_num_tokens,
        )
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request.info, block_ids, num_external)
        request.num_computed_tokens = num_cached
        if load_async:
            request.status = Status.WAITING_FOR_REMOTE_KVS
            self.loading[request.request_id] = request
        else:
            request.num_computed_tokens = num_cached + num_external
            self._start_running(request)
        return True

    def _start_running(self, request: _Request) -> None:
        request.status = Status.RUNNING
        if request.num_computed_tokens >= request.num_kv_tokens and request.kv_digest is None:
            request.kv_digest = self._cache_view(request).digest(request.num_kv_tokens)
        self.running.append(request)

    def _cache_view(self, request: _Request) -> PagedRequestCache:
        return PagedRequestCache(
            self.spec, self.kind, self.ranks, self.blocks.tables[request.request_id]
        )

    def _run_model(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        finishing: list[_Request] = []
        for request in list(self.running):
            try:
                self._compute(request)
            except ConnectorError as exc:  # e.g. PoolExhausted: this request fails, not the engine
                self.running.remove(request)
                outputs.append(self._fail(request, f"{type(exc).__name__}: {exc}"))
                continue
            if len(request.output) >= request.spec.max_tokens:
                self.running.remove(request)
                finishing.append(request)
        self._stage_out(finishing)
        return outputs + [self._finish(request) for request in finishing]

    def _stage_out(self, finishing: list[_Request]) -> None:
        """Staging: remote-decode requests' KV goes device->host before their params go out."""
        if self.staging is None:
            return
        remote = [r for r in finishing if (r.spec.kv_transfer_params or {}).get("do_remote_decode")]
        self.staging.save(self.ranks, [self.blocks.block_ids(r.request_id) for r in remote])

    def _compute(self, request: _Request) -> None:
        """Feed every not-yet-computed token; the last one yields the next output token."""
        self.blocks.grow(request.request_id, len(request.token_ids))
        cache = self._cache_view(request)
        next_token = -1
        for position in range(request.num_computed_tokens, len(request.token_ids)):
            next_token = self.model.step(request.token_ids[position], position, cache)
            if position + 1 == request.num_kv_tokens:
                request.kv_digest = cache.digest(request.num_kv_tokens)
        request.num_computed_tokens = len(request.token_ids)
        self.blocks.cache_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
        request.output.append(next_token)
        request.token_ids.append(next_token)

    def _finish(self, request: _Request) -> RequestOutput:
        params = None
        delay_free = False
        if self.scheduler is not None:
            block_ids = self.blocks.block_ids(request.request_id)
            # The tokens whose KV the blocks hold: a decode engine in multi-turn mode holds
            # them for the next turn's prefill (the last output token has none yet).
            request.info.num_computed_tokens = request.num_computed_tokens
            delay_free, params = self.scheduler.request_finished(request.info, block_ids)
        if delay_free:
            self.held[request.request_id] = request
        else:
            self.blocks.free(request.request_id)
        return self._output(request, params=params)

    def _fail(self, request: _Request, reason: str, kind: str | None = None) -> RequestOutput:
        """End ``request`` with an error; its blocks are freed unless the connector holds them."""
        delay_free = False
        if request.known_to_connector and self.scheduler is not None:
            request.info.aborted = True
            block_ids = self._held_block_ids(request)
            delay_free, _ = self.scheduler.request_finished(request.info, block_ids)
        if delay_free:
            self.held[request.request_id] = request
        elif request.request_id in self.blocks.tables:
            self.blocks.free(request.request_id)
        return self._output(request, error=reason, error_kind=kind)

    def _held_block_ids(self, request: _Request) -> tuple[tuple[int, ...], ...]:
        if request.request_id in self.blocks.tables:
            return self.blocks.block_ids(request.request_id)
        return tuple(() for _ in self.spec.groups)

    def _output(
        self,
        request: _Request,
        *,
        params: dict[str, Any] | None = None,
        error: str | None = None,
        error_kind: str | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request.request_id,
            list(request.output),
            error=error,
            error_kind=error_kind,
            kv_transfer_params=params,
            kv_digest=request.kv_digest,
            num_cached_tokens=request.num_cached_tokens,
            num_external_tokens=request.num_external_tokens,
        )

    def _apply_finished(self, finished: Any) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if self.staging is not None:
            self.staging.load(self.ranks, finished.finished_recving)
            self.staging.forget(finished.failed_recving)
        for request_id in finished.finished_recving:
            request = self.loading.pop(request_id, None)
            if request is not None:
                request.num_computed_tokens = (
                    request.num_cached_tokens + request.num_external_tokens
                )
                self.blocks.cache_blocks(request_id, request.token_ids, request.num_computed_tokens)
                self._start_running(request)
        for request_id, reason in finished.failed_recving.items():
            request = self.loading.pop(request_id, None)
            if request is not None:
                outputs.append(
                    self._fail(request, f"KV load failed: {reason.message}", reason.kind.value)
                )
        for request_id in finished.finished_sending:
            if self.held.pop(request_id, None) is not None:
                self.blocks.free(request_id)
        return outputs

    def shutdown(self) -> None:
        """Stop the connector (workers, side channel) and close the agents; idempotent."""
        workers, self.workers = self.workers, []
        scheduler, self.scheduler = self.scheduler, None
        agents, self.agents = self.agents, []
        steps = [worker.shutdown for worker in workers]
        steps += [scheduler.shutdown] if scheduler is not None else []
        steps += [agent.close for agent in agents]
        for step in steps:  # best effort: one failure must not keep the rest running
            try:
                step()
            except Exception:
                logger.exception("engine %s: shutdown step failed", self.config.engine_id)


def _with_staged(report: WorkerReport, copied: WorkerReport) -> WorkerReport:
    """A rank's report with what its host staging copied this step added."""
    return msgspec.structs.replace(
        report, staged=report.staged + copied.staged, unsaved=report.unsaved + copied.unsaved
    )


def _overlap_refused() -> InvalidTransferParams:
    """Overlapped dispatch (docs/overlap.md) sends decode the prompt before prefill produced
    its first token, but this engine's decode request carries that token last (the KV of
    every token before it is loaded): it serves the sequential flow only."""
    return InvalidTransferParams(
        "kv_transfer_params['transfer_key']: the example engine does not serve overlapped "
        "dispatch (its decode request must end with prefill's first output token); send the "
        "request to prefill first, then to decode with the kv_transfer_params prefill returned"
    )


def _check_request(request: EngineRequest, num_tokens: int) -> str | None:
    if num_tokens == 0:
        return "the prompt is empty; send at least one token"
    if request.max_tokens < 1:
        return f"max_tokens must be >= 1, got {request.max_tokens}"
    return None
