-- The doctor's checks of invoices and billing periods (docs/reference/billing.md, docs/reference/domain.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: invoice_one_per_period
-- At most one non-void invoice per (subscription, billing period) (docs/reference/domain.md, docs/reference/guarantees.md);
-- a change invoiced at once (billing_reason subscription_update) is not a period's invoice.
SELECT subscription_id AS ref,
       count(*) || ' non-void invoices for the period starting ' || period_start
       || ' (' || string_agg(id, ', ' ORDER BY id) || ')' AS detail
FROM billing_invoice
WHERE status <> 'void' AND subscription_id IS NOT NULL AND billing_reason = 'subscription_cycle'
GROUP BY subscription_id, period_start
HAVING count(*) > 1;

-- name: invoice_periods_disjoint
-- The non-void invoices of a subscription cover disjoint periods (no period billed twice under another start). The
-- one overlap allowed is a restarted cycle's first period (billing_cycle_anchor=now, docs/decisions/0147): it starts
-- inside the period before, whose unused rest was credited. Its invoice records the restart (or, re-issued after a
-- void, the voided one does).
SELECT id AS ref,
       'period [' || period_start || ', ' || period_end || ') overlaps invoice ' || prev_id
       || ' [' || prev_start || ', ' || prev_end || ')' AS detail
FROM (SELECT id, subscription_id, period_start, period_end,
             lag(id) OVER w AS prev_id, lag(period_start) OVER w AS prev_start,
             lag(period_end) OVER w AS prev_end
      FROM billing_invoice
      WHERE status <> 'void' AND subscription_id IS NOT NULL AND billing_reason = 'subscription_cycle'
      WINDOW w AS (PARTITION BY subscription_id ORDER BY period_start, id)) x
WHERE prev_end > period_start AND prev_start <> period_start
  AND NOT (prev_start < period_start
           AND EXISTS (SELECT 1 FROM billing_invoice r
                       WHERE r.subscription_id = x.subscription_id AND r.period_start = x.period_start
                         AND r.previous_billing_cycle_anchor IS NOT NULL));

-- name: subscription_periods_contiguous
-- A subscription's invoiced periods follow each other without a gap: each starts where the previous one ended (no
-- lost period).
SELECT subscription_id AS ref,
       'period starting ' || period_start || ' leaves a gap after the previous period, which ended '
       || prev_end AS detail
FROM (SELECT subscription_id, period_start,
             lag(period_end) OVER (PARTITION BY subscription_id ORDER BY period_start, period_end) AS prev_end
      FROM (SELECT DISTINCT subscription_id, period_start, period_end
            FROM billing_invoice WHERE subscription_id IS NOT NULL AND billing_reason = 'subscription_cycle') periods) x
WHERE prev_end < period_start;

