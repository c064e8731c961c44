-- The doctor's checks of events: no change without its event, no event without its change (docs/reference/webhooks.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: invoice_has_created_event
-- Every invoice has its invoice.created event, in its own tenant and mode.
SELECT i.id AS ref, 'no invoice.created event' AS detail
FROM billing_invoice i
WHERE NOT EXISTS (SELECT 1 FROM outbox_event e
                  WHERE e.type = 'invoice.created' AND coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id') = i.id
                    AND e.tenant_id = i.tenant_id AND e.livemode = i.livemode);

-- name: invoice_state_has_event
-- Every invoice state reached has its event: finalised ⇒ invoice.finalized, paid ⇒ invoice.paid, void ⇒
-- invoice.voided, uncollectible ⇒ invoice.marked_uncollectible; a declined attempt ⇒ invoice.payment_failed.
WITH needed AS (
    SELECT id, tenant_id, livemode, 'invoice.finalized' AS type FROM billing_invoice
    WHERE finalized_at IS NOT NULL
    UNION ALL
    SELECT id, tenant_id, livemode, 'invoice.paid' FROM billing_invoice WHERE status = 'paid'
    UNION ALL
    SELECT id, tenant_id, livemode, 'invoice.voided' FROM billing_invoice WHERE status = 'void'
    UNION ALL
    SELECT id, tenant_id, livemode, 'invoice.marked_uncollectible' FROM billing_invoice
    WHERE status = 'uncollectible'
    UNION ALL
    SELECT DISTINCT invoice_id, tenant_id, livemode, 'invoice.payment_failed' FROM billing_paymentattempt
    WHERE outcome = 'declined'
), seen AS (
    SELECT DISTINCT coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id') AS id, e.type, e.tenant_id, e.livemode
    FROM outbox_event e
    WHERE e.type IN ('invoice.finalized', 'invoice.paid', 'invoice.voided', 'invoice.marked_uncollectible',
                     'invoice.payment_failed')
)
SELECT n.id AS ref, 'no ' || n.type || ' event' AS detail
FROM needed n
LEFT JOIN seen s ON s.id = n.id AND s.type = n.type AND s.tenant_id = n.tenant_id AND s.livemode = n.livemode
WHERE s.id IS NULL;

-- name: object_has_created_event
-- Every customer has its customer.created event and every subscription its subscription.created event; a parked
-- subscription has its subscription.billing_parked event.
WITH needed AS (
    SELECT id, tenant_id, livemode, 'customer.created' AS type FROM billing_customer
    UNION ALL
    SELECT id, tenant_id, livemode, 'subscription.created' FROM billing_subscription
    UNION ALL
    SELECT id, tenant_id, livemode, 'subscription.billing_parked' FROM billing_subscription
    WHERE billing_parked_at IS NOT NULL
), seen AS (
    SELECT DISTINCT coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id') AS id, e.type, e.tenant_id, e.livemode
    FROM outbox_event e
    WHERE e.type IN ('customer.created', 'subscription.created', 'subscription.billing_parked')
)
SELECT n.id AS ref, 'no ' || n.type || ' event' AS detail
FROM needed n
LEFT JOIN seen s ON s.id = n.id AND s.type = n.type AND s.tenant_id = n.tenant_id AND s.livemode = n.livemode
WHERE s.id IS NULL;

