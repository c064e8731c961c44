"""Billing's SQL that the ORM cannot say cleanly, each statement named with the guarantee it gives.

Every statement runs on the caller's connection, inside the caller's transaction; times come
from PostgreSQL's ``now()`` (one clock authority, docs/reference/roles-and-leases.md) unless a test
clock's time is passed as ``as_of``. The due predicate is written once, here (:func:`due_predicate`),
and every statement that asks "is this subscription due" (the claim, the close's re-lock, the page
close's lock through :func:`due_condition`) takes it from there. Locks follow the order of
:mod:`billing.lock_objects`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import cache
from operator import itemgetter
from typing import NamedTuple

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL

from billing.models import Subscription
from billing.shards import Shard
from hardcount.bulk import array_literal

# docs/reference/billing.md: failure k (1..7) waits LADDER[k-1] after the failure; failure 8 parks.
LADDER: tuple[timedelta, ...] = (
    timedelta(minutes=15),
    timedelta(hours=1),
    timedelta(hours=4),
    timedelta(hours=12),
    timedelta(hours=24),
    timedelta(hours=24),
    timedelta(hours=24),
)
PARK_AT_FAILURE = len(LADDER) + 1

# Due by ``as_of`` (a parameter; the DB's now() when it is null).
_DUE_BY = "billing_subscription.next_billing_at <= COALESCE(%s::timestamptz, now())"
# Not waiting on the retry ladder (no next attempt, or it has passed), not parked.
_NOT_FAILING = (
    "billing_subscription.billing_parked_at IS NULL AND (billing_subscription.next_billing_attempt_at IS NULL"
    " OR billing_subscription.next_billing_attempt_at <= now())"
)
# Collection paused for the period that is due (docs/decisions/0144): a pause, and the period starts
# before it resumes (no resumes_at: until resumed by hand). Measured on the period's start, not on
# now(), so a period that began during the pause is a paused one whenever the drain gets to it.
_PERIOD_PAUSED = (
    "(billing_subscription.pause_collection_behavior <> '' AND (billing_subscription.pause_collection_resumes_at"
    " IS NULL OR billing_subscription.next_billing_at < billing_subscription.pause_collection_resumes_at))"
)


# A subscription billing usage (an item of a metered price) closes a period only once the usage of the
# period that ended can no longer grow: its grace has passed (docs/decisions/0165). Its first period bills
# no usage and is not delayed. ``%s`` are ``as_of`` and the delay in seconds.
_USAGE_SETTLED = (
    "(billing_subscription.periods_billed = 0"
    " OR billing_subscription.next_billing_at <= COALESCE(%s::timestamptz, now()) - make_interval(secs => %s)"
    " OR NOT EXISTS (SELECT 1 FROM billing_subscriptionitem usage_si JOIN billing_price usage_p"
    " ON usage_p.id = usage_si.price_id WHERE usage_si.subscription_id = billing_subscription.id"
    " AND usage_p.usage_type = 'metered'))"
)


def usage_close_delay_s(*, test_clock_id: str | None = None) -> int:
    """Seconds after a period's end before the close that bills its usage: the grace (``HARDCOUNT_USAGE_GRACE_S``),
    on the wall clock and on test clocks alike (``test_clock_id`` is accepted for the callers' symmetry)."""
    return settings.HARDCOUNT_USAGE_GRACE_S


def due_predicate(
    *, test_clock_id: str | None, as_of: datetime | None, failing_too: bool = False, paused: bool = False
) -> tuple[str, list[object]]:
    """DUE: the SQL condition "this ``billing_subscription`` row is due", and its ``%s`` parameters in order.

    Due: a billable status (:data:`billing.models.subscriptions.BILLABLE_STATUSES`),
    ``next_billing_at <= as_of`` (``now()`` when None), not waiting (``next_billing_attempt_at``
    unset or passed), not parked, and on the clock ``test_clock_id`` (None: wall-clock
    subscriptions only, the ``test_clock_id IS NULL`` of the due-scan index), and collection not
    paused for the due period (:data:`_PERIOD_PAUSED`), and for a subscription billing usage, its grace
    passed (:data:`_USAGE_SETTLED`; ``paused=True`` asks the opposite: the due
    periods whose collection is paused, which :mod:`billing.services.pausing` invoices without a
    charge). ``failing_too``
    leaves out the waiting and parked terms (an operator's retry-billing, which clears them).
    Columns are qualified with the table's name, so the condition stands in a statement that
    joins other tables. Put it in a statement with positional parameters, its own in this order.
    """
    clock = "billing_subscription.test_clock_id = %s" if test_clock_id else "billing_subscription.test_clock_id IS NULL"
    terms = [
        "billing_subscription.status = ANY(%s::text[])",
        clock,
        _DUE_BY,
        _USAGE_SETTLED,
        _PERIOD_PAUSED if paused else f"NOT {_PERIOD_PAUSED}",
    ]
    params: list[object] = [
        list(Subscription.BILLABLE_STATUSES),
        *([test_clock_id] if test_clock_id else []),
        as_of,
        as_of,
        usage_close_delay_s(test_clock_id=test_clock_id),
    ]
    if not failing_too:
        terms.append(_NOT_FAILING)
    return " AND ".join(terms), params


def due_condition(*, test_clock_id: str | None, as_of: datetime | None) -> RawSQL:
    """:func:`due_predicate` as a boolean expression for ``Subscription`` querysets: ``.filter(due_condition(…))``."""
    # The text is this module's own; every value in it is a bound parameter.
    return RawSQL(*due_predicate(test_clock_id=test_clock_id, as_of=as_of), output_field=BooleanField())  # noqa: S611


def shard_filter(shard: Shard | None) -> tuple[str, list[object]]:
    """IN_SHARD: ``AND <the subscription's tenant is in shard>`` and its parameters, for a ``billing_subscription``
    statement; ``("", [])`` without a shard or for a single one, which leaves the statement as it was before shards.

    The one place the scheduler's billing work is split (:mod:`billing.shards`): the drain's claims (due and paused
    periods) and its resumes of paused collection take it from here.
    """
    if shard is None:
        return "", []
    condition, params = shard.predicate("billing_subscription.tenant_id")
    return (f"AND {condition}", params) if condition else ("", [])


def claim_due_page(
    *,
    livemode: bool,
    tenant_id: str | None,
    test_clock_id: str | None,
    as_of: datetime | None,
    page_size: int,
    run_id: str | None = None,
    after: tuple[datetime, str] | None = None,
    exclude: list[str] = (),
    paused: bool = False,
    shard: Shard | None = None,
) -> list[tuple[str, int, datetime]]:
    """CLAIM_DUE_PAGE: up to ``page_size`` due subscriptions as ``(id, periods_billed, next_billing_at)``, in
    ``(next_billing_at, id)`` order.

    Due as :func:`due_predicate` says (wall-clock subscriptions only, unless ``test_clock_id``
    names the clock whose subscriptions are drained), of mode ``livemode`` (and tenant
    ``tenant_id`` when given). ``run_id``: the claim is that billing run's: it passes over the rows
    the run marked (:func:`mark_still_due`: those it attempted that were still due afterwards), so a
    run attempts a subscription once whatever became of its close, with no list sent back.
    ``after``: the ``(next_billing_at, id)`` of the run's last claimed row; only rows past it, so a
    claim walks the due-scan index from where the last one stopped instead of over every row the run
    left still due. ``exclude``: ids passed over as well (a bound array; the paused periods' pass).
    ``FOR UPDATE SKIP LOCKED`` passes over rows another transaction is closing right now; the CTE
    applies ``LIMIT`` once, so a page never exceeds ``page_size``. The claim commits at once: the
    close re-locks each subscription and re-checks it is still due for the same period
    (:func:`lock_due_subscription`), and the invoice's unique index is the hard guard
    (docs/decisions/0010-drain-claims-and-parallel-closes.md, 0187). ``paused``: claim the due periods
    whose collection is paused instead (:func:`due_predicate`). ``shard``: only the subscriptions of
    its tenants (:func:`shard_filter`).
    """
    due, due_params = due_predicate(test_clock_id=test_clock_id, as_of=as_of, paused=paused)
    # The claim's terms, each with its parameters: a term added here needs nothing else.
    terms: list[tuple[str, list[object]]] = [("livemode = %s", [livemode]), (due, due_params)]
    if tenant_id:
        terms.append(("tenant_id = %s", [tenant_id]))
    in_shard, shard_params = shard_filter(shard)
    if in_shard:
        terms.append((in_shard.removeprefix("AND "), list(shard_params)))
    if run_id:
        terms.append(("claimed_by_run IS DISTINCT FROM %s", [run_id]))
    if after is not None:
        terms.append(("(next_billing_at, id) > (%s::timestamptz, %s::text)", list(after)))
    if exclude:
        terms.append(("NOT (id = ANY(%s::text[]))", [list(exclude)]))
    where = " AND ".join(f"({term})" for term, _ in terms)
    params = [value for _, values in terms for value in values]
    sql = f"""
        WITH due AS (
            SELECT id, periods_billed, next_billing_at FROM billing_subscription
            WHERE {where}
            ORDER BY next_billing_at, id
            LIMIT %s
            FOR UPDATE SKIP LOCKED
        )
        SELECT id, periods_billed, next_billing_at FROM due ORDER BY next_billing_at, id
    """
    with bound_cursor() as cursor:
        cursor.execute(sql, [*params, page_size])
        return [(row[0], row[1], row[2]) for row in cursor.fetchall()]


def mark_still_due(run_id: str, subscription_ids: list[str], *, as_of: datetime | None) -> int:
    """MARK_STILL_DUE: mark those of ``subscription_ids`` (a run's attempted page) that are due again right after
    their close as claimed by run ``run_id``; returns how many.

    A subscription several periods behind is due again once one period is billed; a failed one whose
    failure was not saved is still due. Only these are written (the date term of :func:`due_predicate`,
    so one the close left waiting on the retry ladder is marked too): the others are no longer due, and
    no claim returns them. The ids go as one bound array.
    """
    if not subscription_ids:
        return 0
    with bound_cursor() as cursor:
        cursor.execute(
            f"UPDATE billing_subscription SET claimed_by_run = %s WHERE id = ANY(%s::text[]) AND {_DUE_BY}",
            [run_id, list(subscription_ids), as_of],
        )
        return cursor.rowcount


@contextmanager
def bound_cursor() -> Iterator:
    """A cursor on the default connection (the caller's transaction) that binds its parameters on the server.

    Django's psycopg backend renders every parameter into the statement's text on the client; an
    array of thousands of ids then costs its rendering here and its parsing there. This cursor sends
    them as bound parameters (psycopg's binary or text formats) instead. ``%s`` placeholders as usual.
    """
    connection.ensure_connection()
    # Wrapped as Django wraps its own cursors (the execute wrappers, the tenant's among them; errors as Django's), and
    # of the class django-prometheus gives the connection's own cursors, so its statements are counted as theirs.
    cursor = _server_binding_cursor_class(connection.alias, connection.vendor)(connection.connection)
    with connection._prepare_cursor(cursor) as wrapped:
        yield wrapped


@cache
def _server_binding_cursor_class(alias: str, vendor: str) -> type:
    from django.db.backends.postgresql.base import ServerBindingCursor
    from django_prometheus.db.common import ExportingCursorWrapper

    return ExportingCursorWrapper(ServerBindingCursor, alias, vendor)


def lock_due_subscription(
    subscription_id: str,
    *,
    periods_billed: int,
    test_clock_id: str | None,
    as_of: datetime | None,
    manual_retry: bool = False,
    paused: bool = False,
) -> bool:
    """LOCK_DUE_SUBSCRIPTION: lock the subscription iff it is still due for period ``periods_billed``.

    ``FOR UPDATE SKIP LOCKED``: a row another transaction holds is being closed by someone
    else, so the caller skips it. The re-check (same period index, still due by
    :func:`due_predicate` on the same clock) makes a stale claim harmless: a period that another
    close has advanced is not closed twice. ``manual_retry`` (an operator's retry-billing) ignores
    the waiting and parked terms, which that retry clears; ``paused`` re-checks a paused period
    instead (:func:`due_predicate`). Returns False when the row is not locked.
    """
    due, due_params = due_predicate(test_clock_id=test_clock_id, as_of=as_of, failing_too=manual_retry, paused=paused)
    sql = f"""
        SELECT id FROM billing_subscription
        WHERE id = %s
          AND periods_billed = %s
          AND {due}
        FOR UPDATE SKIP LOCKED
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [subscription_id, periods_billed, *due_params])
        return cursor.fetchone() is not None


def materialise_invoice(row: dict[str, object]) -> bool:
    """MATERIALISE_INVOICE: ``INSERT … ON CONFLICT DO NOTHING``; True when this call inserted the row.

    ``row`` maps ``billing_invoice`` columns to database values. The conflict that matters is
    the partial unique index ``invoice_one_per_period`` on ``(subscription_id, period_start)``
    (voided invoices excluded): a second close of the same period inserts nothing and takes the
    existing invoice. No conflict target is named on purpose: the statement then needs no
    particular index to exist, so the negative-control test that drops the index shows what the
    index alone prevents (a duplicate invoice), instead of an error.
    """
    columns = list(row)
    sql = (
        f"INSERT INTO billing_invoice ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(columns))}) ON CONFLICT DO NOTHING RETURNING id"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [row[c] for c in columns])
        return cursor.fetchone() is not None


def next_invoice_number(tenant_id: str, livemode: bool, count: int = 1) -> int:
    """NEXT_INVOICE_NUMBER: take the next ``count`` numbers of (tenant, mode); returns the last of them.

    The numbers taken are ``last - count + 1 … last``. The upsert locks the counter row until the
    caller's transaction ends, so numbers are assigned in commit order and a rolled-back
    transaction gives its numbers back: gapless. Call it last in a transaction to keep the lock
    short.
    """
    sql = """
        INSERT INTO billing_invoicecounter (tenant_id, livemode, last_number) VALUES (%s, %s, %s)
        ON CONFLICT (tenant_id, livemode) DO UPDATE
            SET last_number = billing_invoicecounter.last_number + EXCLUDED.last_number
        RETURNING last_number
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [tenant_id, livemode, count])
        return cursor.fetchone()[0]


