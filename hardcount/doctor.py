"""The money-invariant sweep behind ``python manage.py doctor`` (SPEC §9, issue 9).

Each :class:`Check` is one read-only SQL statement that returns the rows violating one
invariant, as ``(ref, detail)``: ``ref`` is the id of the offending object (an invoice,
a subscription, a delivery …) and ``detail`` says what is wrong in words. A clean
database returns no row for any check.

The checks read the tables directly, across every tenant and mode (no tenant scoping:
a cross-tenant reference is itself one of the violations), so they depend only on the
schema and the SPEC, not on the services that write the rows. They run together in one
``READ ONLY`` transaction (``REPEATABLE READ`` when the sweep opens the transaction
itself), so every check sees the same snapshot and ``now()`` is one instant.

The sweep is meant for a quiescent database (after a scenario, before a release): in the
middle of a drain some invariants are legitimately between their two transactions (an
invoice materialised, its charge not yet recorded), and the sweep would report them.

Every statement is written to stay a few hash joins and one aggregate over each table, so
the whole sweep takes seconds on hundreds of thousands of rows (see ``bench/doctor.py``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections, transaction

from hardcount.money import MINIMUM_CHARGE

# The retry ladder of SPEC §4 has seven waiting steps; the eighth failure parks.
PARK_AFTER_FAILURES = 8
# SPEC §6: a delivery gets at most eight attempts.
MAX_DELIVERY_ATTEMPTS = 8
# The role whose fencing token billing runs record (SPEC §3).
BILLING_ROLE = "billing"

OK, FAIL, NOT_CHECKED, ERROR = "ok", "fail", "not checked", "error"


@dataclass(frozen=True)
class Check:
    """One invariant and the SQL that finds its violations.

    ``sql`` selects two text columns, ``ref`` (an object id) and ``detail`` (what is wrong),
    one row per violation. It may use the named parameters listed in :func:`run_checks`
    (``%(reaper_interval_s)s`` …); a literal percent sign must be written ``%%``.
    """

    name: str
    invariant: str
    sql: str


@dataclass
class CheckResult:
    """The outcome of one check: ``status`` is ``ok``, ``fail``, ``not checked`` or ``error``.

    ``violations`` counts every violating row; ``examples`` holds the first few as
    ``"<ref>: <detail>"`` (ordered by ref); ``note`` explains ``not checked`` and ``error``.
    """

    name: str
    invariant: str
    status: str
    violations: int = 0
    examples: list[str] = field(default_factory=list)
    note: str = ""
    duration_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the ``--json`` output of the command)."""
        return {
            "name": self.name,
            "invariant": self.invariant,
            "status": self.status,
            "violations": self.violations,
            "examples": self.examples,
            "note": self.note,
            "duration_ms": round(self.duration_ms, 1),
        }


# Stripe's minimum charge per currency (hardcount.money), as a relation the checks join;
# a currency without a documented minimum has a minimum of 1 minor unit.
_MINIMUM_CHARGE_VALUES = ", ".join(f"('{code}', {amount})" for code, amount in sorted(MINIMUM_CHARGE.items()))


def _minimum_charge(alias: str) -> str:
    return f"(VALUES {_MINIMUM_CHARGE_VALUES}) AS {alias}(currency, amount)"


# The id of the object an event describes: event data is the object's representation
# (billing/representations.py), possibly wrapped as {"object": {...}} like Stripe's.
_EVENT_OBJECT_ID = "coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id')"


def _events_missing(types: tuple[str, ...], needed: str) -> str:
    """SQL for the rows ``(ref, detail)`` of objects that lack an event they must have.

    ``needed`` selects ``(id, tenant_id, livemode, type)``: an object and the type of an event it
    must have. An event of that type, of the same tenant and mode, describing the object
    (:data:`_EVENT_OBJECT_ID`) meets the need. ``types`` lists every type ``needed`` names: only
    events of those types are read.
    """
    type_list = ", ".join(f"'{t}'" for t in types)
    return f"""
        WITH needed AS ({needed}), seen AS (
            SELECT DISTINCT {_EVENT_OBJECT_ID} AS id, e.type, e.tenant_id, e.livemode FROM outbox_event e
            WHERE e.type IN ({type_list})
        )
        SELECT n.id AS ref, 'no ' || n.type || ' event' AS detail
        FROM needed n
        LEFT JOIN seen s ON s.id = n.id AND s.type = n.type AND s.tenant_id = n.tenant_id AND s.livemode = n.livemode
        WHERE s.id IS NULL
        """


# The step of one billing period, multiplied by n, for a subscription joined as s with its price p.
# PostgreSQL adds months and years to the original timestamp and clamps to the month's last
# day, as dateutil.relativedelta does (billing/periods.py); the session time zone is UTC.
_PERIODS_FROM = """
    make_interval(
        years => CASE p.interval WHEN 'year' THEN p.interval_count * {n} ELSE 0 END,
        months => CASE p.interval WHEN 'month' THEN p.interval_count * {n} ELSE 0 END,
        weeks => CASE p.interval WHEN 'week' THEN p.interval_count * {n} ELSE 0 END,
        days => CASE p.interval WHEN 'day' THEN p.interval_count * {n} ELSE 0 END)
"""


def _step(n: str) -> str:
    return _PERIODS_FROM.format(n=f"({n})")


def _period_index(start: str, anchor: str) -> str:
    """SQL for the nearest period index n with ``anchor + n × interval ≈ start``; checked exactly afterwards."""
    return f"""round(extract(epoch FROM ({start} - {anchor})) / 86400.0 / p.interval_count / CASE p.interval
        WHEN 'day' THEN 1 WHEN 'week' THEN 7 WHEN 'month' THEN 30.436875 ELSE 365.2425 END)::int"""


def _on_grid(start: str, end: str, anchor: str) -> str:
    n = _period_index(start, anchor)
    return f"""({anchor} IS NOT NULL AND {n} >= 0
        AND {start} = {anchor} + {_step(n)} AND {end} = {anchor} + {_step(f"{n} + 1")})"""


