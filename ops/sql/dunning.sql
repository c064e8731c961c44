-- The doctor's checks of dunning runs (docs/reference/dunning.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: declined_invoice_has_dunning_run
-- An open invoice whose charge was declined has a dunning run (docs/reference/billing.md: a decline starts dunning).
SELECT i.id AS ref, 'open invoice with a declined attempt and no dunning run' AS detail
FROM billing_invoice i
WHERE i.status = 'open'
  AND EXISTS (SELECT 1 FROM billing_paymentattempt a WHERE a.invoice_id = i.id AND a.outcome = 'declined')
  AND NOT EXISTS (SELECT 1 FROM dunning_dunningrun d WHERE d.invoice_id = i.id);

-- name: dunning_run_matches_invoice
-- A dunning run agrees with its invoice: active ⇒ open (no retry ever charges a paid invoice), recovered ⇒ paid,
-- exhausted ⇒ uncollectible or void; an ended run has ended_at.
SELECT d.id AS ref, d.status || ' dunning run for ' || i.status || ' invoice ' || i.id AS detail
FROM dunning_dunningrun d JOIN billing_invoice i ON i.id = d.invoice_id
WHERE (d.status = 'active' AND i.status <> 'open')
   OR (d.status = 'recovered' AND i.status <> 'paid')
   OR (d.status = 'exhausted' AND i.status NOT IN ('uncollectible', 'void'))
UNION ALL
SELECT d.id, d.status || ' dunning run without ended_at' FROM dunning_dunningrun d
WHERE d.status <> 'active' AND d.ended_at IS NULL;
