"""Two boots of ONE prefill engine id (issue 25 item 1) over real NIXL (UCX on lo).

Deployments pin the prefill engine id (`nixl-pd serve --engine-id`, vLLM's
kv_transfer_config.engine_id), so a restarted prefill comes back under the same engine id and
ports and, starting from the same state, hands out the same request ids at the same block ids.
Boot A leases r0..r3 and returns params; D1 serves a request from A (its handshake with A's
NIXL agent is cached); A is SIGKILLed; boot B starts with the same engine id and ports and
leases r0..r3 again, for other prompts; D2 starts after the restart (it never knew A). Both
decodes replay boot A's params; then D2, once it has read a request from B, replays them again
(so its free notifications would reach B). Then:

- every replayed load fails with a reason (its lease check or handshake names A's boot; B
  refuses it): no output with tokens, right or wrong, comes back;
- boot B's leases are not ended by what those loads notified (`request@lease` of A's leases):
  B holds exactly the blocks of r0..r3 after the replays and receives none of their
  notifications: decode's handshake names the boot its params name, and B refuses A's
  (before issue 21 the handshake learned B's boot, linked the replays to B's agent, and B
  counted each (lease key, sender) once as stray a lease duration later);
- loads with boot B's params then succeed on both decodes with a single engine's tokens; D1
  needs no second failure for that: its notification to A's dead agent retired its handshake
  with A (before that fix its first loads of B's params READ from A's dead agent and failed);
- once drained, no engine holds a block, and B counted exactly its readers' notifications.

At 47a6c53 (before lease-proven loads) D2's replays answered with wrong tokens (B's KV of
other prompts) and their notifications freed B's leases of r0..r3. Every process started here
is stopped; every wait is bounded; the test body is budgeted (BUDGET_S).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.engine import Engine, EngineConfig, EngineRequest, RequestOutput
from examples.model import VOCAB_SIZE
from examples.router import InProcessEngine, run_local
from tests.drill_servers import Served, collect, prefill_all

pytestmark = pytest.mark.real_nixl

BUDGET_S = 90.0  # the whole test, server start-ups included
ENGINE_ID = "prefill-pinned"  # both boots: the id a deployment pins
MAX_TOKENS = 4  # decode's tokens after prefill's first
PROMPT_LEN = 48  # 3 blocks of 16 tokens per request
NUM_REQUESTS = 4
LEASE_S = 10.0  # outlives the replay phase; also how long an unmatched notification waits
FLAGS = ("--lease", str(LEASE_S), "--heartbeat", "1", "--handshake-timeout", "1",
         "--handshake-retries", "1", "--metrics-port", "0")  # fmt: skip
METRICS_URL = re.compile(r"metrics (http://127\.0\.0\.1:\d+/metrics)")
QUIET_S = 1.5  # after the replays ended: time for their notifications to reach boot B
REQUEST_IDS = [f"r{i}" for i in range(NUM_REQUESTS)]  # prefill's request ids, on both boots


def _prompts(seed: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {rid: [int(t) for t in rng.integers(0, VOCAB_SIZE, PROMPT_LEN)] for rid in REQUEST_IDS}


WARM = {  # D1 reads "warm" from boot A; D2 reads "warm-b" from boot B
    name: [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB_SIZE, PROMPT_LEN)]
    for name, seed in (("warm", 3), ("warm-b", 4))
}
PROMPTS_A = _prompts(1)  # boot A's r0..r3
PROMPTS_B = _prompts(2)  # boot B's r0..r3: other prompts under the same request ids


class Server(Served):
    """A `nixl-pd serve` with a pinned engine id and ports (0: a free one) and /metrics."""

    def __init__(
        self,
        role: str,
        log_dir: Path,
        *,
        engine_id: str | None = None,
        port: int = 0,
        side_channel_port: int = 0,
    ) -> None:
        self.role = role
        self.log_path = log_dir / f"{role}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        argv = ["serve", "--role", role, "--port", str(port)]
        argv += ["--side-channel-port", str(side_channel_port), *FLAGS]
        argv += ["--engine-id", engine_id] if engine_id else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "connector.tools.cli", *argv],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1"),
        )
        self.engine_id = ""
        self.port = self.side_channel_port = 0
        self.client = None
        self.metrics_url = ""

    def ready(self, timeout_s: float = 60.0) -> Server:
        self.wait_ready(timeout_s)
        match = METRICS_URL.search(self.log_path.read_text(errors="replace"))
        assert match, self.log_tail()
        self.metrics_url = match.group(1)
        return self

    def counter(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples by ``label`` value, as Prometheus parses the scrape."""
        with urllib.request.urlopen(self.metrics_url, timeout=5.0) as response:
            text = response.read().decode()
        return {
            sample.labels[label]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and label in sample.labels
        }

    def notifications(self) -> dict[str, float]:
        return self.counter("nixl_pd_notifications_total", "kind")

    def held_blocks(self) -> int:
        return self.stats().leaked_blocks

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, exactly like a crash."""
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10.0)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    """Started servers are appended here; every one is stopped at teardown."""
    started: list[Server] = []
    try:
        yield started
    finally:
        for server in started:  # SIGTERM all at once: engines shut down in parallel
            if server.process.poll() is None:
                server.process.terminate()
        for server in started:
            with contextlib.suppress(subprocess.TimeoutExpired):  # then close() kills it
                server.process.wait(timeout=15.0)
            server.close()


def start(
    servers: list[Server], role: str, tmp_path: Path, engine_id: str | None = None, **ports: int
) -> Server:
    server = Server(role, tmp_path, engine_id=engine_id, **ports)
    servers.append(server)
    return server


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """Every prompt on one local engine: prefill's first token + decode's MAX_TOKENS."""
    engine = Engine(EngineConfig("reference"))
    prompts = {**WARM, **{f"A-{r}": p for r, p in PROMPTS_A.items()}}
    prompts.update({f"B-{r}": p for r, p in PROMPTS_B.items()})
    outputs = run_local(InProcessEngine(engine), prompts, MAX_TOKENS + 1, timeout_s=30.0)
    return {rid: output.token_ids for rid, output in outputs.items()}


def decode_request(request_id: str, prompt: list[int], prefilled: RequestOutput) -> EngineRequest:
    """What a router sends decode: the prompt + prefill's first token, prefill's params."""
    params = dict(prefilled.kv_transfer_params or {})
    return EngineRequest(request_id, prompt + prefilled.token_ids[:1], MAX_TOKENS, params)


def load(
    decode: Server, loads: dict[str, tuple[list[int], RequestOutput]]
) -> dict[str, RequestOutput]:
    """Submit each decode request id's (prompt, prefill output) and collect its output."""
    assert decode.client is not None
    for request_id, (prompt, prefilled) in loads.items():
        decode.client.submit(decode_request(request_id, prompt, prefilled))
    outputs = collect(decode.client, set(loads), timeout_s=20.0)
    assert set(outputs) == set(loads), f"no output for {set(loads) - set(outputs)}"
    return outputs