CHECKS: tuple[Check, ...] = (
    # ---------------------------------------------------------------- invoices and periods
    Check(
        "invoice_one_per_period",
        "At most one non-void invoice per (subscription, billing period) (SPEC §2, §9).",
        """
        SELECT subscription_id AS ref,
               count(*) || ' non-void invoices for the period starting ' || period_start
               || ' (' || string_agg(id, ', ' ORDER BY id) || ')' AS detail
        FROM billing_invoice
        WHERE status <> 'void' AND subscription_id IS NOT NULL
        GROUP BY subscription_id, period_start
        HAVING count(*) > 1
        """,
    ),
    Check(
        "invoice_periods_disjoint",
        "The non-void invoices of a subscription cover disjoint periods (no period billed twice under another start).",
        """
        SELECT id AS ref,
               'period [' || period_start || ', ' || period_end || ') overlaps invoice ' || prev_id
               || ' [' || prev_start || ', ' || prev_end || ')' AS detail
        FROM (SELECT id, period_start, period_end,
                     lag(id) OVER w AS prev_id, lag(period_start) OVER w AS prev_start,
                     lag(period_end) OVER w AS prev_end
              FROM billing_invoice
              WHERE status <> 'void' AND subscription_id IS NOT NULL
              WINDOW w AS (PARTITION BY subscription_id ORDER BY period_start, id)) x
        WHERE prev_end > period_start AND prev_start <> period_start
        """,
    ),
    Check(
        "subscription_periods_contiguous",
        "A subscription's invoiced periods follow each other without a gap: each starts where the previous "
        "one ended (no lost period).",
        """
        SELECT subscription_id AS ref,
               'period starting ' || period_start || ' leaves a gap after the previous period, which ended '
               || prev_end AS detail
        FROM (SELECT subscription_id, period_start,
                     lag(period_end) OVER (PARTITION BY subscription_id ORDER BY period_start, period_end) AS prev_end
              FROM (SELECT DISTINCT subscription_id, period_start, period_end
                    FROM billing_invoice WHERE subscription_id IS NOT NULL) periods) x
        WHERE prev_end < period_start
        """,
    ),
    Check(
        "subscription_next_billing_at_last_period_end",
        "A subscription's next_billing_at is the end of its last invoiced period (billing in advance: the start "
        "of the first period not yet invoiced), neither behind it (a period billed twice) nor past it (a lost "
        "period). The one exception is a last period whose close failed (SPEC §4: the period does not advance): "
        "next_billing_at is then that period's start, and none of its invoices is paid, uncollectible, declined "
        "or waiting for tax, the outcomes that advance a period.",
        """
        WITH last AS (
            SELECT DISTINCT ON (subscription_id) subscription_id, period_start, period_end
            FROM billing_invoice WHERE subscription_id IS NOT NULL
            ORDER BY subscription_id, period_end DESC
        ), advanced AS (
            SELECT DISTINCT i.subscription_id, i.period_start
            FROM billing_invoice i
            WHERE i.subscription_id IS NOT NULL
              AND (i.status IN ('paid', 'uncollectible')
                   OR (i.status = 'draft' AND i.tax_status = 'pending')
                   OR EXISTS (SELECT 1 FROM billing_paymentattempt a
                              WHERE a.invoice_id = i.id AND a.outcome = 'declined'))
        )
        SELECT s.id AS ref,
               'next_billing_at ' || s.next_billing_at || ' but the last invoiced period is ['
               || last.period_start || ', ' || last.period_end || ')'
               || CASE WHEN s.next_billing_at = last.period_start THEN ', which was closed (paid, declined or taxed)'
                       ELSE '' END AS detail
        FROM billing_subscription s
        JOIN last ON last.subscription_id = s.id
        LEFT JOIN advanced ON advanced.subscription_id = s.id AND advanced.period_start = last.period_start
        WHERE s.next_billing_at IS NOT NULL
          AND s.next_billing_at <> last.period_end
          AND NOT (s.next_billing_at = last.period_start AND advanced.subscription_id IS NULL)
        """,
    ),
    Check(
        "subscription_next_billing_on_cycle",
        "next_billing_at is the start of period periods_billed of the subscription's cycle: anchor + "
        "periods_billed × interval (the counter the close relies on agrees with the schedule).",
        f"""
        SELECT s.id AS ref, 'next_billing_at ' || s.next_billing_at || ' but period ' || s.periods_billed
               || ' starts ' || (s.billing_cycle_anchor + {_step("s.periods_billed")}) AS detail
        FROM billing_subscription s JOIN billing_price p ON p.id = s.price_id
        WHERE s.next_billing_at IS NOT NULL
          AND s.next_billing_at <> s.billing_cycle_anchor + {_step("s.periods_billed")}
        """,
    ),
    Check(
        "invoice_period_on_billing_cycle",
        "Every invoice period is one period of its subscription's cycle: [anchor + n × interval, anchor + (n+1) "
        "× interval) from the billing cycle anchor (or the trial end), computed from the anchor (SPEC §2).",
        f"""
        SELECT i.id AS ref,
               'period [' || i.period_start || ', ' || i.period_end || ') is not a period of '
               || p.interval_count || ' ' || p.interval || ' anchored at ' || s.billing_cycle_anchor AS detail
        FROM billing_invoice i
        JOIN billing_subscription s ON s.id = i.subscription_id
        JOIN billing_price p ON p.id = s.price_id
        WHERE NOT {_on_grid("i.period_start", "i.period_end", "s.billing_cycle_anchor")}
          AND NOT coalesce({_on_grid("i.period_start", "i.period_end", "s.trial_end")}, false)
        """,
    ),
    Check(
        "invoice_lines_match_invoice",
        "Every invoice has line items; each line bills the invoice's period, and a price line is quantity × the "
        "price's amount.",
        """
        SELECT i.id AS ref, 'has no line items' AS detail
        FROM billing_invoice i
        WHERE NOT EXISTS (SELECT 1 FROM billing_invoicelineitem l WHERE l.invoice_id = i.id)
        UNION ALL
        SELECT l.invoice_id, 'line ' || l.id || ' bills [' || l.period_start || ', ' || l.period_end
               || ') but the invoice period is [' || i.period_start || ', ' || i.period_end || ')'
        FROM billing_invoicelineitem l JOIN billing_invoice i ON i.id = l.invoice_id
        WHERE l.period_start <> i.period_start OR l.period_end <> i.period_end
        UNION ALL
        SELECT l.invoice_id, 'line ' || l.id || ' amount ' || l.amount || ' is not ' || l.quantity || ' × '
               || p.amount
        FROM billing_invoicelineitem l JOIN billing_price p ON p.id = l.price_id
        WHERE l.amount <> l.quantity * p.amount
        """,
    ),
    Check(
        "invoice_subtotal_equals_lines",
        "An invoice's subtotal is the sum of its line items.",
        """
        SELECT i.id AS ref, 'subtotal ' || i.subtotal || ' but the lines sum to ' || coalesce(l.amount, 0) AS detail
        FROM billing_invoice i
        LEFT JOIN (SELECT invoice_id, sum(amount) AS amount FROM billing_invoicelineitem GROUP BY invoice_id) l
               ON l.invoice_id = i.id
        WHERE i.subtotal <> coalesce(l.amount, 0)
        """,
    ),
    Check(
        "invoice_total_is_subtotal_plus_tax",
        "total = subtotal + tax on every invoice.",
        """
        SELECT id AS ref, 'total ' || total || ' but subtotal ' || subtotal || ' + tax ' || tax || ' = '
               || (subtotal + tax) AS detail
        FROM billing_invoice
        WHERE total <> subtotal + tax
        """,
    ),
    Check(
        "invoice_amount_due_is_total_minus_credit",
        "amount_due = total − credit_applied, and is never negative (credit never exceeds the total).",
        """
        SELECT id AS ref, 'amount_due ' || amount_due || ' but total ' || total || ' − credit_applied '
               || credit_applied || ' = ' || (total - credit_applied) AS detail
        FROM billing_invoice
        WHERE amount_due <> total - credit_applied OR amount_due < 0
        """,
    ),
    Check(
        "money_amounts_nonnegative",
        "Prices, line items, invoice amounts and charges are never negative; an invoice is never paid more than "
        "its amount_due.",
        """
        SELECT id AS ref, 'negative amount (subtotal ' || subtotal || ', tax ' || tax || ', total ' || total
               || ', amount_paid ' || amount_paid || ')' AS detail
        FROM billing_invoice
        WHERE subtotal < 0 OR tax < 0 OR total < 0 OR amount_paid < 0
        UNION ALL
        SELECT id, 'amount_paid ' || amount_paid || ' exceeds amount_due ' || amount_due
        FROM billing_invoice WHERE amount_paid > amount_due
        UNION ALL
        SELECT id, 'negative line amount ' || amount FROM billing_invoicelineitem WHERE amount < 0
        UNION ALL
        SELECT id, 'negative price amount ' || amount FROM billing_price WHERE amount < 0
        UNION ALL
        SELECT id, 'negative payment attempt amount ' || amount FROM billing_paymentattempt WHERE amount < 0
        """,
    ),
    Check(
        "invoice_status_fields",
        "An invoice's fields agree with its status: finalised invoices (open, paid, uncollectible) carry a number "
        "and finalized_at, drafts no number; paid ⇔ paid_at; void ⇒ voided_at; uncollectible ⇒ "
        "marked_uncollectible_at; a pending tax keeps the invoice a draft; no tax is charged while it is pending "
        "or not applicable.",
        """
        SELECT id AS ref, status || ' invoice without ' ||
               CASE WHEN number IS NULL THEN 'a number' ELSE 'finalized_at' END AS detail
        FROM billing_invoice
        WHERE status IN ('open', 'paid', 'uncollectible') AND (number IS NULL OR finalized_at IS NULL)
        UNION ALL
        SELECT id, 'draft invoice carries number ' || number FROM billing_invoice
        WHERE status = 'draft' AND number IS NOT NULL
        UNION ALL
        SELECT id, status || ' invoice ' || CASE WHEN paid_at IS NULL THEN 'without' ELSE 'with' END || ' paid_at'
        FROM billing_invoice WHERE (status = 'paid') <> (paid_at IS NOT NULL)
        UNION ALL
        SELECT id, 'void invoice without voided_at' FROM billing_invoice
        WHERE status = 'void' AND voided_at IS NULL
        UNION ALL
        SELECT id, 'uncollectible invoice without marked_uncollectible_at' FROM billing_invoice
        WHERE status = 'uncollectible' AND marked_uncollectible_at IS NULL
        UNION ALL
        SELECT id, status || ' invoice with tax_status pending' FROM billing_invoice
        WHERE tax_status = 'pending' AND status NOT IN ('draft', 'void')
        UNION ALL
        SELECT id, 'tax ' || tax || ' at ' || tax_rate_bps || ' bps with tax_status ' || tax_status FROM billing_invoice
        WHERE (tax_status IN ('not_applicable', 'pending') AND tax <> 0)
           OR (tax_status = 'not_applicable' AND tax_rate_bps <> 0)
        """,
    ),
    Check(
        "invoice_numbers_gapless",
        "Invoice numbers of each (tenant, mode) run 1..N without a gap or a duplicate, N being the counter's "
        "last_number (SPEC §2: per-tenant gapless number).",
        """
        WITH numbered AS (
            SELECT tenant_id, livemode, id, number,
                   substring(number FROM '([0-9]+)$')::bigint AS n
            FROM billing_invoice WHERE number IS NOT NULL
        ), per_mode AS (
            SELECT tenant_id, livemode, count(*) AS issued, count(DISTINCT n) AS distinct_numbers,
                   min(n) AS lowest, max(n) AS highest
            FROM numbered WHERE n IS NOT NULL GROUP BY tenant_id, livemode
        )
        SELECT id AS ref, 'number ' || quote_literal(number) || ' does not end in a sequence number' AS detail
        FROM numbered WHERE n IS NULL
        UNION ALL
        SELECT coalesce(pm.tenant_id, c.tenant_id),
               CASE WHEN coalesce(pm.livemode, c.livemode) THEN 'live' ELSE 'test' END || ' mode: '
               || coalesce(pm.issued, 0) || ' numbered invoices with ' || coalesce(pm.distinct_numbers, 0)
               || ' distinct numbers in ' || coalesce(pm.lowest, 0) || '..' || coalesce(pm.highest, 0)
               || ', counter at ' || coalesce(c.last_number::text, 'none')
        FROM per_mode pm
        FULL JOIN billing_invoicecounter c ON c.tenant_id = pm.tenant_id AND c.livemode = pm.livemode
        WHERE NOT (coalesce(pm.issued, 0) = coalesce(pm.distinct_numbers, 0)
                   AND coalesce(pm.lowest, 1) = 1
                   AND coalesce(pm.highest, 0) = coalesce(pm.issued, 0)
                   AND coalesce(c.last_number, 0) = coalesce(pm.highest, 0))
        """,
    ),
    Check(
        "invoice_credit_matches_ledger",
        "An invoice's credit_applied is exactly what the ledger took from the customer's balance for it (its "
        "applied_to_invoice entries, negated).",
        """
        SELECT i.id AS ref, 'credit_applied ' || i.credit_applied || ' but the ledger applied '
               || coalesce(-l.amount, 0) AS detail
        FROM billing_invoice i
        LEFT JOIN (SELECT invoice_id, sum(amount) AS amount FROM billing_ledgerentry
                   WHERE reason = 'applied_to_invoice' AND invoice_id IS NOT NULL GROUP BY invoice_id) l
               ON l.invoice_id = i.id
        WHERE i.credit_applied <> coalesce(-l.amount, 0)
        """,
    ),
    # ---------------------------------------------------------------- payments
    Check(
        "paid_invoice_has_one_success",
        "A paid invoice has exactly one succeeded payment attempt: a charge, or the settled-without-charge "
        "record of a zero or below-minimum amount.",
        """
        SELECT i.id AS ref, 'paid with ' || count(a.id) || ' succeeded payment attempts' AS detail
        FROM billing_invoice i
        LEFT JOIN billing_paymentattempt a ON a.invoice_id = i.id AND a.outcome = 'succeeded'
        WHERE i.status = 'paid'
        GROUP BY i.id
        HAVING count(a.id) <> 1
        """,
    ),
    Check(
        "invoice_at_most_one_success",
        "No invoice has two succeeded payment attempts: at most one successful charge per invoice (SPEC §9).",
        """
        SELECT invoice_id AS ref, count(*) || ' succeeded payment attempts ('
               || string_agg(id, ', ' ORDER BY attempt_number) || ')' AS detail
        FROM billing_paymentattempt
        WHERE outcome = 'succeeded'
        GROUP BY invoice_id
        HAVING count(*) > 1
        """,
    ),
    Check(
        "succeeded_payment_marks_invoice_paid",
        "An invoice with a succeeded payment attempt is paid: money taken is never left recorded against an "
        "open, void or uncollectible invoice.",
        """
        SELECT i.id AS ref, i.status || ' invoice has succeeded payment attempt ' || a.id AS detail
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        WHERE a.outcome = 'succeeded' AND i.status <> 'paid'
        """,
    ),
    Check(
        "payment_attempt_amount_matches_invoice",
        "Every charge carries the invoice's amount_due and currency: the invoice is frozen once finalised, so "
        "the body under an idempotency key never changes (SPEC §4).",
        """
        SELECT a.id AS ref, 'attempt charged ' || a.amount || ' ' || a.currency || ' for invoice ' || i.id
               || ' whose amount_due is ' || i.amount_due || ' ' || i.currency AS detail
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        WHERE NOT a.settled_without_charge AND (a.amount <> i.amount_due OR a.currency <> i.currency)
        """,
    ),
    Check(
        "payment_attempt_numbers_contiguous",
        "An invoice's payment attempts are numbered 1..n without a gap or a duplicate.",
        """
        SELECT invoice_id AS ref, count(*) || ' attempts numbered '
               || string_agg(attempt_number::text, ',' ORDER BY attempt_number) AS detail
        FROM billing_paymentattempt
        GROUP BY invoice_id
        HAVING min(attempt_number) <> 1 OR max(attempt_number) <> count(*)
            OR count(DISTINCT attempt_number) <> count(*)
        """,
    ),
    Check(
        "one_payment_intent_per_invoice",
        "An invoice has one PaymentIntent: its attempts all name the invoice's payment_intent_id, and no "
        "PaymentIntent is shared by two invoices (SPEC §4).",
        """
        SELECT a.id AS ref, 'attempt names PaymentIntent ' || a.payment_intent_id || ' but invoice ' || i.id
               || ' has ' || coalesce(nullif(i.payment_intent_id, ''), 'none') AS detail
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        WHERE a.payment_intent_id <> '' AND a.payment_intent_id <> i.payment_intent_id
        UNION ALL
        SELECT min(i.id), 'PaymentIntent ' || i.payment_intent_id || ' is shared by invoices '
               || string_agg(i.id, ', ' ORDER BY i.id)
        FROM billing_invoice i
        WHERE i.payment_intent_id <> ''
        GROUP BY i.payment_intent_id
        HAVING count(*) > 1
        """,
    ),
    Check(
        "idempotency_key_one_body",
        "An idempotency key is used for one invoice and one body only (amount, currency, payment method): a retry "
        "under the same key sends the same request (SPEC §4).",
        """
        SELECT min(id) AS ref, 'key ' || quote_literal(idempotency_key) || ' used by '
               || count(DISTINCT invoice_id) || ' invoices with '
               || count(DISTINCT (amount, currency, payment_method)) || ' bodies' AS detail
        FROM billing_paymentattempt
        WHERE idempotency_key <> ''
        GROUP BY idempotency_key
        HAVING count(DISTINCT invoice_id) > 1 OR count(DISTINCT (amount, currency, payment_method)) > 1
        """,
    ),
    Check(
        "settled_without_charge_only_below_minimum",
        "Only a zero or below-minimum amount_due is settled without a gateway call, and such an amount never "
        "reaches the gateway (SPEC §4; Stripe's minimum charge amounts).",
        f"""
        SELECT a.id AS ref, 'settled without charge, but amount_due ' || i.amount_due || ' ' || i.currency
               || ' is chargeable (minimum ' || coalesce(m.amount, 1) || ')' AS detail
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        LEFT JOIN {_minimum_charge("m")} ON m.currency = i.currency
        WHERE a.settled_without_charge AND i.amount_due >= coalesce(m.amount, 1)
        UNION ALL
        SELECT a.id, 'settled without charge but outcome ' || a.outcome || ', PaymentIntent '
               || coalesce(nullif(a.payment_intent_id, ''), 'none')
        FROM billing_paymentattempt a
        WHERE a.settled_without_charge AND (a.outcome <> 'succeeded' OR a.payment_intent_id <> '')
        UNION ALL
        SELECT a.id, 'charged at the gateway, but amount_due ' || i.amount_due || ' ' || i.currency
               || ' is below the minimum ' || coalesce(m.amount, 1)
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        LEFT JOIN {_minimum_charge("m")} ON m.currency = i.currency
        WHERE NOT a.settled_without_charge AND i.amount_due < coalesce(m.amount, 1)
        """,
    ),
    Check(
        "payment_outcome_not_left_unknown",
        "No charge stays in limbo: a payment attempt whose outcome is unknown (the call was sent, its answer "
        "lost) is resolved, by retrieval or a same-key re-send, within the in-flight window plus one billing "
        "tick (parameter unknown_after_s, default 5 × the gateway timeout + the billing interval).",
        """
        SELECT a.id AS ref, 'outcome unknown since ' || a.started_at || ' for invoice ' || a.invoice_id
               || ' (' || i.status || ')' AS detail
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        WHERE a.outcome = 'unknown' AND a.started_at < now() - make_interval(secs => %(unknown_after_s)s)
        """,
    ),
    # ---------------------------------------------------------------- credit ledger
    Check(
        "ledger_balance_after_running_sum",
        "A customer's ledger entries form one running sum from 0: taken in some order, each entry's "
        "balance_after − amount is the previous entry's balance_after. Entries are ordered by the customer row "
        "lock, not by created_at (a transaction's now() or a test clock's frozen time), so the check is the "
        "order-free form: every balance is left as often as it is reached, except 0 (the start) and the sum "
        "(the end). It finds any lost, stale or mis-summed write; it cannot see a closed loop of entries "
        "detached from the chain, which no single bad write produces.",
        """
        WITH chain_end AS (
            SELECT customer_id, sum(amount) AS final FROM billing_ledgerentry GROUP BY customer_id
        ), step AS (
            SELECT customer_id, balance_after - amount AS balance, 1 AS leaves FROM billing_ledgerentry
            UNION ALL
            SELECT customer_id, balance_after, -1 FROM billing_ledgerentry
            UNION ALL
            SELECT customer_id, 0, -1 FROM chain_end
            UNION ALL
            SELECT customer_id, final, 1 FROM chain_end
        ), unbalanced AS (
            SELECT customer_id, balance, sum(leaves) AS excess FROM step
            GROUP BY customer_id, balance HAVING sum(leaves) <> 0
        )
        SELECT customer_id AS ref,
               'the ledger is not one running sum from 0: '
               || string_agg('balance ' || balance || CASE WHEN excess > 0 THEN ' left ' ELSE ' reached ' END
                             || abs(excess) || ' more time(s) than ' || CASE WHEN excess > 0 THEN 'reached'
                             ELSE 'left' END, ', ' ORDER BY balance) AS detail
        FROM unbalanced
        GROUP BY customer_id
        """,
    ),
    Check(
        "customer_balance_matches_ledger",
        "A customer's credit_balance is where its ledger ends: the sum of its entries (0 with no entry).",
        """
        SELECT c.id AS ref, 'credit_balance ' || c.credit_balance || ' but the ledger sums to '
               || coalesce(l.amount, 0) AS detail
        FROM billing_customer c
        LEFT JOIN (SELECT customer_id, sum(amount) AS amount FROM billing_ledgerentry GROUP BY customer_id) l
               ON l.customer_id = c.id
        WHERE c.credit_balance <> coalesce(l.amount, 0)
        """,
    ),
    # ---------------------------------------------------------------- tenancy and currency
    Check(
        "no_cross_tenant_reference",
        "Nothing crosses tenants or modes: every reference joins two rows of the same tenant and mode, and an "
        "invoice's customer is its subscription's customer (SPEC §2).",
        """
        SELECT i.id AS ref, 'invoice of ' || i.tenant_id || '/' || i.livemode || ' names customer ' || c.id
               || ' of ' || c.tenant_id || '/' || c.livemode AS detail
        FROM billing_invoice i JOIN billing_customer c ON c.id = i.customer_id
        WHERE (i.tenant_id, i.livemode) <> (c.tenant_id, c.livemode)
        UNION ALL
        SELECT i.id, 'invoice of ' || i.tenant_id || '/' || i.livemode || ' names subscription ' || s.id
               || ' of ' || s.tenant_id || '/' || s.livemode || ' (customer ' || s.customer_id || ')'
        FROM billing_invoice i JOIN billing_subscription s ON s.id = i.subscription_id
        WHERE (i.tenant_id, i.livemode, i.customer_id) <> (s.tenant_id, s.livemode, s.customer_id)
        UNION ALL
        SELECT s.id, 'subscription of ' || s.tenant_id || '/' || s.livemode || ' names customer ' || c.id
               || ' of ' || c.tenant_id || '/' || c.livemode
        FROM billing_subscription s JOIN billing_customer c ON c.id = s.customer_id
        WHERE (s.tenant_id, s.livemode) <> (c.tenant_id, c.livemode)
        UNION ALL
        SELECT s.id, 'subscription of ' || s.tenant_id || '/' || s.livemode || ' names price ' || p.id
               || ' of ' || p.tenant_id || '/' || p.livemode
        FROM billing_subscription s JOIN billing_price p ON p.id = s.price_id
        WHERE (s.tenant_id, s.livemode) <> (p.tenant_id, p.livemode)
        UNION ALL
        SELECT l.id, 'line of invoice ' || i.id || ' (' || i.tenant_id || '/' || i.livemode || ') names price '
               || p.id || ' of ' || p.tenant_id || '/' || p.livemode
        FROM billing_invoicelineitem l JOIN billing_invoice i ON i.id = l.invoice_id
        JOIN billing_price p ON p.id = l.price_id
        WHERE (i.tenant_id, i.livemode) <> (p.tenant_id, p.livemode)
        UNION ALL
        SELECT a.id, 'payment attempt of ' || a.tenant_id || '/' || a.livemode || ' for invoice ' || i.id
               || ' of ' || i.tenant_id || '/' || i.livemode
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        WHERE (a.tenant_id, a.livemode) <> (i.tenant_id, i.livemode)
        UNION ALL
        SELECT e.id, 'ledger entry of ' || e.tenant_id || '/' || e.livemode || ' for customer ' || c.id
               || ' of ' || c.tenant_id || '/' || c.livemode
        FROM billing_ledgerentry e JOIN billing_customer c ON c.id = e.customer_id
        WHERE (e.tenant_id, e.livemode) <> (c.tenant_id, c.livemode)
        UNION ALL
        SELECT e.id, 'ledger entry for customer ' || e.customer_id || ' names invoice ' || i.id
               || ' of customer ' || i.customer_id
        FROM billing_ledgerentry e JOIN billing_invoice i ON i.id = e.invoice_id
        WHERE e.customer_id <> i.customer_id
        UNION ALL
        SELECT x.id, x.kind || ' of ' || x.tenant_id || '/' || x.livemode || ' is on test clock ' || k.id
               || ' of ' || k.tenant_id || '/' || k.livemode
        FROM (SELECT id, 'subscription' AS kind, tenant_id, livemode, test_clock_id FROM billing_subscription
              UNION ALL
              SELECT id, 'customer', tenant_id, livemode, test_clock_id FROM billing_customer) x
        JOIN billing_testclock k ON k.id = x.test_clock_id
        WHERE (x.tenant_id, x.livemode) <> (k.tenant_id, k.livemode)
        UNION ALL
        SELECT d.id, 'dunning run of ' || d.tenant_id || '/' || d.livemode || ' for invoice ' || i.id
               || ' of ' || i.tenant_id || '/' || i.livemode
        FROM dunning_dunningrun d JOIN billing_invoice i ON i.id = d.invoice_id
        WHERE (d.tenant_id, d.livemode) <> (i.tenant_id, i.livemode)
        UNION ALL
        SELECT d.id, 'delivery of event ' || e.id || ' (' || e.tenant_id || '/' || e.livemode
               || ') to endpoint ' || w.id || ' of ' || w.tenant_id || '/' || w.livemode
        FROM outbox_delivery d JOIN outbox_event e ON e.id = d.event_id
        JOIN outbox_webhookendpoint w ON w.id = d.endpoint_id
        WHERE (e.tenant_id, e.livemode) <> (w.tenant_id, w.livemode)
        UNION ALL
        SELECT a.id, 'billing attempt of run ' || r.id || ' (' || coalesce(r.tenant_id, 'all tenants') || '/'
               || r.livemode || ') on subscription ' || s.id || ' of ' || s.tenant_id || '/' || s.livemode
        FROM billing_billingattempt a JOIN billing_billingrun r ON r.id = a.run_id
        JOIN billing_subscription s ON s.id = a.subscription_id
        WHERE r.livemode <> s.livemode OR r.tenant_id <> s.tenant_id
        UNION ALL
        SELECT a.id, 'billing attempt on subscription ' || a.subscription_id || ' names invoice ' || i.id
               || ' of subscription ' || coalesce(i.subscription_id, 'none')
        FROM billing_billingattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        WHERE i.subscription_id IS DISTINCT FROM a.subscription_id
        """,
    ),
    Check(
        "currency_consistent",
        "One currency along each chain: price → subscription's customer → invoice → its lines and payment "
        "attempts; ledger entries in their customer's currency.",
        """
        SELECT i.id AS ref, 'invoice in ' || i.currency || ' for customer ' || c.id || ' in '
               || coalesce(nullif(c.currency, ''), 'no currency') AS detail
        FROM billing_invoice i JOIN billing_customer c ON c.id = i.customer_id
        WHERE i.currency <> c.currency
        UNION ALL
        SELECT i.id, 'invoice in ' || i.currency || ' for a subscription to price ' || p.id || ' in '
               || p.currency
        FROM billing_invoice i JOIN billing_subscription s ON s.id = i.subscription_id
        JOIN billing_price p ON p.id = s.price_id
        WHERE i.currency <> p.currency
        UNION ALL
        SELECT s.id, 'subscription to price ' || p.id || ' in ' || p.currency || ' for customer ' || c.id
               || ' in ' || coalesce(nullif(c.currency, ''), 'no currency')
        FROM billing_subscription s JOIN billing_price p ON p.id = s.price_id
        JOIN billing_customer c ON c.id = s.customer_id
        WHERE p.currency <> c.currency
        UNION ALL
        SELECT l.id, 'line in ' || l.currency || ' on invoice ' || i.id || ' in ' || i.currency
        FROM billing_invoicelineitem l JOIN billing_invoice i ON i.id = l.invoice_id
        WHERE l.currency <> i.currency
        UNION ALL
        SELECT a.id, 'payment attempt in ' || a.currency || ' for invoice ' || i.id || ' in ' || i.currency
        FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
        WHERE a.currency <> i.currency
        UNION ALL
        SELECT e.id, 'ledger entry in ' || e.currency || ' for customer ' || c.id || ' in '
               || coalesce(nullif(c.currency, ''), 'no currency')
        FROM billing_ledgerentry e JOIN billing_customer c ON c.id = e.customer_id
        WHERE e.currency <> c.currency
        """,
    ),
    Check(
        "subscription_status_matches_invoices",
        "A subscription's status agrees with what it owes: past_due ⇒ it has an open invoice; active or "
        "trialing ⇒ none of its open invoices was declined (a decline makes it past_due, SPEC §4).",
        """
        SELECT s.id AS ref, 'past_due without an open invoice' AS detail
        FROM billing_subscription s
        WHERE s.status = 'past_due'
          AND NOT EXISTS (SELECT 1 FROM billing_invoice i WHERE i.subscription_id = s.id AND i.status = 'open')
        UNION ALL
        SELECT s.id, s.status || ' with declined open invoice ' || i.id
        FROM billing_subscription s JOIN billing_invoice i ON i.subscription_id = s.id
        WHERE s.status IN ('active', 'trialing') AND i.status = 'open'
          AND EXISTS (SELECT 1 FROM billing_paymentattempt a WHERE a.invoice_id = i.id AND a.outcome = 'declined')
        """,
    ),
    # ---------------------------------------------------------------- billing failure state (SPEC §4)
    Check(
        "parked_subscription_has_eight_failures",
        f"A parked subscription (billing_parked_at set) has failed at least {PARK_AFTER_FAILURES} times in a row.",
        f"""
        SELECT id AS ref, 'parked at ' || billing_parked_at || ' after ' || billing_failure_count || ' failures'
               AS detail
        FROM billing_subscription
        WHERE billing_parked_at IS NOT NULL AND billing_failure_count < {PARK_AFTER_FAILURES}
        """,
    ),
    Check(
        "waiting_subscription_failure_state",
        "A subscription that is not parked waits (next_billing_attempt_at set) exactly when it has "
        f"1..{PARK_AFTER_FAILURES - 1} failures in a row; with no failure it neither waits nor is parked.",
        f"""
        SELECT id AS ref,
               CASE WHEN next_billing_attempt_at IS NULL
                    THEN billing_failure_count || ' failures but no next_billing_attempt_at'
                    ELSE 'waiting until ' || next_billing_attempt_at || ' with ' || billing_failure_count
                         || ' failures' END AS detail
        FROM billing_subscription
        WHERE billing_parked_at IS NULL
          AND (next_billing_attempt_at IS NOT NULL) <> (billing_failure_count BETWEEN 1 AND {PARK_AFTER_FAILURES - 1})
        """,
    ),
    Check(
        "test_clock_subscription_has_no_failure_state",
        "A subscription on a test clock never saves billing failures: no failure count, no waiting, not parked "
        "(SPEC §4: failures on a clock are covered by the run's exclude list only).",
        """
        SELECT id AS ref, 'on test clock ' || test_clock_id || ' with ' || billing_failure_count || ' failures'
               || CASE WHEN next_billing_attempt_at IS NOT NULL THEN ', waiting' ELSE '' END
               || CASE WHEN billing_parked_at IS NOT NULL THEN ', parked' ELSE '' END AS detail
        FROM billing_subscription
        WHERE test_clock_id IS NOT NULL
          AND (billing_failure_count <> 0 OR next_billing_attempt_at IS NOT NULL OR billing_parked_at IS NOT NULL)
        """,
    ),
    Check(
        "test_clocks_in_test_mode",
        "Test clocks, and the customers and subscriptions on them, are test-mode rows; a subscription on a clock "
        "is on its customer's clock (SPEC §2: test clocks are test mode only).",
        """
        SELECT id AS ref, 'test clock in live mode' AS detail FROM billing_testclock WHERE livemode
        UNION ALL
        SELECT id, 'live customer on test clock ' || test_clock_id FROM billing_customer
        WHERE livemode AND test_clock_id IS NOT NULL
        UNION ALL
        SELECT s.id, 'subscription on test clock ' || coalesce(s.test_clock_id, 'none') || ' but its customer '
               || c.id || ' is on ' || coalesce(c.test_clock_id, 'none')
        FROM billing_subscription s JOIN billing_customer c ON c.id = s.customer_id
        WHERE s.test_clock_id IS DISTINCT FROM c.test_clock_id
        """,
    ),
    # ---------------------------------------------------------------- leases and billing runs (SPEC §3)
    Check(
        "billing_run_not_orphaned_by_lease",
        "No billing run is still running under a fencing token that no longer holds the billing lease (the "
        "token moved on, or the lease was released or has expired): a run without a live lease is not doing "
        "work and must have been closed as abandoned.",
        f"""
        SELECT r.id AS ref, 'running under token ' || r.lease_token || ', but the billing lease is '
               || CASE WHEN l.role IS NULL THEN 'absent'
                       WHEN l.token <> r.lease_token THEN 'at token ' || l.token
                       WHEN l.holder IS NULL THEN 'released'
                       ELSE 'expired since ' || l.expires_at END AS detail
        FROM billing_billingrun r
        LEFT JOIN leases_leaderlease l ON l.role = '{BILLING_ROLE}'
        WHERE r.status = 'running' AND r.lease_token IS NOT NULL
          AND (l.role IS NULL OR l.token <> r.lease_token OR l.holder IS NULL OR l.expires_at IS NULL
               OR l.expires_at < now())
        """,
    ),
    Check(
        "no_billing_write_after_lease_lost",
        "A deposed leader writes nothing after its successor took the lease: no billing attempt, and no "
        "completed or failed run, of an older fencing token is dated after the current token's acquired_at "
        "(SPEC §3, §9).",
        f"""
        SELECT a.id AS ref, 'billing attempt of run ' || r.id || ' (token ' || r.lease_token || ') at '
               || a.created_at || ', after token ' || l.token || ' took the lease at ' || l.acquired_at AS detail
        FROM billing_billingattempt a JOIN billing_billingrun r ON r.id = a.run_id
        JOIN leases_leaderlease l ON l.role = '{BILLING_ROLE}'
        WHERE r.lease_token < l.token AND a.created_at > l.acquired_at
        UNION ALL
        SELECT r.id, r.status || ' at ' || r.finished_at || ' under token ' || r.lease_token
               || ', after token ' || l.token || ' took the lease at ' || l.acquired_at
        FROM billing_billingrun r JOIN leases_leaderlease l ON l.role = '{BILLING_ROLE}'
        WHERE r.lease_token < l.token AND r.status IN ('completed', 'failed') AND r.finished_at > l.acquired_at
        """,
    ),
    Check(
        "lease_rows_well_formed",
        "A held lease has a positive fencing token and acquired_at ≤ heartbeat_at ≤ expires_at.",
        """
        SELECT role AS ref, 'held by ' || holder || ' with token ' || token || ', acquired '
               || coalesce(acquired_at::text, 'never')
               || ', heartbeat ' || coalesce(heartbeat_at::text, 'never') || ', expires '
               || coalesce(expires_at::text, 'never') AS detail
        FROM leases_leaderlease
        WHERE holder IS NOT NULL
          AND NOT coalesce(token > 0 AND acquired_at <= heartbeat_at AND heartbeat_at <= expires_at, false)
        """,
    ),
    # ---------------------------------------------------------------- events (SPEC §6: no change without its event)
    Check(
        "invoice_has_created_event",
        "Every invoice has its invoice.created event, in its own tenant and mode.",
        f"""
        SELECT i.id AS ref, 'no invoice.created event' AS detail
        FROM billing_invoice i
        WHERE NOT EXISTS (SELECT 1 FROM outbox_event e
                          WHERE e.type = 'invoice.created' AND {_EVENT_OBJECT_ID} = i.id
                            AND e.tenant_id = i.tenant_id AND e.livemode = i.livemode)
        """,
    ),
    Check(
        "invoice_state_has_event",
        "Every invoice state reached has its event: finalised ⇒ invoice.finalized, paid ⇒ invoice.paid, void ⇒ "
        "invoice.voided, uncollectible ⇒ invoice.marked_uncollectible; a declined attempt ⇒ "
        "invoice.payment_failed.",
        _events_missing(
            (
                "invoice.finalized",
                "invoice.paid",
                "invoice.voided",
                "invoice.marked_uncollectible",
                "invoice.payment_failed",
            ),
            """
            SELECT id, tenant_id, livemode, 'invoice.finalized' AS type FROM billing_invoice
            WHERE finalized_at IS NOT NULL
            UNION ALL
            SELECT id, tenant_id, livemode, 'invoice.paid' FROM billing_invoice WHERE status = 'paid'
            UNION ALL
            SELECT id, tenant_id, livemode, 'invoice.voided' FROM billing_invoice WHERE status = 'void'
            UNION ALL
            SELECT id, tenant_id, livemode, 'invoice.marked_uncollectible' FROM billing_invoice
            WHERE status = 'uncollectible'
            UNION ALL
            SELECT DISTINCT invoice_id, tenant_id, livemode, 'invoice.payment_failed' FROM billing_paymentattempt
            WHERE outcome = 'declined'
            """,
        ),
    ),
    Check(
        "object_has_created_event",
        "Every customer has its customer.created event and every subscription its subscription.created event; a "
        "parked subscription has its subscription.billing_parked event.",
        _events_missing(
            ("customer.created", "subscription.created", "subscription.billing_parked"),
            """
            SELECT id, tenant_id, livemode, 'customer.created' AS type FROM billing_customer
            UNION ALL
            SELECT id, tenant_id, livemode, 'subscription.created' FROM billing_subscription
            UNION ALL
            SELECT id, tenant_id, livemode, 'subscription.billing_parked' FROM billing_subscription
            WHERE billing_parked_at IS NOT NULL
            """,
        ),
    ),
    Check(
        "event_has_its_change",
        "No event without its change: the object an event describes (by its id's prefix: invoice, subscription, "
        "customer, ledger entry, price, test clock, dunning run) exists in the event's tenant and mode; an "
        "invoice, subscription or customer event names an object; an invoice.paid event's invoice is paid. "
        "An object deleted by design (a test_clock.deleted event names it) counts as existing.",
        f"""
        WITH event_object AS (
            SELECT e.id, e.type, e.tenant_id, e.livemode, {_EVENT_OBJECT_ID} AS object_id FROM outbox_event e
        ), object AS (
            SELECT id, tenant_id, livemode FROM billing_invoice
            UNION ALL SELECT id, tenant_id, livemode FROM billing_subscription
            UNION ALL SELECT id, tenant_id, livemode FROM billing_customer
            UNION ALL SELECT id, tenant_id, livemode FROM billing_ledgerentry
            UNION ALL SELECT id, tenant_id, livemode FROM billing_price
            UNION ALL SELECT id, tenant_id, livemode FROM billing_testclock
            UNION ALL SELECT id, tenant_id, livemode FROM dunning_dunningrun
            -- A deleted object (test_clock.deleted) existed: its events, the deletion's included, stand.
            UNION ALL SELECT {_EVENT_OBJECT_ID}, e.tenant_id, e.livemode FROM outbox_event e
            WHERE e.type LIKE '%%.deleted'
        )
        SELECT eo.id AS ref, eo.type || ' names ' || coalesce(eo.object_id, 'no object')
               || CASE WHEN o.id IS NULL THEN ', which does not exist'
                       ELSE ' of ' || o.tenant_id || '/' || o.livemode END
               || ' (the event is of ' || eo.tenant_id || '/' || eo.livemode || ')' AS detail
        FROM event_object eo LEFT JOIN object o ON o.id = eo.object_id
        WHERE CASE WHEN eo.object_id IS NULL
                   THEN split_part(eo.type, '.', 1) IN ('invoice', 'subscription', 'customer')
                   WHEN split_part(eo.object_id, '_', 1) IN ('in', 'sub', 'cus', 'cbtxn', 'price', 'clock', 'dun')
                   THEN o.id IS NULL OR (o.tenant_id, o.livemode) <> (eo.tenant_id, eo.livemode)
                   ELSE false END
        UNION ALL
        SELECT e.id, 'invoice.paid for invoice ' || i.id || ', which is ' || i.status
        FROM outbox_event e JOIN billing_invoice i ON i.id = {_EVENT_OBJECT_ID}
        WHERE e.type = 'invoice.paid' AND i.status <> 'paid'
        """,
    ),
    Check(
        "event_has_its_deliveries",
        "Every event has a delivery to each endpoint of its tenant and mode that is enabled, not deleted, "
        "subscribed to its type and existed when the event was written (by the time in both ids); events older "
        "than the delivery retention are exempt.",
        """
        WITH endpoint AS (
            SELECT w.id, w.tenant_id, w.livemode, w.enabled_events,
                   substr(split_part(w.id, '_', 2), 1, 10) COLLATE "C" AS created_prefix
            FROM outbox_webhookendpoint w
            WHERE w.enabled AND w.deleted_at IS NULL
        ), recent_event AS (
            SELECT e.id, e.type, e.tenant_id, e.livemode,
                   substr(split_part(e.id, '_', 2), 1, 10) COLLATE "C" AS created_prefix
            FROM outbox_event e
            WHERE substr(split_part(e.id, '_', 2), 1, 10) COLLATE "C" >= %(retention_prefix)s
        ), subscribed AS (
            -- (endpoint, event type) pairs, matched once per type rather than once per event.
            SELECT w.id, w.tenant_id, w.livemode, w.created_prefix, t.type
            FROM endpoint w CROSS JOIN (SELECT DISTINCT type FROM recent_event) t
            WHERE EXISTS (SELECT 1 FROM jsonb_array_elements_text(w.enabled_events) pattern
                          WHERE pattern = '*' OR pattern = t.type
                             OR (right(pattern, 2) = '.*' AND starts_with(t.type, left(pattern, -1))))
        )
        SELECT e.id AS ref, e.type || ' has no delivery to endpoint ' || w.id AS detail
        FROM recent_event e
        JOIN subscribed w ON w.tenant_id = e.tenant_id AND w.livemode = e.livemode AND w.type = e.type
             AND w.created_prefix < e.created_prefix
        WHERE NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.event_id = e.id AND d.endpoint_id = w.id)
        """,
    ),
    # ---------------------------------------------------------------- deliveries (SPEC §6)
    Check(
        "delivery_at_most_eight_attempts",
        f"No delivery has more than {MAX_DELIVERY_ATTEMPTS} attempts, counted or recorded.",
        f"""
        SELECT d.id AS ref, 'attempts ' || d.attempts || ', ' || count(a.id) || ' attempt rows' AS detail
        FROM outbox_delivery d LEFT JOIN outbox_deliveryattempt a ON a.delivery_id = d.id
        GROUP BY d.id
        HAVING d.attempts > {MAX_DELIVERY_ATTEMPTS} OR count(a.id) > {MAX_DELIVERY_ATTEMPTS}
        """,
    ),
    Check(
        "delivery_attempt_numbers_contiguous",
        f"A delivery's attempt rows are numbered 1..n without a gap or a duplicate (n ≤ {MAX_DELIVERY_ATTEMPTS}), "
        "and its attempts counter is n (n + 1 while a claim holds the attempt in flight: the claim spends the "
        "attempt before the request is sent).",
        f"""
        SELECT d.id AS ref, 'attempts counter ' || d.attempts || ', attempt rows numbered '
               || coalesce(string_agg(a.number::text, ',' ORDER BY a.number), 'none')
               || CASE WHEN d.claimed_by IS NOT NULL THEN ' (claimed)' ELSE '' END AS detail
        FROM outbox_delivery d LEFT JOIN outbox_deliveryattempt a ON a.delivery_id = d.id
        GROUP BY d.id
        HAVING NOT (count(a.id) = d.attempts OR (d.claimed_by IS NOT NULL AND count(a.id) = d.attempts - 1))
            OR (count(a.id) > 0 AND (min(a.number) <> 1 OR max(a.number) <> count(a.id)
                                     OR count(DISTINCT a.number) <> count(a.id)))
            OR max(a.number) > {MAX_DELIVERY_ATTEMPTS}
        """,
    ),
    Check(
        "delivery_succeeded_by_one_executor",
        "No delivery has succeeded (2xx) attempts recorded by two different executors (SPEC §9: no delivery "
        "recorded as succeeded by two executors).",
        """
        SELECT delivery_id AS ref, count(*) || ' succeeded attempts by executors '
               || string_agg(DISTINCT executor, ', ') AS detail
        FROM outbox_deliveryattempt
        WHERE outcome = 'succeeded' OR status_code BETWEEN 200 AND 299
        GROUP BY delivery_id
        HAVING count(DISTINCT executor) > 1
        """,
    ),
    Check(
        "delivery_status_matches_attempts",
        "A delivery is succeeded exactly when it has a succeeded (2xx) attempt; a succeeded or failed delivery "
        "has completed_at and holds no claim.",
        """
        SELECT d.id AS ref, d.status || ' delivery '
               || CASE WHEN d.status = 'succeeded' AND ok.delivery_id IS NULL THEN 'without a succeeded attempt'
                       WHEN d.status <> 'succeeded' AND ok.delivery_id IS NOT NULL THEN 'with a succeeded attempt'
                       WHEN d.completed_at IS NULL THEN 'without completed_at'
                       ELSE 'still claimed by ' || d.claimed_by END AS detail
        FROM outbox_delivery d
        LEFT JOIN (SELECT DISTINCT delivery_id FROM outbox_deliveryattempt
                   WHERE outcome = 'succeeded' AND status_code BETWEEN 200 AND 299) ok
               ON ok.delivery_id = d.id
        WHERE (d.status = 'succeeded') <> (ok.delivery_id IS NOT NULL)
           OR (d.status IN ('succeeded', 'failed') AND (d.completed_at IS NULL OR d.claimed_by IS NOT NULL))
        """,
    ),
    Check(
        "delivery_claim_not_stale",
        "No pending or retrying delivery stays claimed with a lease that expired longer than the reaper interval "
        "ago (SPEC §6: an expired lease is reclaimable; the reaper re-queues it).",
        """
        SELECT id AS ref, status || ' delivery claimed by ' || claimed_by || ', lease expired at '
               || claim_expires_at AS detail
        FROM outbox_delivery
        WHERE status IN ('pending', 'retrying') AND claimed_by IS NOT NULL
          AND claim_expires_at < now() - make_interval(secs => %(reaper_interval_s)s)
        """,
    ),
    # ---------------------------------------------------------------- dunning (SPEC §5)
    Check(
        "declined_invoice_has_dunning_run",
        "An open invoice whose charge was declined has a dunning run (SPEC §4: a decline starts dunning).",
        """
        SELECT i.id AS ref, 'open invoice with a declined attempt and no dunning run' AS detail
        FROM billing_invoice i
        WHERE i.status = 'open'
          AND EXISTS (SELECT 1 FROM billing_paymentattempt a WHERE a.invoice_id = i.id AND a.outcome = 'declined')
          AND NOT EXISTS (SELECT 1 FROM dunning_dunningrun d WHERE d.invoice_id = i.id)
        """,
    ),
    Check(
        "dunning_run_matches_invoice",
        "A dunning run agrees with its invoice: active ⇒ open (no retry ever charges a paid invoice), recovered "
        "⇒ paid, exhausted ⇒ uncollectible or void; an ended run has ended_at.",
        """
        SELECT d.id AS ref, d.status || ' dunning run for ' || i.status || ' invoice ' || i.id AS detail
        FROM dunning_dunningrun d JOIN billing_invoice i ON i.id = d.invoice_id
        WHERE (d.status = 'active' AND i.status <> 'open')
           OR (d.status = 'recovered' AND i.status <> 'paid')
           OR (d.status = 'exhausted' AND i.status NOT IN ('uncollectible', 'void'))
        UNION ALL
        SELECT d.id, d.status || ' dunning run without ended_at' FROM dunning_dunningrun d
        WHERE d.status <> 'active' AND d.ended_at IS NULL
        """,
    ),
)


