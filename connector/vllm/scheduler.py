"""NixlPDConnector's scheduler-process half: vLLM's request objects in, our decisions out.

It translates and nothing more: vLLM's Request and KVCacheBlocks become RequestInfo and block
ids, the ranks' reports come out of vLLM's worker metadata (with vLLM's own aggregate of them),
and the outcomes vLLM has not heard of from the ranks go back for them to echo. Each decode
request's one record, its claim, parse, refusal and load, is SchedulerConnector's (Consumer's),
whose params bind at allocation: see scheduler/connector.py.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.v1.request import RequestStatus

from connector.errors import UnsupportedConfiguration
from connector.protocol import WorkerHandshake
from connector.vllm.messages import (
    NixlPDHandshakeMetadata,
    NixlPDMetadata,
    NixlPDWorkerMeta,
    merge,
)
from connector.vllm.semantics import (
    clip_ssm_groups,
    kv_salt,
    kv_transfer_params,
    loads_from_remote,
    ssm_scratch_blocks,
    transferred_prompt_tokens,
)
from connector.vllm.staging import scheduled_rows
from scheduler.connector import SchedulerConnector
from scheduler.requests import FinishedRequests, RequestInfo

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# Finished statuses under which a prefill's KV is complete and may be offered to decode.
_COMPLETE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_handshake_decoder = msgspec.msgpack.Decoder(WorkerHandshake)


def _ids(request: Request) -> Sequence[int] | None:
    """The ids a lease is bound to (prompt first); None for prompt embeddings, whose ids
    are placeholders that would bind nothing."""
    return None if request.prompt_embeds is not None else request.all_token_ids


class SchedulerSide:
    """The scheduler process's half: request state via SchedulerConnector, plus the echo.

    vLLM may ask get_num_new_matched_tokens many times before it allocates, and nothing binds
    until then (vLLM's own connector reads the params there too): ``connector`` reads them
    there as well.
    """

    def __init__(
        self,
        connector: SchedulerConnector,
        kv_cache_config: KVCacheConfig,
        *,
        backoff_tokens: int = 0,
    ) -> None:
        self.connector = connector
        self._holds_finished = connector.holds_finished_requests  # fixed by its config
        self._kv_cache_config = kv_cache_config
        self._backoff = backoff_tokens  # prompt tokens prefill leaves to decode (semantics.py)
        self._ssm_scratch = ssm_scratch_blocks(kv_cache_config)
        self._has_ssm = any(scratch is not None for scratch in self._ssm_scratch)
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        self._transfers_every_group = kv_cache_config.transfer_group_ids == tuple(
            range(self._num_groups)
        )
        # Outcomes decided here, not yet sent to the ranks to echo.
        self._announce = FinishedRequests()

    def _request_info(self, request: Request, params: dict[str, Any] | None = None) -> RequestInfo:
        """The request as our connector sees it (``params``: its kv_transfer_params, if read
        already): a decode load covers the prompt tokens prefill computed for it
        (``transferred_prompt_tokens``, whatever either request asked)."""
        if params is None:
            params = kv_transfer_params(request)
        num_tokens = request.num_prompt_tokens
        if self._backoff and loads_from_remote(params):  # prefill counted it the same way
            num_tokens = transferred_prompt_tokens(num_tokens, self._backoff)
        # A load's ids: it covers prompt tokens only, and vLLM's own prompt list (a plain
        # list, the ids ``all_token_ids`` begins with) packs without ConstantList's slice.
        prompt_ids = None if request.prompt_embeds is not None else request.prompt_token_ids
        return RequestInfo(
            request.request_id, num_tokens, params, token_ids=prompt_ids, kv_salt=kv_salt(request)
        )

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
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params  # kv_transfer_params(request), inlined: every ask
        if params is None:
            return 0, False  # most requests: no call further
        return self.connector.get_num_new_matched_tokens(
            self._request_info(request, params), num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.connector.update_state_after_alloc(
            self._request_info(request),
            self._transfer_block_ids(blocks.get_block_ids()),
            num_external_tokens,
        )

    def track_chunks(self, request: Request) -> None:
        """Chunked pulls, prefill: follow a request whose blocks decode reads chunk by chunk."""
        if self.connector.chunk_leases is not None and not self._has_ssm:
            self.connector.chunk_leases.track(
                request.request_id, request.kv_transfer_params, request.num_prompt_tokens,
                _ids(request), kv_salt(request),
            )  # fmt: skip

    def step_chunks(
        self, metadata: NixlPDMetadata, scheduler_output: SchedulerOutput
    ) -> NixlPDMetadata:
        """Chunked pulls, prefill: note the step's chunks (and end preempted requests' leases
        before the step's forward); the ranks echo the step's number once it ran."""
        chunks = self.connector.chunk_leases
        if chunks is None or not len(chunks):
            return metadata
        rows = scheduled_rows(scheduler_output, self._kv_cache_config)
        step_seq = chunks.step(rows, scheduler_output.preempted_req_ids or ())
        step = msgspec.structs.replace(metadata.step, step_seq=step_seq)
        return NixlPDMetadata(step, metadata.announce, metadata.saves)

    def build_connector_meta(self) -> NixlPDMetadata:
        step = self.connector.build_connector_meta()
        refused = FinishedRequests(failed_recving=self.connector.take_refused())
        announce, self._announce = merge(self._announce, refused), FinishedRequests()
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
        if self.connector.chunk_leases is not None:
            self.connector.chunk_leases.saved(reports)
        self.connector.on_engine_outcomes(
            connector_output.finished_recving or (), connector_output.failed_recving or ()
        )
        finished = self.connector.take_finished()
        for request_id, reason in finished.failed_recving.items():
            logger.warning("request %s: KV load failed: %s", request_id, reason)
        self._announce = merge(self._announce, self._not_reported_by_ranks(finished))

    def _not_reported_by_ranks(self, finished: FinishedRequests) -> FinishedRequests:
        reported = self.connector.reported_by_ranks
        if not reported:
            return finished
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
        params = request.kv_transfer_params  # kv_transfer_params(request), inlined
        aborted = request.status not in _COMPLETE
        request_id, num_prompt_tokens = request.request_id, request.num_prompt_tokens
        num_computed_tokens = request.num_computed_tokens
        if params is None or (
            not self._holds_finished
            and (  # loads_from_remote(params), inlined for the usual dict
                params.get("do_remote_prefill") is True
                if type(params) is dict
                else loads_from_remote(params)
            )
        ):
            # A decode keeps no lease: no blocks, and no ids to bind one to.
            info = RequestInfo(request_id, num_prompt_tokens, params, aborted, num_computed_tokens)
            return self.connector.request_finished(info, ())
        info = RequestInfo(
            request_id,
            num_prompt_tokens,
            params,
            aborted,
            num_computed_tokens,
            _ids(request),
            kv_salt(request),
        )
        return self.connector.request_finished(info, self._transfer_block_ids(block_ids))

    def _transfer_block_ids(self, block_ids: Sequence[list[int]]) -> Sequence[Sequence[int]]:
        """The transfer groups' ids, each SSM group clipped to its running state: vLLM's
        lists as they are (Python ints, KVCacheBlock.block_id); SchedulerConnector copies
        what it keeps."""
        if not self._transfers_every_group or len(block_ids) != self._num_groups:
            block_ids = self._kv_cache_config.select_transfer_block_ids(block_ids)  # and checks
        return clip_ssm_groups(block_ids, self._ssm_scratch) if self._has_ssm else block_ids