def next_credit_note_number(tenant_id: str, livemode: bool) -> int:
    """NEXT_CREDIT_NOTE_NUMBER: take the next credit-note number of (tenant, mode), as
    :func:`next_invoice_number` does for invoices: the upsert holds the counter row until the caller's
    transaction ends, so numbers follow commit order and a rollback gives its number back (gapless).
    Call it last in the transaction (after the ledger's customer lock)."""
    sql = """
        INSERT INTO billing_creditnotecounter (tenant_id, livemode, last_number) VALUES (%s, %s, 1)
        ON CONFLICT (tenant_id, livemode) DO UPDATE
            SET last_number = billing_creditnotecounter.last_number + 1
        RETURNING last_number
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [tenant_id, livemode])
        return cursor.fetchone()[0]


def record_billing_failure(
    subscription_id: str, *, error: str, fresh: bool = False
) -> tuple[int, datetime | None, datetime | None, datetime]:
    """RECORD_BILLING_FAILURE: count one more failure and set its ladder step, on the DB's clock.

    Failure k (after this one) waits until ``now() + LADDER[k-1]`` for k ≤ 7; failure 8 parks
    the subscription (``billing_parked_at = now()``, no next attempt). ``fresh`` counts from
    zero (a manual retry starts the ladder again). Returns ``(count, next_billing_attempt_at,
    billing_parked_at, failed_at)``. The caller holds the subscription's row lock.
    """
    sql = """
        UPDATE billing_subscription SET
            billing_failure_count = (CASE WHEN %(fresh)s THEN 0 ELSE billing_failure_count END) + 1,
            next_billing_attempt_at = CASE
                WHEN (CASE WHEN %(fresh)s THEN 0 ELSE billing_failure_count END) + 1 >= %(park_at)s THEN NULL
                ELSE now() + (%(ladder)s::interval[])[(CASE WHEN %(fresh)s THEN 0 ELSE billing_failure_count END) + 1]
            END,
            billing_parked_at = CASE
                WHEN (CASE WHEN %(fresh)s THEN 0 ELSE billing_failure_count END) + 1 >= %(park_at)s THEN now()
                ELSE NULL
            END,
            last_billing_error = %(error)s,
            updated_at = now()
        WHERE id = %(id)s
        RETURNING billing_failure_count, next_billing_attempt_at, billing_parked_at, now()
    """
    with connection.cursor() as cursor:
        cursor.execute(
            sql,
            {
                "id": subscription_id,
                "error": error[:2000],
                "fresh": fresh,
                "park_at": PARK_AT_FAILURE,
                "ladder": list(LADDER),
            },
        )
        return cursor.fetchone()


# -- Usage billing (docs/decisions/0164, 0165) ----------------------------------------------

# The advisory lock key of meter-event inserts: each insert holds it shared until it commits; a close takes
# and drops it exclusively before reading usage (:func:`usage_barrier`). 0x68637573 is "hcus".
USAGE_INGEST_LOCK = 0x68637573


def ingest_time_locked() -> datetime:
    """USAGE_INGEST_LOCK (shared) then ``clock_timestamp()``: the time a meter-event insert validates against.

    Read after the lock is held, not the transaction's start (``now()``): a close's barrier either waits
    for this transaction's commit, or ran before this time, and then this time is past that close's
    period end + grace, so the events it accepts belong to a later period (docs/decisions/0165).
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock_shared(%s), clock_timestamp()", [USAGE_INGEST_LOCK])
        return cursor.fetchone()[1]