def default_unknown_after_s() -> float:
    """How long a payment outcome may stay unknown: the in-flight window (5 × the gateway timeout,
    :func:`billing.services.payments.in_flight_window`) plus one billing interval, by which the
    tick's reconciler has re-sent or retrieved it."""
    return 5 * float(getattr(settings, "HARDCOUNT_GATEWAY_TIMEOUT_S", 20.0)) + float(
        getattr(settings, "HARDCOUNT_BILLING_INTERVAL_S", 3600.0)
    )


def _time_prefix(epoch_ms: int) -> str:
    """The first 10 characters of an id minted at ``epoch_ms`` (see :mod:`hardcount.ids`): its time part."""
    alphabet = "0123456789abcdefghjkmnpqrstvwxyz"
    value = max(epoch_ms, 0) & ((1 << 48) - 1)
    return "".join(alphabet[(value >> (5 * i)) & 31] for i in reversed(range(10)))


def _open_read_only(cursor, *, outermost: bool, statement_timeout_s: float) -> None:
    if outermost:
        # The first statement of the transaction: one snapshot for every check.
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    else:
        # Inside a caller's transaction (tests): READ ONLY may still be set, the isolation may not.
        cursor.execute("SET TRANSACTION READ ONLY")
    cursor.execute("SET LOCAL TIME ZONE 'UTC'")
    # The checks are hash joins and aggregates over whole tables: let them stay in memory.
    cursor.execute("SET LOCAL work_mem = '64MB'")
    cursor.execute("SELECT set_config('statement_timeout', %s, true)", [f"{int(statement_timeout_s * 1000)}ms"])


