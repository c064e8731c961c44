"""Claims: named, expiring holds kept in ``hardcount_claim`` (docs/decisions/0182-claims-instead-of-session-locks.md).

What a PostgreSQL session advisory lock gave — one holder at a time, freed when the holder dies —
without a session: a transaction-pooling PgBouncer hands each transaction whatever server
connection is free, so a session lock would stay with that connection, not with its taker.

A claim is a row ``(key, holder, expires_at)``. :func:`take` takes keys that are free, expired
or already the caller's; the holder is the calling *thread* (as a session lock's holder was the
thread's connection), and a thread may take a key again (each take needs its own
:func:`release`, as session locks count). While a process holds claims, one heartbeat thread
pushes their ``expires_at`` to ``now() + HARDCOUNT_CLAIM_TTL_S`` every third of the TTL, so a
process that dies (or stops: SIGSTOP) loses its claims one TTL after its last beat. Expiry is
one-way: a lapsed claim is never extended, only taken again. Every time is the database's ``now()``.

The statements run as the connecting role (the tables' owner), also inside an API request
(:func:`hardcount.tenancy.cross_tenant`): the tenant role has no grant on the table.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections import Counter

from django.conf import settings
from django.db import connection, connections

from hardcount import tenancy

log = logging.getLogger("hardcount.claims")

# Keys free, lapsed or already ours become ours (one statement: two takers of a free key cannot both
# win; the row lock serialises them and the loser's WHERE fails on the winner's fresh expires_at).
TAKE = """
INSERT INTO hardcount_claim AS c (key, holder, taken_at, expires_at)
SELECT k, %(holder)s, now(), now() + make_interval(secs => %(ttl_s)s)
FROM (SELECT DISTINCT k FROM unnest(%(keys)s::text[]) AS k) AS wanted
ON CONFLICT (key) DO UPDATE SET
    holder = EXCLUDED.holder,
    taken_at = CASE WHEN c.holder = EXCLUDED.holder AND c.expires_at > now() THEN c.taken_at ELSE now() END,
    expires_at = EXCLUDED.expires_at