def usage_barrier() -> None:
    """USAGE_BARRIER: wait until every meter-event insert in flight has committed or rolled back.

    Takes USAGE_INGEST_LOCK exclusively and drops it at once (a session lock, so it does not last the
    transaction): inserts that hold it shared finish first; new ones wait only for this moment. The
    usage statement that follows (a new snapshot in READ COMMITTED) sees every event accepted before it.
    Call it before locking any customer row: an insert's foreign-key check takes a key-share lock on its
    customer while it holds the shared lock.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s), pg_advisory_unlock(%s)", [USAGE_INGEST_LOCK, USAGE_INGEST_LOCK])


def usage_hold_locked() -> None:
    """USAGE_INGEST_LOCK exclusively until the transaction ends: no meter-event insert is in flight, and none
    starts before this commit. A change or an immediate cancel that bills usage up to its instant takes it, so
    the events it aggregates are all there are before that instant, and an insert after it reads the customer's
    new ``usage_billed_until`` (docs/decisions/0170). Same caution as :func:`usage_barrier` on customer rows.
    """
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [USAGE_INGEST_LOCK])


# The batch's rows as a relation: one JSON parameter, an array of arrays (:func:`insert_meter_events`), the billing
# time ``now`` the default of both instants. Arrays, not objects: half the text to encode and parse, and each field
# taken by its position (decision 0229).
_METER_EVENT_INPUT = """
    WITH input AS (
        SELECT r ->> 0 AS id, r ->> 1 AS identifier, r ->> 2 AS event_name, r ->> 3 AS customer_id,
               (r ->> 4)::bigint AS value, r -> 5 AS payload,
               COALESCE((r ->> 6)::timestamptz, (r ->> 7)::timestamptz, %(now)s) AS ts,
               COALESCE((r ->> 7)::timestamptz, %(now)s) AS created_at
        FROM jsonb_array_elements(%(rows)s::jsonb) AS r
    )"""

# The usual case, a batch none of whose identifiers was stored before: every guard row and every event inserted by a
# plain INSERT each. A stored (or concurrently inserted, then committed) identifier makes the guard's primary key
# raise, and :func:`insert_meter_events` runs INSERT_METER_EVENTS_ADMITTED instead (decision 0215).
INSERT_METER_EVENTS = f"""{_METER_EVENT_INPUT}, guarded AS (
        INSERT INTO billing_metereventidentifier
            (tenant_id, livemode, identifier, event_id, event_timestamp, created_at)
        SELECT %(tenant)s, %(livemode)s, identifier, id, ts, %(now)s FROM input
    )
    INSERT INTO billing_meterevent
        (id, tenant_id, livemode, event_name, customer_id, identifier, value, payload, timestamp, created_at)
    SELECT id, %(tenant)s, %(livemode)s, event_name, customer_id, identifier, value, payload, ts, created_at
    FROM input
