-- The doctor's checks of tenancy and currency: no row refers across tenants or currencies (docs/reference/domain.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: no_cross_tenant_reference
-- Nothing crosses tenants or modes: every reference joins two rows of the same tenant and mode, and an invoice's
-- customer is its subscription's customer (docs/reference/domain.md).
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
WHERE i.subscription_id IS DISTINCT FROM a.subscription_id;

-- name: currency_consistent
-- One currency along each chain: price → subscription's customer → invoice → its lines and payment attempts; ledger
-- entries in their customer's currency.
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
WHERE e.currency <> c.currency;
