"""Overlapped dispatch on real engines: examples/vllm/proxy.py --overlap against a single engine.

A real prefill and decode `vllm serve` pair (tests/real_vllm_harness.py) behind two proxies:
the deployment's sequential one and an overlapped one (``--overlap``: both engines get the
request at once; decode waits for prefill's side channel to announce the lease). Both must
be token-identical to the reference engine, greedily, on the same prompts; and a prefill
that never gets the request (a decode sent alone with an overlapped key) fails that one
request within the wait and leaves the engine serving.

    .venv/bin/python -m pytest tests/test_real_vllm_overlap.py -m real_vllm
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from examples.vllm.proxy import Overlap, make_server
from tests.real_vllm_harness import (
    HOST,
    Completion,
    Deployment,
    RequestFailed,
    complete,
    free_port,
    missing_vllm_venv,
)
from tests.real_vllm_workspace import OVERLAP_WAIT_S, Workspace

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

if (missing := missing_vllm_venv()) is not None:
    pytest.skip(missing, allow_module_level=True)

MAX_TOKENS = 12
LOGPROB_TOL = 1e-3  # as tests/test_real_vllm.py: wrong KV moves logprobs by 0.01-1
VOCAB_IDS = range(4, 512)
WAIT_S = OVERLAP_WAIT_S  # the shared pair's overlap_wait_timeout: decode's wait for prefill


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(VOCAB_IDS) for _ in range(num_tokens)]


class Served:
    """The deployment and its overlapped proxy's URL."""

    def __init__(self, deployment: Deployment, overlap_url: str) -> None:
        self.deployment, self.overlap_url = deployment, overlap_url


@pytest.fixture(scope="module")
def served(real_vllm: Workspace) -> Iterator[Served]:
    # The session's shared pair: overlapped dispatch is the proxy's, the engines are plain.
    deployment = real_vllm.pair("nixlpd")
    side_channel_port = deployment.prefill.spec.side_channel_port
    assert side_channel_port is not None
    overlap = Overlap(HOST, side_channel_port)
    proxy = make_server(HOST, free_port(), deployment.prefill.url, deployment.decode.url, overlap)
    thread = threading.Thread(target=proxy.serve_forever, name="overlap-proxy", daemon=True)
    thread.start()
    try:
        url = f"http://{HOST}:{proxy.server_address[1]}"
        complete(url, prompt(0, 200), 2)  # warm both engines' first-request costs
        yield Served(deployment, url)
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(timeout=10)


def mismatch(actual: Completion, expected: Completion) -> str | None:
    if actual.token_ids != expected.token_ids:
        return f"tokens {actual.token_ids} != reference {expected.token_ids}"
    worst = max(
        (abs(a - e) for a, e in zip(actual.logprobs, expected.logprobs, strict=True)), default=0.0
    )
    return None if worst <= LOGPROB_TOL else f"logprob differs by {worst}"


def assert_match(url: str, reference_url: str, prompts: Sequence[Sequence[int]]) -> None:
    with ThreadPoolExecutor(4) as pool:
        actual = list(pool.map(lambda p: complete(url, p, MAX_TOKENS), prompts))
    expected = [complete(reference_url, p, MAX_TOKENS) for p in prompts]
    problems = [
        f"prompt {index} ({len(prompts[index])} tokens): {why}"
        for index, (a, e) in enumerate(zip(actual, expected, strict=True))
        if (why := mismatch(a, e)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_overlapped_and_sequential_dispatch_match_a_single_engine(served: Served) -> None:
    lengths = [1, 100, 127, 128, 129, 300, 421, 600]
    prompts = [prompt(seed, n) for seed, n in enumerate(lengths, start=10)]
    reference_url = served.deployment.reference.url
    assert_match(served.overlap_url, reference_url, prompts)
    assert_match(served.deployment.proxy_url, reference_url, prompts)


def test_a_decode_whose_prefill_never_gets_the_request_fails_within_the_wait(
    served: Served,
) -> None:
    side_channel_port = served.deployment.prefill.spec.side_channel_port
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_key": "never-sent-to-prefill",
        "remote_host": HOST,
        "remote_port": side_channel_port,
    }
    with pytest.raises(RequestFailed):
        complete(
            served.deployment.decode.url, prompt(99, 150), MAX_TOKENS, kv_transfer_params=params
        )
    # The engine keeps serving, overlapped and sequential alike.
    after = [prompt(100, 250)]
    assert_match(served.overlap_url, served.deployment.reference.url, after)