class Phases:
    """Wall time per phase, printed at the end (the run-time record of the test)."""

    def __init__(self) -> None:
        self.start_s = self.last_s = time.monotonic()
        self.times: dict[str, float] = {}

    def done(self, name: str) -> None:
        now_s = time.monotonic()
        self.times[name] = round(now_s - self.last_s, 2)
        self.last_s = now_s

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start_s


def tokens(prefilled: RequestOutput, decoded: RequestOutput) -> list[int]:
    return prefilled.token_ids[:1] + decoded.token_ids


def replay(
    decode: Server, tag: str, params_a: dict[str, RequestOutput]
) -> dict[str, RequestOutput]:
    """``decode`` loads r0..r3 with boot A's params, as a router with stale params would."""
    return load(decode, {f"{tag}-{rid}": (PROMPTS_A[rid], params_a[rid]) for rid in REQUEST_IDS})


def answered(
    outputs: dict[str, RequestOutput], params_a: dict[str, RequestOutput], expected: dict
) -> dict[str, str]:
    """Replayed loads that answered with tokens: right ones, or (the bug) wrong ones."""
    found = {}
    for request_id, out in outputs.items():
        if out.error is None:
            rid = request_id.rsplit("-", 1)[1]
            right = tokens(params_a[rid], out) == expected[f"A-{rid}"]
            found[request_id] = "right tokens" if right else f"WRONG tokens {out.token_ids}"
    return found


