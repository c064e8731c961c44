-- The doctor's checks of coupons and discounts (docs/reference/discounts.md, docs/decisions/0153, 0155).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none.

-- name: line_discount_within_amount
-- No line's discount exceeds its amount: a line's discount_amount has the line's sign and is at most its amount, so
-- a discount never takes a line below zero (nor a credit line past zero).
SELECT id AS ref, 'discount ' || discount_amount || ' on a line of ' || amount || ' (invoice ' || invoice_id || ')'
       AS detail
FROM billing_invoicelineitem
WHERE abs(discount_amount) > abs(amount)
   OR (discount_amount > 0 AND amount < 0)
   OR (discount_amount < 0 AND amount > 0);

-- name: invoice_discount_equals_lines
-- An invoice's total_discount is the sum of its lines' discount amounts, and an invoice with a discount names it.
-- With invoice_subtotal_equals_lines, invoice_total_is_subtotal_plus_tax and invoice_amount_due_is_total_minus_credit
-- (ops/sql/invoices.sql) it makes amount_due = the lines − their discounts + tax − credit applied.
SELECT i.id AS ref, 'total_discount ' || i.total_discount || ' but the lines'' discounts sum to '
       || coalesce(l.discount, 0) || CASE WHEN i.discount_id IS NULL AND i.total_discount <> 0
                                         THEN ' (and no discount named)' ELSE '' END AS detail
FROM billing_invoice i
LEFT JOIN (SELECT invoice_id, sum(discount_amount) AS discount FROM billing_invoicelineitem GROUP BY invoice_id) l
       ON l.invoice_id = i.id
WHERE i.total_discount <> coalesce(l.discount, 0) OR (i.discount_id IS NULL AND i.total_discount <> 0);

-- name: coupon_redemptions_counted
-- A coupon's times_redeemed is the number of discounts made of it, and never more than its max_redemptions.
SELECT c.id AS ref, 'times_redeemed ' || c.times_redeemed || ' but ' || coalesce(d.n, 0) || ' discounts'
       || coalesce(' (max ' || c.max_redemptions || ')', '') AS detail
FROM billing_coupon c
LEFT JOIN (SELECT coupon_id, count(*) AS n FROM billing_discount GROUP BY coupon_id) d ON d.coupon_id = c.id
WHERE c.times_redeemed <> coalesce(d.n, 0) OR c.times_redeemed > coalesce(c.max_redemptions, c.times_redeemed);

-- name: discount_of_its_own_tenant
-- A discount, its coupon, its customer, its subscription and the invoices that took it share one tenant and mode,
-- and a subscription's discount is of that subscription's customer.
SELECT d.id AS ref, 'coupon ' || d.coupon_id || ', customer ' || d.customer_id
       || coalesce(', subscription ' || d.subscription_id, '') || ' not all of its tenant and mode' AS detail
FROM billing_discount d
JOIN billing_coupon c ON c.id = d.coupon_id
JOIN billing_customer cu ON cu.id = d.customer_id
LEFT JOIN billing_subscription s ON s.id = d.subscription_id
WHERE (c.tenant_id, c.livemode) <> (d.tenant_id, d.livemode)
   OR (cu.tenant_id, cu.livemode) <> (d.tenant_id, d.livemode)
   OR (s.id IS NOT NULL AND (s.tenant_id <> d.tenant_id OR s.livemode <> d.livemode OR s.customer_id <> d.customer_id))
UNION ALL
SELECT i.id, 'took discount ' || i.discount_id || ' of another customer'
FROM billing_invoice i JOIN billing_discount d ON d.id = i.discount_id
WHERE d.customer_id <> i.customer_id;