@contextmanager
def _read_only_cursor(using: str, *, statement_timeout_s: float):
    """A cursor in a ``READ ONLY`` transaction (``REPEATABLE READ`` when not nested in the caller's)
    that is always rolled back: the doctor never writes, whatever its SQL says."""
    connection = connections[using]
    outermost = not connection.in_atomic_block
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            _open_read_only(cursor, outermost=outermost, statement_timeout_s=statement_timeout_s)
            yield cursor
        transaction.set_rollback(True, using=using)


def run_checks(
    *,
    using: str = "default",
    names: list[str] | None = None,
    reaper_interval_s: float = 60.0,
    retention_days: float | None = None,
    unknown_after_s: float | None = None,
    max_examples: int = 5,
    statement_timeout_s: float = 120.0,
) -> list[CheckResult]:
    """Run the checks (all, or those in ``names``) read-only and return one result per check, in order.

    Parameters available to the SQL: ``reaper_interval_s`` (seconds a delivery claim may stay
    expired before the reaper must have re-queued it; default 60), ``unknown_after_s``
    (seconds a payment attempt may stay ``unknown``; default :func:`default_unknown_after_s`)
    and ``retention_prefix`` (the id time prefix of the oldest event whose deliveries are
    still kept: now minus ``retention_days``, default
    ``settings.HARDCOUNT_OUTBOX_RETENTION_DAYS`` or 30).

    Runs in one transaction that is ``READ ONLY`` (and ``REPEATABLE READ`` when not nested in
    the caller's transaction) and always rolled back; a check that errors (e.g. the statement
    timeout) is reported with status ``error`` and the others still run. Raises ``KeyError``
    for an unknown name in ``names``.
    """
    by_name = {c.name: c for c in CHECKS}
    selected = [by_name[n] for n in names] if names else list(CHECKS)
    if retention_days is None:
        retention_days = float(getattr(settings, "HARDCOUNT_OUTBOX_RETENTION_DAYS", 30))
    if unknown_after_s is None:
        unknown_after_s = default_unknown_after_s()
    connection = connections[using]
    if not connection.in_atomic_block:
        # Let Django's connection health check run now, in autocommit, rather than as the
        # first statement of the read-only transaction.
        connection.ensure_connection()
        with connection.cursor():
            pass
    results: list[CheckResult] = []
    with _read_only_cursor(using, statement_timeout_s=statement_timeout_s) as cursor:
        cursor.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        now_ms = cursor.fetchone()[0]
        params = {
            "reaper_interval_s": float(reaper_interval_s),
            "unknown_after_s": float(unknown_after_s),
            "retention_prefix": _time_prefix(now_ms - int(retention_days * 86_400_000)),
            "max_examples": int(max_examples),
        }
        for check in selected:
            results.append(_run_one(connection, cursor, check, params))
    return results


