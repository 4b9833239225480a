"""Peers under concurrent and failing handshakes (issues 11 and 25): one record per address.

Each case reproduces a finding against ``nixl-pd serve`` pairs: handshakes to the same engine
at different ports overwrote each other (a load hung forever); a wrong ``remote_port`` with the
right engine id failed healthy requests with a misleading reason; every request to a dead
prefill waited for a full handshake; a prefill continued 26 s after its last failure failed 4
of the next 8 requests with that cached failure. Handshake threads are real in the Rig cases;
the clock is injected. The PeerTable cases below script the handshake results instead.
"""

from __future__ import annotations

import re

import pytest

from connector.geometry import build_rank_layout
from tests.test_worker_connector import (
    PREFILL_PORT,
    RecordingAgent,
    Rig,
    load,
    remote_handshake,
    source,
)
from tests.test_worker_parts import BASE, Clock
from worker.handshake import HandshakeClient, HandshakeJob, HandshakeResult, fingerprint
from worker.peers import PeerState, PeerTable

BAD_PORT = PREFILL_PORT + 50


@pytest.fixture
def rig() -> object:
    rig = Rig()
    yield rig
    rig.close()


def test_concurrent_handshakes_to_one_engine_at_two_ports_all_end(rig: Rig) -> None:
    """Bad port, good port, bad port again while the first is in flight: all three end."""
    rig.channels.serve("p", 1)
    rig.channels.gate.clear()  # hold every fetch so the three handshakes overlap
    rig.step(loads=(load("bad-1", source("pb1", port=BAD_PORT)),))
    rig.step(loads=(load("good", source("pg"), (4, 5)),))
    rig.step(loads=(load("bad-2", source("pb2", port=BAD_PORT), (6, 7)),))
    rig.channels.gate.set()
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: all(rig.reported(r) for r in ("bad-1", "good", "bad-2")))
    assert rig.finished == ["good"]
    assert sorted(rig.failed) == ["bad-1", "bad-2"]
    for reason in rig.failed.values():
        assert re.search(rf"127.0.0.1:{BAD_PORT}.*connection refused", reason), reason


