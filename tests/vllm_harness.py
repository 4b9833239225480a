"""A CPU harness around vLLM 0.33's real Scheduler: one engine = scheduler + worker connectors.

No model runs. A step is: vLLM schedules, every worker rank gets the connector metadata (as a
model runner would), each rank reports, vLLM's own KVOutputAggregator merges the ranks, and
vLLM's scheduler consumes a fake model output that samples token 7 for every scheduled
request. KV memory is plain host tensors laid out as our geometry says, moved by FakeNixl.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from connector.layout import TOKEN_ADDRESSABLE, BlockFormat  # noqa: E402
from connector.metadata import LoadSpec  # noqa: E402
from connector.vllm import NixlPDConnector  # noqa: E402
from connector.vllm.scheduler import NixlPDMetadata  # noqa: E402
from worker.fake import FakeNixl  # noqa: E402

MODEL_KV_HEADS = 2
HEAD_SIZE = 16
NUM_LAYERS = 2
SAMPLED_TOKEN = 7
MAX_MODEL_LEN = 1024
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": MODEL_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}

init_none_hash(sha256)


def write_tiny_model(folder: Path) -> Path:
    """A config-only llama checkpoint folder: enough for vLLM's ModelConfig, no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


def model_config(folder: Path) -> ModelConfig:
    """Slow (vLLM inspects the architecture in a subprocess): build once per session."""
    return ModelConfig(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def vllm_config(
    model: ModelConfig,
    *,
    kv_role: str,
    block_size: int = 16,
    failure_policy: str = "fail",
    extra_config: dict[str, Any] | None = None,
    tp_size: int = 1,
) -> VllmConfig:
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlPDConnector",
            kv_connector_module_path="connector.vllm",
            kv_role=kv_role,
            kv_load_failure_policy=failure_policy,
            kv_connector_extra_config=extra_config or {},
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.parallel_config.tensor_parallel_size = tp_size
    return config


def kv_cache_config(
    *, block_size: int, num_blocks: int, tp_size: int = 1, window: int | None = None
) -> KVCacheConfig:
    """Dense: one full-attention group of every layer. ``window``: layer 1 slides (HMA)."""
    heads = max(MODEL_KV_HEADS // tp_size, 1)
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float32
    )
    if window is None:
        groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(NUM_LAYERS)], full)]
    else:
        sliding = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=HEAD_SIZE,
            dtype=torch.float32,
            sliding_window=window,
        )
        groups = [KVCacheGroupSpec(["layers.0"], full), KVCacheGroupSpec(["layers.1"], sliding)]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups, kv_cache_layout="LBNHC"
    )


def make_request(
    request_id: str,
    num_tokens: int,
    *,
    block_size: int,
    kv_transfer_params: dict[str, Any] | None = None,
    max_tokens: int = 4,
    first_token: int = 1,
    token_ids: Sequence[int] | None = None,  # the prompt (then num_tokens is its length)
    prompt_logprobs: int | None = None,
    **request_options: Any,  # more of vLLM's Request arguments: cache_salt, lora_request, ...
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    prompt = [first_token + i for i in range(num_tokens)] if token_ids is None else token_ids
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
        **request_options,
    )
    request.kv_transfer_params = kv_transfer_params
    return request


class RecordingFakeNixl(FakeNixl):
    """FakeNixl that counts the READs it posted, so tests can act while one is in flight."""

    num_posted = 0

    def post(self, transfer: Any) -> Any:
        self.num_posted += 1
        return super().post(transfer)


