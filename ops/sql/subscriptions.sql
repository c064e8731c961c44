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