def test_wrong_port_fails_only_its_request_with_the_real_reason(rig: Rig) -> None:
    """Requests to the healthy address keep their peer while one request names a bad port."""
    rig.channels.serve("p", 1)
    rig.step(loads=(load("first", source("p0")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.collect()
    good = [load(f"ok{i}", source(f"p{i}"), (2 * i, 2 * i + 1)) for i in range(1, 8)]
    wrong = load("wrong", source("pw", port=BAD_PORT), (20, 21))
    rig.step(loads=(*good[:4], wrong, *good[4:]))
    rig.until(lambda: len(rig.agent.reads) == 8 and rig.reported("wrong"))
    rig.finish_reads()
    rig.until(lambda: len(rig.finished) == 8)
    assert sorted(rig.finished) == sorted(["first", *(spec.request_id for spec in good)])
    assert list(rig.failed) == ["wrong"]
    assert re.search(
        rf"handshake with prefill engine p failed: rank 0 at 127.0.0.1:{BAD_PORT}.*refused",
        rig.failed["wrong"],
    ), rig.failed["wrong"]
    assert rig.channels.calls.count((PREFILL_PORT, 0)) == 1  # the healthy peer was kept


def test_dead_prefill_fails_fast_after_the_first_failure(rig: Rig) -> None:
    rig.step(loads=(load("a", source("pa", port=BAD_PORT)),))
    rig.until(lambda: rig.reported("a"))
    num_calls = len(rig.channels.calls)
    rig.step(loads=(load("b", source("pb", port=BAD_PORT)),))  # same step: no thread round trip
    assert "b" in rig.failed and len(rig.channels.calls) == num_calls
    assert re.search(
        r"handshake with prefill engine p failed: .*refused.*0.0 s ago", rig.failed["b"]
    ), rig.failed["b"]


def test_restarted_prefill_with_a_new_engine_id_is_picked_up_at_once(rig: Rig) -> None:
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: rig.reported("a"))
    rig.channels.serve("p-v2", 1)  # a new process on the same port
    rig.step(loads=(load("b", source("pb", engine_id="p-v2")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["b"]


def test_same_engine_id_restarted_is_handshaked_afresh_by_params_naming_its_new_boot(
    rig: Rig,
) -> None:
    """A prefill restarted under a pinned engine id, on its port: the first request whose
    params name the new boot handshakes again at once (the old boot's agents are gone), and
    the old boot's peer retires."""
    rig.channels.serve("p", 1)
    rig.step(loads=(load("a", source("pa", boot_id="boot-a")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("a"))
    assert rig.finished == ["a"] and len(rig.channels.calls) == 1

    rig.step(loads=(load("b", source("pb", boot_id="boot-b")),))
    rig.until(lambda: len(rig.agent.reads) == 2)
    rig.finish_reads()
    rig.until(lambda: rig.reported("b"))
    assert rig.finished == ["a", "b"]
    assert len(rig.channels.calls) == 2, "the new boot was not handshaked"


def test_same_engine_id_back_on_its_port_is_probed_once_per_window(rig: Rig) -> None:
    """After a failure, one background probe per window; requests never wait on it."""
    rig.step(loads=(load("a", source("pa")),))
    rig.until(lambda: rig.reported("a"))
    rig.channels.serve("p", 1)
    rig.step(loads=(load("b", source("pb")),))  # inside the window: fails, no probe
    assert "b" in rig.failed and len(rig.channels.calls) == 1
    rig.clock.now_s += 1.5
    rig.step(loads=(load("c", source("pc")),))  # window over: fails fast, starts one probe
    assert "c" in rig.failed
    rig.until(lambda: len(rig.channels.calls) == 2)
    rig.collect()
    rig.step(loads=(load("d", source("pd")),))
    rig.until(lambda: bool(rig.agent.reads))
    rig.finish_reads()
    rig.until(lambda: rig.reported("d"))
    assert rig.finished == ["d"] and len(rig.channels.calls) == 2


def test_a_load_never_waits_longer_than_its_deadline(rig: Rig) -> None:
    """A handshake that never returns (a stuck side channel) still ends the load, bounded."""
    rig.channels.serve("p", 1)
    rig.channels.gate.clear()
    rig.step(loads=(load("a", source("pa")),))
    rig.clock.now_s += 60.0
    rig.collect()
    assert re.search(
        r"handshake with prefill engine p at 127.0.0.1:\d+ did not finish within", rig.failed["a"]
    ), rig.failed
    rig.channels.gate.set()


def test_a_prefill_back_after_a_long_silence_serves_the_whole_next_batch(rig: Rig) -> None:
    """Issue 25: nobody asked for the failed key for 25.9 s, so nobody probed it; the next
    batch must not fail with that old reason but try once and use the peer that answers."""
    rig.step(loads=(load("a", source("pa")),))  # the prefill is stopped: its handshake fails
    rig.until(lambda: rig.reported("a"))
    rig.clock.now_s += 25.9
    rig.channels.serve("p", 1)  # continued
    batch = [load(f"b{i}", source(f"pb{i}"), (2 * i, 2 * i + 1)) for i in range(8)]
    rig.step(loads=tuple(batch))
    rig.until(lambda: len(rig.agent.reads) == 8 or len(rig.failed) > 1)
    assert list(rig.failed) == ["a"], rig.failed
    rig.finish_reads()
    rig.until(lambda: len(rig.finished) == 8)
    assert rig.channels.calls == [(PREFILL_PORT, 0)] * 2  # one fresh attempt for the batch


class ScriptedHandshakes(HandshakeClient):
    """The handshake client double: records jobs; poll() returns what the test answered."""

    def __init__(self) -> None:
        self.jobs: list[HandshakeJob] = []
        self.results: list[HandshakeResult] = []

    def submit(self, job: HandshakeJob) -> None:
        self.jobs.append(job)

    def poll(self, wait_s: float = 0.0) -> list[HandshakeResult]:
        results, self.results = self.results, []
        return results

    def answer(self, *, error: str | None = None) -> None:
        """The last job finishes: refused with ``error``, or engine p's handshake."""
        job = self.jobs[-1]
        handshakes = {} if error else {0: remote_handshake("p", 0, 1)}
        self.results.append(HandshakeResult(job, handshakes, error))


class Table:
    """A PeerTable over the scripted client, an injected clock and a recording agent."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.handshakes = ScriptedHandshakes()
        self.peers = PeerTable(
            RecordingAgent("decode-r0"), self.handshakes, tp_rank=0, tp_size=1,
            local_layout=build_rank_layout(BASE, 0, 1), local_fingerprint=fingerprint(BASE),
            enforce_compat=True, clock=self.clock,
        )  # fmt: skip

    def failed_once(self) -> None:
        """The first request's handshake is refused: the key is in the negative cache."""
        assert self.peers.ensure(source()).state is PeerState.HANDSHAKING
        self.handshakes.answer(error="rank 0 at 127.0.0.1:7001 did not answer (refused)")
        assert [p.state for p in self.peers.poll()] == [PeerState.FAILED]


@pytest.mark.parametrize(
    ("wait_s", "state", "num_jobs", "retries"),
    [
        pytest.param(0.5, PeerState.FAILED, 1, None, id="known-dead-fails-fast-without-a-handshake"),
        pytest.param(1.5, PeerState.FAILED, 2, 0, id="due-for-a-probe-fails-fast-and-probes-once"),
        pytest.param(3.0, PeerState.HANDSHAKING, 2, 0, id="stale-tries-once-and-waits-for-it"),
        pytest.param(25.9, PeerState.HANDSHAKING, 2, 0, id="long-silence-tries-once-and-waits-for-it"),
    ],
)  # fmt: skip
def test_a_failed_key_after(
    wait_s: float, state: PeerState, num_jobs: int, retries: int | None
) -> None:
    table = Table()
    table.failed_once()
    table.clock.now_s += wait_s
    assert table.peers.ensure(source()).state is state
    assert len(table.handshakes.jobs) == num_jobs
    assert table.handshakes.jobs[-1].retries == retries


def test_a_stale_retry_that_reaches_the_peer_serves_every_request() -> None:
    table = Table()
    table.failed_once()
    table.clock.now_s += 25.9
    first = table.peers.ensure(source("r1"))
    assert table.peers.ensure(source("r2")) is first  # the second waits for the same attempt
    table.handshakes.answer()
    table.peers.poll()
    assert first.state is PeerState.READY and table.peers.ensure(source("r3")) is first


def test_a_stale_retry_that_fails_makes_the_key_known_dead_again() -> None:
    table = Table()
    table.failed_once()
    table.clock.now_s += 25.9
    table.peers.ensure(source("r1"))
    table.handshakes.answer(error="rank 0 at 127.0.0.1:7001 did not answer (refused)")
    table.peers.poll()
    failed = table.peers.ensure(source("r2"))
    assert failed.state is PeerState.FAILED and len(table.handshakes.jobs) == 2
    assert re.search(r"refused\) \(that was 0.0 s ago", failed.failure or ""), failed.failure


def test_a_probe_that_answered_serves_the_next_request_before_any_poll() -> None:
    """The probe's result is in; the transfer thread has not polled yet: the request uses it."""
    table = Table()
    table.failed_once()
    table.clock.now_s += 1.5
    assert table.peers.ensure(source("r1")).state is PeerState.FAILED  # starts the probe
    table.handshakes.answer()
    assert table.peers.ensure(source("r2")).state is PeerState.READY
    assert len(table.handshakes.jobs) == 2


def test_while_a_probe_is_out_requests_fail_fast_however_old_the_failure() -> None:
    """A stopped prefill: the probe hangs until its timeout; requests meanwhile fail at once."""
    table = Table()
    table.failed_once()
    table.clock.now_s += 1.5
    table.peers.ensure(source("r1"))  # starts the probe, which hangs
    table.clock.now_s += 10.0
    assert table.peers.ensure(source("r2")).state is PeerState.FAILED
    assert len(table.handshakes.jobs) == 2