"""

# A batch with an identifier stored before: each identifier's guard row inserted ``ON CONFLICT DO NOTHING``, and only
# the events whose guard row was inserted, joined back on the event table's whole key (decisions 0164, 0174); the
# identifiers not admitted are returned (the duplicates).
INSERT_METER_EVENTS_ADMITTED = f"""{_METER_EVENT_INPUT}, admitted AS (
        INSERT INTO billing_metereventidentifier
            (tenant_id, livemode, identifier, event_id, event_timestamp, created_at)
        SELECT %(tenant)s, %(livemode)s, identifier, id, ts, %(now)s FROM input
        ON CONFLICT DO NOTHING
        RETURNING event_id, event_timestamp
    ), inserted AS (
        INSERT INTO billing_meterevent
            (id, tenant_id, livemode, event_name, customer_id, identifier, value, payload, timestamp, created_at)
        SELECT i.id, %(tenant)s, %(livemode)s, i.event_name, i.customer_id, i.identifier, i.value, i.payload,
               i.ts, i.created_at
        FROM input i JOIN admitted a ON a.event_id = i.id AND a.event_timestamp = i.ts
    )
    SELECT i.identifier FROM input i
    WHERE NOT EXISTS (SELECT 1 FROM admitted a WHERE a.event_id = i.id AND a.event_timestamp = i.ts)
