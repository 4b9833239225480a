"""NixlPDConnector's scheduler-process half: vLLM's request objects in, our decisions out.

Our SchedulerConnector owns request state; this class translates vLLM's Request and
KVCacheBlocks into RequestInfo and block ids, collects the ranks' reports from vLLM's worker
metadata (and vLLM's own aggregate of them), and queues the decisions vLLM has not heard of
from the ranks (invalid params, unplannable loads, prefill frees) for the ranks to echo.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.v1.request import RequestStatus

from connector.errors import InvalidTransferParams, UnsupportedConfiguration
from connector.lifecycle import TransitionTable
from connector.metadata import BlockIds
from connector.protocol import WorkerHandshake
from connector.vllm.messages import (
    NixlPDHandshakeMetadata,
    NixlPDMetadata,
    NixlPDWorkerMeta,
    merge,
)
from connector.vllm.semantics import clip_ssm_groups, loads_from_remote, ssm_scratch_blocks
from scheduler.connector import SchedulerConnector
from scheduler.lifecycles import Book, LifecycleState, OnMove
from scheduler.requests import FinishedRequests, RequestInfo

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Finished statuses under which a prefill's KV is complete and may be offered to decode.
_COMPLETE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_handshake_decoder = msgspec.msgpack.Decoder(WorkerHandshake)


class TrackedState(LifecycleState):
    """What this adapter still owes vLLM for a request (most requests it never tracks)."""

    NEW = enum.auto()
    CLAIMED = enum.auto()  # params refused; tokens claimed so vLLM parks it as a pending load
    REFUSED = enum.auto()  # params refused; never offered a load again (announced if parked)
    RANKS_REPORT = enum.auto()  # a LoadSpec went out: the ranks tell vLLM its outcome themselves
    ENDED = enum.auto()


_T = TrackedState
TRACKED_LIFECYCLE = TransitionTable(
    "vLLM request tracking",
    {
        _T.NEW: {_T.CLAIMED, _T.REFUSED, _T.RANKS_REPORT},
        _T.CLAIMED: {_T.REFUSED, _T.ENDED},
        _T.REFUSED: {_T.ENDED},  # at request_finished
        _T.RANKS_REPORT: {_T.ENDED},  # once SchedulerConnector reports it
        _T.ENDED: (),
    },
)
# The states as module names: shorter to read, and cheaper than Enum class attributes per call.
CLAIMED, REFUSED = TrackedState.CLAIMED, TrackedState.REFUSED
RANKS_REPORT, ENDED = TrackedState.RANKS_REPORT, TrackedState.ENDED


@dataclasses.dataclass
class _Tracked:
    state: TrackedState = TrackedState.NEW
    reason: str = ""  # why its params were refused, announced as the failed load's reason


def _request_info(
    request: Request, *, aborted: bool = False, backoff: int = 0, num_tokens: int | None = None
) -> RequestInfo:
    if num_tokens is None:
        num_tokens = _num_loadable_tokens(request, backoff)
    return RequestInfo(request.request_id, num_tokens, request.kv_transfer_params, aborted)


def _num_loadable_tokens(request: Request, backoff: int) -> int:
    """Prompt tokens a decode load covers: prefill stopped ``backoff`` short (vllm_semantics)."""
    num_tokens = int(request.num_prompt_tokens)
    if loads_from_remote(request.kv_transfer_params) and num_tokens > backoff:
        return num_tokens - backoff
    return num_tokens


_BLOCK_ID_GROUPS = tuple[tuple[int, ...], ...]


def _block_ids(groups: Iterable[Iterable[int]]) -> BlockIds:
    try:  # vLLM's ids are Python ints: one C-level pass
        return msgspec.convert(groups, _BLOCK_ID_GROUPS)
    except msgspec.ValidationError:  # numpy ints and the like: as int() makes them
        return tuple(tuple(int(block) for block in group) for group in groups)


class SchedulerSide:
    """The scheduler process's half: request state via SchedulerConnector, plus the echo.

    Requests with malformed params never reach SchedulerConnector. Their journey along
    TRACKED_LIFECYCLE: CLAIMED as a pending load, announced as a failed load once vLLM parked
    them (i.e. called update_state_after_alloc with tokens to load), then REFUSED: never
    offered a load again, so "recompute" computes them locally. Loads whose LoadSpec went out
    are RANKS_REPORT until reported: the ranks tell vLLM their outcome, so it is not echoed.
    """

    def __init__(
        self,
        connector: SchedulerConnector,
        kv_cache_config: KVCacheConfig,
        *,
        backoff_tokens: int = 0,
        on_move: OnMove | None = None,  # sees every tracking state change (tests)
    ) -> None:
        self.connector = connector
        self._kv_cache_config = kv_cache_config
        self._backoff = backoff_tokens  # prompt tokens prefill leaves to decode (vllm_semantics)
        self._ssm_scratch = ssm_scratch_blocks(kv_cache_config)
        self._tracked: Book[TrackedState, _Tracked] = Book(
            TRACKED_LIFECYCLE, what="tracking", on_move=on_move
        )
        # Outboxes: decided, not yet sent to the ranks to echo.
        self._announce = FinishedRequests()
        self._to_announce: dict[str, str] = {}  # parked refused requests -> reason

    def start_side_channel(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        handshakes = []
        for tp_rank, payload in sorted(metadata.items()):
            if not isinstance(payload, NixlPDHandshakeMetadata):
                raise UnsupportedConfiguration(
                    f"TP rank {tp_rank} sent {type(payload).__name__} handshake metadata; "
                    "every worker must run NixlPDConnector"
                )
            try:
                handshakes.append(_handshake_decoder.decode(payload.payload))
            except msgspec.DecodeError as exc:
                raise UnsupportedConfiguration(
                    f"TP rank {tp_rank}'s handshake metadata does not decode ({exc}); every "
                    "worker must run the same nixl-pd-connector version"
                ) from None
        self.connector.start_side_channel(handshakes)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        request_id = request.request_id
        num_loadable = _num_loadable_tokens(request, self._backoff)
        num_tokens = num_loadable - num_computed_tokens
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.state is REFUSED:
            return 0, False
        if tracked is not None and tracked.state is CLAIMED:  # not parked yet: claim again
            return (num_tokens, True) if num_tokens > 0 else (0, False)
        try:
            return self.connector.get_num_new_matched_tokens(
                _request_info(request, num_tokens=num_loadable), num_computed_tokens
            )
        except InvalidTransferParams as exc:
            logger.warning("request %s: %s", request_id, exc)
            if tracked is not None:  # its load already went out: claim nothing more
                return 0, False
            # Claim the tokens so vLLM parks the request as a pending load, then announce
            # the load as failed: vLLM's kv_load_failure_policy decides its fate.
            self._tracked.add(request_id, _Tracked(reason=f"invalid kv_transfer_params: {exc}"))
            claimed = num_tokens > 0
            self._tracked.move(request_id, CLAIMED if claimed else REFUSED)
            return (num_tokens, True) if claimed else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        request_id = request.request_id
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.state is CLAIMED:
            if num_external_tokens > 0:  # parked: vLLM now waits for our answer
                self._to_announce[request_id] = tracked.reason
            self._tracked.move(request_id, REFUSED)
            return
        if tracked is not None and tracked.state is REFUSED:
            return
        self.connector.update_state_after_alloc(
            _request_info(request, backoff=self._backoff),
            self._transfer_block_ids(blocks.get_block_ids()),
            num_external_tokens,
        )

    def build_connector_meta(self) -> NixlPDMetadata:
        step = self.connector.build_connector_meta()
        for load in step.loads:
            if self._tracked.get(load.request_id) is None:
                self._tracked.add(load.request_id, _Tracked())
                self._tracked.move(load.request_id, RANKS_REPORT)
        invalid = FinishedRequests(failed_recving=dict(self._to_announce))
        self._to_announce.clear()
        announce, self._announce = merge(self._announce, invalid), FinishedRequests()
        return NixlPDMetadata(step, announce)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take the ranks' reports, then vLLM's own aggregate of them; queue what vLLM lacks.

        A load the ranks got a LoadSpec for, each rank reports to vLLM itself, in the step it
        ends (as vLLM's own connector does): its outcome is never echoed. The rest (invalid
        params, loads that could not be planned, prefill frees) is decided here and echoed by
        the ranks in the next step.
        """
        meta = connector_output.kv_connector_worker_meta
        reports = meta.reports if isinstance(meta, NixlPDWorkerMeta) else ()
        self.connector.update_connector_output(reports)
        self.connector.on_engine_outcomes(
            connector_output.finished_recving or (), connector_output.failed_recving or ()
        )
        finished = self.connector.take_finished()
        for request_id, reason in finished.failed_recving.items():
            logger.warning("request %s: KV load failed: %s", request_id, reason)
        self._announce = merge(self._announce, self._not_reported_by_ranks(finished))

    def _not_reported_by_ranks(self, finished: FinishedRequests) -> FinishedRequests:
        reported = set()
        for request_id in (*finished.finished_recving, *finished.failed_recving):
            tracked = self._tracked.get(request_id)
            if tracked is not None and tracked.state is RANKS_REPORT:
                self._tracked.move(request_id, ENDED)
                reported.add(request_id)
        return FinishedRequests(
            finished_sending=finished.finished_sending,
            finished_recving=tuple(i for i in finished.finished_recving if i not in reported),
            failed_recving={
                i: reason for i, reason in finished.failed_recving.items() if i not in reported
            },
        )

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.state in (CLAIMED, REFUSED):
            self._tracked.move(request_id, ENDED)
            return False, None
        info = _request_info(request, aborted=request.status not in _COMPLETE)
        params = request.kv_transfer_params
        if loads_from_remote(params) and not (params or {}).get("do_remote_decode"):
            return self.connector.request_finished(info, ())  # a decode keeps no lease
        return self.connector.request_finished(info, self._transfer_block_ids(block_ids))

    def _transfer_block_ids(self, block_ids: Sequence[list[int]]) -> BlockIds:
        """The transfer groups' ids, each SSM group clipped to its running state."""
        groups = self._kv_cache_config.select_transfer_block_ids(block_ids)
        return clip_ssm_groups(_block_ids(groups), self._ssm_scratch)