def _run_one(connection, cursor, check: Check, params: dict[str, Any]) -> CheckResult:
    wrapped = f"""
        WITH violation AS MATERIALIZED ({check.sql})
        SELECT (SELECT count(*) FROM violation),
               ARRAY(SELECT ref || ': ' || detail FROM violation ORDER BY ref, detail LIMIT %(max_examples)s)
    """
    started = time.perf_counter()
    sid = transaction.savepoint(using=connection.alias)
    try:
        cursor.execute(wrapped, params)
        count, examples = cursor.fetchone()
    except DatabaseError as exc:
        transaction.savepoint_rollback(sid, using=connection.alias)
        return CheckResult(
            check.name,
            check.invariant,
            ERROR,
            note=str(exc).strip().splitlines()[0],
            duration_ms=(time.perf_counter() - started) * 1000,
        )
    transaction.savepoint_commit(sid, using=connection.alias)
    return CheckResult(
        check.name,
        check.invariant,
        FAIL if count else OK,
        violations=count,
        examples=list(examples),
        duration_ms=(time.perf_counter() - started) * 1000,
    )


# ---------------------------------------------------------------- the gateway (optional, --gateway)

GATEWAY_CHECK = Check(
    "gateway_agrees_with_invoices",
    "The gateway agrees with the books: each paid invoice's PaymentIntent succeeded for its amount_due and "
    "currency; no PaymentIntent of an unpaid invoice succeeded; at the gateway, no invoice has two succeeded "
    "PaymentIntents and every succeeded one is its paid invoice's payment_intent_id.",
    """
    SELECT i.id, i.status, i.amount_due, i.currency, i.payment_intent_id,
           coalesce((SELECT a.payment_intent_id FROM billing_paymentattempt a
                     WHERE a.invoice_id = i.id AND a.outcome = 'succeeded' AND NOT a.settled_without_charge
                       AND a.payment_intent_id <> '' LIMIT 1), '') AS charged_intent,
           EXISTS (SELECT 1 FROM billing_paymentattempt a
                   WHERE a.invoice_id = i.id AND a.outcome = 'succeeded' AND a.settled_without_charge) AS settled
    FROM billing_invoice i
    WHERE i.payment_intent_id <> ''
       OR EXISTS (SELECT 1 FROM billing_paymentattempt a WHERE a.invoice_id = i.id AND a.payment_intent_id <> '')
    ORDER BY i.id DESC
    """,
)
OPTIONAL_CHECKS: tuple[Check, ...] = (GATEWAY_CHECK,)