"""

METER_EVENT_GUARD_KEY = "billing_metereventidentifier_pkey"


def insert_meter_events(*, tenant_id: str, livemode: bool, rows: list[tuple], now: datetime) -> set[str]:
    """Insert a batch of meter events; the identifiers not inserted (stored before: duplicates), usually none.

    ``rows``: ``(id, identifier, event_name, customer_id, value (int or None), payload (a dict)[, ts, created_at])``
    (the two instants ISO 8601 texts or None; ``created_at`` defaults to ``now``, ``ts`` to ``created_at``),
    identifiers distinct within the batch. Each event is admitted by its identifier's row in the guard, whose
    primary key (tenant, livemode, identifier) no two events share, whichever connection inserts them: so no
    event is ever stored twice. First INSERT_METER_EVENTS, plain inserts under a savepoint (the usual batch has
    no stored identifier); when the guard's key refuses a row (an identifier stored before, by a retry or by a
    concurrent batch that the insert waited for), the savepoint is rolled back and INSERT_METER_EVENTS_ADMITTED
    admits the others. Rows are sent sorted by identifier, so two batches sharing identifiers take their keys in
    the same order and cannot deadlock. The batch travels as one bound JSON parameter, an array of arrays:
    decisions 0172, 0174, 0215, 0229.
    """
    if not rows:
        return set()
    rows.sort(key=_IDENTIFIER)
    params = {"tenant": tenant_id, "livemode": livemode, "rows": json.dumps(rows, separators=(",", ":")), "now": now}
    # savepoint=False: no savepoint of Django's inside a caller's transaction (ours is below, three statements where
    # Django's atomic() makes the same three with more bookkeeping); a transaction of its own in autocommit.
    with transaction.atomic(savepoint=False), connection.cursor() as cursor:
        cursor.execute("SAVEPOINT meter_events")
        try:
            # Bound, not rendered: no 200 kB literal written into the statement's text and parsed there (0229).
            with bound_cursor() as bound:
                bound.execute(INSERT_METER_EVENTS, params)
        except IntegrityError as exc:
            if getattr(getattr(exc.__cause__, "diag", None), "constraint_name", None) != METER_EVENT_GUARD_KEY:
                raise  # the savepoint stays open: the caller's transaction rolls back whole
            cursor.execute("ROLLBACK TO SAVEPOINT meter_events; RELEASE SAVEPOINT meter_events")
            cursor.execute(INSERT_METER_EVENTS_ADMITTED, params)
            return {row[0] for row in cursor.fetchall()}
        cursor.execute("RELEASE SAVEPOINT meter_events")
        return set()


_IDENTIFIER = itemgetter(1)


def prune_meter_event_identifiers(retention: timedelta, limit: int) -> int:
    """Delete at most ``limit`` guard rows of meter events taken more than ``retention`` before the database's now(),
    oldest first (the ``created_at`` index); the number deleted (docs/decisions/0219)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "DELETE FROM billing_metereventidentifier WHERE ctid = ANY(ARRAY("
            " SELECT ctid FROM billing_metereventidentifier WHERE created_at < now() - %s"
            " ORDER BY created_at LIMIT %s))",
            [retention, limit],
        )
        return cursor.rowcount