-- name: subscription_next_billing_at_last_period_end
-- A subscription's next_billing_at is the end of its last invoiced period (billing in advance: the start of the
-- first period not yet invoiced), neither behind it (a period billed twice) nor past it (a lost period). The one
-- exception is a last period whose close failed (docs/reference/billing.md: the period does not advance): next_billing_at is then that
-- period's start, and none of its invoices is paid, uncollectible, declined or waiting for tax, the outcomes that
-- advance a period.
WITH last AS (
    SELECT DISTINCT ON (subscription_id) subscription_id, period_start, period_end
    FROM billing_invoice WHERE subscription_id IS NOT NULL AND billing_reason = 'subscription_cycle'
    ORDER BY subscription_id, period_end DESC
), advanced AS (
    SELECT DISTINCT i.subscription_id, i.period_start
    FROM billing_invoice i
    WHERE i.subscription_id IS NOT NULL AND i.billing_reason = 'subscription_cycle'
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
  AND NOT (s.next_billing_at = last.period_start AND advanced.subscription_id IS NULL);

-- name: subscription_next_billing_on_cycle
-- next_billing_at is the start of period periods_billed of the subscription's cycle: anchor + periods_billed ×
-- interval (the counter the close relies on agrees with the schedule).
SELECT s.id AS ref, 'next_billing_at ' || s.next_billing_at || ' but period ' || s.periods_billed
       || ' starts ' || (s.billing_cycle_anchor + make_interval(
           years => CASE p.interval WHEN 'year' THEN p.interval_count * (s.periods_billed) ELSE 0 END,
           months => CASE p.interval WHEN 'month' THEN p.interval_count * (s.periods_billed) ELSE 0 END,
           weeks => CASE p.interval WHEN 'week' THEN p.interval_count * (s.periods_billed) ELSE 0 END,
           days => CASE p.interval WHEN 'day' THEN p.interval_count * (s.periods_billed) ELSE 0 END)) AS detail
FROM billing_subscription s JOIN billing_price p ON p.id = s.price_id
WHERE s.next_billing_at IS NOT NULL
  AND s.next_billing_at <> s.billing_cycle_anchor + make_interval(
      years => CASE p.interval WHEN 'year' THEN p.interval_count * (s.periods_billed) ELSE 0 END,
      months => CASE p.interval WHEN 'month' THEN p.interval_count * (s.periods_billed) ELSE 0 END,
      weeks => CASE p.interval WHEN 'week' THEN p.interval_count * (s.periods_billed) ELSE 0 END,
      days => CASE p.interval WHEN 'day' THEN p.interval_count * (s.periods_billed) ELSE 0 END);

-- name: invoice_period_on_billing_cycle
-- Every invoice period is one period of its subscription's cycle: [anchor + n × interval, anchor + (n+1) ×
-- interval) from the billing cycle anchor (or the trial end), computed from the anchor (docs/reference/domain.md); a
-- change invoiced at once bills the rest of a period from the change. An invoice before a restarted cycle
-- (billing_cycle_anchor=now, docs/decisions/0147) is on the anchor that the next restart replaced.
WITH restarts AS (
    SELECT subscription_id, period_start, previous_billing_cycle_anchor
    FROM billing_invoice WHERE previous_billing_cycle_anchor IS NOT NULL
), earlier_cycle AS (
    SELECT DISTINCT ON (i.id) i.id, r.previous_billing_cycle_anchor AS anchor
    FROM billing_invoice i
    JOIN restarts r ON r.subscription_id = i.subscription_id AND r.period_start > i.period_start
    WHERE i.billing_reason = 'subscription_cycle'
    ORDER BY i.id, r.period_start
)
SELECT i.id AS ref,
       'period [' || i.period_start || ', ' || i.period_end || ') is not a period of '
       || p.interval_count || ' ' || p.interval || ' anchored at ' || a.anchor AS detail
FROM billing_invoice i
JOIN billing_subscription s ON s.id = i.subscription_id
JOIN billing_price p ON p.id = s.price_id
LEFT JOIN earlier_cycle e ON e.id = i.id
CROSS JOIN LATERAL (SELECT coalesce(e.anchor, s.billing_cycle_anchor) AS anchor) a
-- The nearest period index n with anchor + n × interval ≈ period_start, from either anchor;
-- the WHERE clause then checks start and end exactly.
CROSS JOIN LATERAL (
    SELECT round(extract(epoch FROM (i.period_start - a.anchor)) / 86400.0 / p.interval_count
                 / CASE p.interval WHEN 'day' THEN 1 WHEN 'week' THEN 7 WHEN 'month' THEN 30.436875
                                   ELSE 365.2425 END)::int AS from_anchor,
           round(extract(epoch FROM (i.period_start - s.trial_end)) / 86400.0 / p.interval_count
                 / CASE p.interval WHEN 'day' THEN 1 WHEN 'week' THEN 7 WHEN 'month' THEN 30.436875
                                   ELSE 365.2425 END)::int AS from_trial_end
) n
WHERE i.billing_reason = 'subscription_cycle'
  AND NOT (a.anchor IS NOT NULL AND n.from_anchor >= 0
           AND i.period_start = a.anchor + make_interval(
               years => CASE p.interval WHEN 'year' THEN p.interval_count * (n.from_anchor) ELSE 0 END,
               months => CASE p.interval WHEN 'month' THEN p.interval_count * (n.from_anchor) ELSE 0 END,
               weeks => CASE p.interval WHEN 'week' THEN p.interval_count * (n.from_anchor) ELSE 0 END,
               days => CASE p.interval WHEN 'day' THEN p.interval_count * (n.from_anchor) ELSE 0 END)
           AND i.period_end = a.anchor + make_interval(
               years => CASE p.interval WHEN 'year' THEN p.interval_count * (n.from_anchor + 1) ELSE 0 END,
               months => CASE p.interval WHEN 'month' THEN p.interval_count * (n.from_anchor + 1) ELSE 0 END,
               weeks => CASE p.interval WHEN 'week' THEN p.interval_count * (n.from_anchor + 1) ELSE 0 END,
               days => CASE p.interval WHEN 'day' THEN p.interval_count * (n.from_anchor + 1) ELSE 0 END))
  AND NOT coalesce((s.trial_end IS NOT NULL AND n.from_trial_end >= 0
                    AND i.period_start = s.trial_end + make_interval(
                        years => CASE p.interval WHEN 'year' THEN p.interval_count * (n.from_trial_end) ELSE 0 END,
                        months => CASE p.interval WHEN 'month' THEN p.interval_count * (n.from_trial_end) ELSE 0 END,
                        weeks => CASE p.interval WHEN 'week' THEN p.interval_count * (n.from_trial_end) ELSE 0 END,
                        days => CASE p.interval WHEN 'day' THEN p.interval_count * (n.from_trial_end) ELSE 0 END)
                    AND i.period_end = s.trial_end + make_interval(
                        years => CASE p.interval WHEN 'year' THEN p.interval_count * (n.from_trial_end + 1) ELSE 0 END,
                        months => CASE p.interval WHEN 'month' THEN p.interval_count * (n.from_trial_end + 1) ELSE 0 END,
                        weeks => CASE p.interval WHEN 'week' THEN p.interval_count * (n.from_trial_end + 1) ELSE 0 END,
                        days => CASE p.interval WHEN 'day' THEN p.interval_count * (n.from_trial_end + 1) ELSE 0 END)),
                  false);

