-- The doctor's checks of credit notes and refunds (docs/reference/credit-notes.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: credit_notes_within_invoice_total
-- The non-void credit notes of an invoice never exceed its total, and its pre_payment_credit_notes_amount /
-- post_payment_credit_notes_amount are exactly their sums by type; a credit note's parts add up to its total.
WITH sums AS (
    SELECT invoice_id,
           sum(total) FILTER (WHERE type = 'pre_payment') AS pre,
           sum(total) FILTER (WHERE type = 'post_payment') AS post
    FROM billing_creditnote WHERE status = 'issued' GROUP BY invoice_id
)
SELECT i.id AS ref, 'credit notes ' || (coalesce(s.pre, 0) + coalesce(s.post, 0)) || ' exceed the total '
       || i.total AS detail
FROM billing_invoice i JOIN sums s ON s.invoice_id = i.id
WHERE coalesce(s.pre, 0) + coalesce(s.post, 0) > i.total
UNION ALL
SELECT i.id, 'pre/post-payment credit notes ' || i.pre_payment_credit_notes_amount || '/'
       || i.post_payment_credit_notes_amount || ' but its credit notes sum to ' || coalesce(s.pre, 0) || '/'
       || coalesce(s.post, 0)
FROM billing_invoice i LEFT JOIN sums s ON s.invoice_id = i.id
WHERE i.pre_payment_credit_notes_amount <> coalesce(s.pre, 0)
   OR i.post_payment_credit_notes_amount <> coalesce(s.post, 0)
UNION ALL
SELECT c.id, 'total ' || c.total || ' but parts ' || c.pre_payment_amount || '+' || c.refund_amount || '+'
       || c.credit_amount || '+' || c.out_of_band_amount
FROM billing_creditnote c
WHERE c.total <> c.pre_payment_amount + c.refund_amount + c.credit_amount + c.out_of_band_amount
   OR (c.type = 'pre_payment') <> (c.pre_payment_amount > 0)
UNION ALL
SELECT c.id, 'credit note of ' || c.tenant_id || '/' || c.livemode || ' in ' || c.currency || ' on invoice '
       || i.id || ' of ' || i.tenant_id || '/' || i.livemode || ' in ' || i.currency
FROM billing_creditnote c JOIN billing_invoice i ON i.id = c.invoice_id
WHERE (c.tenant_id, c.livemode, c.currency, c.customer_id) <> (i.tenant_id, i.livemode, i.currency, i.customer_id);

-- name: credit_note_numbers_gapless
-- Credit-note numbers of each (tenant, mode) run 1..N without a gap or a duplicate, N being the counter's last_number.
WITH numbered AS (
    SELECT tenant_id, livemode, substring(number FROM '([0-9]+)$')::bigint AS n FROM billing_creditnote
), per_mode AS (
    SELECT tenant_id, livemode, count(*) AS issued, count(DISTINCT n) AS distinct_numbers, max(n) AS highest
    FROM numbered GROUP BY tenant_id, livemode
)
SELECT coalesce(pm.tenant_id, c.tenant_id) AS ref,
       coalesce(pm.issued, 0) || ' credit notes with ' || coalesce(pm.distinct_numbers, 0) || ' distinct numbers up to '
       || coalesce(pm.highest, 0) || ', counter at ' || coalesce(c.last_number::text, 'none') AS detail
FROM per_mode pm
FULL JOIN billing_creditnotecounter c ON c.tenant_id = pm.tenant_id AND c.livemode = pm.livemode
WHERE NOT (coalesce(pm.issued, 0) = coalesce(pm.distinct_numbers, 0)
           AND coalesce(pm.highest, 0) = coalesce(pm.issued, 0)
           AND coalesce(c.last_number, 0) = coalesce(pm.highest, 0));

-- name: refund_has_its_credit_note
-- Every refund belongs to a credit note of the same invoice whose refund_amount it is, and every credit note with a
-- refund_amount has its refund; a refund sent is resolved (not left unknown) within unknown_after_s.
SELECT r.id AS ref, 'refund of ' || r.amount || ' for credit note ' || c.id || ' whose refund_amount is '
       || c.refund_amount || ' on invoice ' || c.invoice_id AS detail
FROM billing_refund r JOIN billing_creditnote c ON c.id = r.credit_note_id
WHERE r.amount <> c.refund_amount OR r.invoice_id <> c.invoice_id OR r.currency <> c.currency
UNION ALL
SELECT c.id, 'refund_amount ' || c.refund_amount || ' without a refund'
FROM billing_creditnote c
WHERE c.refund_amount > 0 AND NOT EXISTS (SELECT 1 FROM billing_refund r WHERE r.credit_note_id = c.id)
UNION ALL
SELECT r.id, 'refund outcome unknown since ' || r.started_at
FROM billing_refund r
WHERE r.outcome = 'unknown' AND r.started_at < now() - make_interval(secs => %(unknown_after_s)s)
UNION ALL
SELECT r.id, 'refund ' || r.outcome || ' of credit note ' || c.id || ', which is ' || c.status
FROM billing_refund r JOIN billing_creditnote c ON c.id = r.credit_note_id
WHERE (r.outcome = 'error') <> (c.status = 'void');

-- name: ledger_agrees_with_credit_notes
-- A credit note's credit_amount is one ledger entry (reason credit_note, the same customer, currency and amount), and
-- a voided one's is taken back by one more; so a customer's credit_note entries sum to its issued credit notes'
-- credit_amount.
SELECT c.id AS ref, 'credit_amount ' || c.credit_amount || ' but its ledger entry is '
       || coalesce(l.reason || ' ' || l.amount || ' ' || l.currency || ' for ' || l.customer_id, 'missing') AS detail
FROM billing_creditnote c LEFT JOIN billing_ledgerentry l ON l.id = c.credit_entry_id
WHERE (c.credit_amount > 0 OR c.credit_entry_id IS NOT NULL)
  AND (l.id IS NULL OR l.reason <> 'credit_note' OR l.amount <> c.credit_amount OR l.currency <> c.currency
       OR l.customer_id <> c.customer_id)
UNION ALL
SELECT coalesce(n.customer_id, e.customer_id), 'credit_note ledger entries sum to ' || coalesce(e.amount, 0)
       || ' but issued credit notes credited ' || coalesce(n.amount, 0)
FROM (SELECT customer_id, sum(credit_amount) AS amount FROM billing_creditnote
      WHERE status = 'issued' AND credit_amount > 0 GROUP BY customer_id) n
FULL JOIN (SELECT customer_id, sum(amount) AS amount FROM billing_ledgerentry
           WHERE reason = 'credit_note' GROUP BY customer_id) e ON e.customer_id = n.customer_id
WHERE coalesce(n.amount, 0) <> coalesce(e.amount, 0);
