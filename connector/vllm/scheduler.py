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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.v1.request import RequestStatus

from connector.errors import InvalidTransferParams, UnsupportedConfiguration
from connector.lifecycle import TransitionTable
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
    HANDED = enum.auto()  # SchedulerConnector holds its load; no LoadSpec has gone out yet
    RANKS_REPORT = enum.auto()  # a LoadSpec went out: the ranks tell vLLM its outcome themselves
    ENDED = enum.auto()


_T = TrackedState
TRACKED_LIFECYCLE = TransitionTable(
    "vLLM request tracking",
    {
        _T.NEW: {_T.CLAIMED, _T.REFUSED, _T.HANDED},
        _T.CLAIMED: {_T.REFUSED, _T.ENDED},
        _T.REFUSED: {_T.ENDED},  # at request_finished
        _T.HANDED: {_T.RANKS_REPORT, _T.ENDED},  # LoadSpec out, or finished without one
        _T.RANKS_REPORT: {_T.ENDED},  # once SchedulerConnector reports it
        _T.ENDED: (),
    },
)
# The states as module names: shorter to read, and cheaper than Enum class attributes per call.
CLAIMED, REFUSED, HANDED = TrackedState.CLAIMED, TrackedState.REFUSED, TrackedState.HANDED
RANKS_REPORT, ENDED = TrackedState.RANKS_REPORT, TrackedState.ENDED


@dataclasses.dataclass(slots=True)
class _Tracked:
    state: TrackedState = TrackedState.NEW
    reason: str = ""  # why its params were refused, announced as the failed load's reason


def _request_info(request: Request, num_tokens: int, *, aborted: bool = False) -> RequestInfo:
    params = request.kv_transfer_params
    return RequestInfo(request.request_id, num_tokens, params, aborted, token_ids=_ids(request))


def _ids(request: Request) -> Sequence[int] | None:
    """The ids a lease is bound to (prompt first); None for prompt embeddings, whose ids
    are placeholders that would bind nothing."""
    return None if request.prompt_embeds is not None else request.all_token_ids


def _num_loadable_tokens(request: Request, backoff: int) -> int:
    """Prompt tokens a decode load covers: prefill stopped ``backoff`` short (vllm_semantics)."""
    num_tokens = int(request.num_prompt_tokens)
    if loads_from_remote(request.kv_transfer_params) and num_tokens > backoff:
        return num_tokens - backoff
    return num_tokens


def _params_summary(info: RequestInfo) -> str:
    params = info.kv_transfer_params
    if not isinstance(params, dict):
        return f"params are now {type(params).__name__}"
    return f"do_remote_prefill is now {params.get('do_remote_prefill')!r}"


def _claims_a_load(params: object) -> bool:
    """Do these params ask for a remote prefill's KV? (Read, not validated: see SchedulerSide.)"""
    return type(params) is dict and params.get("do_remote_prefill") is True


