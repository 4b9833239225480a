"""Honest about failure over real NIXL: engines as separate processes, one of them SIGKILLed.

Each scenario checks what docs/integrity.md ("Failure semantics") promises: the affected
request is reported once, with a reason naming what happened, in bounded time (well under the
lease); the surviving engines keep serving (a fresh request matches a single engine's tokens); and
no surviving engine keeps a block once drained. The harness is the demo's (``ServerProcess``,
``ToyRouter``); every process started here is stopped, every wait is bounded.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

import msgspec
import numpy as np
import pytest

from connector.config import ConnectorConfig
from connector.errors import UnsupportedConfiguration
from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from examples.model import VOCAB_SIZE
from examples.router import Completion, InProcessEngine, ToyRouter, run_local
from examples.server import ServerProcess

pytestmark = pytest.mark.real_nixl

# Short handshake timeout and few retries: a dead prefill is noticed in ~1 s, not ~30 s.
CONNECTOR = ConnectorConfig(
    side_channel_host="127.0.0.1",
    side_channel_port=0,
    handshake_timeout_s=0.5,
    handshake_retries=1,
    kv_lease_duration_s=30.0,
    heartbeat_interval_s=5.0,
)
SHORT_LEASE = msgspec.structs.replace(CONNECTOR, kv_lease_duration_s=2.0, heartbeat_interval_s=0.5)
PROMPT_LEN = 40
MAX_TOKENS = 3  # decode's tokens after prefill's first
START_TIMEOUT_S = 60.0
OUTPUT_TIMEOUT_S = 20.0  # per awaited output; a hang shows up as a TimeoutError naming it
# One handshake attempt of 0.5 s (a silent side channel is not retried while loads wait),
# with slack for a loaded 2-core machine; it was two attempts plus backoff before issue 21.
HANDSHAKE_FAILURE_BOUND_S = 3.0
READ_FAILURE_BOUND_S = 5.0  # a READ from a dead peer fails on UCX's disconnect, not the lease


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    names = ("warm", "lost", "lost-too", "stale", "fresh", "held-0", "held-1")
    return {name: [int(t) for t in rng.integers(0, VOCAB_SIZE, PROMPT_LEN)] for name in names}


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def expected_tokens() -> dict[str, list[int]]:
    """Every prompt on a single local engine: prefill's first token + decode's tokens."""
    engine = Engine(EngineConfig("reference"))
    outputs = run_local(InProcessEngine(engine), PROMPTS, MAX_TOKENS + 1, timeout_s=30.0)
    return {request_id: output.token_ids for request_id, output in outputs.items()}


class Server:
    """A ServerProcess that records every output it delivered (for exactly-once checks)."""

    def __init__(self, process: ServerProcess) -> None:
        self.process = process
        self.outputs: list[RequestOutput] = []

    @property
    def side_channel_port(self) -> int:
        if self.process.ready is None:
            raise RuntimeError(f"{self.process.config.engine_id}: call wait_ready first")
        return self.process.ready.side_channel_port

    def submit(self, request: EngineRequest) -> None:
        self.process.submit(request)

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        outputs = self.process.poll(timeout_s)
        self.outputs += outputs
        return outputs

    def problem(self, num_pending: int) -> str | None:
        return self.process.problem(num_pending)

    def wait_for(self, request_id: str, timeout_s: float = OUTPUT_TIMEOUT_S) -> RequestOutput:
        """The first output for ``request_id``, polled or already recorded."""
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            for output in self.outputs:
                if output.request_id == request_id:
                    return output
            self.poll(0.05)
        raise TimeoutError(f"no output for {request_id} within {timeout_s} s")

    def num_outputs(self, request_id: str) -> int:
        self.poll(0.0)
        return sum(output.request_id == request_id for output in self.outputs)

    def leaked_blocks_once_drained(self, timeout_s: float) -> int:
        """Blocks still referenced once the engine has no work left (or after ``timeout_s``)."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            stats = self.process.stats(timeout_s=10.0)
            if not stats.busy or time.monotonic() > deadline_s:
                self.poll(0.0)  # keep outputs that arrived while waiting for stats
                return stats.leaked_blocks
            time.sleep(0.02)  # the engine works through its leases and releases meanwhile

    def log(self) -> str:
        return Path(self.process.log_path).read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, exactly like a crash."""
        self.process.process.kill()
        self.process.process.wait(timeout=10.0)


Start = Callable[..., Server]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """start(role, engine_id, connector=CONNECTOR) -> a Server; all are stopped at teardown."""
    env = dict(os.environ, UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
    with ExitStack() as stack:

        def start_server(
            role: str, engine_id: str, connector: ConnectorConfig = CONNECTOR, tp_size: int = 1
        ) -> Server:
            config = EngineConfig(engine_id, role=role, tp_size=tp_size, num_blocks=64)
            process = ServerProcess(
                config, env=env, log_path=str(tmp_path / engine_id), connector=connector
            )
            stack.push(process)
            return Server(process)

        yield start_server


def wait_ready(*servers: Server) -> None:
    """Wait for servers started together (before any poll: poll would drop Ready)."""
    for server in servers:
        server.process.wait_ready(timeout_s=START_TIMEOUT_S)


def prefill_only(prefill: Server, name: str) -> RequestOutput:
    """Run one prompt on prefill (max_tokens=1, do_remote_decode); its params come back."""
    prefill.submit(EngineRequest(f"{name}-prefill", PROMPTS[name], 1, {"do_remote_decode": True}))
    output = prefill.wait_for(f"{name}-prefill")
    assert output.error is None and output.kv_transfer_params is not None
    return output


def decode_request(name: str, prefilled: RequestOutput) -> EngineRequest:
    """What the router sends decode: prompt + prefill's first token, prefill's params."""
    params = dict(prefilled.kv_transfer_params or {})
    return EngineRequest(
        f"{name}-decode", PROMPTS[name] + prefilled.token_ids[:1], MAX_TOKENS, params
    )


def serve(
    prefill: Server, decode: Server, names: tuple[str, ...], expected: Mapping[str, list[int]]
) -> dict[str, Completion]:
    """Route ``names`` through prefill and decode; each must match the single engine."""
    prompts = {name: PROMPTS[name] for name in names}
    completions = ToyRouter(prefill, decode).run(prompts, MAX_TOKENS, timeout_s=OUTPUT_TIMEOUT_S)
    for name, completion in completions.items():
        assert completion.errors == [], name
        assert completion.token_ids == expected[name], name
    return completions


def test_prefill_killed_before_the_handshake_fails_the_load_fast_and_decode_keeps_serving(
    start: Start, expected_tokens: dict[str, list[int]]
) -> None:
    dead = start("prefill", "prefill-dead")
    decode = start("decode", "decode")
    healthy = start("prefill", "prefill-healthy")
    wait_ready(dead, decode, healthy)
    dead_port = dead.side_channel_port
    prefilled = prefill_only(dead, "lost")
    dead.kill()

    submitted_s = time.monotonic()
    decode.submit(decode_request("lost", prefilled))
    failed = decode.wait_for("lost-decode")
    elapsed_s = time.monotonic() - submitted_s

    assert failed.token_ids == []
    assert failed.error is not None
    assert failed.error.startswith(
        f"KV load failed: handshake with prefill engine prefill-dead failed: rank 0 at "
        f"127.0.0.1:{dead_port} failed after 1 attempt(s): side channel 127.0.0.1:{dead_port} "
        "did not answer within 0.5 s"
    ), failed.error
    assert elapsed_s < HANDSHAKE_FAILURE_BOUND_S
    serve(healthy, decode, ("fresh",), expected_tokens)
    assert decode.leaked_blocks_once_drained(timeout_s=5.0) == 0
    assert healthy.leaked_blocks_once_drained(timeout_s=5.0) == 0
    assert decode.num_outputs("lost-decode") == 1


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (2, 2)], ids=["tp1-to-1", "tp2-to-1", "tp2-to-2"]
)
def test_prefill_killed_between_requests_fails_the_read_and_a_restarted_prefill_serves(
    start: Start, expected_tokens: dict[str, list[int]], prefill_tp: int, decode_tp: int
) -> None:
    prefill = start("prefill", "prefill-first", tp_size=prefill_tp)
    decode = start("decode", "decode", tp_size=decode_tp)
    wait_ready(prefill, decode)
    serve(prefill, decode, ("warm",), expected_tokens)  # the handshake is done
    prefilled = {name: prefill_only(prefill, name) for name in ("lost", "lost-too", "stale")}
    port = prefill.side_channel_port
    prefill.kill()

    submitted_s = time.monotonic()
    for name in ("lost", "lost-too"):
        decode.submit(decode_request(name, prefilled[name]))
    failed = {name: decode.wait_for(f"{name}-decode") for name in ("lost", "lost-too")}
    elapsed_s = time.monotonic() - submitted_s

    # Prefill's side channel answered the warm request's lease checks moments ago, so these
    # loads post their READs at once (lease_precheck_skip, worker/lease_proof.py): the dead
    # engine's agent is gone and real NIXL fails the READ (remote disconnected), which retires
    # the peer; a load that comes after that finds no one to handshake with. With decode
    # TP > 1, the lowest failing rank's reason names it.
    read_failed = (
        r"READ from prefill engine prefill-first rank \d failed: .*the remote agent disconnected"
    )
    handshake_failed = rf"handshake with prefill engine prefill-first failed: .*{port}"
    for name in ("lost", "lost-too"):
        assert re.match(
            rf"KV load failed: (tp_rank 0: )?({read_failed}|{handshake_failed})",
            failed[name].error or "",
        ), failed[name].error
    assert re.match(rf"KV load failed: (tp_rank 0: )?{read_failed}", failed["lost"].error or "")
    assert [output.token_ids for output in failed.values()] == [[], []]
    assert elapsed_s < READ_FAILURE_BOUND_S
    restarted = start(
        "prefill",
        "prefill-restarted",
        msgspec.structs.replace(CONNECTOR, side_channel_port=port),
        tp_size=prefill_tp,
    )
    wait_ready(restarted)
    assert restarted.side_channel_port == port  # same address, new engine id and agent names
    decode.submit(decode_request("stale", prefilled["stale"]))  # a router's stale params
    stale = decode.wait_for("stale-decode")
    # The old engine's address is in decode's negative cache until a background probe (one per
    # second) reaches the restarted engine: inside that window the stale request fails with
    # the cached reason, after it with the restart named. Either way it fails, and fast.
    restarted_reason = (
        r"remote rank \d belongs to engine 'prefill-restarted', but the request's KV is on "
        r"engine 'prefill-first': the prefill engine restarted and its KV is gone"
    )
    cached_reason = r"rank \d at 127\.0\.0\.1:\d+ failed after .* requests for it fail at once\)"
    # No READ failed above, so decode may still hold the old engine's peer as ready: then the
    # check before the READs, naming the params' boot, learns that the engine restarted.
    lease_gone = (
        r"KV load failed: (tp_rank 0: )?lease expired: prefill engine 'prefill-first' request "
        r"'stale-prefill' \(lease \w+\): the prefill engine restarted since it leased"
    )
    assert re.match(
        r"KV load failed: (tp_rank 0: )?handshake with prefill engine prefill-first failed: "
        f"({restarted_reason}|{cached_reason})|{lease_gone}",
        stale.error or "",
    ), stale.error
    serve(restarted, decode, ("fresh",), expected_tokens)
    assert decode.leaked_blocks_once_drained(timeout_s=5.0) == 0
    assert restarted.leaked_blocks_once_drained(timeout_s=5.0) == 0
    for name in ("lost", "lost-too", "stale"):
        assert decode.num_outputs(f"{name}-decode") == 1, name


def test_decode_killed_while_prefill_holds_leases_frees_them_at_expiry(
    start: Start, expected_tokens: dict[str, list[int]]
) -> None:
    prefill = start("prefill", "prefill", SHORT_LEASE)
    doomed = start("decode", "decode-doomed", SHORT_LEASE)
    survivor = start("decode", "decode-survivor", SHORT_LEASE)
    wait_ready(prefill, doomed, survivor)
    serve(prefill, doomed, ("warm",), expected_tokens)  # doomed has handshaken with prefill
    leased_s = time.monotonic()
    for name in ("held-0", "held-1"):
        prefill_only(prefill, name)  # the router would now hand these to doomed
    doomed.kill()
    assert prefill.process.stats(timeout_s=10.0).leaked_blocks > 0  # held under the lease

    leaked = prefill.leaked_blocks_once_drained(timeout_s=SHORT_LEASE.kv_lease_duration_s + 5.0)
    freed_after_s = time.monotonic() - leased_s

    assert leaked == 0
    assert SHORT_LEASE.kv_lease_duration_s - 0.5 < freed_after_s  # by expiry, not by accident
    assert freed_after_s < SHORT_LEASE.kv_lease_duration_s + 5.0
    log = prefill.log()
    for name in ("held-0", "held-1"):
        expiry = f"request {name}-prefill: lease of 2.0 s expired before every decode reader"
        assert log.count(expiry) == 1, log[-2000:]
    serve(prefill, survivor, ("fresh",), expected_tokens)
    assert prefill.leaked_blocks_once_drained(timeout_s=5.0) == 0
    assert survivor.leaked_blocks_once_drained(timeout_s=5.0) == 0


def test_decode_restarted_under_its_engine_id_and_address_serves_and_old_leases_expire(
    start: Start, expected_tokens: dict[str, list[int]]
) -> None:
    """Issue 21 item 4, prefill's side: a decode engine killed with loads pending comes back
    under the same engine id and side-channel address. The old boot never asked about these
    leases (it died first), so no reader claimed them and the new boot's messages end nothing
    (scheduler/readers.py): they are held until they expire, as for a decode that stays dead;
    the new boot's loads, meanwhile, are served from the same prefill without a stale
    handshake or a mixed-up notification."""
    port = _free_port()
    # A lease that outlives the decode's restart (about 3 s on an idle machine, 10 s in a CI
    # run beside the real-vLLM tier, 23 s once beside other engineers' engines), so the new
    # boot is served while the old boot's leases are still held.
    lease = msgspec.structs.replace(SHORT_LEASE, kv_lease_duration_s=30.0, heartbeat_interval_s=1.0)
    config = msgspec.structs.replace(lease, side_channel_port=port)
    prefill = start("prefill", "prefill", lease)
    first = start("decode", "decode-pinned", config)
    wait_ready(prefill, first)
    serve(prefill, first, ("warm",), expected_tokens)
    leased_s = time.monotonic()
    for name in ("held-0", "held-1"):
        prefill_only(prefill, name)  # the router would now hand these to the first boot
    first.kill()
    second = start("decode", "decode-pinned", config)  # same engine id, same side channel
    wait_ready(second)
    assert second.side_channel_port == port
    serve(prefill, second, ("fresh",), expected_tokens)  # before the old leases expire
    assert time.monotonic() - leased_s < lease.kv_lease_duration_s

    leaked = prefill.leaked_blocks_once_drained(timeout_s=lease.kv_lease_duration_s + 5.0)
    assert leaked == 0 and second.leaked_blocks_once_drained(timeout_s=5.0) == 0
    log = prefill.log()
    duration_s = lease.kv_lease_duration_s
    for name in ("held-0", "held-1"):
        expiry = (
            f"request {name}-prefill: lease of {duration_s} s expired before every decode reader"
        )
        assert log.count(expiry) == 1, log[-2000:]
    assert log.count("expired before every decode reader") == 2, "the new boot's lease expired"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_connector_config_with_a_secret_never_reaches_a_command_line(tmp_path: Path) -> None:
    secret = msgspec.structs.replace(CONNECTOR, side_channel_secret="s" * 16)

    with pytest.raises(UnsupportedConfiguration, match="a side_channel_secret would be visible"):
        ServerProcess(
            EngineConfig("prefill-secret", role="prefill"),
            env=dict(os.environ),
            log_path=str(tmp_path / "log"),
            connector=secret,
        )
