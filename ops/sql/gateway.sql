-- The doctor's gateway comparison (doctor --gateway): the rows it reads from the books and then compares with
-- the gateway through the stripe library (docs/reference/billing.md). These are not violation queries:
-- ops/doctor.py does the comparing.

-- name: gateway_agrees_with_invoices
-- The gateway agrees with the books: each paid invoice's PaymentIntent succeeded for its amount_due and currency; no
-- PaymentIntent of an unpaid invoice succeeded; at the gateway, no invoice has two succeeded PaymentIntents and
-- every succeeded one is its paid invoice's payment_intent_id. Each invoice is compared in its tenant's own gateway
-- account for its mode (billing.gateway_accounts), else the platform's.
SELECT i.id, i.status, i.amount_due, i.currency, i.payment_intent_id,
       coalesce((SELECT a.payment_intent_id FROM billing_paymentattempt a
                 WHERE a.invoice_id = i.id AND a.outcome = 'succeeded' AND NOT a.settled_without_charge
                   AND a.payment_intent_id <> '' LIMIT 1), '') AS charged_intent,
       EXISTS (SELECT 1 FROM billing_paymentattempt a
               WHERE a.invoice_id = i.id AND a.outcome = 'succeeded' AND a.settled_without_charge) AS settled,
       i.tenant_id, i.livemode
FROM billing_invoice i
WHERE i.payment_intent_id <> ''
   OR EXISTS (SELECT 1 FROM billing_paymentattempt a WHERE a.invoice_id = i.id AND a.payment_intent_id <> '')
ORDER BY i.id DESC;

-- name: gateway_tenants
-- The tenants this database holds: only their PaymentIntents at a shared gateway account are ours to judge.
SELECT id FROM hardcount_tenant;

-- name: gateway_invoices_by_id
-- The status and PaymentIntent of the invoices a gateway listing names (parameter: a list of invoice ids).
SELECT id, status, payment_intent_id FROM billing_invoice WHERE id = ANY(%s);

-- name: gateway_agrees_with_refunds
-- Every refund has its credit note and, unless the gateway refused it, a refund at the gateway: the one its
-- gateway_refund_id names (or its hardcount_refund metadata finds), of its amount, on its PaymentIntent, whose status
-- agrees with the books (succeeded ⇔ succeeded). Each refund is looked up in its tenant's own gateway account for its
-- mode, else the platform's.
SELECT r.id, r.credit_note_id, r.payment_intent_id, r.gateway_refund_id, r.amount, r.currency, r.outcome,
       r.tenant_id, r.livemode, EXISTS (SELECT 1 FROM billing_creditnote c WHERE c.id = r.credit_note_id) AS has_note
FROM billing_refund r
ORDER BY r.id DESC;