class SchedulerSide:
    """The scheduler process's half: request state via SchedulerConnector, plus the echo.

    A decode request's params are read at allocation, not when vLLM first asks: vLLM may ask
    get_num_new_matched_tokens many times before it allocates, and nothing binds until then
    (vLLM's own connector reads them there too). So the first ask only claims the tokens of a
    dict saying ``do_remote_prefill: true``, noting the request in ``_claims`` (a memo kept
    until request_finished: unread, or read). Allocation, or an ask that finds nothing left to
    load, hands the request to SchedulerConnector, which parses and validates its params
    once: valid, it is HANDED; refused, its load is announced failed.

    Requests with malformed params never reach SchedulerConnector's request state. Their
    journey along TRACKED_LIFECYCLE: refused at allocation, announced as a failed load if vLLM
    parked them (tokens to load), then REFUSED: never offered a load again, so "recompute"
    computes them locally. (Params refused at the first ask, where nothing was claimed
    unread, are CLAIMED until vLLM parks them.) A HANDED load whose LoadSpec went out is
    RANKS_REPORT until reported: the ranks tell vLLM its outcome, so it is not echoed.
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
        self._has_ssm = any(scratch is not None for scratch in self._ssm_scratch)
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        self._transfers_every_group = kv_cache_config.transfer_group_ids == tuple(
            range(self._num_groups)
        )
        self._tracked: Book[TrackedState, _Tracked] = Book(
            TRACKED_LIFECYCLE, what="tracking", on_move=on_move
        )
        # Decode requests whose params claim a load, from vLLM's first ask to request_finished:
        # tokens computed locally at the last ask while the params are unread, None once read.
        self._claims: dict[str, int | None] = {}
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
        params = request.kv_transfer_params
        if params is None:
            return 0, False
        claims = self._claims
        # Unread: claimed before, or a decode request vLLM asks about for the first time.
        if claims[request_id] is not None if request_id in claims else _claims_a_load(params):
            num_tokens = request.num_prompt_tokens
            if num_tokens > self._backoff:
                num_tokens -= self._backoff
            num_tokens -= num_computed_tokens
            if num_tokens > 0:  # claim now, read the params at allocation
                claims[request_id] = num_computed_tokens
                return num_tokens, True
            claims[request_id] = None  # nothing to load: the connector settles it now
        return self._ask_connector(request, num_computed_tokens)

    def _ask_connector(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        request_id = request.request_id
        num_loadable = _num_loadable_tokens(request, self._backoff)
        num_tokens = num_loadable - num_computed_tokens
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.state is REFUSED:
            return 0, False
        if tracked is not None and tracked.state is CLAIMED:  # not parked yet: claim again
            return (num_tokens, True) if num_tokens > 0 else (0, False)
        try:
            matched = self.connector.get_num_new_matched_tokens(
                _request_info(request, num_loadable), num_computed_tokens
            )
        except InvalidTransferParams as exc:
            logger.warning("request %s: %s", request_id, exc)
            if tracked is not None:  # its load already went out: claim nothing more
                return 0, False
            # Claim the tokens so vLLM parks the request as a pending load, then announce
            # the load as failed: vLLM's kv_load_failure_policy decides its fate.
            claimed = num_tokens > 0
            refused = _Tracked(reason=f"invalid kv_transfer_params: {exc}")
            self._tracked.start(request_id, refused, CLAIMED if claimed else REFUSED)
            return (num_tokens, True) if claimed else (0, False)
        if tracked is None and (loads_from_remote(request.kv_transfer_params) or matched[1]):
            # the connector holds its load from now on (matched: a pull from decode)
            self._track(request_id, HANDED)
        return matched

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        request_id = request.request_id
        info = _request_info(request, _num_loadable_tokens(request, self._backoff))
        num_computed = self._claims.get(request_id)
        if num_computed is not None:
            self._claims[request_id] = None  # read now, whatever the connector decides
            if not self._hand_over(info, num_computed, num_external_tokens):
                return
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.state is CLAIMED:
            if num_external_tokens > 0:  # parked: vLLM now waits for our answer
                self._to_announce[request_id] = tracked.reason
            self._tracked.move(request_id, REFUSED)
            return
        if tracked is not None and tracked.state is REFUSED:
            return
        self.connector.update_state_after_alloc(
            info, self._transfer_block_ids(blocks.get_block_ids()), num_external_tokens
        )

    def _hand_over(self, info: RequestInfo, num_computed: int, num_external_tokens: int) -> bool:
        """Give a claimed request to SchedulerConnector, which reads its params now.

        Returns whether it took it; refused params are announced as a failed load if vLLM
        parked the request (``num_external_tokens`` > 0), and never offered a load again.
        """
        request_id = info.request_id
        try:
            _, loads = self.connector.get_num_new_matched_tokens(info, num_computed)
        except InvalidTransferParams as exc:
            return self._refuse(
                request_id, f"invalid kv_transfer_params: {exc}", num_external_tokens
            )
        if num_external_tokens > 0 and not loads:
            # vLLM parked the request for the tokens claimed at its first ask, but its params
            # no longer ask for a load (another connector edited them in between): nothing
            # would ever answer the wait. Fail it; vLLM's failure policy decides.
            return self._refuse(
                request_id,
                "kv_transfer_params changed between vLLM's first ask and allocation: "
                f"{_params_summary(info)}; nothing is "
                "loaded for this request",
                num_external_tokens,
            )
        self._track(request_id, HANDED)
        return True

    def _refuse(self, request_id: str, reason: str, num_external_tokens: int) -> bool:
        """Never offer the request a load again; announce its load failed if vLLM parked it."""
        logger.warning("request %s: %s", request_id, reason)
        if num_external_tokens > 0:
            self._to_announce[request_id] = reason
        self._track(request_id, REFUSED)
        return False

    def _track(self, request_id: str, state: TrackedState) -> None:
        self._tracked.start(request_id, _Tracked(), state)

    def build_connector_meta(self) -> NixlPDMetadata:
        step = self.connector.build_connector_meta()
        for load in step.loads:  # every load was HANDED when the connector took it
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
        params = request.kv_transfer_params
        if params is None:
            return False, None
        # A claim still unread: the connector reads the params now, to release prefill's KV.
        loads = self._claims.pop(request_id, False) is not False or loads_from_remote(params)
        tracked = self._tracked.get(request_id)
        if tracked is not None:
            state = tracked.state
            if state is CLAIMED or state is REFUSED:
                self._tracked.move(request_id, ENDED)
                return False, None
            if state is HANDED:  # no LoadSpec went out: the ranks will not report it
                self._tracked.move(request_id, ENDED)
        aborted = request.status not in _COMPLETE
        info = RequestInfo(
            request_id,
            request.num_prompt_tokens,
            params,
            aborted,
            request.num_computed_tokens,
            _ids(request),
        )
        if loads and not self.connector.holds_finished_requests:
            return self.connector.request_finished(info, ())  # a decode keeps no lease
        return self.connector.request_finished(info, self._transfer_block_ids(block_ids))

    def _transfer_block_ids(self, block_ids: Sequence[list[int]]) -> Sequence[Sequence[int]]:
        """The transfer groups' ids, each SSM group clipped to its running state: vLLM's
        lists as they are (Python ints, KVCacheBlock.block_id); SchedulerConnector copies
        what it keeps."""
        if not self._transfers_every_group or len(block_ids) != self._num_groups:
            block_ids = self._kv_cache_config.select_transfer_block_ids(block_ids)  # and checks
        return clip_ssm_groups(block_ids, self._ssm_scratch) if self._has_ssm else block_ids
