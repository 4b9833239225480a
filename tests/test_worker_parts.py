"""Worker-side pieces on their own: the compatibility check, free-notification counting and the
handshake client's retries. The connector that uses them is tested in test_worker_connector.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from connector.errors import HandshakeError, UnsupportedConfiguration
from connector.geometry import build_rank_layout
from connector.layout import GroupKind, GroupSpec, KVCacheSpec, LayerSpec, MemoryLayout
from worker.handshake import (
    Fingerprint,
    HandshakeClient,
    HandshakeJob,
    any_boot,
    check_compatible,
    digest_of,
    fingerprint,
)
from worker.notifications import NotificationCounter
from worker.plan.recipe import TransferRequest, peer_plan, plan_request
from worker.topology import expected_notifications, head_shapes, notification_duty

# --- model specs ------------------------------------------------------------------------------


def make_spec(
    *,
    model: str = "tiny",
    num_kv_heads: int = 4,
    num_layers: int = 2,
    kind: GroupKind = GroupKind.FULL,
    block_size: int = 4,
    num_blocks: int = 16,
    memory_layout: MemoryLayout = MemoryLayout.NHD,
    cache_dtype: str = "bfloat16",
    kv_scales: tuple[tuple[float, float], ...] | None = None,  # per layer: FP8 per tensor
) -> KVCacheSpec:
    num_planes = 1 if kind is GroupKind.MLA else 2
    dtype_bytes = 1 if kv_scales else 2
    layers = tuple(
        LayerSpec(
            f"layer{i}", num_kv_heads, head_dim=4, dtype_bytes=dtype_bytes, num_planes=num_planes,
            kv_scales=kv_scales[i] if kv_scales else None,
        )
        for i in range(num_layers)
    )  # fmt: skip
    group = GroupSpec(kind, block_size, block_size, num_blocks, layers)
    return KVCacheSpec(model, "bfloat16", cache_dtype, (group,), memory_layout)


# --- compat ----------------------------------------------------------------------------------

BASE = make_spec()


@pytest.mark.parametrize(
    ("other", "same"),
    [
        pytest.param(make_spec(), True, id="identical-spec"),
        pytest.param(make_spec(block_size=8), True, id="block-size-left-to-planner"),
        pytest.param(make_spec(num_blocks=99), True, id="pool-size-ignored"),
        pytest.param(make_spec(memory_layout=MemoryLayout.HND), True, id="layout-left-to-planner"),
        pytest.param(make_spec(model="other"), False, id="model-differs"),
        pytest.param(make_spec(cache_dtype="fp8"), False, id="cache-dtype-differs"),
        pytest.param(make_spec(num_kv_heads=8), False, id="heads-differ"),
        pytest.param(make_spec(num_layers=3), False, id="layers-differ"),
        pytest.param(make_spec(kind=GroupKind.MLA), False, id="group-kind-differs"),
    ],
)
def test_fingerprint_covers_model_facts_only(other: KVCacheSpec, same: bool) -> None:
    assert (fingerprint(other).digest == fingerprint(BASE).digest) is same


def test_fingerprint_digest_is_hash_of_its_facts() -> None:
    digest, facts = fingerprint(BASE)
    assert digest == digest_of(facts)
    assert facts["group0.num_kv_heads"] == "4" and facts["model"] == "tiny"


@pytest.mark.parametrize(
    ("remote", "enforce", "error", "match"),
    [
        pytest.param(
            fingerprint(make_spec(model="other")),
            True,
            UnsupportedConfiguration,
            r"model: local 'tiny', remote 'other'.*enforce_handshake_compat=false",
            id="model-mismatch-enforced",
        ),
        pytest.param(
            fingerprint(make_spec(num_kv_heads=8, num_layers=3)),
            True,
            UnsupportedConfiguration,
            r"group0.num_kv_heads: local '4', remote '8'; group0.num_layers: local '2', remote '3'",
            id="names-every-differing-fact",
        ),
        pytest.param(
            fingerprint(BASE, protocol_version=999),
            False,
            HandshakeError,
            r"protocol version mismatch: local '\d+', remote '999'",
            id="protocol-version-never-tolerated",
        ),
        pytest.param(
            Fingerprint("0" * 64, fingerprint(BASE).facts),
            False,
            HandshakeError,
            r"does not match the facts it sent",
            id="digest-not-matching-facts",
        ),
    ],
)
def test_check_compatible_rejects(
    remote: Fingerprint, enforce: bool, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        check_compatible(fingerprint(BASE), remote, enforce)


def test_check_compatible_unenforced_returns_differences() -> None:
    reasons = check_compatible(fingerprint(BASE), fingerprint(make_spec(model="x")), False)
    assert reasons == ("model: local 'tiny', remote 'x'",)
    assert check_compatible(fingerprint(BASE), fingerprint(BASE), True) == ()


FP8 = make_spec(cache_dtype="fp8", kv_scales=((1.0, 1.0), (0.5, 0.25)))


@pytest.mark.parametrize(
    ("remote", "match"),
    [
        pytest.param(make_spec(), r"cache_dtype: local 'fp8', remote 'bfloat16'", id="dtype"),
        pytest.param(
            make_spec(cache_dtype="fp8_e5m2", kv_scales=((1.0, 1.0), (0.5, 0.25))),
            r"cache_dtype: local 'fp8', remote 'fp8_e5m2'",
            id="fp8-flavour",
        ),
        pytest.param(
            make_spec(cache_dtype="fp8", kv_scales=((1.0, 1.0), (0.5, 0.125))),
            r"group0.v_scale: local '1.0,0.25', remote '1.0,0.125'",
            id="one-layers-v-scale",
        ),
        pytest.param(
            make_spec(cache_dtype="fp8", kv_scales=((1.0, 1.0), (0.5000001, 0.25))),
            r"group0.k_scale: local '1.0,0.5', remote '1.0,0.5000001'",
            id="k-scale-compared-exactly",
        ),
    ],
)
@pytest.mark.parametrize("enforce", [True, False], ids=["enforced", "not-enforced"])
def test_cache_dtype_or_kv_scale_mismatch_is_refused_naming_both(
    remote: KVCacheSpec, match: str, enforce: bool
) -> None:
    """What a cache byte means must agree: never tolerated, even with enforcement off."""
    with pytest.raises(UnsupportedConfiguration, match=match) as refused:
        check_compatible(fingerprint(FP8), fingerprint(remote), enforce)
    assert "encode values differently" in str(refused.value)


def test_fp8_fingerprint_carries_scales_and_unquantized_has_none() -> None:
    facts = fingerprint(FP8).facts
    assert (facts["group0.k_scale"], facts["group0.v_scale"]) == ("1.0,0.5", "1.0,0.25")
    assert facts["group0.dtype_bytes"] == "1"
    assert not any(key.endswith("_scale") for key in fingerprint(BASE).facts)
    assert check_compatible(fingerprint(FP8), fingerprint(FP8), True) == ()


# --- notifications ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


Step = tuple[
    str, Any
]  # ("expect", ids) | ("forget", ids) | ("notif", (sender, bytes)) | ("tick", s)


@pytest.mark.parametrize(
    ("steps", "finished", "stats"),
    [
        pytest.param(
            [("expect", ["p1"]), ("notif", ("d0", b"p1:1"))],
            ["p1"],
            {"counted": 1},
            id="one-reader",
        ),
        pytest.param(
            [("expect", ["p1"]), ("notif", ("d0", b"p1:2")), ("notif", ("d1", b"p1:2"))],
            ["p1"],
            {"counted": 2},
            id="two-readers",
        ),
        pytest.param(
            [("expect", ["p1"]), ("notif", ("d0", b"p1:2")), ("notif", ("d0", b"p1:2"))],
            [],
            {"counted": 1, "duplicate": 1},
            id="duplicate-sender-counted-once",
        ),
        pytest.param(
            [("expect", ["a:b"]), ("notif", ("d0", b"a:b:1"))],
            ["a:b"],
            {"counted": 1},
            id="id-with-colon",
        ),
        pytest.param(
            [("expect", ["p1"]), ("notif", ("d0", b"garbage")), ("notif", ("d0", b"p1:0"))],
            [],
            {"garbage": 2},
            id="garbage-counted-not-raised",
        ),
        pytest.param(
            [("notif", ("d0", b"p1:1")), ("expect", ["p1"])],
            ["p1"],
            {"counted": 1},
            id="notification-before-sends",
        ),
        pytest.param(
            [("notif", ("d0", b"ghost:1")), ("tick", 31.0), ("notif", ("d0", b"x"))],
            [],
            {"stray": 1, "garbage": 1},
            id="unknown-id-expires-as-stray",
        ),
        pytest.param(
            [("expect", ["p1"]), ("forget", ["p1"]), ("notif", ("d0", b"p1:1"))],
            [],
            {},
            id="forgotten-id-not-reported",
        ),
        pytest.param(
            [("expect", ["p1"]), ("notif", ("d0", b"p1:1")), ("notif", ("d1", b"p1:1"))],
            ["p1"],
            {"counted": 1, "duplicate": 1},
            id="late-notification-after-finish",
        ),
        pytest.param(
            [("expect", ["p1"]), ("notif", ("d0", b"p1:1")), ("notif", ("d1", b"p1:2"))],
            ["p1"],
            {"counted": 1, "duplicate": 1},
            id="first-count-reached-finishes",
        ),
        pytest.param(
            [("expect", ["p1"]), ("notif", ("d0", b"p1:2")), ("notif", ("d1", b"p1:3"))],
            [],
            {"counted": 2},
            id="disagreeing-counts-wait-for-larger",
        ),
    ],
)
def test_notification_counter(
    steps: list[Step], finished: list[str], stats: dict[str, int]
) -> None:
    clock = Clock()
    counter = NotificationCounter(clock=clock, early_ttl_s=30.0)
    reported: list[str] = []
    for action, value in steps:
        if action == "expect":
            counter.expect(value)
        elif action == "forget":
            counter.forget(value)
        elif action == "tick":
            clock.now_s += value
        else:
            sender, message = value
            counter.receive({sender: [message]})
        reported.extend(counter.take_finished())
    assert reported == finished
    expected = {"counted": 0, "duplicate": 0, "stray": 0, "garbage": 0} | stats
    assert vars(counter.stats) == expected


# --- handshake client ------------------------------------------------------------------------


def test_handshake_client_retries_with_exponential_backoff() -> None:
    attempts: list[int] = []
    waits: list[float] = []

    def flaky(host: str, port: int, tp_rank: int) -> Any:
        attempts.append(tp_rank)
        if len(attempts) < 3:
            raise HandshakeError("timeout")
        return f"handshake-{tp_rank}"

    client = HandshakeClient(any_boot(flaky), retries=3, backoff_s=0.5, wait=waits.append)
    try:
        client.submit(HandshakeJob("e", "127.0.0.1", 1, (0,)))
        (result,) = client.poll(wait_s=5.0)
    finally:
        client.close()
    assert result.error is None and result.handshakes == {0: "handshake-0"}
    assert attempts == [0, 0, 0] and waits == [0.5, 1.0]


def test_a_probe_job_makes_one_attempt_whatever_the_client_retries() -> None:
    attempts: list[int] = []

    def down(host: str, port: int, tp_rank: int) -> Any:
        attempts.append(port)
        raise HandshakeError("did not answer")

    client = HandshakeClient(any_boot(down), retries=3, wait=lambda s: None)
    try:
        client.submit(HandshakeJob("e", "127.0.0.1", 5, (0,), job_id=1, retries=0))
        client.submit(HandshakeJob("e", "127.0.0.1", 5, (0,), job_id=2))
        results = client.poll(wait_s=5.0)
        while len(results) < 2:
            results += client.poll(wait_s=5.0)
    finally:
        client.close()
    errors = {result.job.job_id: result.error or "" for result in results}
    assert "after 1 attempt(s)" in errors[1] and "after 4 attempt(s)" in errors[2]
    assert len(attempts) == 5


@pytest.mark.parametrize(
    ("fetch_error", "match"),
    [
        pytest.param(
            HandshakeError("did not answer within 1 s"),
            r"rank 1 at 127.0.0.1:9 failed after 3 attempt\(s\): did not answer within 1 s",
            id="retries-exhausted",
        ),
        pytest.param(
            ValueError("bug"), r"handshake crashed: ValueError\('bug'\)", id="crash-surfaced"
        ),
    ],
)
def test_handshake_client_reports_failures(fetch_error: Exception, match: str) -> None:
    def failing(host: str, port: int, tp_rank: int) -> Any:
        raise fetch_error

    client = HandshakeClient(any_boot(failing), retries=2, wait=lambda s: None)
    try:
        client.submit(HandshakeJob("e", "127.0.0.1", 9, (1,)))
        (result,) = client.poll(wait_s=5.0)
    finally:
        client.close()
    assert result.handshakes == {}
    assert result.error is not None
    assert re.search(match, result.error)
    assert client.num_in_flight == 0


# --- notification duty ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_tp", "remote_tp", "num_kv_heads", "kind"),
    [
        pytest.param(1, 1, 4, GroupKind.FULL, id="tp1-tp1"),
        pytest.param(2, 1, 4, GroupKind.FULL, id="d2-p1"),
        pytest.param(1, 2, 4, GroupKind.FULL, id="d1-p2"),
        pytest.param(4, 2, 2, GroupKind.FULL, id="d4-p2-replicated-heads"),
        pytest.param(2, 4, 1, GroupKind.FULL, id="d2-p4-one-head"),
        pytest.param(1, 2, 1, GroupKind.MLA, id="mla-d1-p2"),
        pytest.param(4, 2, 1, GroupKind.MLA, id="mla-d4-p2"),
    ],
)
def test_notification_duty_matches_the_planner(
    local_tp: int, remote_tp: int, num_kv_heads: int, kind: GroupKind
) -> None:
    spec = make_spec(num_kv_heads=num_kv_heads, kind=kind)
    remote = build_rank_layout(spec, 0, remote_tp)
    replicated = kind is GroupKind.MLA
    notified_by: dict[int, list[int]] = {}
    for tp_rank in range(local_tp):
        local = build_rank_layout(spec, tp_rank, local_tp)
        plan = plan_request(
            peer_plan(local, remote),
            TransferRequest(((0, 1),), ((0, 1),), num_tokens=8, num_cached_tokens=0),
        )
        duty = notification_duty(tp_rank, local_tp, remote_tp, head_shapes(local))
        assert duty == plan.consumers
        assert set(duty) == {r.remote_rank for r in plan.reads} | set(plan.notify_only)
        for remote_rank, count in duty.items():
            assert count == expected_notifications(
                remote_rank, local_tp, remote_tp, num_kv_heads, replicated=replicated
            )
            notified_by.setdefault(remote_rank, []).append(tp_rank)
    # Every prefill rank hears from exactly as many decode ranks as each of them announces.
    assert sorted(notified_by) == list(range(remote_tp))
    for remote_rank, senders in notified_by.items():
        assert len(senders) == expected_notifications(
            remote_rank, local_tp, remote_tp, num_kv_heads, replicated=replicated
        )