def held_during(server: Server, duration_s: float) -> set[int]:
    """Every value of ``server``'s held blocks seen over ``duration_s``."""
    seen = set()
    deadline_s = time.monotonic() + duration_s
    while time.monotonic() < deadline_s:
        seen.add(server.held_blocks())
        time.sleep(0.05)
    return seen


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.05)
    return True


STALE_REASON = (  # the lease check (D1: A's peer is cached) or the handshake (D2) names boot
    # A's id; B's side channel says it is another boot
    rf"KV load failed: lease expired: prefill engine '{ENGINE_ID}' request 'r\d' "
    r"\(lease \S+\): the prefill engine restarted since it leased \((rank 0 at \S+ failed "
    r"after 1 attempt\(s\): )?side channel 127\.0\.0\.1:\d+ refused the request: "
    rf"(LeaseCheck|HandshakeRequest) names side-channel boot '\w+' but engine '{ENGINE_ID}' "
    r"at this host:port is boot '\w+'"
)

DEAD_AGENT = (
    rf"KV load failed: READ from prefill engine {ENGINE_ID} rank 0 failed: .*the remote "
    "agent disconnected"
)


def test_a_prefill_restarted_under_its_engine_id_and_ports_serves_no_stale_kv(
    servers: list[Server], tmp_path: Path, expected: dict[str, list[int]]
) -> None:
    phases = Phases()
    boot_a = start(servers, "prefill", tmp_path, engine_id=ENGINE_ID)
    d1 = start(servers, "decode", tmp_path)
    boot_a.ready(), d1.ready()
    assert boot_a.client is not None and d1.client is not None
    phases.done("start A, D1")

    # Boot A leases r0..r3; a router holds their params. D1 serves a request from boot A: its
    # handshake with A (A's NIXL agent) is cached.
    params_a = prefill_all(boot_a.client, PROMPTS_A)
    warm = prefill_all(boot_a.client, {"warm": WARM["warm"]})["warm"]
    out = load(d1, {"warm-d1": (WARM["warm"], warm)})["warm-d1"]
    assert out.error is None and tokens(warm, out) == expected["warm"], out
    port, side_channel_port = boot_a.port, boot_a.side_channel_port
    boot_a.kill()
    phases.done("A leases r0..r3, D1 served from A, A killed")

    # Boot B: same engine id, same ports; D2 starts after the restart (it never knew A).
    boot_b = start(
        servers, "prefill", tmp_path,
        engine_id=ENGINE_ID, port=port, side_channel_port=side_channel_port,
    )  # fmt: skip
    d2 = start(servers, "decode", tmp_path)
    boot_b.ready(), d2.ready()
    assert boot_b.client is not None and d2.client is not None
    assert (boot_b.engine_id, boot_b.port, boot_b.side_channel_port) == (
        ENGINE_ID, port, side_channel_port,
    )  # fmt: skip
    phases.done("start B, D2")
    params_b = prefill_all(boot_b.client, PROMPTS_B)
    # The hazard is real: boot B leased the very request ids at the very blocks A had.
    for rid in REQUEST_IDS:
        old, new = params_a[rid].kv_transfer_params or {}, params_b[rid].kv_transfer_params or {}
        assert (new["remote_request_id"], new["remote_block_ids"]) == (
            old["remote_request_id"], old["remote_block_ids"],
        ), (old, new)  # fmt: skip
    leased = sum(
        len(group)
        for rid in REQUEST_IDS
        for group in (params_b[rid].kv_transfer_params or {})["remote_block_ids"]
    )
    assert boot_b.held_blocks() == leased > 0  # B holds r0..r3 under its leases, nothing else
    warm_b = prefill_all(boot_b.client, {"warm-b": WARM["warm-b"]})["warm-b"]
    phases.done("B leases r0..r3 and warm-b")

    # Round 1: D2 (fresh) and D1 (knew A) replay boot A's params.
    round_1 = replay(d2, "stale-d2", params_a)
    phases.done("D2 replays A's params")
    round_1 |= replay(d1, "stale-d1", params_a)
    phases.done("D1 replays A's params")
    # D2 reads warm-b from B: its handshake with B is done, and warm-b's lease ends by its
    # notification while r0..r3 stay held.
    out = load(d2, {"warm-b-d2": (WARM["warm-b"], warm_b)})["warm-b-d2"]
    assert out.error is None and tokens(warm_b, out) == expected["warm-b"], out
    warm_b_freed = wait_for(lambda: boot_b.held_blocks() <= leased, timeout_s=5.0)
    # Round 2: D2, now linked to B's agent for B's params, replays boot A's params again:
    # whatever its loads notified would reach B, naming r0..r3 (with boot A's lease ids).
    round_2 = replay(d2, "stale2-d2", params_a)
    replays_ended_s = time.monotonic()
    held_seen = held_during(boot_b, QUIET_S)
    notifications = boot_b.notifications()
    phases.done("warm-b on D2, D2 replays again, quiet")

    stale = {**round_1, **round_2}
    wrong = answered(stale, params_a, expected)
    assert not wrong and held_seen == {leased} and warm_b_freed, (
        f"replayed loads of boot A's params that answered: {wrong}; blocks boot B held under "
        f"its leases of r0..r3: {leased}, seen after the replays: {sorted(held_seen)}; "
        f"warm-b freed: {warm_b_freed}; B's notifications: {notifications}"
    )
    for request_id, out in stale.items():
        # D1's lease check (or, without the check before the READs, its READ from A's dead
        # agent) fails the load; D2 knew no agent of A's, only its lease check can.
        reason = STALE_REASON if "-d2-" in request_id else f"{STALE_REASON}|{DEAD_AGENT}"
        assert out.token_ids == [] and re.match(reason, out.error or ""), (request_id, out)
    assert notifications.get("counted") == 1, notifications  # warm-b's: no replay counted

    # Boot B's params load on both decodes (two requests each) with a single engine's tokens.
    fresh = {
        **load(d2, {f"fresh-d2-{rid}": (PROMPTS_B[rid], params_b[rid]) for rid in ("r0", "r1")}),
        **load(d1, {f"fresh-d1-{rid}": (PROMPTS_B[rid], params_b[rid]) for rid in ("r2", "r3")}),
    }
    for request_id, out in fresh.items():
        rid = request_id.rsplit("-", 1)[1]
        assert out.error is None, (request_id, out.error)
        assert tokens(params_b[rid], out) == expected[f"B-{rid}"], request_id
    phases.done("B's params loaded on D2 and D1")

    # Nothing held anywhere once drained; B counted exactly its readers' notifications.
    leaks = {name: server.drained_leaks(timeout_s=10.0)
             for name, server in (("B", boot_b), ("D1", d1), ("D2", d2))}  # fmt: skip
    assert leaks == {"B": 0, "D1": 0, "D2": 0}, leaks
    phases.done("drained")
    # The replays notified B of nothing: a decode handshakes with the boot its params name,
    # and B refused the handshakes naming A's boot, so no replay ever had B's agent to notify.
    # A notification that did reach B would wait one lease duration for a lease of its key,
    # then count as stray: none does in that time.
    any_stray = wait_for(
        lambda: boot_b.notifications().get("stray", 0) > 0,
        timeout_s=max(0.0, replays_ended_s + LEASE_S + 5.0 - time.monotonic()),
    )
    notifications = boot_b.notifications()
    phases.done("no replay's notification reached B")
    assert not any_stray and notifications["stray"] == 0, notifications
    assert notifications["duplicate"] == 0, notifications
    assert notifications["counted"] == 1 + NUM_REQUESTS, notifications
    assert all(server.process.poll() is None for server in (boot_b, d1, d2)), "a server died"
    print(f"\ntwo boots: {phases.elapsed_s:.1f} s {phases.times}; B's notifications "
          f"{notifications}; a replay's reason: {round_2['stale2-d2-r0'].error}")  # fmt: skip
    assert phases.elapsed_s < BUDGET_S
