-- The doctor's checks of webhook deliveries and their attempts (docs/reference/webhooks.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: delivery_at_most_eight_attempts
-- No delivery has more than 8 attempts, counted or recorded.
SELECT d.id AS ref, 'attempts ' || d.attempts || ', ' || count(a.id) || ' attempt rows' AS detail
FROM outbox_delivery d LEFT JOIN outbox_deliveryattempt a ON a.delivery_id = d.id
GROUP BY d.id
HAVING d.attempts > 8 OR count(a.id) > 8;

-- name: delivery_attempt_numbers_contiguous
-- A delivery's attempt rows are numbered 1..n without a gap or a duplicate (n ≤ 8), and its attempts counter is
-- n (n + 1 while a claim holds the attempt in flight: the claim spends the attempt before the request is sent).
SELECT d.id AS ref, 'attempts counter ' || d.attempts || ', attempt rows numbered '
       || coalesce(string_agg(a.number::text, ',' ORDER BY a.number), 'none')
       || CASE WHEN d.claimed_by IS NOT NULL THEN ' (claimed)' ELSE '' END AS detail
FROM outbox_delivery d LEFT JOIN outbox_deliveryattempt a ON a.delivery_id = d.id
GROUP BY d.id
HAVING NOT (count(a.id) = d.attempts OR (d.claimed_by IS NOT NULL AND count(a.id) = d.attempts - 1))
    OR (count(a.id) > 0 AND (min(a.number) <> 1 OR max(a.number) <> count(a.id)
                             OR count(DISTINCT a.number) <> count(a.id)))
    OR max(a.number) > 8;

-- name: delivery_succeeded_by_one_executor
-- No delivery has succeeded (2xx) attempts recorded by two different executors (docs/reference/guarantees.md: no delivery recorded as
-- succeeded by two executors).
SELECT delivery_id AS ref, count(*) || ' succeeded attempts by executors '
       || string_agg(DISTINCT executor, ', ') AS detail
FROM outbox_deliveryattempt
WHERE outcome = 'succeeded' OR status_code BETWEEN 200 AND 299
GROUP BY delivery_id
HAVING count(DISTINCT executor) > 1;

-- name: delivery_status_matches_attempts
-- A delivery is succeeded exactly when it has a succeeded (2xx) attempt; a succeeded or failed delivery has
-- completed_at and holds no claim.
SELECT d.id AS ref, d.status || ' delivery '
       || CASE WHEN d.status = 'succeeded' AND ok.delivery_id IS NULL THEN 'without a succeeded attempt'
               WHEN d.status <> 'succeeded' AND ok.delivery_id IS NOT NULL THEN 'with a succeeded attempt'
               WHEN d.completed_at IS NULL THEN 'without completed_at'
               ELSE 'still claimed by ' || d.claimed_by END AS detail
FROM outbox_delivery d
LEFT JOIN (SELECT DISTINCT delivery_id FROM outbox_deliveryattempt
           WHERE outcome = 'succeeded' AND status_code BETWEEN 200 AND 299) ok
       ON ok.delivery_id = d.id
WHERE (d.status = 'succeeded') <> (ok.delivery_id IS NOT NULL)
   OR (d.status IN ('succeeded', 'failed') AND (d.completed_at IS NULL OR d.claimed_by IS NOT NULL));

-- name: delivery_claim_not_stale
-- No pending or retrying delivery stays claimed with a lease that expired longer than the reaper interval ago
-- (docs/reference/webhooks.md: an expired lease is reclaimable; the reaper re-queues it).
SELECT id AS ref, status || ' delivery claimed by ' || claimed_by || ', lease expired at '
       || claim_expires_at AS detail
FROM outbox_delivery
WHERE status IN ('pending', 'retrying') AND claimed_by IS NOT NULL
  AND claim_expires_at < now() - make_interval(secs => %(reaper_interval_s)s);