-- name: invoice_lines_match_invoice
-- Every invoice has line items; each line of a subscription item bills the invoice's period, and a price line that
-- is not a proration is quantity × the price's amount (a pending invoice item's line keeps the item's own period).
-- A metered price's line bills the usage of the period that ended where the invoice's begins (in arrears), or is
-- the empty line of a first invoice of metered items only, or the usage of a final invoice (over its own period);
-- its amount follows the price's tiers or package.
SELECT i.id AS ref, 'has no line items' AS detail
FROM billing_invoice i
WHERE NOT EXISTS (SELECT 1 FROM billing_invoicelineitem l WHERE l.invoice_id = i.id)
UNION ALL
SELECT l.invoice_id, 'line ' || l.id || ' bills [' || l.period_start || ', ' || l.period_end
       || ') but the invoice period is [' || i.period_start || ', ' || i.period_end || ')'
FROM billing_invoicelineitem l JOIN billing_invoice i ON i.id = l.invoice_id
LEFT JOIN billing_price p ON p.id = l.price_id
WHERE l.invoice_item_id IS NULL AND p.usage_type IS DISTINCT FROM 'metered'
  AND (l.period_start <> i.period_start OR l.period_end <> i.period_end)
UNION ALL
SELECT l.invoice_id, 'usage line ' || l.id || ' ends ' || l.period_end || ' but the invoice period starts '
       || i.period_start
FROM billing_invoicelineitem l JOIN billing_invoice i ON i.id = l.invoice_id
JOIN billing_price p ON p.id = l.price_id
WHERE l.invoice_item_id IS NULL AND p.usage_type = 'metered' AND l.period_end <> i.period_start
  AND NOT (l.period_start = i.period_start AND l.period_end = i.period_end
           AND ((l.amount = 0 AND l.quantity = 0) OR i.billing_reason = 'subscription_update'))
UNION ALL
SELECT l.invoice_id, 'line ' || l.id || ' amount ' || l.amount || ' is not ' || l.quantity || ' × '
       || p.amount
FROM billing_invoicelineitem l JOIN billing_price p ON p.id = l.price_id
WHERE NOT l.proration AND p.usage_type = 'licensed' AND l.amount <> l.quantity * p.amount;

-- name: invoice_subtotal_equals_lines
-- An invoice's subtotal is the sum of its line items.
SELECT i.id AS ref, 'subtotal ' || i.subtotal || ' but the lines sum to ' || coalesce(l.amount, 0) AS detail
FROM billing_invoice i
LEFT JOIN (SELECT invoice_id, sum(amount) AS amount FROM billing_invoicelineitem GROUP BY invoice_id) l
       ON l.invoice_id = i.id