class IngestMeter(NamedTuple):
    """What an insert needs of a meter (:func:`ingest_meters`)."""

    id: str
    formula: str
    customer_key: str
    value_key: str


def ingest_meters(tenant_id: str, livemode: bool, names: set[str]) -> dict[str, IngestMeter]:
    """The meters of the tenant and mode named by ``names`` (event names), by event name: one query without the
    ORM (building and compiling the queryset cost a batch more than running it, decision 0216)."""
    if not names:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT event_name, id, formula, customer_key, value_key FROM billing_meter"
            " WHERE tenant_id = %s AND livemode = %s AND event_name = ANY(%s)",
            [tenant_id, livemode, array_literal(names)],
        )
        return {name: IngestMeter(*rest) for name, *rest in cursor.fetchall()}


def ingest_customers(tenant_id: str, livemode: bool, ids: set[str]) -> dict[str, tuple[str | None, str | None]]:
    """What an insert needs of the customers of the tenant and mode among ``ids``: by id, ``(test clock id, usage
    billed-until per meter as JSON text or None when empty)`` (0170). One array parameter, written as the array's
    text here (the driver's quoting of 1,000 elements one by one cost a batch 2 ms; decision 0216) and read as the
    same untyped literal the driver sends for a list, so the plan is the same; no model instances. The caller
    decodes a cutoff only for a customer that has one (most have billed nothing early)."""
    if not ids:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, test_clock_id, NULLIF(usage_billed_until, '{}'::jsonb)::text FROM billing_customer"
            " WHERE tenant_id = %s AND livemode = %s AND id = ANY(%s)",
            [tenant_id, livemode, array_literal(ids)],
        )
        return {id_: (clock, billed) for id_, clock, billed in cursor.fetchall()}


