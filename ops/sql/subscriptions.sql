-- The doctor's checks of subscription status, billing failure state and test clocks (docs/reference/billing.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: subscription_status_matches_invoices
-- A subscription's status agrees with what it owes: past_due ⇒ it has an open invoice; active or trialing ⇒ none of
-- its open invoices was declined (a decline makes it past_due, docs/reference/billing.md).
SELECT s.id AS ref, 'past_due without an open invoice' AS detail
FROM billing_subscription s
WHERE s.status = 'past_due'
  AND NOT EXISTS (SELECT 1 FROM billing_invoice i WHERE i.subscription_id = s.id AND i.status = 'open')
UNION ALL
SELECT s.id, s.status || ' with declined open invoice ' || i.id
FROM billing_subscription s JOIN billing_invoice i ON i.subscription_id = s.id
WHERE s.status IN ('active', 'trialing') AND i.status = 'open'
  AND EXISTS (SELECT 1 FROM billing_paymentattempt a WHERE a.invoice_id = i.id AND a.outcome = 'declined');

-- name: canceled_subscription_bills_nothing
-- A canceled subscription is never due again: next_billing_at null (a charge recorded after a racing cancel leaves it
-- as the cancel wrote it, docs/reference/billing.md#cancelling).
SELECT id AS ref, 'canceled but next_billing_at ' || next_billing_at AS detail
FROM billing_subscription
WHERE status = 'canceled' AND next_billing_at IS NOT NULL;

-- name: parked_subscription_has_eight_failures
-- A parked subscription (billing_parked_at set) has failed at least 8 times in a row.
SELECT id AS ref, 'parked at ' || billing_parked_at || ' after ' || billing_failure_count || ' failures'
       AS detail
FROM billing_subscription
WHERE billing_parked_at IS NOT NULL AND billing_failure_count < 8;

-- name: waiting_subscription_failure_state
-- A subscription that is not parked waits (next_billing_attempt_at set) exactly when it has 1..7 failures in a row;
-- with no failure it neither waits nor is parked.
SELECT id AS ref,
       CASE WHEN next_billing_attempt_at IS NULL
            THEN billing_failure_count || ' failures but no next_billing_attempt_at'
            ELSE 'waiting until ' || next_billing_attempt_at || ' with ' || billing_failure_count
                 || ' failures' END AS detail
FROM billing_subscription
WHERE billing_parked_at IS NULL
  AND (next_billing_attempt_at IS NOT NULL) <> (billing_failure_count BETWEEN 1 AND 7);

-- name: test_clock_subscription_has_no_failure_state
-- A subscription on a test clock never saves billing failures: no failure count, no waiting, not parked (docs/reference/billing.md:
-- failures on a clock are covered by the run's exclude list only).
SELECT id AS ref, 'on test clock ' || test_clock_id || ' with ' || billing_failure_count || ' failures'
       || CASE WHEN next_billing_attempt_at IS NOT NULL THEN ', waiting' ELSE '' END
       || CASE WHEN billing_parked_at IS NOT NULL THEN ', parked' ELSE '' END AS detail
FROM billing_subscription
WHERE test_clock_id IS NOT NULL
  AND (billing_failure_count <> 0 OR next_billing_attempt_at IS NOT NULL OR billing_parked_at IS NOT NULL);

-- name: test_clocks_in_test_mode
-- Test clocks, and the customers and subscriptions on them, are test-mode rows; a subscription on a clock is on its
-- customer's clock (docs/reference/domain.md: test clocks are test mode only).
SELECT id AS ref, 'test clock in live mode' AS detail FROM billing_testclock WHERE livemode
UNION ALL
SELECT id, 'live customer on test clock ' || test_clock_id FROM billing_customer
WHERE livemode AND test_clock_id IS NOT NULL
UNION ALL
SELECT s.id, 'subscription on test clock ' || coalesce(s.test_clock_id, 'none') || ' but its customer '
       || c.id || ' is on ' || coalesce(c.test_clock_id, 'none')
FROM billing_subscription s JOIN billing_customer c ON c.id = s.customer_id
WHERE s.test_clock_id IS DISTINCT FROM c.test_clock_id;

-- name: test_clock_times_on_its_timeline
-- Nothing written for an object on a test clock is dated by the wall clock (docs/decisions/0082): no started_at or
-- completed_at of its payment attempts, created_at of its ledger entries or created of its events (about the clock,
-- its customers, subscriptions, invoices, ledger entries, dunning runs and billing runs) is the moment the row was
-- written (within an hour of the wall-clock time in the row's id) while lying off the clock's timeline, which runs
-- from the time the clock was created at (its test_clock.created event; unbounded without one) to its frozen_time.
-- A clock never moves backwards and its objects take the time it is at, so such a time is not one the clock
-- produced; one on the timeline may be the clock's own and is not reported, nor is a time far from the row's
-- writing (a service asked to bill ahead of its clock). A re-sent attempt keeps the id of its first send.
WITH clock AS (
    SELECT c.id, c.frozen_time AS latest, min(e.created_at) AS earliest
    FROM billing_testclock c
    LEFT JOIN outbox_event e
           ON e.type = 'test_clock.created' AND coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id') = c.id
    GROUP BY c.id, c.frozen_time
), customer_on_clock AS (
    SELECT id, test_clock_id FROM billing_customer WHERE test_clock_id IS NOT NULL
), object_on_clock AS (
    SELECT id, test_clock_id FROM customer_on_clock
    UNION ALL SELECT id, test_clock_id FROM billing_subscription WHERE test_clock_id IS NOT NULL
    UNION ALL SELECT i.id, c.test_clock_id FROM billing_invoice i JOIN customer_on_clock c ON c.id = i.customer_id
    UNION ALL SELECT l.id, c.test_clock_id FROM billing_ledgerentry l JOIN customer_on_clock c ON c.id = l.customer_id
    UNION ALL SELECT id, test_clock_id FROM dunning_dunningrun WHERE test_clock_id IS NOT NULL
    UNION ALL SELECT id, test_clock_id FROM billing_billingrun WHERE test_clock_id IS NOT NULL
    UNION ALL SELECT id, id FROM billing_testclock
), stamp AS (
    SELECT a.id AS ref, c.test_clock_id, 'payment attempt started_at' AS what, a.started_at AS at
    FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
    JOIN customer_on_clock c ON c.id = i.customer_id
    UNION ALL
    SELECT a.id, c.test_clock_id, 'payment attempt completed_at', a.completed_at
    FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
    JOIN customer_on_clock c ON c.id = i.customer_id
    UNION ALL
    SELECT l.id, c.test_clock_id, 'ledger entry created_at', l.created_at
    FROM billing_ledgerentry l JOIN customer_on_clock c ON c.id = l.customer_id
    UNION ALL
    SELECT e.id, o.test_clock_id, e.type || ' event created', e.created_at
    FROM outbox_event e JOIN object_on_clock o ON o.id = coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id')
), off_timeline AS (
    SELECT s.ref, s.what, s.at, k.id AS clock_id, k.latest, k.earliest,
           -- The wall-clock millisecond in the id (hardcount/ids.py: its first 10 base-32 digits).
           to_timestamp((SELECT sum((strpos('0123456789abcdefghjkmnpqrstvwxyz',
                                             substr(split_part(s.ref, '_', 2), n, 1)) - 1)::numeric
                                    * power(32::numeric, 10 - n))
                         FROM generate_series(1, 10) AS n) / 1000) AS written_at
    FROM stamp s JOIN clock k ON k.id = s.test_clock_id
    WHERE s.at > k.latest OR s.at < k.earliest
)
SELECT ref, what || ' ' || at || ', the wall-clock time it was written at, is '
       || CASE WHEN at > latest THEN 'after the frozen_time ' || latest ELSE 'before the first time ' || earliest END
       || ' of test clock ' || clock_id AS detail
FROM off_timeline
WHERE at BETWEEN written_at - interval '1 hour' AND written_at + interval '1 hour';
