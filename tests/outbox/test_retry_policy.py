"""Retry policy: which answers are permanent, and how long the executor waits between attempts."""

import random

import pytest

from outbox.executor import RETRY_SCHEDULE_S, classify, retry_delay_s


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, "succeeded"),
        (204, "succeeded"),
        (299, "succeeded"),
        (400, "failed"),
        (401, "failed"),
        (404, "failed"),
        (410, "failed"),
        (422, "failed"),
        (408, "retryable"),
        (409, "retryable"),
        (425, "retryable"),
        (429, "retryable"),
        (301, "retryable"),
        (500, "retryable"),
        (503, "retryable"),
        (None, "retryable"),
    ],
)
def test_classify_treats_4xx_as_permanent_except_408_409_425_429(status, outcome):
    assert classify(status) == outcome


def test_schedule_spans_about_a_minute_to_about_a_day_over_eight_attempts():
    assert len(RETRY_SCHEDULE_S) == 7  # 7 waits between 8 attempts
    assert RETRY_SCHEDULE_S[0] == 60
    assert 18 * 3600 <= sum(RETRY_SCHEDULE_S) <= 26 * 3600
    assert list(RETRY_SCHEDULE_S) == sorted(RETRY_SCHEDULE_S)


def test_jitter_spreads_delays_within_twenty_percent():
    rng = random.Random(7)
    delays = [retry_delay_s(1, rng=rng) for _ in range(200)]
    assert min(delays) >= 48 and max(delays) <= 72
    assert len({round(d, 3) for d in delays}) > 150  # not all the same


def test_retry_after_lengthens_but_never_shortens_the_wait():
    rng = random.Random(1)
    assert retry_delay_s(1, jitter=0, retry_after_s=3600, rng=rng) == 3600
    assert retry_delay_s(3, jitter=0, retry_after_s=5, rng=rng) == 600
    assert retry_delay_s(1, jitter=0, retry_after_s=10**9, rng=rng) == 86400