# The development default of settings.STRIPE_API_KEY: with no API base either, no gateway is configured.
_DEVELOPMENT_STRIPE_KEY = "sk_test_hardcount_localstripe"
# Metadata key under which billing.gateway records the invoice a PaymentIntent charges.
_INVOICE_METADATA_KEY = "hardcount_invoice"
_TENANT_METADATA_KEY = "hardcount_tenant"


def gateway_configured() -> bool:
    """True when settings name a gateway: an API base (localstripe) or a real, non-development key."""
    api_base = getattr(settings, "STRIPE_API_BASE", "")
    api_key = getattr(settings, "STRIPE_API_KEY", "")
    return bool(api_base) or bool(api_key and api_key != _DEVELOPMENT_STRIPE_KEY)


def _stripe_client():
    import stripe

    api_base = getattr(settings, "STRIPE_API_BASE", "")
    return stripe.StripeClient(
        settings.STRIPE_API_KEY,
        base_addresses={"api": api_base} if api_base else None,
        max_network_retries=2,
        http_client=stripe.HTTPXClient(
            timeout=float(getattr(settings, "HARDCOUNT_GATEWAY_TIMEOUT_S", 20.0)), allow_sync_methods=True
        ),
    )


def check_gateway(
    *, using: str = "default", limit: int | None = None, max_examples: int = 5, client=None
) -> CheckResult:
    """Compare the invoices' PaymentIntents with the gateway, through the ``stripe`` library (read-only).

    Retrieves the PaymentIntent of every invoice that names one (at most ``limit`` invoices,
    newest first) and lists the gateway's PaymentIntents (at most ``limit``) to find charges
    the books do not show (a process killed between the charge and its record, left
    unresolved). Returns status ``not checked`` when no gateway is configured and ``error``
    when the gateway cannot be reached; ``client`` overrides the ``stripe.StripeClient``.
    """
    import stripe

    started = time.perf_counter()
    name, invariant = GATEWAY_CHECK.name, GATEWAY_CHECK.invariant
    if client is None and not gateway_configured():
        return CheckResult(name, invariant, NOT_CHECKED, note="no gateway configured (STRIPE_API_BASE unset)")
    invoices = _read_gateway_rows(using, limit)
    client = client or _stripe_client()
    violations: list[str] = []
    try:
        for inv_id, status, amount_due, currency, invoice_intent, charged_intent, settled in invoices:
            intent_id = charged_intent or invoice_intent
            if status == "paid" and settled and not charged_intent:
                continue
            try:
                intent = client.v1.payment_intents.retrieve(intent_id)
            except stripe.InvalidRequestError as exc:
                if status == "paid":
                    violations.append(
                        f"{inv_id}: paid, but PaymentIntent {intent_id} is unknown to the gateway ({exc.http_status})"
                    )
                continue
            if status == "paid":
                if intent.status != "succeeded":
                    violations.append(f"{inv_id}: paid, but PaymentIntent {intent.id} is {intent.status}")
                elif intent.amount != amount_due or intent.currency != currency:
                    violations.append(
                        f"{inv_id}: amount_due {amount_due} {currency}, but PaymentIntent {intent.id} charged "
                        f"{intent.amount} {intent.currency}"
                    )
            elif intent.status == "succeeded":
                violations.append(f"{inv_id}: {status}, but PaymentIntent {intent.id} succeeded at the gateway")
        violations.extend(_gateway_listing_violations(using, client, limit))
    except stripe.StripeError as exc:
        return CheckResult(
            name,
            invariant,
            ERROR,
            violations=len(violations),
            examples=sorted(violations)[:max_examples],
            note=f"gateway unreachable or refused: {type(exc).__name__}: {exc.user_message or exc}",
            duration_ms=(time.perf_counter() - started) * 1000,
        )
    return CheckResult(
        name,
        invariant,
        FAIL if violations else OK,
        violations=len(violations),
        examples=sorted(violations)[:max_examples],
        note=f"{len(invoices)} invoices compared",
        duration_ms=(time.perf_counter() - started) * 1000,
    )


