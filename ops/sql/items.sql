-- The doctor's checks of subscription items, pending invoice items and prorations
-- (docs/reference/billing-changes.md). Each statement returns one row (ref, detail) per violation of the invariant
-- its description states; a clean database returns none. ops/doctor.py runs them in file order (docs/decisions/0060,
-- 0121, 0146).

-- name: proration_matches_its_inputs
-- Every proration item's amount is its recorded full amount × remaining_s / period_s, rounded once to the minor unit,
-- half away from zero (billing.services.proration.prorate, docs/decisions/0141), with its inputs recorded and in
-- range (0 ≤ remaining_s ≤ period_s, period_s > 0).
SELECT id AS ref,
       CASE WHEN proration_full_amount IS NULL OR proration_remaining_s IS NULL OR proration_period_s IS NULL
                 THEN 'proration of ' || amount || ' without its recorded inputs'
            WHEN proration_period_s <= 0 OR proration_remaining_s < 0 OR proration_remaining_s > proration_period_s
                 THEN 'remaining ' || proration_remaining_s || ' s of a ' || proration_period_s || ' s period'
            ELSE 'amount ' || amount || ' but ' || proration_full_amount || ' × ' || proration_remaining_s || ' / '
                 || proration_period_s || ' rounds to ' || expected
       END AS detail
FROM (SELECT ii.*,
             CASE WHEN proration_period_s > 0
                  THEN sign(proration_full_amount)
                       * div(2 * abs(proration_full_amount)::numeric * proration_remaining_s + proration_period_s,
                             2 * proration_period_s::numeric)
             END AS expected
      FROM billing_invoiceitem ii WHERE ii.proration) p
WHERE expected IS NULL OR proration_remaining_s < 0 OR proration_remaining_s > proration_period_s
   OR amount <> expected;

-- name: invoice_item_on_one_invoice
-- A pending invoice item is billed at most once: an item on an invoice has exactly one line, on that invoice, of the
-- item's amount and currency; an item still pending has no line on any invoice.
SELECT ii.id AS ref,
       CASE WHEN ii.invoice_id IS NULL
                 THEN 'pending, yet billed by ' || l.lines || ' line(s) on ' || l.invoices
            WHEN l.lines IS NULL THEN 'on invoice ' || ii.invoice_id || ' without a line'
            ELSE 'on invoice ' || ii.invoice_id || ' but billed by ' || l.lines || ' line(s) on ' || l.invoices
                 || ' for ' || l.amount || ' ' || l.currencies
       END AS detail
FROM billing_invoiceitem ii
LEFT JOIN (SELECT invoice_item_id, count(*) AS lines, sum(amount) AS amount,
                  string_agg(DISTINCT invoice_id, ', ') AS invoices, count(DISTINCT invoice_id) AS n_invoices,
                  min(invoice_id) AS invoice_id, string_agg(DISTINCT currency, ', ') AS currencies
           FROM billing_invoicelineitem WHERE invoice_item_id IS NOT NULL GROUP BY invoice_item_id) l
       ON l.invoice_item_id = ii.id
WHERE (ii.invoice_id IS NULL AND l.lines IS NOT NULL)
   OR (ii.invoice_id IS NOT NULL
       AND (l.lines IS NULL OR l.lines <> 1 OR l.invoice_id <> ii.invoice_id OR l.amount <> ii.amount
            OR l.currencies <> ii.currency));

-- name: pending_invoice_item_swept
-- No invoice item is left pending by an invoice that should have swept it: none was created before the period of a
-- later collected cycle invoice of its subscription (for an item of no subscription: of any subscription of its
-- customer) in its currency. Collected: open, paid, or a draft waiting for tax, the invoices whose close sweeps; a
-- paused period's invoice (void, uncollectible, kept as a draft) sweeps nothing (docs/decisions/0142, 0144).
SELECT DISTINCT ON (ii.id) ii.id AS ref,
       'pending since ' || ii.created_at || ', but invoice ' || i.id || ' of [' || i.period_start || ', '
       || i.period_end || ') did not sweep it' AS detail
FROM billing_invoiceitem ii
JOIN billing_invoice i
  ON i.customer_id = ii.customer_id AND i.currency = ii.currency AND i.billing_reason = 'subscription_cycle'
 AND (ii.subscription_id IS NULL OR i.subscription_id = ii.subscription_id)
WHERE ii.invoice_id IS NULL
  AND ii.created_at < i.period_start AND ii.created_at < i.created_at
  AND (i.status IN ('open', 'paid') OR (i.status = 'draft' AND i.tax_status = 'pending'))
ORDER BY ii.id, i.period_start;

-- name: billable_subscription_has_items
-- Every billable subscription (trialing, active, past_due: docs/decisions/0053) has one item at least, and its
-- price is one of its items' prices (a period's invoice bills its items, docs/decisions/0140).
SELECT s.id AS ref, s.status || ' subscription without items' AS detail
FROM billing_subscription s
WHERE s.status IN ('trialing', 'active', 'past_due')
  AND NOT EXISTS (SELECT 1 FROM billing_subscriptionitem si WHERE si.subscription_id = s.id)
UNION ALL
SELECT s.id, 'price ' || s.price_id || ' is none of its items'' prices'
FROM billing_subscription s
WHERE s.status IN ('trialing', 'active', 'past_due')
  AND EXISTS (SELECT 1 FROM billing_subscriptionitem si WHERE si.subscription_id = s.id)
  AND NOT EXISTS (SELECT 1 FROM billing_subscriptionitem si
                  WHERE si.subscription_id = s.id AND si.price_id = s.price_id);