@dataclass
class Engine:
    """One vLLM engine: the real Scheduler and one worker connector (+ KV tensors) per rank."""

    name: str
    scheduler: Scheduler
    workers: list[NixlPDConnector]
    kv_caches: list[dict[str, torch.Tensor]]
    agents: list[RecordingFakeNixl]  # one per rank: set their ``faults`` to inject failures
    aggregator: KVOutputAggregator
    outputs: list[Any] = field(default_factory=list)
    # Every step's merged invalid_block_ids (what the ranks reported with load errors).
    invalid_block_ids: list[set[int]] = field(default_factory=list)
    call_start_load_kv: bool = True  # False: like an engine step that skips the load hook
    call_wait_for_save: bool = False  # True: call it after the (absent) forward, as vLLM does
    stats: dict[str, int] = field(default_factory=dict)  # connector stats, summed over steps
    load_specs: list[LoadSpec] = field(default_factory=list)  # every LoadSpec the ranks got

    @property
    def connector(self) -> NixlPDConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, NixlPDConnector)
        return connector

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def step(self) -> list[Any]:
        """One engine step; returns this step's EngineCoreOutput records."""
        scheduled = self.scheduler.schedule()
        if isinstance(scheduled.kv_connector_metadata, NixlPDMetadata):
            self.load_specs.extend(scheduled.kv_connector_metadata.step.loads)
        rank_outputs = [self._run_rank(worker, scheduled) for worker in self.workers]
        merged = self.aggregator.aggregate(rank_outputs)
        assert merged is not None
        kv_output = merged.kv_connector_output
        if kv_output is not None and kv_output.invalid_block_ids:
            self.invalid_block_ids.append(set(kv_output.invalid_block_ids))
        if kv_output is not None and kv_output.kv_connector_stats is not None:
            for key, value in kv_output.kv_connector_stats.reduce().items():
                self.stats[key] = self.stats.get(key, 0) + int(value)
        by_client = self.scheduler.update_from_output(scheduled, merged)
        outputs = [o for client in by_client.values() for o in client.outputs]
        self.outputs.extend(outputs)
        return outputs

    def run_until(self, done: Any, timeout_s: float = 10.0) -> int:
        """Step until ``done(engine)`` is true; returns the steps taken.

        Bounded by wall time, not steps: handshakes run on a background thread over ZMQ, so
        how many (fast) engine steps they span depends on the machine. Between steps we yield
        the GIL for a millisecond so that thread can run.
        """
        deadline_s = time.monotonic() + timeout_s
        steps = 0
        while time.monotonic() < deadline_s:
            self.step()
            steps += 1
            if done(self):
                return steps
            time.sleep(0.001)
        raise AssertionError(f"{self.name}: condition not met within {timeout_s} s ({steps} steps)")

    def finished(self, request_id: str) -> Any | None:
        for output in self.outputs:
            if output.request_id == request_id and output.finish_reason is not None:
                return output
        return None

    def num_free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.connector.shutdown()

    def _run_rank(self, worker: NixlPDConnector, scheduled: Any) -> ModelRunnerOutput:
        # Worker ranks live in other processes: metadata crosses as pickles, both ways.
        worker.bind_connector_metadata(_across_processes(scheduled.kv_connector_metadata))
        if self.call_start_load_kv:
            worker.start_load_kv(None)  # type: ignore[arg-type]  # no forward context here
        if self.call_wait_for_save:
            worker.wait_for_save()
        results = worker.get_transfer_results(scheduled.finished_req_ids)
        kv_output = KVConnectorOutput(
            kv_connector_stats=_across_processes(worker.get_kv_connector_stats()),
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),  # as vLLM asks, right after
            kv_connector_worker_meta=_across_processes(worker.build_connector_worker_meta()),
        )
        worker.clear_connector_metadata()
        req_ids = list(scheduled.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: index for index, rid in enumerate(req_ids)},
            sampled_token_ids=[[SAMPLED_TOKEN] for _ in req_ids],
            kv_connector_output=kv_output,
        )


