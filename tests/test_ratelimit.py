"""The rate-limited log: one line per reason per interval, then how many were suppressed."""

from __future__ import annotations

import logging

import pytest

from connector.observability.ratelimit import RateLimitedLog

LOGGER = logging.getLogger("tests.ratelimit")


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER.name]


def test_one_line_per_reason_per_interval_then_the_suppressed_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    log = RateLimitedLog(LOGGER, interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        written = [log.warning("garbage", "bad frame %d", i) for i in range(1_000)]
        log.warning("auth", "bad mac")
        clock.now_s = 9.9
        log.warning("garbage", "bad frame late")
        clock.now_s = 10.0
        log.warning("garbage", "bad frame %s", "after")
        clock.now_s = 30.0
        log.warning("garbage", "quiet again")
    assert written == [True] + [False] * 999
    assert messages(caplog) == [
        "bad frame 0",
        "bad mac",
        "bad frame after [1000 more like this suppressed since the previous one]",
        "quiet again",
    ]
    assert log.num_suppressed == 1_000


def test_the_record_names_the_callers_line_and_keeps_the_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RateLimitedLog(LOGGER, clock=FakeClock())
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.error("internal", "failed", exc_info=True)
    (record,) = caplog.records
    assert record.filename == "test_ratelimit.py" and record.exc_info is not None


def test_reasons_are_bounded_and_the_oldest_is_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(LOGGER, clock=FakeClock(), max_reasons=2)
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        for reason in ["a", "b", "c", "a", "c"]:
            log.info(reason, reason)
    assert messages(caplog) == ["a", "b", "c", "a"]  # "a" was forgotten, "c" was not


def test_a_disabled_level_is_neither_written_nor_counted(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(LOGGER, clock=FakeClock())
    with caplog.at_level(logging.WARNING, logger=LOGGER.name):
        assert log.log(logging.DEBUG, "x", "hidden") is False
        assert log.log(logging.WARNING, "x", "shown") is True
    assert messages(caplog) == ["shown"] and log.num_suppressed == 0
