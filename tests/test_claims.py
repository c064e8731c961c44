"""Claims (hardcount.claims, decision 0182): one holder at a time, kept alive by the heartbeat, lapsing once
their holder stops beating — what a session advisory lock gave, with no session to keep it in."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from hardcount import claims
from tests.claim_holder import TTL_S, OtherHolder

pytestmark = pytest.mark.django_db(transaction=True)


def _in_thread(fn):
    """``fn()`` on another thread (another holder, with a connection of its own); its result."""
    out = []

    def run():
        try:
            out.append(fn())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return out[0]


def test_one_holder_at_a_time_and_a_thread_may_take_its_own_key_again():
    assert claims.take(["k:1", "k:2"]) == ["k:1", "k:2"]
    # k:3 was free; k:1 is ours.
    assert _in_thread(lambda: (claims.take(["k:1", "k:3"]), claims.release(["k:3"]))[0]) == ["k:3"]
    assert _in_thread(lambda: claims.held_elsewhere(["k:1", "k:2", "k:4"])) == ["k:1", "k:2"]
    assert claims.take(["k:1"]) == ["k:1"]  # taken twice: given back twice
    claims.release(["k:1"])
    assert claims.still_held(["k:1"]) == ["k:1"]
    assert _in_thread(lambda: claims.take(["k:1"])) == []
    claims.release(["k:1", "k:2"])
    assert claims.still_held(["k:1", "k:2"]) == []
    assert _in_thread(lambda: (claims.take(["k:1"]), claims.release(["k:1"]))[0]) == ["k:1"]


def test_the_heartbeat_keeps_a_claim_past_its_ttl(settings):
    settings.HARDCOUNT_CLAIM_TTL_S = TTL_S
    assert claims.take(["beat:1"]) == ["beat:1"]
    try:
        time.sleep(3 * TTL_S)  # three TTLs: without the heartbeat it would have lapsed
        assert claims.still_held(["beat:1"]) == ["beat:1"]
        assert _in_thread(lambda: claims.take(["beat:1"])) == []
    finally:
        claims.release(["beat:1"])


def test_a_holder_that_stops_beating_loses_its_claim_one_ttl_later():
    other = OtherHolder("dead:1")
    time.sleep(2 * TTL_S)
    assert claims.take(["dead:1"]) == []  # alive: it beats
    other.die()
    deadline = time.monotonic() + 10 * TTL_S
    while not claims.take(["dead:1"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert claims.still_held(["dead:1"]) == ["dead:1"]
    claims.release(["dead:1"])


def test_negative_control_without_heartbeats_a_live_holders_claim_would_lapse(settings, monkeypatch):
    settings.HARDCOUNT_CLAIM_TTL_S = TTL_S
    monkeypatch.setattr(claims, "_ensure_beater", lambda: None)
    assert claims.take(["quiet:1"]) == ["quiet:1"]
    try:
        time.sleep(2 * TTL_S)
        assert claims.still_held(["quiet:1"]) == []
        assert _in_thread(lambda: (claims.take(["quiet:1"]), claims.release(["quiet:1"]))[0]) == ["quiet:1"]
    finally:
        claims.release(["quiet:1"])
