"""Billing's SQL that the ORM cannot say cleanly, each statement named with the guarantee it gives.

Every statement runs on the caller's connection, inside the caller's transaction; times come
from PostgreSQL's ``now()`` (one clock authority, docs/reference/roles-and-leases.md) unless a test
clock's time is passed as ``as_of``. The due predicate is written once, here (:func:`due_predicate`),
and every statement that asks "is this subscription due" (the claim, the close's re-lock, the page
close's lock through :func:`due_condition`) takes it from there. Locks follow the order of
:mod:`billing.lock_objects`.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL

from billing.models import Subscription

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


def due_predicate(
    *, test_clock_id: str | None, as_of: datetime | None, failing_too: bool = False, paused: bool = False
) -> tuple[str, list[object]]:
    """DUE: the SQL condition "this ``billing_subscription`` row is due", and its ``%s`` parameters in order.

    Due: a billable status (:data:`billing.models.subscriptions.BILLABLE_STATUSES`),
    ``next_billing_at <= as_of`` (``now()`` when None), not waiting (``next_billing_attempt_at``
    unset or passed), not parked, and on the clock ``test_clock_id`` (None: wall-clock
    subscriptions only, the ``test_clock_id IS NULL`` of the due-scan index), and collection not
    paused for the due period (:data:`_PERIOD_PAUSED`; ``paused=True`` asks the opposite: the due
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
        _PERIOD_PAUSED if paused else f"NOT {_PERIOD_PAUSED}",
    ]
    params: list[object] = [list(Subscription.BILLABLE_STATUSES), *([test_clock_id] if test_clock_id else []), as_of]
    if not failing_too:
        terms.append(_NOT_FAILING)
    return " AND ".join(terms), params


def due_condition(*, test_clock_id: str | None, as_of: datetime | None) -> RawSQL:
    """:func:`due_predicate` as a boolean expression for ``Subscription`` querysets: ``.filter(due_condition(…))``."""
    # The text is this module's own; every value in it is a bound parameter.
    return RawSQL(*due_predicate(test_clock_id=test_clock_id, as_of=as_of), output_field=BooleanField())  # noqa: S611


def claim_due_page(
    *,
    livemode: bool,
    tenant_id: str | None,
    test_clock_id: str | None,
    as_of: datetime | None,
    exclude: list[str],
    page_size: int,
    paused: bool = False,
) -> list[tuple[str, int]]:
    """CLAIM_DUE_PAGE: up to ``page_size`` due subscriptions as ``(id, periods_billed)``, oldest due first.

    Due as :func:`due_predicate` says (wall-clock subscriptions only, unless ``test_clock_id``
    names the clock whose subscriptions are drained), of mode ``livemode`` (and tenant
    ``tenant_id`` when given), not in ``exclude`` (this run's attempted ones). ``FOR UPDATE SKIP
    LOCKED`` passes over rows another transaction is closing right now; the CTE applies ``LIMIT``
    once, so a page never exceeds ``page_size``. The claim commits at once: the close re-locks
    each subscription and re-checks it is still due for the same period
    (:func:`lock_due_subscription`), and the invoice's unique index is the hard guard
    (docs/decisions/0010-drain-claims-and-parallel-closes.md). ``paused``: claim the due periods
    whose collection is paused instead (:func:`due_predicate`).
    """
    due, due_params = due_predicate(test_clock_id=test_clock_id, as_of=as_of, paused=paused)
    tenant_filter = "AND tenant_id = %s" if tenant_id else ""
    sql = f"""
        WITH due AS (
            SELECT id, periods_billed, next_billing_at
            FROM billing_subscription
            WHERE livemode = %s
              AND {due}
              AND NOT (id = ANY(%s::text[]))
              {tenant_filter}
            ORDER BY next_billing_at
            LIMIT %s
            FOR UPDATE SKIP LOCKED
        )
        SELECT id, periods_billed FROM due ORDER BY next_billing_at
    """
    with connection.cursor() as cursor:
        cursor.execute(sql, [livemode, *due_params, exclude, *([tenant_id] if tenant_id else []), page_size])
        return [(row[0], row[1]) for row in cursor.fetchall()]


def still_due(subscription_ids: list[str], *, as_of: datetime | None) -> list[str]:
    """STILL_DUE: which of ``subscription_ids`` are due again right after their close.

    A subscription several periods behind is due again once one period is billed; a failed
    one whose failure was not saved is still due. The drain puts these (and only these) in its
    exclude list, which keeps the list, sent with every claim, as short as docs/reference/billing.md
    allows. It asks only the date term of :func:`due_predicate`, so one that the close left waiting
    on the retry ladder joins the list too.
    """
    if not subscription_ids:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM billing_subscription WHERE id = ANY(%s::text[]) AND {_DUE_BY}", [subscription_ids, as_of]
        )
        return [row[0] for row in cursor.fetchall()]


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
