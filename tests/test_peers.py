"""Peers under concurrent and failing handshakes (issue 11): one record per remote address.

Each case reproduces a finding against ``nixl-pd serve`` pairs: handshakes to the same engine
at different ports overwrote each other (a load hung forever); a wrong ``remote_port`` with the
right engine id failed healthy requests with a misleading reason; every request to a dead
prefill waited for a full handshake. Handshake threads are real; the clock is injected.
"""

from __future__ import annotations

import re

import pytest

from tests.test_worker_connector import PREFILL_PORT, Rig, load, source

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
