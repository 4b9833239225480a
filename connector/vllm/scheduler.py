"""NixlPDConnector's scheduler-process half: vLLM's request objects in, our decisions out.

It translates and nothing more: vLLM's Request and KVCacheBlocks become RequestInfo and block
ids, the ranks' reports come out of vLLM's worker metadata (with vLLM's own aggregate of them),
and the outcomes vLLM has not heard of from the ranks go back for them to echo. Each decode
request's one record, its claim, parse, refusal and load, is SchedulerConnector's (Consumer's),
whose params bind at allocation: see scheduler/connector.py. What crosses vLLM's process
boundaries is defined here too (``NixlPDMetadata`` to the ranks each step, which this half
builds; ``NixlPDWorkerMeta`` and ``NixlPDHandshakeMetadata`` from them, which it reads).

vLLM's request semantics, mirrored here (the functions at the end; why, in docs/integrity.md
"A state is loaded for exactly its tokens"): with SSM (Mamba) or sliding-window groups or
multi-token prediction prefill stops ``backoff`` tokens short and decode loads ``N - backoff``,
since vLLM's decode recomputes the last loaded prompt token (and a sliding window's blocks
before the next token's window are freed); both sides count the transfer with one function,
``transferred_prompt_tokens``, of the prompt's length and the model's back-off, whatever the
request asks. Speculative decoding's scratch SSM slots are clipped (only the running state is
transferred). A LoRA adapter, a cache salt and multimodal inputs change a prompt's KV without
changing its ids: ``kv_salt`` names them for the lease's token binding
(connector/lease_binding.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
from vllm.v1.request import RequestStatus

from connector.errors import UnsupportedConfiguration
from connector.lease_binding import KVSalt
from connector.metadata import ConnectorMetadata, WorkerReport
from connector.params import raw_flag
from connector.protocol import WorkerHandshake
from connector.staging import StagedBlocks
from connector.vllm.staging import scheduled_rows
from scheduler.connector import SchedulerConnector
from scheduler.requests import FinishedRequests, RequestInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


logger = logging.getLogger(__name__)

# Finished statuses under which a prefill's KV is complete and may be offered to decode.
_COMPLETE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
_handshake_decoder = msgspec.msgpack.Decoder(WorkerHandshake)


# --- what crosses vLLM's process boundaries (all picklable): scheduler -> every worker rank each
# step, NixlPDMetadata; worker ranks -> scheduler each step, NixlPDWorkerMeta; each worker rank
# -> scheduler once at start, NixlPDHandshakeMetadata.


class NixlPDMetadata(KVConnectorMetadata):
    """Scheduler -> every worker rank, one per step: our instructions plus what to echo.

    ``saves`` (host staging only): requests whose prefill completes this step; each rank
    copies their blocks device->host in wait_for_save.
    """

    def __init__(
        self,
        step: ConnectorMetadata,
        announce: FinishedRequests,
        saves: tuple[StagedBlocks, ...] = (),
    ) -> None:
        self.step = step
        self.announce = announce
        self.saves = saves


class NixlPDWorkerMeta(KVConnectorWorkerMetadata):
    """Worker ranks -> scheduler, one per step: the ranks' reports, concatenated."""

    def __init__(self, reports: tuple[WorkerReport, ...]) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, NixlPDWorkerMeta):
            return self
        return NixlPDWorkerMeta(self.reports + other.reports)


class NixlPDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One rank's WorkerHandshake, msgpack-encoded, on its way to the scheduler process."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def merge(first: FinishedRequests, second: FinishedRequests) -> FinishedRequests:
    return FinishedRequests(
        first.finished_sending + second.finished_sending,
        first.finished_recving + second.finished_recving,
        {**first.failed_recving, **second.failed_recving},
    )


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
        # Prompt tokens prefill leaves to decode (prefill_backoff_tokens, below).
        self._backoff = backoff_tokens
        self._ssm_scratch = ssm_scratch_blocks(kv_cache_config)
        self._has_ssm = any(scratch is not None for scratch in self._ssm_scratch)
        self._num_groups = len(kv_cache_config.kv_cache_groups)
        self._transfers_every_group = kv_cache_config.transfer_group_ids == tuple(
            range(self._num_groups)
        )
        # Outcomes decided here, not yet sent to the ranks to echo.
        self._announce = FinishedRequests()

    def _request_info(self, request: Request) -> RequestInfo:
        """The request as our connector sees it: a decode load covers the prompt tokens
        prefill computed for it (``transferred_prompt_tokens``, whatever either request asked)."""
        params = request.kv_transfer_params
        num_tokens = request.num_prompt_tokens
        if self._backoff and raw_flag(params, "do_remote_prefill"):  # as prefill counted it
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
        if request.kv_transfer_params is None:
            return 0, False  # most requests: no call further
        return self.connector.get_num_new_matched_tokens(
            self._request_info(request), num_computed_tokens
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
        params = request.kv_transfer_params
        aborted = request.status not in _COMPLETE
        request_id, num_prompt_tokens = request.request_id, request.num_prompt_tokens
        num_computed_tokens = request.num_computed_tokens
        if params is None or (not self._holds_finished and raw_flag(params, "do_remote_prefill")):
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


def prefill_backoff_tokens(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Trailing prompt tokens prefill leaves for decode to compute (0 for plain attention).

    At least 1 with an SSM state (decode recomputes the last loaded token, and a state holds
    no earlier one) or a sliding window: on a full-prompt hit vLLM's decode recomputes token
    N - 1 (``Scheduler._update_waiting_for_remote_kv``), whose window starts at N - window,
    while prefill's finish freed the blocks wholly before N - window + 1, the window of token
    N (``SlidingWindowManager.get_num_skipped_tokens``). Backed off, prefill computes N - 1
    tokens and keeps the window of token N - 1, the first token decode computes.
    """
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 1) or 1)
    # Does a transferred group hold the sequence's end only (SSM state, sliding window)?
    keeps_only_the_end = kv_cache_config.has_mamba_layers or any(
        isinstance(group.kv_cache_spec, SlidingWindowSpec)
        for group in kv_cache_config.transfer_groups
    )
    return max(1 if keeps_only_the_end else 0, lookahead - 1)


def ssm_scratch_blocks(kv_cache_config: KVCacheConfig) -> tuple[int | None, ...]:
    """Per transfer group: speculative scratch slots after the SSM state, None for attention."""
    return tuple(
        int(group.kv_cache_spec.num_speculative_blocks)
        if isinstance(group.kv_cache_spec, MambaSpec)
        else None
        for group in kv_cache_config.transfer_groups
    )


def clip_ssm_groups(
    groups: Sequence[Sequence[int]], scratch: Sequence[int | None]
) -> tuple[Sequence[int], ...]:
    """Each SSM group reduced to its running-state block; attention groups unchanged.

    vLLM's SSM list is [placeholders..., running state, scratch x num_speculative_blocks]:
    ``[0, 0, 7, 8, 9]`` with 2 scratch slots -> ``[7]``. An empty list stays empty.
    """
    return tuple(
        group if spec is None or not group else _running_state(group, spec)
        for group, spec in zip(groups, scratch, strict=True)
    )


def _running_state(group: Sequence[int], num_scratch: int) -> Sequence[int]:
    keep = len(group) - min(num_scratch, len(group) - 1)
    return group[keep - 1 : keep]


def kv_salt(request: Request) -> KVSalt:
    """What the request's KV depends on besides its ids, as vLLM's prefix cache hashes it
    (the "extra keys" of its block hashes): the LoRA adapter's name, the cache salt (both from
    token 0 on), and each multimodal item's hash and placeholder length, from its offset on.
    () for a plain request. Prompt embeddings are not here: their leases bind no ids at all.

    The adapter is named, not located: engines may keep one adapter at different paths, so
    they must give one name to one adapter.
    """
    lora, cache_salt, features = request.lora_request, request.cache_salt, request.mm_features
    if lora is None and not cache_salt and not features:
        return ()
    parts: list[tuple[int, bytes]] = []
    if lora is not None:
        parts.append((0, b"lora\0" + lora.lora_name.encode()))
    if cache_salt:
        parts.append((0, b"cache_salt\0" + cache_salt.encode()))
    for feature in features:
        position = feature.mm_position
        identity = f"{feature.identifier}\0{position.length}".encode()
        parts.append((position.offset, b"mm\0" + identity))
    return tuple(parts)


def transferred_prompt_tokens(num_prompt_tokens: int, backoff: int) -> int:
    """The prompt tokens a prefill->decode transfer covers: prefill computes them, decode loads
    them. All but the last ``backoff``; none when the prompt has no more than that (decode
    computes it whole: a state for all of it would take its last token twice)."""
    if backoff <= 0:
        return num_prompt_tokens
    return max(num_prompt_tokens - backoff, 0)


def truncate_for_prefill(request: Request, backoff: int) -> bool:
    """Prefill side: drop the prompt tokens of a do_remote_decode request that decode computes
    (``transferred_prompt_tokens``); returns whether it did.

    Every such request, whatever it asks (prompt logprobs included: their values for the
    dropped tokens are decode's to give), so that the state prefill leases is the one decode
    loads. A prompt no longer than ``backoff`` stays whole: decode loads none of it.
    """
    num_tokens = transferred_prompt_tokens(request.num_prompt_tokens, backoff)
    if (
        num_tokens in (0, request.num_prompt_tokens)
        or not raw_flag(request.kv_transfer_params, "do_remote_decode")
        or (request.prompt_token_ids is None and request.prompt_embeds is None)
    ):
        return False
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[num_tokens:]
    if request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:num_tokens]
    is_token_ids = getattr(request, "prompt_is_token_ids", None)  # ids and embeddings mixed
    if is_token_ids is not None:
        request.prompt_is_token_ids = is_token_ids[:num_tokens]
    del request._all_token_ids[num_tokens:]
    request.num_prompt_tokens = num_tokens
    request.max_tokens = 1
    return True