def _read_only_rows(using: str, sql: str, params) -> list[tuple]:
    with _read_only_cursor(using, statement_timeout_s=120.0) as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def _read_gateway_rows(using: str, limit: int | None) -> list[tuple]:
    sql = GATEWAY_CHECK.sql + (" LIMIT %s" if limit is not None else "")
    return _read_only_rows(using, sql, [limit] if limit is not None else [])


def _gateway_listing_violations(using: str, client, limit: int | None) -> list[str]:
    """Succeeded PaymentIntents at the gateway, grouped by the invoice in their metadata.

    Only PaymentIntents of tenants this database holds count (their metadata names the
    tenant): a gateway account shared with another deployment or test database is not ours
    to judge.
    """
    tenants = {row[0] for row in _read_only_rows(using, "SELECT id FROM hardcount_tenant", [])}
    succeeded: dict[str, list[str]] = {}
    seen = 0
    for intent in client.v1.payment_intents.list(params={"limit": 100}).auto_paging_iter():
        seen += 1
        if limit is not None and seen > limit:
            break
        metadata = intent.metadata.to_dict() if intent.metadata else {}
        invoice_id = metadata.get(_INVOICE_METADATA_KEY)
        tenant_id = metadata.get(_TENANT_METADATA_KEY)
        if tenant_id and tenant_id not in tenants:
            continue
        if invoice_id and intent.status == "succeeded":
            succeeded.setdefault(invoice_id, []).append(intent.id)
    if not succeeded:
        return []
    rows = _read_only_rows(
        using,
        "SELECT id, status, payment_intent_id FROM billing_invoice WHERE id = ANY(%s)",
        [list(succeeded)],
    )
    books = {inv_id: (status, intent_id) for inv_id, status, intent_id in rows}
    violations = []
    for invoice_id, intents in sorted(succeeded.items()):
        if len(intents) > 1:
            violations.append(
                f"{invoice_id}: {len(intents)} succeeded PaymentIntents at the gateway ({', '.join(intents)})"
            )
        status, intent_id = books.get(invoice_id, (None, None))
        if status is None:
            violations.append(f"{invoice_id}: PaymentIntent {intents[0]} succeeded for an invoice that does not exist")
        elif status != "paid":
            violations.append(f"{invoice_id}: {status}, but PaymentIntent {intents[0]} succeeded at the gateway")
        elif intent_id not in intents:
            violations.append(
                f"{invoice_id}: paid under PaymentIntent {intent_id or 'none'}, "
                f"but {intents[0]} succeeded at the gateway"
            )
    return violations