# One meter's aggregate over the events joined as ``e`` (``m`` the meter): the formula's value, 0 for none.
_AGGREGATE = """
    CASE m.formula
        WHEN 'sum' THEN COALESCE(SUM(e.value), 0)
        WHEN 'count' THEN COUNT(e.id)
        WHEN 'max' THEN COALESCE(MAX(e.value), 0)
        WHEN 'last' THEN COALESCE((array_agg(e.value ORDER BY e.timestamp DESC, e.id DESC)
                                   FILTER (WHERE e.id IS NOT NULL))[1], 0)
        WHEN 'unique_count' THEN COUNT(DISTINCT e.payload ->> m.value_key)
    END
"""

# The events of one wanted row ``w`` of meter ``m``: the usage index's range, one customer's events of one name.
# ``c`` is the row's customer only when it is of the meter's tenant and mode (else NULL, which matches no event):
# every event's tenant and mode are its customer's (the insert takes them from the customer it looked up under
# them) and customer ids are unique across tenants, so this stands for the event's own tenant and mode, which the
# narrower usage index no longer carries (decision 0222).
_EVENTS_OF_W = """
    FROM billing_meterevent e
    WHERE e.customer_id = c.id
      AND e.event_name = m.event_name AND e.timestamp >= w.start_at AND e.timestamp < w.end_at
"""

# One scalar subquery per formula, of which CASE runs only the meter's: each is a range scan of the usage index for
# one customer, so no step sorts or hashes the events of every customer together (an ordered aggregate such as
# ``last``'s made PostgreSQL sort all the rows, payloads included, on disk: decision 0172).
AGGREGATE_USAGE = f"""
    WITH wanted AS (
        SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::timestamptz[], %s::timestamptz[])
            AS w(key, customer_id, meter_id, start_at, end_at)
    )
    SELECT w.key,
        CASE m.formula
            WHEN 'sum' THEN (SELECT COALESCE(SUM(e.value), 0) {_EVENTS_OF_W})
            WHEN 'count' THEN (SELECT COUNT(*) {_EVENTS_OF_W})
            WHEN 'max' THEN (SELECT COALESCE(MAX(e.value), 0) {_EVENTS_OF_W})
            WHEN 'last' THEN COALESCE((SELECT e.value {_EVENTS_OF_W} ORDER BY e.timestamp DESC, e.id DESC LIMIT 1), 0)
            WHEN 'unique_count' THEN (SELECT COUNT(DISTINCT e.payload ->> m.value_key) {_EVENTS_OF_W})
        END
    FROM wanted w
    JOIN billing_meter m ON m.id = w.meter_id
    LEFT JOIN billing_customer c ON c.id = w.customer_id AND c.tenant_id = m.tenant_id AND c.livemode = m.livemode
"""


def aggregate_usage(wanted: list[tuple[str, str, str, datetime, datetime]]) -> dict[str, int]:
    """AGGREGATE_USAGE: each ``(key, customer id, meter id, start, end)``'s quantity, in one statement.

    The quantity is the meter's formula over the customer's events of the meter's ``event_name`` with
    ``start <= timestamp < end``, computed by PostgreSQL from one range of the usage index per row (no event is
    loaded into Python); 0 when there are none. Run inside the close's transaction, so the invoice and
    its usage lines commit together or not at all; :func:`usage_barrier` runs first.
    """
    if not wanted:
        return {}
    usage_barrier()
    return usage_quantities(wanted)


# The rows of one meter and one window, many customers at once (:func:`usage_quantities`): the meter's aggregate per
# customer, for the customers of the meter's tenant and mode only (as AGGREGATE_USAGE's join). The window and the
# event name are constants, so PostgreSQL prunes the partitions when it plans and picks by the numbers: a range of
# the usage index per customer for a few, a (parallel) scan of the window's rows for many (decision 0230).
AGGREGATE_USAGE_GROUPED = """
    SELECT e.customer_id, {aggregate}
    FROM billing_meterevent e
    WHERE e.customer_id IN (
            SELECT c.id FROM billing_customer c
            WHERE c.id = ANY(%(customers)s::text[]) AND c.tenant_id = %(tenant)s AND c.livemode = %(livemode)s
        )
      AND e.event_name = %(event_name)s AND e.timestamp >= %(start)s AND e.timestamp < %(end)s
    GROUP BY e.customer_id
"""
# The formulas a grouped statement computes. ``last`` and ``unique_count`` stay per row: grouped, each would sort or
# hash every event of the window (decision 0172).
_GROUPED_AGGREGATES = {"sum": "COALESCE(SUM(e.value), 0)", "count": "COUNT(*)", "max": "COALESCE(MAX(e.value), 0)"}


