"""Real vLLM prefill and decode on two "hosts": network namespaces joined by a veth, UCX on tcp.

The prefill engine runs in one namespace and the decode engine in the other (tests/netns.py),
each serving HTTP on its veth address, with ``VLLM_NIXL_SIDE_CHANNEL_HOST`` on that address and
UCX restricted to TCP on the veth (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=<veth>``): the handshake
and every READ must cross the link. The P/D proxy runs on the decode host (its threads entered
that namespace); the reference engine, without a connector, runs on the machine's loopback.
Greedy tokens must equal the reference's, decode must have loaded the prompts' KV, and decode's
UCX log must name the transport: tcp on the veth, UCX seeing the peer as another node.

Skipped without .venv-vllm or where namespaces cannot be made, unless NIXL_PD_REQUIRE_REAL_VLLM=1
or NIXL_PD_REQUIRE_NETNS=1 (CI sets both) make that an error.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from connector.tools.doctor_ucx import all_read_lanes, parse_proto_tables, read_scopes
from examples.vllm.proxy import make_server
from tests.netns import (
    Host,
    HostPair,
    host_pair,
    our_namespaces,
    require_or_skip_reason,
    threads_in,
)
from tests.real_vllm_harness import (
    VLLM_PYTHON,
    Completion,
    Engine,
    EngineSpec,
    RequestFailed,
    complete,
    connector_under_test,
    kv_transfer_config,
    one_set_starting,
)
from tests.real_vllm_workspace import Workspace

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(900)]

if not VLLM_PYTHON.exists():
    if os.environ.get("NIXL_PD_REQUIRE_REAL_VLLM") == "1":
        raise RuntimeError(f"{VLLM_PYTHON} is missing and NIXL_PD_REQUIRE_REAL_VLLM=1")
    pytest.skip("no .venv-vllm: run scripts/setup_vllm_cpu.sh", allow_module_level=True)
_SKIP_REASON = require_or_skip_reason()
if _SKIP_REASON is not None:
    pytest.skip(f"network namespaces cannot be made: {_SKIP_REASON}", allow_module_level=True)

MAX_TOKENS = 8
LOGPROB_TOL = 1e-3  # as in tests/test_real_vllm.py: wrong KV moves logprobs by 0.01-1
# Each namespace is private, so fixed ports cannot clash with anything else on the machine.
HTTP_PORT = 8000
SIDE_CHANNEL_PORT = 5600
PROXY_PORT = 8080
PROMPT_LENGTHS = (1, 127, 200, 300)  # around vLLM CPU's 128-token blocks, kept small


@dataclass
class TwoHosts:
    hosts: HostPair
    reference: Engine
    prefill: Engine
    decode: Engine
    proxy_url: str
    on_decode_host: ThreadPoolExecutor  # its threads are in the decode namespace


def engine_on(host: Host, name: str, model_dir: Path, kv_role: str, logs: Path) -> Engine:
    # UCX's protocol tables into the engine's log, through stderr: a log file of UCX's own is
    # block-buffered, and vLLM's engine-core process ends without flushing it.
    env = {**host.env(), "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": "stderr"}
    spec = EngineSpec(
        name,
        model_dir,
        HTTP_PORT,
        kv_transfer_config(connector_under_test(), kv_role),
        SIDE_CHANNEL_PORT,
        namespace=host.namespace,
        host=host.address,
        extra_env=tuple(env.items()),
    )
    return Engine(spec, logs)


@pytest.fixture(scope="module")
def two_hosts(real_vllm: Workspace, request: pytest.FixtureRequest) -> Iterator[TwoHosts]:
    reference = real_vllm.reference()  # the session's shared single engine, on loopback
    model_dir = real_vllm.model()
    with (
        real_vllm.module_logs(request, "two-host engine and UCX") as logs,
        ExitStack() as stack,
    ):
        hosts = stack.enter_context(host_pair())
        on_prefill = stack.enter_context(threads_in(hosts.prefill, max_workers=1))
        on_decode = stack.enter_context(threads_in(hosts.decode))
        prefill = engine_on(hosts.prefill, "prefill", model_dir, "kv_producer", logs)
        decode = engine_on(hosts.decode, "decode", model_dir, "kv_consumer", logs)
        for engine in (prefill, decode):
            stack.callback(engine.cleanup)  # before the namespaces go (LIFO)
        with one_set_starting():
            for engine in (prefill, decode):
                engine.start()
            # /health of an engine on another host is reached from a thread on that host.
            waits = [on_prefill.submit(prefill.wait_ready), on_decode.submit(decode.wait_ready)]
            reference.wait_ready()
            for wait in waits:
                wait.result()
        proxy_url = on_decode.submit(start_proxy, stack, hosts.decode, prefill, decode).result()
        yield TwoHosts(hosts, reference, prefill, decode, proxy_url, on_decode)
    assert our_namespaces() == [], "a namespace outlived the test"


def start_proxy(stack: ExitStack, host: Host, prefill: Engine, decode: Engine) -> str:
    """The P/D proxy on the decode host: called on a thread in its namespace, so the server
    socket and the serving threads (which inherit the namespace) live there."""
    server = make_server(host.address, PROXY_PORT, prefill.url, decode.url)
    thread = threading.Thread(target=server.serve_forever, name="pd-proxy", daemon=True)
    thread.start()
    stack.callback(server.server_close)
    stack.callback(server.shutdown)
    return f"http://{host.address}:{PROXY_PORT}"


def prompt(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(num_tokens)]


def differs(actual: Completion, expected: Completion) -> str | None:
    if actual.token_ids != expected.token_ids:
        return f"P->D {list(actual.token_ids)}, single engine {list(expected.token_ids)}"
    worst = max(abs(a - e) for a, e in zip(actual.logprobs, expected.logprobs, strict=True))
    return f"logprobs differ by {worst:.2e}" if worst > LOGPROB_TOL else None


def test_prefill_and_decode_on_two_hosts_match_a_single_engine_over_tcp(
    two_hosts: TwoHosts,
) -> None:
    prompts = [prompt(seed=length, num_tokens=length) for length in PROMPT_LENGTHS]
    on_decode = two_hosts.on_decode_host
    loaded_before = on_decode.submit(two_hosts.decode.prompt_tokens_by_source).result()

    try:
        routed = list(
            on_decode.map(lambda p: complete(two_hosts.proxy_url, p, MAX_TOKENS), prompts)
        )
    except RequestFailed as exc:
        pytest.fail(
            f"{exc}\ndecode's log:\n{two_hosts.decode.notable_lines()}"
            f"\nprefill's log:\n{two_hosts.prefill.notable_lines()}"
        )
    expected = [complete(two_hosts.reference.url, p, MAX_TOKENS) for p in prompts]

    problems = [
        f"prompt of {len(p)} tokens: {why}"
        for p, a, e in zip(prompts, routed, expected, strict=True)
        if (why := differs(a, e)) is not None
    ]
    assert not problems, "\n".join(problems)
    loaded = on_decode.submit(two_hosts.decode.prompt_tokens_by_source).result()
    external = loaded["external_kv_transfer"] - loaded_before.get("external_kv_transfer", 0.0)
    # Decode computes at most each prompt's last token itself: the rest crossed the veth.
    assert external >= sum(PROMPT_LENGTHS) - len(PROMPT_LENGTHS)
    tables = parse_proto_tables(two_hosts.decode.log_path.read_text(errors="replace"))
    assert all_read_lanes(tables) == (f"tcp/{two_hosts.hosts.decode.device}",)
    assert read_scopes(tables) == ("inter-node",)