def build_engine(
    name: str,
    config: VllmConfig,
    cache_config: KVCacheConfig,
    *,
    port: int,
    env: Any,
    block_format: BlockFormat | Sequence[BlockFormat] = TOKEN_ADDRESSABLE,
) -> Engine:
    """``env`` is pytest's monkeypatch: the side-channel port is read from the environment.

    No model runs here, so no attention layer tells the workers their block format:
    ``block_format`` says it (token-addressable, as vLLM's GPU backends keep their blocks),
    for every transfer group or one per group.
    """
    formats = (
        [block_format] * len(cache_config.transfer_groups)
        if isinstance(block_format, BlockFormat)
        else list(block_format)
    )
    env.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(port))
    config.cache_config.num_gpu_blocks = cache_config.num_blocks
    # As vLLM's EngineCore does: with groups of different block sizes (a Mamba group of
    # max_model_len tokens beside attention), the scheduler steps in their LCM.
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(cache_config, config)
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
    )
    tp_size = config.parallel_config.tensor_parallel_size
    workers, caches, agents = [], [], []
    for rank in range(tp_size):
        agent = RecordingFakeNixl(f"{name}-{config.kv_transfer_config.engine_id}-{rank}")
        worker = NixlPDConnector(
            config,
            KVConnectorRole.WORKER,
            cache_config,
            tp_rank=rank,
            agent=agent,
            block_formats=formats,
        )
        agents.append(agent)
        tensors = allocate_kv_caches(cache_config)
        worker.register_kv_caches(tensors)
        workers.append(worker)
        caches.append(tensors)
    engine = Engine(name, scheduler, workers, caches, agents, KVOutputAggregator(tp_size))
    # As vLLM's engine core does: {(pp_rank, tp_rank): metadata} from every worker process.
    handshakes = {
        (0, rank): _across_processes(w.get_handshake_metadata()) for rank, w in enumerate(workers)
    }
    engine.connector.set_xfer_handshake_metadata_pp_aware(handshakes)
    return engine


def build_pair(
    model: ModelConfig,
    env: Any,
    *,
    failure_policy: str,
    extra_config: dict[str, Any],
    block_size: int = 16,
    num_blocks: int = 64,
) -> tuple[Engine, Engine]:
    """A prefill and a decode engine (TP 1) of ``model`` with one KV cache spec; stop them with
    ``shutdown``."""
    engines = []
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = vllm_config(
            model,
            kv_role=role,
            block_size=block_size,
            failure_policy=failure_policy,
            extra_config=extra_config,
        )
        cache = kv_cache_config(block_size=block_size, num_blocks=num_blocks)
        engines.append(build_engine(name, config, cache, port=free_port(), env=env))
    return engines[0], engines[1]


def _across_processes(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value))