class _GroupedMeter(NamedTuple):
    tenant_id: str
    livemode: bool
    event_name: str
    formula: str


def usage_quantities(wanted: list[tuple[str, str, str, datetime, datetime]]) -> dict[str, int]:
    """AGGREGATE_USAGE without the barrier: the quantities as committed now, for reading (the operators' console);
    a close uses :func:`aggregate_usage`, which first waits for the inserts in flight.

    Rows sharing a meter of a ``sum``, ``count`` or ``max`` formula and a window, at least
    ``HARDCOUNT_USAGE_GROUPED_MIN`` of them, are aggregated by one AGGREGATE_USAGE_GROUPED each; every other row by
    one AGGREGATE_USAGE. Both give each row the same quantity (decision 0230). The close's barrier makes the
    statements agree: no event of a window it aggregates can be accepted after it (decision 0165).
    """
    if not wanted:
        return {}
    windows: dict[tuple[str, datetime, datetime], list[tuple]] = {}
    for row in wanted:
        windows.setdefault((row[2], row[3], row[4]), []).append(row)
    minimum = settings.HARDCOUNT_USAGE_GROUPED_MIN
    meters = _grouped_meters({meter_id for (meter_id, _, _), rows in windows.items() if len(rows) >= minimum})
    quantities: dict[str, int] = {}
    rest: list[tuple] = []
    for (meter_id, start, end), rows in windows.items():
        meter = meters.get(meter_id) if len(rows) >= minimum else None
        if meter is None:
            rest.extend(rows)
            continue
        by_customer = _grouped_quantities(meter, start, end, {row[1] for row in rows})
        quantities.update((row[0], by_customer.get(row[1], 0)) for row in rows)
    if rest:
        columns = list(zip(*rest, strict=True))
        with connection.cursor() as cursor:
            cursor.execute(AGGREGATE_USAGE, [list(c) for c in columns])
            quantities.update((row[0], int(row[1])) for row in cursor.fetchall())
    return quantities


def _grouped_meters(meter_ids: set[str]) -> dict[str, _GroupedMeter]:
    """The meters among ``meter_ids`` whose formula a grouped statement computes, by id."""
    if not meter_ids:
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, tenant_id, livemode, event_name, formula FROM billing_meter"
            " WHERE id = ANY(%s::text[]) AND formula = ANY(%s::text[])",
            [array_literal(meter_ids), array_literal(_GROUPED_AGGREGATES)],
        )
        return {meter_id: _GroupedMeter(*rest) for meter_id, *rest in cursor.fetchall()}


def _grouped_quantities(meter: _GroupedMeter, start: datetime, end: datetime, customers: set[str]) -> dict[str, int]:
    """AGGREGATE_USAGE_GROUPED: ``meter``'s aggregate of each of ``customers``' events in ``[start, end)``, by
    customer id; a customer without events (or not of the meter's tenant and mode) is absent."""
    statement = AGGREGATE_USAGE_GROUPED.format(aggregate=_GROUPED_AGGREGATES[meter.formula])
    params = {
        "customers": array_literal(customers),
        "tenant": meter.tenant_id,
        "livemode": meter.livemode,
        "event_name": meter.event_name,
        "start": start,
        "end": end,
    }
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return {customer_id: int(value) for customer_id, value in cursor.fetchall()}


EVENT_SUMMARIES = f"""
    SELECT CASE WHEN %s THEN date_trunc('day', e.timestamp AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' END AS bucket,
           {_AGGREGATE}
    FROM billing_meter m
    JOIN billing_meterevent e
        ON e.tenant_id = m.tenant_id AND e.livemode = m.livemode AND e.customer_id = %s
       AND e.event_name = m.event_name AND e.timestamp >= %s AND e.timestamp < %s
    WHERE m.id = %s
    GROUP BY bucket, m.formula
    ORDER BY bucket NULLS FIRST
"""


def event_summaries(
    meter_id: str, customer_id: str, start: datetime, end: datetime, *, by_day: bool
) -> list[tuple[datetime | None, int]]:
    """EVENT_SUMMARIES: the meter's aggregate of a customer's events in ``[start, end)``: ``[(day or None, value)]``.

    ``by_day`` groups by UTC day (Stripe's ``value_grouping_window=day``); days without events are absent.
    """
    with connection.cursor() as cursor:
        cursor.execute(EVENT_SUMMARIES, [by_day, customer_id, start, end, meter_id])
        return [(row[0], int(row[1])) for row in cursor.fetchall()]