WHERE c.expires_at <= now() OR c.holder = EXCLUDED.holder
RETURNING key
"""

# The heartbeat: extend the live claims of these (key, holder) pairs. Rows another transaction has
# locked (a taker mid-transaction) are skipped, never waited for; the next beat gets them.
RENEW = """
UPDATE hardcount_claim c SET expires_at = now() + make_interval(secs => %(ttl_s)s)
WHERE (c.key, c.holder) IN (
    SELECT l.key, l.holder FROM hardcount_claim l
    JOIN unnest(%(keys)s::text[], %(holders)s::text[]) AS h(key, holder) ON l.key = h.key AND l.holder = h.holder
    WHERE l.expires_at > now()
    FOR UPDATE OF l SKIP LOCKED
)
RETURNING c.key
"""

RELEASE = "DELETE FROM hardcount_claim WHERE key = ANY(%(keys)s::text[]) AND holder = %(holder)s"

# The keys some holder other than ``holder`` has a live claim on.
HELD_ELSEWHERE = """
SELECT key FROM hardcount_claim
WHERE key = ANY(%(keys)s::text[]) AND expires_at > now() AND holder <> %(holder)s
"""

STILL_HELD = """
SELECT key FROM hardcount_claim
WHERE key = ANY(%(keys)s::text[]) AND expires_at > now() AND holder = %(holder)s
"""

_local = threading.local()

# Every claim this process holds: (key, holder) -> how many takes are not released yet.
_held: Counter[tuple[str, str]] = Counter()
_held_lock = threading.Lock()
# The heartbeat thread, while one runs: the thread, the process that started it, its pace and its wake-up.
_beater: dict = {}


def holder() -> str:
    """This thread's holder id: ``<hostname>:<pid>:<8 random hex>:<thread id>``.

    The pid part is read again after a fork, so a forked worker (gunicorn) is a holder of its own.
    """
    if getattr(_local, "pid", None) != os.getpid():
        _local.pid = os.getpid()
        _local.id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}:{threading.get_ident()}"
    return _local.id


def ttl_s() -> float:
    """Seconds a claim lives past its last heartbeat (``HARDCOUNT_CLAIM_TTL_S``)."""
    return float(getattr(settings, "HARDCOUNT_CLAIM_TTL_S", 10))


def take(keys: list[str]) -> list[str]:
    """Take each of ``keys`` for this thread when it is free, lapsed or already this thread's; the keys taken.

    Runs in the caller's transaction when there is one (a rollback undoes the take; release it
    all the same), else commits at once. Each key taken must be given back by :func:`release`.
    """
    if not keys:
        return []
    me = holder()
    with tenancy.cross_tenant(), connection.cursor() as cursor:
        cursor.execute(TAKE, {"keys": list(keys), "holder": me, "ttl_s": ttl_s()})
        won = {row[0] for row in cursor.fetchall()}
    taken = [key for key in keys if key in won]
    if taken:
        with _held_lock:
            for key in taken:
                _held[(key, me)] += 1
        _ensure_beater()
    return taken


def release(keys: list[str]) -> None:
    """Give back one take of each of ``keys``; a key this thread no longer holds at all is deleted.

    Raises :class:`django.db.DatabaseError` when the delete fails (the claims then lapse by themselves).
    """
    if not keys:
        return
    me = holder()
    gone = []
    with _held_lock:
        for key in keys:
            if _held[(key, me)] > 0:
                _held[(key, me)] -= 1
            if _held[(key, me)] <= 0:
                del _held[(key, me)]
                gone.append(key)
    if gone:
        with tenancy.cross_tenant(), connection.cursor() as cursor:
            cursor.execute(RELEASE, {"keys": gone, "holder": me})


def held_elsewhere(keys: list[str]) -> list[str]:
    """The keys among ``keys`` that another holder (another thread or process) has a live claim on."""
    if not keys:
        return []
    with tenancy.cross_tenant(), connection.cursor() as cursor:
        cursor.execute(HELD_ELSEWHERE, {"keys": list(keys), "holder": holder()})
        found = {row[0] for row in cursor.fetchall()}
    return [key for key in keys if key in found]


def still_held(keys: list[str]) -> list[str]:
    """The keys among ``keys`` this thread still has a live claim on (a read: it neither waits nor extends)."""
    if not keys:
        return []
    with tenancy.cross_tenant(), connection.cursor() as cursor:
        cursor.execute(STILL_HELD, {"keys": list(keys), "holder": holder()})
        found = {row[0] for row in cursor.fetchall()}
    return [key for key in keys if key in found]


def _ensure_beater() -> None:
    with _held_lock:
        running = _beater.get("thread")
        if running is not None and running.is_alive() and _beater.get("pid") == os.getpid():
            if _beater["every_s"] > ttl_s() / 3:
                _beater["wake"].set()  # the TTL was shortened (a test's setting): beat at the new pace now
            return
        thread = threading.Thread(target=_beat, name="claims-heartbeat", daemon=True)
        _beater.update(thread=thread, pid=os.getpid(), every_s=ttl_s() / 3, wake=threading.Event())
        thread.start()


def _beat() -> None:
    """The heartbeat thread: renew every claim of this process each third of the TTL; exit once none is held."""
    try:
        while True:
            with _held_lock:
                every_s, wake = ttl_s() / 3, _beater["wake"]
                _beater["every_s"] = every_s
            wake.wait(every_s)
            wake.clear()
            with _held_lock:
                pairs = [pair for pair, count in _held.items() if count > 0]
                if not pairs:
                    _beater.clear()
                    return
            try:
                with connection.cursor() as cursor:
                    cursor.execute(
                        RENEW,
                        {"keys": [k for k, _ in pairs], "holders": [h for _, h in pairs], "ttl_s": ttl_s()},
                    )
            except Exception:  # the heartbeat must outlive any one failed beat; the next one tries again
                log.warning("claims heartbeat failed; %d claim(s) may lapse", len(pairs), exc_info=True)
            finally:
                # No connection kept between beats: a sleeping heartbeat holds nothing of the database's.
                connection.close()
    finally:
        connections.close_all()


__all__ = ["held_elsewhere", "holder", "release", "still_held", "take", "ttl_s"]
