"""Overlapped dispatch on real engines: examples/vllm/proxy.py --overlap against a single engine.

A real prefill and decode `vllm serve` pair (tests/real_vllm_harness.py) behind two proxies:
the deployment's sequential one and an overlapped one (``--overlap``: both engines get the
request at once; decode waits for prefill's side channel to announce the lease). Both must
be token-identical to the reference engine, greedily, on the same prompts; and a prefill
that never gets the request (a decode sent alone with an overlapped key) fails that one
request within the wait and leaves the engine serving.

The failure drills (docs/overlap.md's table) send each engine its copy directly, so the test
can make one side's client go away or stop an engine: prefill aborts before its lease, decode
aborts before and after prefill drew it, prefill stops answering while decode waits.

    .venv/bin/python -m pytest tests/test_real_vllm_overlap.py -m real_vllm
"""

from __future__ import annotations

import functools
import http.client
import json
import random
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from examples.vllm.proxy import Overlap, make_server
from tests.real_vllm_harness import (
    HOST,
    REQUEST_TIMEOUT_S,
    Completion,
    Deployment,
    Engine,
    RequestFailed,
    complete,
    complete_turn,
    completion_body,
    free_port,
    missing_vllm_venv,
    one_set_starting,
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


@pytest.fixture(scope="module", autouse=True)
def no_engine_set_starting_beside(served: Served) -> Iterator[None]:
    """The drills act inside windows (prefill still generating, decode taking the request
    within seconds) that an engine set starting in the tier's other stream closed on two
    cores (both failed so once): hold the start lock while they run, once ``served`` is up
    (its pair starts under that lock itself)."""
    with one_set_starting():
        yield


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
    """The shared pair has chunked_pull on and prefill computes 128 tokens a step: overlapped,
    the longer prompts are pulled chunk by chunk while prefill computes (verify_kv proves
    every chunk), and a one-chunk prompt in one READ."""
    lengths = [1, 100, 127, 128, 129, 300, 421, 600, 900]
    prompts = [prompt(seed, n) for seed, n in enumerate(lengths, start=10)]
    reference_url = served.deployment.reference.url
    decode = served.deployment.decode
    chunk_reads = decode.metric("nixl_pd_chunk_reads_total")
    assert_match(served.overlap_url, reference_url, prompts)
    # Four prompts span 2-8 chunks: decode, given the request with prefill, reads some
    # of their chunks before prefill's last one (900 tokens is 8 prefill steps).
    assert decode.metric("nixl_pd_chunk_reads_total") > chunk_reads, "no chunk was pulled early"
    chunk_reads = decode.metric("nixl_pd_chunk_reads_total")
    assert_match(served.deployment.proxy_url, reference_url, prompts)
    assert decode.metric("nixl_pd_chunk_reads_total") == chunk_reads  # sequential: one READ


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


# ----------------------------------------------------------------------------- failure drills
#
# docs/overlap.md's failure table on real engines: prefill aborts (its client goes away),
# decode aborts first (before prefill drew the lease, and with the lease drawn), prefill stops
# answering while decode waits. Each drill checks the reason's kind (decode's
# nixl_pd_loads_failed_total{reason} and its log), its time bound, that no block or lease is
# held past the table's bound, and that both engines still serve.

DECODE_LABEL = "drill"  # X-Request-Id prefix: finds a drill's lines in decode's log
HANDSHAKE_S = 10.0  # handshake_timeout (the fixture keeps the default): one side-channel call
ABORT_BOUND_S = 5.0  # an abort or cancel frees blocks and ends leases within a few steps
STEP_SLACK_S = 5.0  # engine steps and HTTP between a decision and its reply, on busy cores
PARK_TIMEOUT_S = WAIT_S / 2  # decode must be seen waiting well before its wait ends
IDLE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
LEASE_ENDS = ("completed", "expired", "released", "reader_restarted")
# Prefill's tokens after the prompt (180), as many as --max-model-len 1024 allows: it must still
# be generating when the drill acts (600 once finished first, about 3 s on a quiet machine).
LONG_GENERATION = 840


class Client:
    """One completion request on a connection of its own that the test closes when it likes:
    a client that goes away (vLLM aborts a request whose connection closes)."""

    def __init__(self, url: str, body: dict[str, Any], request_id: str) -> None:
        split = urllib.parse.urlsplit(url)
        self._conn = http.client.HTTPConnection(
            split.hostname or HOST, split.port, timeout=REQUEST_TIMEOUT_S
        )
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        self._conn.request("POST", "/v1/completions", json.dumps(body), headers)
        self._response: http.client.HTTPResponse | None = None

    def first_token(self) -> None:
        """Read a streamed answer up to its first token: the prompt is computed."""
        response = self._response = self._conn.getresponse()
        if response.status != 200:
            raise RequestFailed(response.status, response.read().decode(errors="replace"))
        for _ in range(10_000):
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data: ") and b'"token_ids"' in line:
                return
        raise RequestFailed(200, "the stream ended before its first token")

    def go_away(self) -> None:
        if self._response is not None:
            self._response.close()
        self._conn.close()


def streamed_prefill(served: Served, key: str, prompt_ids: Sequence[int]) -> Client:
    """Prefill's copy of an overlapped request under ``key``, generating long after its
    first token (so it is still running when the drill acts)."""
    params = {"do_remote_decode": True, "transfer_key": key}
    body = completion_body(prompt_ids, LONG_GENERATION, stream=True, kv_transfer_params=params)
    return Client(served.deployment.prefill.url, body, f"{DECODE_LABEL}-p-{key}")


def decode_params(served: Served, key: str) -> dict[str, Any]:
    side_channel_port = served.deployment.prefill.spec.side_channel_port
    assert side_channel_port is not None
    return Overlap(HOST, side_channel_port).decode_params(key)


def decode_attempt(
    served: Served, key: str, prompt_ids: Sequence[int]
) -> tuple[Completion | RequestFailed, float]:
    """Decode's copy of an overlapped request under ``key``: its outcome (an error reply is
    returned, not raised) and when it came."""
    try:
        outcome: Completion | RequestFailed = complete(
            served.deployment.decode.url,
            prompt_ids,
            MAX_TOKENS,
            kv_transfer_params=decode_params(served, key),
            request_id=decode_id(key),
        )
    except RequestFailed as exc:
        outcome = exc
    return outcome, time.monotonic()


def decode_id(key: str) -> str:
    return f"{DECODE_LABEL}-d-{key}"


def new_key(drill: str) -> str:
    return f"{drill}-{uuid.uuid4().hex[:12]}"


def failed_loads(engine: Engine, kind: str) -> float:
    """nixl_pd_loads_failed_total{reason=kind} on ``engine``'s /metrics."""
    pattern = rf'^nixl_pd_loads_failed_total\{{[^}}]*reason="{re.escape(kind)}"[^}}]*\}}\s+(\S+)$'
    return sum(float(value) for value in re.findall(pattern, engine.metrics(), re.MULTILINE))


def held_leases(engine: Engine) -> float:
    """Leases ``engine`` holds now: started minus every way a lease ends."""
    ended = sum(engine.metric(f"nixl_pd_leases_{how}_total") for how in LEASE_ENDS)
    return engine.metric("nixl_pd_leases_started_total") - ended


def poll(what: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``what()`` held (checked every 0.1 s), or None if it never did."""
    started = time.monotonic()
    while True:
        if what():
            return time.monotonic() - started
        if time.monotonic() - started >= timeout_s:
            return None
        time.sleep(0.1)


def holds_nothing(engine: Engine) -> bool:
    return not any(engine.metric(gauge) for gauge in IDLE_GAUGES) and held_leases(engine) == 0


def wait_parked(decode: Engine) -> None:
    """Until decode has the request waiting for remote KV, its blocks allocated."""
    parked = poll(
        lambda: (
            decode.metric("vllm:num_requests_waiting") >= 1
            and decode.metric("vllm:kv_cache_usage_perc") > 0
        ),
        PARK_TIMEOUT_S,
    )
    assert parked is not None, f"decode did not take the request in {PARK_TIMEOUT_S} s"


def logged(engine: Engine, request_id: str, text: str, timeout_s: float = 5.0) -> str | None:
    """The first line of ``engine``'s log naming ``request_id`` and ``text``, or None."""
    lines: list[str] = []

    def found() -> bool:
        log = engine.log_path.read_text(errors="replace").splitlines()
        lines[:] = [line for line in log if request_id in line and text in line]
        return bool(lines)

    return lines[0] if poll(found, timeout_s) is not None else None


def assert_both_serve_and_hold_nothing(served: Served, seed: int) -> None:
    """Neither engine holds a block, a request or a lease (within ABORT_BOUND_S: the drill
    already waited for its own bound), and overlapped and sequential dispatch still match."""
    for engine in (served.deployment.prefill, served.deployment.decode):
        idle = poll(functools.partial(holds_nothing, engine), ABORT_BOUND_S)
        assert idle is not None, (
            f"{engine.spec.name} still holds "
            f"{ {g: engine.metric(g) for g in IDLE_GAUGES} }, leases {held_leases(engine)}"
        )
    after = [prompt(seed, 230)]
    assert_match(served.overlap_url, served.deployment.reference.url, after)
    assert_match(served.deployment.proxy_url, served.deployment.reference.url, after)


def test_prefill_aborting_the_request_fails_decodes_load_with_prefill_failed(
    served: Served,
) -> None:
    """Prefill's client goes away after the prompt is computed, before prefill draws the lease
    (at the request's end): decode's waiting load fails at once with kind prefill_failed,
    through kv_load_failure_policy (this decode: fail, an error reply)."""
    prefill, decode = served.deployment.prefill, served.deployment.decode
    key, prompt_ids = new_key("prefill-aborts"), prompt(200, 180)
    before = failed_loads(decode, "prefill_failed")
    prefill_client = streamed_prefill(served, key, prompt_ids)
    with ThreadPoolExecutor(1) as pool:
        try:
            prefill_client.first_token()
            decoded = pool.submit(decode_attempt, served, key, prompt_ids)
            wait_parked(decode)
        finally:
            aborted_at = time.monotonic()
            prefill_client.go_away()
        outcome, ended_at = decoded.result()
    assert isinstance(outcome, RequestFailed), "decode answered without prefill's lease"
    waited_s = ended_at - aborted_at
    assert waited_s < WAIT_S, f"decode failed {waited_s:.1f} s after prefill's abort"
    assert poll(lambda: failed_loads(decode, "prefill_failed") == before + 1, 5.0) is not None
    line = logged(decode, decode_id(key), "drew no lease: prefill aborted the request")
    assert line is not None, f"decode logged no prefill_failed reason: {decode.notable_lines()}"
    assert held_leases(prefill) == 0
    assert_both_serve_and_hold_nothing(served, seed=201)


def test_decode_aborting_before_the_lease_makes_prefill_draw_none(served: Served) -> None:
    """Decode's client goes away while its load waits and prefill still computes: decode
    frees its blocks at once and cancels the key; prefill, when its request ends normally,
    draws no lease and frees its blocks at once (not one lease duration later)."""
    prefill, decode = served.deployment.prefill, served.deployment.decode
    key, prompt_ids = new_key("decode-aborts"), prompt(210, 180)
    started_before = prefill.metric("nixl_pd_leases_started_total")
    timeouts_before = failed_loads(decode, "prefill_timeout")
    prefill_params = {"do_remote_decode": True, "transfer_key": key}
    with ThreadPoolExecutor(1) as pool:
        prefilled = pool.submit(
            complete_turn, prefill.url, prompt_ids, LONG_GENERATION, prefill_params
        )
        body = completion_body(
            prompt_ids, MAX_TOKENS, kv_transfer_params=decode_params(served, key)
        )
        decode_client = Client(decode.url, body, decode_id(key))
        try:
            wait_parked(decode)
        finally:
            decode_client.go_away()
        freed_s = poll(lambda: holds_nothing(decode), ABORT_BOUND_S)
        assert freed_s is not None, "decode kept the aborted request's blocks"
        assert not prefilled.done(), (
            f"prefill finished its {LONG_GENERATION} tokens before decode's abort was seen"
        )
        _, returned = prefilled.result()
    assert returned is None, f"prefill drew a lease for a cancelled key: {returned}"
    ended_s = poll(lambda: holds_nothing(prefill), ABORT_BOUND_S)
    assert ended_s is not None, f"prefill still holds blocks or a lease {ABORT_BOUND_S} s on"
    assert prefill.metric("nixl_pd_leases_started_total") == started_before, "a lease was drawn"
    # The wait ended by the abort, not by its timeout.
    assert failed_loads(decode, "prefill_timeout") == timeouts_before
    assert_both_serve_and_hold_nothing(served, seed=211)


def test_decode_aborting_with_the_lease_drawn_ends_prefills_lease_at_once(
    served: Served,
) -> None:
    """Decode is stopped (SIGSTOP) while its load waits; prefill draws the lease and
    announces it; decode's client goes away; decode resumes. Whether decode's abort or the
    announcement reaches its engine first (a cancel, or a read and its notification), prefill's
    lease ends and its blocks are freed within ABORT_BOUND_S, not at the lease's expiry."""
    prefill, decode = served.deployment.prefill, served.deployment.decode
    key, prompt_ids = new_key("lease-drawn"), prompt(220, 180)
    expired_before = prefill.metric("nixl_pd_leases_expired_total")
    body = completion_body(prompt_ids, MAX_TOKENS, kv_transfer_params=decode_params(served, key))
    decode_client = Client(decode.url, body, decode_id(key))
    try:
        wait_parked(decode)
        decode.pause()
        try:
            prefill_params = {"do_remote_decode": True, "transfer_key": key}
            _, returned = complete_turn(prefill.url, prompt_ids, 1, prefill_params)
        finally:
            decode_client.go_away()
            resumed_at = time.monotonic()
            decode.resume()
    finally:
        decode_client.go_away()
    assert returned is not None, "prefill drew no lease: the drill needs one held"
    ended_s = poll(lambda: holds_nothing(prefill), ABORT_BOUND_S)
    waited_s = time.monotonic() - resumed_at
    assert ended_s is not None, (
        f"prefill still holds {held_leases(prefill)} lease(s) {waited_s:.1f} s after decode's abort"
    )
    assert prefill.metric("nixl_pd_leases_expired_total") == expired_before
    assert_both_serve_and_hold_nothing(served, seed=221)


def test_prefill_stopped_while_decode_waits_fails_the_load_with_prefill_timeout(
    served: Served,
) -> None:
    """Prefill stops answering (SIGSTOP: to decode a dead or unreachable host; a kill would
    need a restart, which this tier's shared engines cannot afford) while it computes and
    decode waits: decode's load fails with kind prefill_timeout after overlap_wait_timeout,
    within one more handshake_timeout, and decode serves on. Resumed, prefill finds its
    client gone and holds nothing."""
    prefill, decode = served.deployment.prefill, served.deployment.decode
    # Shorter than one block: prefill announces whole blocks only, so decode has no chunk
    # READ out when prefill stops. One that is out cannot end while prefill is stopped, and
    # its blocks stay quarantined until it does (docs/overlap.md): the load would fail only
    # once prefill resumed (seen here when a 180-token prompt's first block was announced).
    num_tokens = min(180, prefill.block_size() - 1)
    key, prompt_ids = new_key("prefill-stops"), prompt(230, num_tokens)
    before = failed_loads(decode, "prefill_timeout")
    chunk_reads = decode.metric("nixl_pd_chunk_reads_total")
    prefill_client = streamed_prefill(served, key, prompt_ids)
    with ThreadPoolExecutor(1) as pool:
        try:
            prefill_client.first_token()
            sent_at = time.monotonic()
            decoded = pool.submit(decode_attempt, served, key, prompt_ids)
            wait_parked(decode)
            prefill.pause()
            try:
                outcome, ended_at = decoded.result(timeout=WAIT_S + HANDSHAKE_S + 60)
            finally:
                prefill_client.go_away()
                prefill.resume()
        finally:
            prefill_client.go_away()
    assert isinstance(outcome, RequestFailed), "decode answered without prefill's lease"
    waited_s = ended_at - sent_at
    bound_s = WAIT_S + HANDSHAKE_S + STEP_SLACK_S
    assert WAIT_S <= waited_s <= bound_s, f"decode failed after {waited_s:.1f} s"
    assert poll(lambda: failed_loads(decode, "prefill_timeout") == before + 1, 5.0) is not None
    assert decode.metric("nixl_pd_chunk_reads_total") == chunk_reads  # nothing was read
    line = logged(decode, decode_id(key), "announced no lease")
    assert line is not None, f"decode logged no prefill_timeout reason: {decode.notable_lines()}"
    assert_both_serve_and_hold_nothing(served, seed=231)