-- name: event_has_its_change
-- No event without its change: the object an event describes (by its id's prefix: invoice, subscription, customer,
-- ledger entry, price, test clock, dunning run) exists in the event's tenant and mode; an invoice, subscription or
-- customer event names an object; an invoice.paid event's invoice is paid. An object deleted by design (a
-- test_clock.deleted event names it) counts as existing.
WITH event_object AS (
    SELECT e.id, e.type, e.tenant_id, e.livemode, coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id') AS object_id
    FROM outbox_event e
), object AS (
    SELECT id, tenant_id, livemode FROM billing_invoice
    UNION ALL SELECT id, tenant_id, livemode FROM billing_subscription
    UNION ALL SELECT id, tenant_id, livemode FROM billing_customer
    UNION ALL SELECT id, tenant_id, livemode FROM billing_ledgerentry
    UNION ALL SELECT id, tenant_id, livemode FROM billing_price
    UNION ALL SELECT id, tenant_id, livemode FROM billing_testclock
    UNION ALL SELECT id, tenant_id, livemode FROM dunning_dunningrun
    -- A deleted object (test_clock.deleted) existed: its events, the deletion's included, stand.
    UNION ALL SELECT coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id'), e.tenant_id, e.livemode
    FROM outbox_event e
    WHERE e.type LIKE '%%.deleted'
)
SELECT eo.id AS ref, eo.type || ' names ' || coalesce(eo.object_id, 'no object')
       || CASE WHEN o.id IS NULL THEN ', which does not exist'
               ELSE ' of ' || o.tenant_id || '/' || o.livemode END
       || ' (the event is of ' || eo.tenant_id || '/' || eo.livemode || ')' AS detail
FROM event_object eo LEFT JOIN object o ON o.id = eo.object_id
WHERE CASE WHEN eo.object_id IS NULL
           THEN split_part(eo.type, '.', 1) IN ('invoice', 'subscription', 'customer')
           WHEN split_part(eo.object_id, '_', 1) IN ('in', 'sub', 'cus', 'cbtxn', 'price', 'clock', 'dun')
           THEN o.id IS NULL OR (o.tenant_id, o.livemode) <> (eo.tenant_id, eo.livemode)
           ELSE false END
UNION ALL
SELECT e.id, 'invoice.paid for invoice ' || i.id || ', which is ' || i.status
FROM outbox_event e JOIN billing_invoice i ON i.id = coalesce(e.data -> 'object' ->> 'id', e.data ->> 'id')
WHERE e.type = 'invoice.paid' AND i.status <> 'paid';

-- name: event_has_its_deliveries
-- Every event has a delivery to each endpoint of its tenant and mode that is enabled, not deleted, subscribed to its
-- type and existed when the event was written (by the time in both ids); events older than the delivery retention
-- are exempt.
WITH endpoint AS (
    SELECT w.id, w.tenant_id, w.livemode, w.enabled_events,
           substr(split_part(w.id, '_', 2), 1, 10) COLLATE "C" AS created_prefix
    FROM outbox_webhookendpoint w
    WHERE w.enabled AND w.deleted_at IS NULL
), recent_event AS (
    SELECT e.id, e.type, e.tenant_id, e.livemode,
           substr(split_part(e.id, '_', 2), 1, 10) COLLATE "C" AS created_prefix
    FROM outbox_event e
    WHERE substr(split_part(e.id, '_', 2), 1, 10) COLLATE "C" >= %(retention_prefix)s
), subscribed AS (
    -- (endpoint, event type) pairs, matched once per type rather than once per event.
    SELECT w.id, w.tenant_id, w.livemode, w.created_prefix, t.type
    FROM endpoint w CROSS JOIN (SELECT DISTINCT type FROM recent_event) t
    WHERE EXISTS (SELECT 1 FROM jsonb_array_elements_text(w.enabled_events) pattern
                  WHERE pattern = '*' OR pattern = t.type
                     OR (right(pattern, 2) = '.*' AND starts_with(t.type, left(pattern, -1))))
)
SELECT e.id AS ref, e.type || ' has no delivery to endpoint ' || w.id AS detail
FROM recent_event e
JOIN subscribed w ON w.tenant_id = e.tenant_id AND w.livemode = e.livemode AND w.type = e.type
     AND w.created_prefix < e.created_prefix
WHERE NOT EXISTS (SELECT 1 FROM outbox_delivery d WHERE d.event_id = e.id AND d.endpoint_id = w.id);
