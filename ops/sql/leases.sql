-- The doctor's checks of leader leases and the billing runs written under them (docs/reference/roles-and-leases.md).
-- Each statement returns one row (ref, detail) per violation of the invariant its description states; a clean
-- database returns none. ops/doctor.py runs them in file order (docs/decisions/0060, 0121).

-- name: billing_run_not_orphaned_by_lease
-- No billing run is still running under a fencing token that no longer holds its lease (the billing lease, or a
-- manual run's own manual:{tenant}:{mode} lease; the token moved on, or the lease was released or has expired): a run
-- without a live lease is not doing work and must have been closed as abandoned, or carried on by the next holder.
SELECT r.id AS ref, 'running under token ' || r.lease_token || ', but the '
       || coalesce(nullif(r.lease_role, ''), 'billing') || ' lease is '
       || CASE WHEN l.role IS NULL THEN 'absent'
               WHEN l.token <> r.lease_token THEN 'at token ' || l.token
               WHEN l.holder IS NULL THEN 'released'
               ELSE 'expired since ' || l.expires_at END AS detail
FROM billing_billingrun r
LEFT JOIN leases_leaderlease l ON l.role = coalesce(nullif(r.lease_role, ''), 'billing')
WHERE r.status = 'running' AND r.lease_token IS NOT NULL
  AND (l.role IS NULL OR l.token <> r.lease_token OR l.holder IS NULL OR l.expires_at IS NULL
       OR l.expires_at < now());

-- name: no_billing_write_after_lease_lost
-- A deposed leader writes nothing after its successor took the lease: no billing attempt, and no completed or failed
-- run, of an older fencing token is dated after the current token's acquired_at (the billing lease, or a manual run's
-- own lease; docs/reference/roles-and-leases.md, docs/reference/guarantees.md).
SELECT a.id AS ref, 'billing attempt of run ' || r.id || ' (token ' || r.lease_token || ') at '
       || a.created_at || ', after token ' || l.token || ' took the lease at ' || l.acquired_at AS detail
FROM billing_billingattempt a JOIN billing_billingrun r ON r.id = a.run_id
JOIN leases_leaderlease l ON l.role = coalesce(nullif(r.lease_role, ''), 'billing')
WHERE r.lease_token < l.token AND a.created_at > l.acquired_at
UNION ALL
SELECT r.id, r.status || ' at ' || r.finished_at || ' under token ' || r.lease_token
       || ', after token ' || l.token || ' took the lease at ' || l.acquired_at
FROM billing_billingrun r JOIN leases_leaderlease l ON l.role = coalesce(nullif(r.lease_role, ''), 'billing')
WHERE r.lease_token < l.token AND r.status IN ('completed', 'failed') AND r.finished_at > l.acquired_at;

-- name: scheduler_run_bills_only_its_shard
-- A sharded scheduler run (lease role billing:<index>) attempts only subscriptions of its shard's tenants: a tenant's
-- shard among HARDCOUNT_BILLING_SHARDS, as billing/shards.py computes it (docs/decisions/0194). Only runs under
-- their shard lease's current token are checked: those of the leaders running now, with the doctor's shard count.
WITH tenant_shard AS (
    SELECT * FROM unnest(%(tenant_ids)s::text[], %(tenant_shards)s::int[]) AS t (tenant_id, shard)
)
SELECT a.id AS ref, 'billing attempt of run ' || r.id || ' under ' || r.lease_role || ' bills subscription '
       || s.id || ' of tenant ' || s.tenant_id || ', which is in shard ' || ts.shard || ' of '
       || %(billing_shards)s AS detail
FROM billing_billingattempt a
JOIN billing_billingrun r ON r.id = a.run_id
JOIN leases_leaderlease l ON l.role = r.lease_role AND l.token = r.lease_token
JOIN billing_subscription s ON s.id = a.subscription_id
JOIN tenant_shard ts ON ts.tenant_id = s.tenant_id
WHERE r.trigger = 'scheduler' AND r.lease_role LIKE 'billing:%%'
  AND ts.shard::text <> split_part(r.lease_role, ':', 2);

-- name: lease_rows_well_formed
-- A held lease has a positive fencing token and acquired_at ≤ heartbeat_at ≤ expires_at.
SELECT role AS ref, 'held by ' || holder || ' with token ' || token || ', acquired '
       || coalesce(acquired_at::text, 'never')
       || ', heartbeat ' || coalesce(heartbeat_at::text, 'never') || ', expires '
       || coalesce(expires_at::text, 'never') AS detail
FROM leases_leaderlease
WHERE holder IS NOT NULL
  AND NOT coalesce(token > 0 AND acquired_at <= heartbeat_at AND heartbeat_at <= expires_at, false);