# ---------------------------------------------------------------- reporting


def exit_status(results: list[CheckResult]) -> int:
    """0 when every check passed (or was not checked), 1 when any failed, 2 when none failed but one errored."""
    if any(r.status == FAIL for r in results):
        return 1
    if any(r.status == ERROR for r in results):
        return 2
    return 0


def summary(results: list[CheckResult]) -> dict[str, Any]:
    """The JSON document of ``doctor --json``: overall status, counts, and every check's result."""
    failed = [r.name for r in results if r.status == FAIL]
    errored = [r.name for r in results if r.status == ERROR]
    return {
        "status": FAIL if failed else (ERROR if errored else OK),
        "checks": len(results),
        "failed": failed,
        "errored": errored,
        "violations": sum(r.violations for r in results),
        "results": [r.as_dict() for r in results],
    }


def format_table(results: list[CheckResult]) -> str:
    """A plain-text table: check, status, violations, examples (or the note), then a one-line verdict."""
    header = ("check", "status", "violations", "examples")
    rows = [
        (
            r.name,
            r.status.upper() if r.status != OK else r.status,
            str(r.violations),
            "; ".join(r.examples) if r.examples else r.note,
        )
        for r in results
    ]
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(3)]
    lines = [f"{header[0]:<{widths[0]}}  {header[1]:<{widths[1]}}  {header[2]:>{widths[2]}}  {header[3]}"]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[3]))
    for name, status, count, examples in rows:
        lines.append(f"{name:<{widths[0]}}  {status:<{widths[1]}}  {count:>{widths[2]}}  {examples}".rstrip())
    failed = sum(r.status == FAIL for r in results)
    errored = sum(r.status == ERROR for r in results)
    skipped = sum(r.status == NOT_CHECKED for r in results)
    total = sum(r.violations for r in results)
    if failed or errored:
        verdict = f"{failed} of {len(results)} checks failed ({total} violations), {errored} could not run"
    else:
        verdict = f"all {len(results) - skipped} checks passed"
    if skipped:
        verdict += f", {skipped} not checked"
    return "\n".join([*lines, "", verdict]) + "\n"
