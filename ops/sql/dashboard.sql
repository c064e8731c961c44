-- The billing figures of the operators' dashboard (ops/dashboard.py, docs/decisions/0137-dashboard-figures.md).
-- Each statement aggregates in the database and returns a few rows per mode and currency, never a row per
-- subscription or invoice. Amounts are integer minor units of their currency. Objects on a test clock are left
-- out of every money figure: their times are the clock's, so "today" and "this month" mean nothing for them.

-- name: mrr_by_currency
-- Monthly recurring revenue per mode and currency: every active or past_due subscription's price normalized to a
-- month (a year is 1/12, a week 52/12, a day 365/12 of a month, divided by the interval count), summed, then rounded
-- once to minor units. Trialing subscriptions pay nothing yet and are left out; so are subscriptions on a test clock.
SELECT s.livemode,
       p.currency,
       round(sum(p.amount::numeric
                 * CASE p.interval WHEN 'month' THEN 1 WHEN 'year' THEN 1 / 12.0
                                   WHEN 'week' THEN 52 / 12.0 WHEN 'day' THEN 365 / 12.0 END
                 / p.interval_count))::bigint AS mrr,
       count(*) AS subscriptions
FROM billing_subscription s
JOIN billing_price p ON p.id = s.price_id
WHERE s.status IN ('active', 'past_due') AND s.test_clock_id IS NULL
GROUP BY s.livemode, p.currency
ORDER BY s.livemode, p.currency;

-- name: collected_by_currency
-- Money collected per mode and currency since the start of today and of this month (UTC, the database's now()):
-- succeeded payment attempts that moved money (not those settled without a charge), by completion time. The scan is
-- bounded on the attempts' time-ordered primary key by %(since_id)s (the id floor a day before the month began).
SELECT a.livemode,
       a.currency,
       COALESCE(sum(a.amount) FILTER (WHERE a.completed_at >= date_trunc('day', now(), 'UTC')), 0)::bigint AS today,
       sum(a.amount)::bigint AS month,
       count(*) AS charges
FROM billing_paymentattempt a
JOIN billing_invoice i ON i.id = a.invoice_id
JOIN billing_customer c ON c.id = i.customer_id
WHERE a.id >= %(since_id)s
  AND a.outcome = 'succeeded' AND NOT a.settled_without_charge
  AND a.completed_at >= date_trunc('month', now(), 'UTC')
  AND c.test_clock_id IS NULL
GROUP BY a.livemode, a.currency
ORDER BY a.livemode, a.currency;

-- name: in_dunning_by_currency
-- Amount due on open invoices whose dunning run is active, per mode and currency, with the number of invoices
-- (the active runs are read through the partial index dunning_due_idx).
SELECT i.livemode, i.currency, sum(i.amount_due)::bigint AS amount, count(*) AS invoices
FROM dunning_dunningrun r
JOIN billing_invoice i ON i.id = r.invoice_id
JOIN billing_customer c ON c.id = i.customer_id
WHERE r.status = 'active' AND i.status = 'open' AND c.test_clock_id IS NULL
GROUP BY i.livemode, i.currency
ORDER BY i.livemode, i.currency;

-- name: failing_by_currency
-- Amount due on open invoices whose charge got no answer and whose subscription is waiting on the retry ladder or
-- parked, per mode and currency (the failing subscriptions are read through subscription_waiting_idx and
-- subscription_parked_idx); an invoice in dunning is counted there instead.
SELECT i.livemode, i.currency, sum(i.amount_due)::bigint AS amount, count(*) AS invoices
FROM billing_subscription s
JOIN billing_invoice i ON i.subscription_id = s.id AND i.status = 'open'
WHERE (s.next_billing_attempt_at IS NOT NULL OR s.billing_parked_at IS NOT NULL)
  AND s.status IN ('trialing', 'active', 'past_due') AND s.test_clock_id IS NULL
  AND NOT EXISTS (SELECT 1 FROM dunning_dunningrun r WHERE r.invoice_id = i.id AND r.status = 'active')
GROUP BY i.livemode, i.currency
ORDER BY i.livemode, i.currency;

-- name: webhook_backlog_by_endpoint
-- Queued deliveries (pending or retrying) per endpoint, and how many of them are due now, for the endpoints that
-- have some, are disabled, or whose circuit is open now (flagged); open circuits first, then the longest queues.
-- The queued deliveries are read through the partial index delivery_due_idx.
WITH queued AS (
    SELECT endpoint_id, count(*) AS queued, count(*) FILTER (WHERE fire_after <= now()) AS due
    FROM outbox_delivery
    WHERE status IN ('pending', 'retrying')
    GROUP BY endpoint_id
)
SELECT w.id, w.livemode, w.url, w.enabled, w.disabled_reason,
       COALESCE(w.circuit_open_until > now(), false) AS circuit_open, w.circuit_open_until,
       w.consecutive_failures, COALESCE(q.queued, 0) AS queued, COALESCE(q.due, 0) AS due
FROM outbox_webhookendpoint w
LEFT JOIN queued q ON q.endpoint_id = w.id
WHERE w.deleted_at IS NULL AND (q.queued > 0 OR w.circuit_open_until > now() OR NOT w.enabled)
ORDER BY circuit_open DESC, queued DESC, w.id
LIMIT %(limit)s;