WHERE i.subtotal <> coalesce(l.amount, 0);

-- name: invoice_total_is_subtotal_plus_tax
-- total = subtotal − total_discount + tax on every invoice (docs/reference/discounts.md).
SELECT id AS ref, 'total ' || total || ' but subtotal ' || subtotal || ' − discount ' || total_discount
       || ' + tax ' || tax || ' = ' || (subtotal - total_discount + tax) AS detail
FROM billing_invoice
WHERE total <> subtotal - total_discount + tax;

-- name: invoice_amount_due_is_total_minus_credit
-- amount_due = total − credit_applied − pre_payment_credit_notes_amount (the credit notes issued while it was open),
-- and is never negative (credit never exceeds the total).
SELECT id AS ref, 'amount_due ' || amount_due || ' but total ' || total || ' − credit_applied ' || credit_applied
       || CASE WHEN pre_payment_credit_notes_amount <> 0
               THEN ' − pre-payment credit notes ' || pre_payment_credit_notes_amount ELSE '' END
       || ' = ' || (total - credit_applied - pre_payment_credit_notes_amount) AS detail
FROM billing_invoice
WHERE amount_due <> total - credit_applied - pre_payment_credit_notes_amount OR amount_due < 0;

-- name: money_amounts_nonnegative
-- Prices, line items, invoice amounts and charges are never negative, except the lines of pending invoice items
-- (a credit) and the subtotal and total of an invoice they make negative, whose amount_due is then 0 (the rest goes to
-- the customer's balance); an invoice is never paid more than its amount_due.
SELECT id AS ref, 'negative amount (subtotal ' || subtotal || ', tax ' || tax || ', total ' || total
       || ', amount_paid ' || amount_paid || ')' AS detail
FROM billing_invoice
WHERE tax < 0 OR amount_paid < 0
   OR ((subtotal < 0 OR total < 0)
       AND NOT (amount_due = 0 AND EXISTS (SELECT 1 FROM billing_invoicelineitem l
                                           WHERE l.invoice_id = billing_invoice.id AND l.amount < 0
                                             AND l.invoice_item_id IS NOT NULL)))
UNION ALL
SELECT id, 'amount_paid ' || amount_paid || ' exceeds amount_due ' || amount_due
FROM billing_invoice WHERE amount_paid > amount_due
UNION ALL
SELECT id, 'negative line amount ' || amount FROM billing_invoicelineitem WHERE amount < 0 AND invoice_item_id IS NULL
UNION ALL
SELECT id, 'negative price amount ' || amount FROM billing_price WHERE amount < 0
UNION ALL
SELECT id, 'negative payment attempt amount ' || amount FROM billing_paymentattempt WHERE amount < 0;

-- name: invoice_status_fields
-- An invoice's fields agree with its status: finalised invoices (open, paid, uncollectible) carry a number and
-- finalized_at, drafts no number; paid ⇔ paid_at; void ⇒ voided_at; uncollectible ⇒ marked_uncollectible_at; a
-- pending tax keeps the invoice a draft; no tax is charged while it is pending or not applicable.
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
   OR (tax_status = 'not_applicable' AND tax_rate_bps <> 0);

-- name: invoice_numbers_gapless
-- Invoice numbers of each (tenant, mode) run 1..N without a gap or a duplicate, N being the counter's last_number
-- (docs/reference/domain.md: per-tenant gapless number).
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
           AND coalesce(c.last_number, 0) = coalesce(pm.highest, 0));

-- name: invoice_credit_matches_ledger
-- An invoice's credit_applied is exactly what the ledger took from the customer's balance for it (its
-- applied_to_invoice entries, negated).
SELECT i.id AS ref, 'credit_applied ' || i.credit_applied || ' but the ledger applied '
       || coalesce(-l.amount, 0) AS detail
FROM billing_invoice i
LEFT JOIN (SELECT invoice_id, sum(amount) AS amount FROM billing_ledgerentry
           WHERE reason = 'applied_to_invoice' AND invoice_id IS NOT NULL GROUP BY invoice_id) l
       ON l.invoice_id = i.id
WHERE i.credit_applied <> coalesce(-l.amount, 0);