def allocate_kv_caches(cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Per-layer KV views exactly as vLLM 0.33 builds them: one raw byte buffer per group,
    layer-outermost, viewed by vLLM's own ``create_kv_cache_views`` in the config's layout."""
    layout = KVCacheLayout[cache_config.kv_cache_layout or "LBNHC"]
    num_blocks = cache_config.num_blocks
    tensors: dict[str, torch.Tensor] = {}
    for group in cache_config.kv_cache_groups:
        page_bytes = group.kv_cache_spec.page_size_bytes
        names = list(group.layer_names)
        raw = torch.zeros(len(names) * page_bytes * num_blocks, dtype=torch.int8)
        placement = KVCacheTensor(
            size=raw.numel(),
            layers=names,
            layer_stride=page_bytes * num_blocks,
            block_stride=page_bytes,
        )
        views = create_kv_cache_views(raw, group.kv_cache_spec, num_blocks, layout, placement)
        tensors.update(zip(names, views, strict=True))
    return tensors


def fill_blocks(engine: Engine, block_ids: Sequence[Sequence[int]], seed: int) -> None:
    """Write seeded random values into the given logical blocks of every layer on every rank:
    floats in [0, 1) into a float view, and non-zero ints into an integer one (a Mamba
    group's view is vLLM's raw int8 bytes, which would keep [0, 1) as zeros), so no block
    is left all zeros and blocks differ from each other."""
    generator = torch.Generator().manual_seed(seed)
    for caches in engine.kv_caches:
        for group_index, tensor in _group_tensors(engine, caches):
            for block in block_ids[group_index]:
                tensor[block] = _random_values(tensor[block], generator)


def _random_values(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if like.dtype.is_floating_point:
        return torch.rand(like.shape, generator=generator)
    high = torch.iinfo(like.dtype).max + 1
    return torch.randint(1, high, like.shape, generator=generator, dtype=like.dtype)


def block_bytes(engine: Engine, rank: int, group: int, block_ids: Sequence[int]) -> list[bytes]:
    caches = engine.kv_caches[rank]
    return [
        bytes(tensor[block].numpy().tobytes())
        for g, tensor in _group_tensors(engine, caches)
        if g == group
        for block in block_ids
    ]


def token_bytes(engine: Engine, group: int, block_ids: Sequence[int], tokens: range) -> list[bytes]:
    """Each token's bytes in every layer of an attention group on rank 0 ([block, head, token,
    C]): for comparing the tokens a load moved when only part of a block is transferred."""
    layers = engine.scheduler.kv_cache_config.kv_cache_groups[group].layer_names
    block_size = engine.scheduler.kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size
    return [
        engine.kv_caches[0][name][block_ids[token // block_size]][:, token % block_size]
        .numpy()
        .tobytes()
        for name in layers
        for token in tokens
    ]


def _group_tensors(engine: Engine, caches: dict[str, torch.Tensor]) -> Iterator[tuple[int, Any]]:
    groups = engine.scheduler.kv_cache_config.kv_cache_groups
    for group_index, group in enumerate(groups):
        for name in group.layer_names:
            yield group_index, caches[name]


def heads_bytes(engine: Engine, block_ids: Sequence[int]) -> list[list[bytes]]:
    """Group 0's blocks as model-wide heads: [layer][K|V of head h for every block], joining
    the ranks' head shards in rank order so engines of different TP sizes compare equal."""
    layers = engine.scheduler.kv_cache_config.kv_cache_groups[0].layer_names
    result = []
    for name in layers:
        # Each rank's view is [kernel blocks, heads, tokens, K|V]; stack the ranks' heads.
        per_rank = [caches[name][list(block_ids)] for caches in engine.kv_caches]
        unique = (
            per_rank if per_rank[0].shape[1] * len(per_rank) <= MODEL_KV_HEADS else per_rank[:1]
        )
        heads = torch.cat(unique, dim=1)
        result.append(
            [bytes(heads[:, head].contiguous().numpy().tobytes()) for head in range(heads.shape[1])]
        )
    return result


def sample_nothing_for_chunks(engine: Engine) -> None:
    """Make ``engine``'s step behave as vLLM's model runner with chunked prefill: a request
    whose prompt is not computed yet (a chunk of a chunked prefill) samples nothing. (The
    harness's step samples a token for every scheduled request.)"""
    run_rank = engine._run_rank

    def run(worker: NixlPDConnector, scheduled: Any) -> ModelRunnerOutput:
        output = run_rank(worker, scheduled)
        requests = engine.scheduler.requests
        output.sampled_token_ids = [
            [] if requests[rid].is_prefill_chunk else tokens
            for rid, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True)
        ]
        return output

    engine._run_rank = run  # type: ignore[method-assign]


def prefill_for_decode(
    prefill: Engine, request_id: str, num_tokens: int, *, block_size: int
) -> dict[str, Any]:
    """Run a do_remote_decode request to its end on ``prefill``; return the kv_transfer_params
    it hands to decode."""
    prefill.add(
        make_request(
            request_id,
            num_tokens,
            block_size=block_size,
            kv_transfer_params={"do_remote_decode": True},
            max_tokens=1,
        )
    )
    prefill.run_until(lambda e: e.finished(request_id) is not None)
    output = prefill.finished(request_id)
    assert output is not None and output.kv_transfer_params is not None, (
        f"prefill returned no kv_transfer_params for {request_id}"
    )
    return dict(output.kv_transfer_params)


def run_until_loaded(
    decode: Engine, request_id: str, *, timeout_s: float = 10.0
) -> list[list[int]]:
    """Step ``decode`` until ``request_id`` stops waiting for its remote KV; return its block
    ids per cache group at that moment (before decoding frees or reuses any)."""
    loaded: list[list[int]] = []

    def received(engine: Engine) -> bool:
        request = engine.scheduler.requests.get(request_id)
        if request is None or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        loaded.extend(engine.scheduler.kv_cache_manager.get_block_ids(request_id))
        return True

    decode.run_until(received, timeout_s=timeout_s)
    return loaded
