-- The doctor's checks of payment attempts and charges (docs/reference/billing.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: paid_invoice_has_one_success
-- A paid invoice has exactly one succeeded payment attempt: a charge, or the settled-without-charge record of a zero
-- or below-minimum amount.
SELECT i.id AS ref, 'paid with ' || count(a.id) || ' succeeded payment attempts' AS detail
FROM billing_invoice i
LEFT JOIN billing_paymentattempt a ON a.invoice_id = i.id AND a.outcome = 'succeeded'
WHERE i.status = 'paid'
GROUP BY i.id
HAVING count(a.id) <> 1;

-- name: invoice_at_most_one_success
-- No invoice has two succeeded payment attempts: at most one successful charge per invoice (docs/reference/guarantees.md).
SELECT invoice_id AS ref, count(*) || ' succeeded payment attempts ('
       || string_agg(id, ', ' ORDER BY attempt_number) || ')' AS detail
FROM billing_paymentattempt
WHERE outcome = 'succeeded'
GROUP BY invoice_id
HAVING count(*) > 1;

-- name: succeeded_payment_marks_invoice_paid
-- An invoice with a succeeded payment attempt is paid: money taken is never left recorded against an open, void or
-- uncollectible invoice.
SELECT i.id AS ref, i.status || ' invoice has succeeded payment attempt ' || a.id AS detail
FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
WHERE a.outcome = 'succeeded' AND i.status <> 'paid';

-- name: payment_attempt_amount_matches_invoice
-- Every charge carries the invoice's amount_due and currency as they were when it was reserved: the invoice is frozen
-- once finalised, so the body under an idempotency key never changes (docs/reference/billing.md), except that a
-- credit note issued on the open invoice lowers amount_due for the attempts after it (docs/decisions/0158).
WITH later_credit AS (
    SELECT a.id, coalesce(sum(CASE WHEN c.status = 'issued' AND c.created_at > a.started_at THEN c.total
                                   WHEN c.status = 'void' AND c.created_at <= a.started_at
                                        AND c.voided_at > a.started_at THEN -c.total
                                   ELSE 0 END), 0) AS amount
    FROM billing_paymentattempt a
    JOIN billing_creditnote c ON c.invoice_id = a.invoice_id AND c.type = 'pre_payment'
    GROUP BY a.id
)
SELECT a.id AS ref, 'attempt charged ' || a.amount || ' ' || a.currency || ' for invoice ' || i.id
       || ' whose amount_due is ' || i.amount_due || ' ' || i.currency
       || ' (+ ' || coalesce(l.amount, 0) || ' credited after the attempt)' AS detail
FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
LEFT JOIN later_credit l ON l.id = a.id
WHERE NOT a.settled_without_charge
  AND (a.amount <> i.amount_due + coalesce(l.amount, 0) OR a.currency <> i.currency);

-- name: payment_attempt_numbers_contiguous
-- An invoice's payment attempts are numbered 1..n without a gap or a duplicate.
SELECT invoice_id AS ref, count(*) || ' attempts numbered '
       || string_agg(attempt_number::text, ',' ORDER BY attempt_number) AS detail
FROM billing_paymentattempt
GROUP BY invoice_id
HAVING min(attempt_number) <> 1 OR max(attempt_number) <> count(*)
    OR count(DISTINCT attempt_number) <> count(*);

-- name: one_payment_intent_per_invoice
-- An invoice has one PaymentIntent: its attempts all name the invoice's payment_intent_id, and no PaymentIntent is
-- shared by two invoices (docs/reference/billing.md).
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
HAVING count(*) > 1;

-- name: idempotency_key_one_body
-- An idempotency key is used for one invoice and one body only (amount, currency, payment method): a retry under the
-- same key sends the same request (docs/reference/billing.md).
SELECT min(id) AS ref, 'key ' || quote_literal(idempotency_key) || ' used by '
       || count(DISTINCT invoice_id) || ' invoices with '
       || count(DISTINCT (amount, currency, payment_method)) || ' bodies' AS detail
FROM billing_paymentattempt
WHERE idempotency_key <> ''
GROUP BY idempotency_key
HAVING count(DISTINCT invoice_id) > 1 OR count(DISTINCT (amount, currency, payment_method)) > 1;

-- name: settled_without_charge_only_below_minimum
-- Only a zero or below-minimum amount_due is settled without a gateway call, and such an amount never reaches the
-- gateway (docs/reference/billing.md; Stripe's minimum charge amounts).
SELECT a.id AS ref, 'settled without charge, but amount_due ' || i.amount_due || ' ' || i.currency
       || ' is chargeable (minimum ' || coalesce(m.amount, 1) || ')' AS detail
FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
LEFT JOIN unnest(%(minimum_charge_currencies)s::text[], %(minimum_charge_amounts)s::int[]) AS m(currency, amount)
       ON m.currency = i.currency
WHERE a.settled_without_charge AND i.amount_due >= coalesce(m.amount, 1)
UNION ALL
SELECT a.id, 'settled without charge but outcome ' || a.outcome || ', PaymentIntent '
       || coalesce(nullif(a.payment_intent_id, ''), 'none')
FROM billing_paymentattempt a
WHERE a.settled_without_charge AND (a.outcome <> 'succeeded' OR a.payment_intent_id <> '')
UNION ALL
-- (The attempt's own amount: the invoice's amount_due when it was reserved, before any later credit note.)
SELECT a.id, 'charged at the gateway, but its amount ' || a.amount || ' ' || i.currency
       || ' is below the minimum ' || coalesce(m.amount, 1)
FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
LEFT JOIN unnest(%(minimum_charge_currencies)s::text[], %(minimum_charge_amounts)s::int[]) AS m(currency, amount)
       ON m.currency = i.currency
WHERE NOT a.settled_without_charge AND a.amount < coalesce(m.amount, 1);

-- name: payment_outcome_not_left_unknown
-- No charge stays in limbo: a payment attempt whose outcome is unknown (the call was sent, its answer lost) is
-- resolved, by retrieval or a same-key re-send, within the in-flight window plus one billing tick (parameter
-- unknown_after_s, default 5 × the gateway timeout + the billing interval). An attempt on a test clock is dated by the
-- clock, so its age is read from the wall-clock time in its id (when it was first sent).
SELECT a.id AS ref, 'outcome unknown since ' || a.started_at || ' for invoice ' || a.invoice_id
       || ' (' || i.status || ')' AS detail
FROM billing_paymentattempt a JOIN billing_invoice i ON i.id = a.invoice_id
JOIN billing_customer c ON c.id = i.customer_id
WHERE a.outcome = 'unknown'
  AND CASE WHEN c.test_clock_id IS NULL THEN a.started_at < now() - make_interval(secs => %(unknown_after_s)s)
           ELSE substr(split_part(a.id, '_', 2), 1, 10) COLLATE "C" < %(unknown_after_prefix)s END;
