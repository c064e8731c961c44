"""The delivery claim queue in SQL: every statement the executor and the reaper run.

Each statement is named for what it does and commented with the guarantee it gives.
Parameters are psycopg named placeholders. All times come from PostgreSQL's ``now()``
(one clock authority, docs/reference/roles-and-leases.md): the executor never compares its own clock to a row.

The lease on a delivery is the pair ``claimed_by`` (unique per claim: the executor's id
plus a random suffix, so a replica that reclaims its own expired claim holds a *new*
claim) and ``claim_expires_at``. A claim is ours while both still match: every write
after the claim carries ``claimed_by = %(claim)s AND claim_expires_at > now()``, so once a
lease has expired (and whether or not anyone has reclaimed it) the late writer's result is
refused by the database and discarded.

Attempt accounting: the claim spends the attempt (``attempts + 1``, clamped to
:data:`MAX_ATTEMPTS`, 8) before the request is sent, so an executor killed mid-request has still
used it and no delivery is ever sent more than :data:`MAX_ATTEMPTS` times. A defer or a release
(no request made) hands it back.
"""

# Requests a delivery gets at most (docs/reference/webhooks.md); the statements below are built with it.
MAX_ATTEMPTS = 8

# CLAIM_DUE: take up to %(limit)s due deliveries (the caller passes its idle workers).
# SKIP LOCKED lets executors in every replica claim side by side without waiting for or
# double-claiming a row; a row whose lease expired is claimable again by anyone, its own
# replica included. The row's previous claim and attempt count come back so the caller
# records evidence for an attempt whose executor vanished. Everything the send needs
# (event, endpoint, circuit state) comes back in the same round trip.
_CLAIM_CTES_TEMPLATE = f"""
WITH due AS (
    SELECT d.id, d.claimed_by AS lost_claim, d.attempts AS prev_attempts
    FROM outbox_delivery d
    WHERE d.status IN ('pending', 'retrying')
      AND d.fire_after <= now()
      AND (d.claim_expires_at IS NULL OR d.claim_expires_at < now())<<more>>
    ORDER BY d.fire_after
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE outbox_delivery d
    SET claimed_by = %(executor)s || '/' || gen_random_uuid()::text,
        claim_expires_at = now() + make_interval(secs => %(lease_s)s),
        attempts = LEAST(d.attempts + 1, {MAX_ATTEMPTS})
    FROM due
    WHERE d.id = due.id
    RETURNING d.id, d.claimed_by, d.attempts, due.prev_attempts, due.lost_claim, d.event_id, d.endpoint_id
)"""
_CLAIM_CTES = _CLAIM_CTES_TEMPLATE.replace("<<more>>", "")
_CLAIM_SELECT = """
SELECT c.id, c.claimed_by, c.attempts, c.prev_attempts, c.lost_claim,
       e.id AS event_id, e.type AS event_type, e.data AS event_data, e.created_at AS event_created_at,
       e.livemode, e.sequence,
       w.id AS endpoint_id, w.url, w.secret,
       (w.enabled AND w.deleted_at IS NULL) AS endpoint_active,
       CASE WHEN w.circuit_open_until IS NULL THEN 'closed'
            WHEN w.circuit_open_until > now() THEN 'open'
            ELSE 'half_open' END AS circuit
FROM claimed c
JOIN outbox_event e ON e.id = c.event_id
JOIN outbox_webhookendpoint w ON w.id = c.endpoint_id
"""
CLAIM_DUE = _CLAIM_CTES + _CLAIM_SELECT

# CLAIM_DUE_RECORDING_LOST: CLAIM_DUE that also inserts, in the same statement, the evidence row
# of every attempt whose executor vanished with its lease (what lost_attempt_params in
# outbox.executor writes; the reaper does the same for the rows it re-queues). The caller passes
# %(attempt_ids)s, %(limit)s fresh attempt ids, one for each row it may claim.
_LOST_CTE = f""", lost AS (
    INSERT INTO outbox_deliveryattempt
        (id, delivery_id, number, outcome, status_code, latency_ms, error, response_excerpt, executor, created_at)
    SELECT (%(attempt_ids)s::text[])[n], id, LEAST(prev_attempts, {MAX_ATTEMPTS}), 'lease_lost', NULL, NULL,
           'lease expired: executor ' || lost_claim
               || ' stopped reporting; the request may or may not have been sent',
           '', %(executor)s, now()
    FROM (SELECT c.*, row_number() OVER (ORDER BY c.id) AS n FROM claimed c
          WHERE c.lost_claim IS NOT NULL AND c.prev_attempts >= 1) expired
    ON CONFLICT (delivery_id, number) DO NOTHING
)"""
CLAIM_DUE_RECORDING_LOST = _CLAIM_CTES + _LOST_CTE + _CLAIM_SELECT

# CLAIM_IDS_RECORDING_LOST: CLAIM_DUE_RECORDING_LOST restricted to the deliveries %(ids)s, the ids a
# stream handed this executor (HARDCOUNT_DELIVERY_DISPATCH=nats, outbox.stream). The same predicate,
# lease, attempts clamp and lost-attempt evidence: a message only says which rows to try, so an id
# whose row is not due, held by a live claim, finished or gone is simply not returned.
CLAIM_IDS_RECORDING_LOST = (
    _CLAIM_CTES_TEMPLATE.replace("<<more>>", "\n      AND d.id = ANY(%(ids)s::text[])") + _LOST_CTE + _CLAIM_SELECT
)

# CLAIM_AGED_RECORDING_LOST: CLAIM_DUE_RECORDING_LOST restricted to rows due for over %(min_age_s)s
# seconds: the stream dispatch's sweep, which claims what no message brought in time (an id never
# published or lost by the stream, a row the reaper re-queued or a probe's success made due early).
CLAIM_AGED_RECORDING_LOST = (
    _CLAIM_CTES_TEMPLATE.replace("<<more>>", "\n      AND d.fire_after <= now() - make_interval(secs => %(min_age_s)s)")
    + _LOST_CTE
    + _CLAIM_SELECT
)

# STREAM_LOOKUP: why ids a stream handed over were not claimed: each row's status, how long until it is
# due and how long its live lease (if any) has left, in seconds by the database's clock. Ids with no row
# are absent.
STREAM_LOOKUP = """
SELECT id, status,
       extract(epoch FROM fire_after - now())::float8 AS due_in_s,
       CASE WHEN claim_expires_at > now() THEN extract(epoch FROM claim_expires_at - now())::float8 END
           AS lease_left_s
FROM outbox_delivery
WHERE id = ANY(%(ids)s::text[])
"""

# RENEW_CLAIMS: extend the leases of requests still in flight. Only an unexpired claim
# that is still ours is extended: an expired lease is never resurrected, because another
# executor may already have reclaimed it. Claims not returned are lost.
RENEW_CLAIMS = """
UPDATE outbox_delivery
SET claim_expires_at = now() + make_interval(secs => %(lease_s)s)
WHERE claimed_by = ANY(%(claims)s)
  AND claim_expires_at > now()
  AND status IN ('pending', 'retrying')
RETURNING claimed_by
"""

# RECORD_SUCCEEDED: terminal. Predicated on the claim still being ours, so a delivery is
# recorded as succeeded by one executor at most: a deposed claimant's write matches no row.
RECORD_SUCCEEDED = """
UPDATE outbox_delivery
SET status = 'succeeded', claimed_by = NULL, claim_expires_at = NULL, last_error = '', completed_at = now()
WHERE id = %(id)s AND claimed_by = %(claim)s AND claim_expires_at > now()
RETURNING id
"""

# RECORD_FAILED: terminal (permanent refusal, or the last attempt failed). Same predicate.
# ``attempts`` is passed so a failure that made no request (endpoint disabled, attempts
# already spent by a vanished executor) hands the claim's attempt back.
RECORD_FAILED = """
UPDATE outbox_delivery
SET status = 'failed', attempts = %(attempts)s, claimed_by = NULL, claim_expires_at = NULL,
    last_error = %(error)s, completed_at = now()
WHERE id = %(id)s AND claimed_by = %(claim)s AND claim_expires_at > now()
RETURNING id
"""

# RECORD_RETRY: a retryable failure; the row goes back to the queue after %(delay_s)s
# (backoff with jitter, computed by the caller) and its claim is dropped. Same predicate.
RECORD_RETRY = """
UPDATE outbox_delivery
SET status = 'retrying', claimed_by = NULL, claim_expires_at = NULL, last_error = %(error)s,
    fire_after = now() + make_interval(secs => %(delay_s)s)
WHERE id = %(id)s AND claimed_by = %(claim)s AND claim_expires_at > now()
RETURNING id
"""

# RECORD_OUTCOMES: the outcomes of a batch of claims in one statement (the executor's writer).
# Each input row is one claim: the delivery's new status ('succeeded', 'failed' or 'retrying'),
# the attempts to set (NULL keeps the count spent at the claim; a failure that made no request
# hands it back), the error, the retry delay, the attempt's evidence row (attempt_id NULL: no
# request was made) and its effect on the endpoint ('reset' after a 2xx or a permanent refusal,
# 'fail' after a retryable failure, 'gone' after a 410). Only rows whose claim is still ours
# (RECORD_SUCCEEDED's predicate) are written; the evidence and the endpoint effects follow from
# those rows alone, so a lost claim writes nothing at all. Per endpoint, the effects add up as
# the one-by-one writes would in the order given (ENDPOINT_SUCCEEDED, ENDPOINT_FAILED,
# ENDPOINT_DISABLE): the failures after its last reset count, and at %(threshold)s consecutive
# failures the circuit opens. Returns the ids written and the endpoints whose circuit a reset
# closed (the caller pulls in what was deferred behind a successful probe).
RECORD_OUTCOMES = """
WITH outcome AS (
    SELECT *
    FROM unnest(%(ids)s::text[], %(claims)s::text[], %(statuses)s::text[], %(attempts)s::int[],
                %(errors)s::text[], %(delays_s)s::float8[], %(attempt_ids)s::text[], %(numbers)s::int[],
                %(outcomes)s::text[], %(status_codes)s::int[], %(latencies_ms)s::int[], %(attempt_errors)s::text[],
                %(excerpts)s::text[],
                %(endpoint_ids)s::text[], %(effects)s::text[])
         WITH ORDINALITY AS o(id, claim, status, attempts, error, delay_s, attempt_id, number, outcome,
                              status_code, latency_ms, attempt_error, excerpt, endpoint_id, effect, n)
), recorded AS (
    UPDATE outbox_delivery d
    SET status = o.status,
        attempts = COALESCE(o.attempts, d.attempts),
        claimed_by = NULL,
        claim_expires_at = NULL,
        last_error = o.error,
        fire_after = CASE WHEN o.status = 'retrying' THEN now() + make_interval(secs => o.delay_s)
                          ELSE d.fire_after END,
        completed_at = CASE WHEN o.status = 'retrying' THEN NULL ELSE now() END
    FROM outcome o
    WHERE d.id = ANY(%(ids)s) AND d.id = o.id AND d.claimed_by = o.claim AND d.claim_expires_at > now()
    RETURNING d.id
), ours AS (
    SELECT o.* FROM outcome o JOIN recorded r ON r.id = o.id
), evidence AS (
    INSERT INTO outbox_deliveryattempt
        (id, delivery_id, number, outcome, status_code, latency_ms, error, response_excerpt, executor, created_at)
    SELECT attempt_id, id, number, outcome, status_code, latency_ms, attempt_error, excerpt, %(executor)s, now()
    FROM ours
    WHERE attempt_id IS NOT NULL
    ON CONFLICT (delivery_id, number) DO NOTHING
), last_reset AS (
    SELECT endpoint_id, max(n) FILTER (WHERE effect = 'reset') AS n,
           min(id) FILTER (WHERE effect = 'gone') AS gone_delivery
    FROM ours
    WHERE effect IS NOT NULL
    GROUP BY endpoint_id
), effect AS (
    SELECT l.endpoint_id, l.n IS NOT NULL AS reset, (l.n IS NULL)::int AS keep, l.gone_delivery,
           (SELECT count(*) FROM ours o
            WHERE o.endpoint_id = l.endpoint_id AND o.effect = 'fail' AND o.n > COALESCE(l.n, 0)) AS failures
    FROM last_reset l
), endpoint AS (
    UPDATE outbox_webhookendpoint w
    SET consecutive_failures = w.consecutive_failures * e.keep + e.failures,
        circuit_open_until = CASE
            WHEN e.failures > 0 AND w.consecutive_failures * e.keep + e.failures >= %(threshold)s
                THEN now() + make_interval(secs => LEAST(%(base_s)s * power(2, LEAST(
                    w.consecutive_failures * e.keep + e.failures - %(threshold)s, 20)), %(max_s)s))
            WHEN e.reset THEN NULL
            ELSE w.circuit_open_until END,
        enabled = w.enabled AND e.gone_delivery IS NULL,
        disabled_reason = CASE WHEN e.gone_delivery IS NULL THEN w.disabled_reason
                               ELSE 'receiver answered 410 Gone to delivery ' || e.gone_delivery END
    FROM effect e
    WHERE w.id = ANY(%(endpoint_ids)s) AND w.id = e.endpoint_id
      AND (e.failures > 0 OR e.gone_delivery IS NOT NULL
           OR (e.reset AND (w.consecutive_failures <> 0 OR w.circuit_open_until IS NOT NULL)))
    RETURNING w.id, e.reset AND e.failures = 0 AS closed
)
SELECT ARRAY(SELECT id FROM recorded) AS recorded, ARRAY(SELECT id FROM endpoint WHERE closed) AS closed
"""

# DEFER: the endpoint's circuit is open; no request is made, so the attempt is handed back
# (``attempts`` = the count before the claim) and the row waits until the circuit's
# cool-down ends (plus jitter so a reopened endpoint is not hit by its whole backlog at
# once). Same predicate.
DEFER = """
UPDATE outbox_delivery d
SET attempts = %(attempts)s, claimed_by = NULL, claim_expires_at = NULL,
    fire_after = GREATEST(now(), (SELECT w.circuit_open_until FROM outbox_webhookendpoint w
                                   WHERE w.id = d.endpoint_id))
                 + make_interval(secs => %(jitter_s)s)
WHERE d.id = %(id)s AND d.claimed_by = %(claim)s AND d.claim_expires_at > now()
RETURNING d.id, extract(epoch FROM d.fire_after - now())::float8 AS due_in_s
"""

# RELEASE: the executor is stopping before it made the request: hand the row and its
# attempt back, due at once. Same predicate.
RELEASE = """
UPDATE outbox_delivery
SET attempts = %(attempts)s, claimed_by = NULL, claim_expires_at = NULL
WHERE id = %(id)s AND claimed_by = %(claim)s AND claim_expires_at > now()
RETURNING id
"""

# FORCE_FAILED: the minimal write when a delivery's terminal transaction failed (docs/reference/webhooks.md):
# nothing but the status, the error and the claim, still only while the claim is ours.
# If even this fails, the lease expires and the reaper re-queues the row (at least once).
FORCE_FAILED = """
UPDATE outbox_delivery
SET status = 'failed', claimed_by = NULL, claim_expires_at = NULL, last_error = %(error)s, completed_at = now()
WHERE id = %(id)s AND claimed_by = %(claim)s
RETURNING id
"""

# INSERT_ATTEMPT: the evidence row of one attempt. (delivery, number) is unique, so an
# attempt is recorded once; ON CONFLICT keeps a duplicate from failing the transaction.
INSERT_ATTEMPT = """
INSERT INTO outbox_deliveryattempt
    (id, delivery_id, number, outcome, status_code, latency_ms, error, response_excerpt, executor, created_at)
VALUES (%(attempt_id)s, %(delivery_id)s, %(number)s, %(outcome)s, %(status_code)s, %(latency_ms)s,
        %(error)s, %(response_excerpt)s, %(executor)s, now())
ON CONFLICT (delivery_id, number) DO NOTHING
"""

# REAP_EXPIRED_CLAIMS: re-queue every delivery whose lease expired (its executor died or
# stalled), in one UPDATE. The inner SELECT locks with SKIP LOCKED, so a row being renewed
# or finished right now is left alone, and the UPDATE re-checks the expiry on the row it
# writes, so a lease renewed in between is never reaped. The expired attempt stays spent
# (the request may have been sent); one that was the last (MAX_ATTEMPTS) fails the delivery. Returns the
# previous claim and attempt number so the caller records the lost attempt's evidence.
REAP_EXPIRED_CLAIMS = f"""
UPDATE outbox_delivery d
SET claimed_by = NULL,
    claim_expires_at = NULL,
    status = CASE WHEN d.attempts >= {MAX_ATTEMPTS} THEN 'failed' ELSE 'retrying' END,
    completed_at = CASE WHEN d.attempts >= {MAX_ATTEMPTS} THEN now() ELSE NULL END,
    last_error = 'lease expired: executor ' || old.claimed_by || ' stopped reporting during attempt '
                 || d.attempts::text
FROM (
    SELECT id, claimed_by, attempts
    FROM outbox_delivery
    WHERE status IN ('pending', 'retrying') AND claim_expires_at < now()
    ORDER BY claim_expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
) old
WHERE d.id = old.id AND d.claim_expires_at < now()
RETURNING d.id, old.claimed_by AS lost_claim, old.attempts AS prev_attempts, d.status
"""

# ENDPOINT_SUCCEEDED: close the circuit after a healthy answer. Written only when there is
# something to reset, so the steady state of a healthy endpoint costs no row lock on it.
# Returns whether the circuit had been open (the caller then pulls its deferred backlog in).
ENDPOINT_SUCCEEDED = """
UPDATE outbox_webhookendpoint
SET consecutive_failures = 0, circuit_open_until = NULL
WHERE id = %(endpoint_id)s AND (consecutive_failures <> 0 OR circuit_open_until IS NOT NULL)
RETURNING id
"""

# ENDPOINT_FAILED: count a failure; at %(threshold)s consecutive failures the circuit opens
# for a cool-down that doubles with every further failure (base %(base_s)s, at most
# %(max_s)s). A failed half-open probe therefore reopens it for longer.
ENDPOINT_FAILED = """
UPDATE outbox_webhookendpoint
SET consecutive_failures = consecutive_failures + 1,
    circuit_open_until = CASE
        WHEN consecutive_failures + 1 >= %(threshold)s THEN now() + make_interval(secs => LEAST(
            %(base_s)s * power(2, LEAST(consecutive_failures + 1 - %(threshold)s, 20)), %(max_s)s))
        ELSE circuit_open_until END
WHERE id = %(endpoint_id)s
RETURNING consecutive_failures, circuit_open_until
"""

# ENDPOINT_DISABLE: the receiver answered 410 Gone: stop sending to it (Stripe's rule).
ENDPOINT_DISABLE = """
UPDATE outbox_webhookendpoint
SET enabled = false, disabled_reason = %(reason)s
WHERE id = %(endpoint_id)s
"""

# TAKE_PROBE: the circuit's cool-down is over (half-open): one delivery, in any replica,
# wins the right to probe the endpoint, by pushing the cool-down on for the probe's lease.
# Everyone else sees the circuit open again and defers. If the prober dies, the window
# ends with its lease and another probe is allowed.
TAKE_PROBE = """
UPDATE outbox_webhookendpoint
SET circuit_open_until = now() + make_interval(secs => %(probe_s)s)
WHERE id = %(endpoint_id)s AND circuit_open_until IS NOT NULL AND circuit_open_until <= now()
RETURNING id
"""

# PULL_IN_DEFERRED: after a successful probe closed the circuit, deliveries deferred
# behind it become due now instead of at their deferral time. Unclaimed rows only.
PULL_IN_DEFERRED = """
UPDATE outbox_delivery
SET fire_after = now()
WHERE endpoint_id = %(endpoint_id)s AND status IN ('pending', 'retrying')
  AND fire_after > now() AND claimed_by IS NULL
"""

# DUE_BACKLOG: deliveries due now and not held by a live claim (the backlog metric).
DUE_BACKLOG = """
SELECT count(*) FROM outbox_delivery
WHERE status IN ('pending', 'retrying') AND fire_after <= now()
  AND (claim_expires_at IS NULL OR claim_expires_at < now())
"""

# INSERT_EVENTS_WITH_DELIVERIES: a transaction's events and their fan-out in one round trip
# (outbox.services._write_events). The events go in in the order given (ORDER BY the ordinality:
# their sequence numbers follow it); each gets a delivery per endpoint of its tenant and mode that
# is enabled, not deleted and subscribed to its type ('*', 'prefix.*' or the exact type: the rule
# of outbox.services.event_type_matches), read in the same statement, so an endpoint that exists
# when the event is written always gets it. Delivery ids keep the id layout (prefix, then the
# event's 10-character millisecond time, then 16 random characters from md5's 0-9a-f, which the
# Crockford alphabet contains): time-ordered like every other id. Returns each event's id and sequence.
INSERT_EVENTS_WITH_DELIVERIES = """
WITH new_event AS (
    INSERT INTO outbox_event (id, tenant_id, livemode, type, data, created_at)
    SELECT t.id, t.tenant_id, t.livemode, t.type, t.data, t.created_at
    FROM unnest(%(ids)s::text[], %(tenant_ids)s::text[], %(livemodes)s::boolean[], %(types)s::text[],
                %(data)s::jsonb[], %(created_at)s::timestamptz[])
         WITH ORDINALITY AS t(id, tenant_id, livemode, type, data, created_at, n)
    ORDER BY t.n
    RETURNING id, tenant_id, livemode, type, sequence
), new_delivery AS (
INSERT INTO outbox_delivery (id, event_id, endpoint_id, status, attempts, fire_after, last_error, created_at)
SELECT 'whd_' || substr(split_part(e.id, '_', 2), 1, 10) || substr(md5(random()::text || e.id || w.id), 1, 16),
       e.id, w.id, 'pending', 0, now(), '', now()
FROM new_event e
JOIN outbox_webhookendpoint w
  ON w.tenant_id = e.tenant_id AND w.livemode = e.livemode AND w.enabled AND w.deleted_at IS NULL
WHERE EXISTS (
    SELECT 1 FROM jsonb_array_elements_text(w.enabled_events) AS p(pattern)
    WHERE p.pattern = '*' OR p.pattern = e.type
       OR (right(p.pattern, 2) = '.*' AND starts_with(e.type, left(p.pattern, -1)))
)
)
SELECT id, sequence FROM new_event
"""

# INSERT_EVENTS_WITH_DELIVERIES_RETURNING_DELIVERIES: the same, also returning each event's delivery ids
# (the third column), which a writer publishes after commit when executors take their work from a
# stream (HARDCOUNT_DELIVERY_DISPATCH=nats, outbox.stream).
INSERT_EVENTS_WITH_DELIVERIES_RETURNING_DELIVERIES = INSERT_EVENTS_WITH_DELIVERIES.replace(
    "\n)\nSELECT id, sequence FROM new_event\n",
    """
RETURNING id, event_id
)
SELECT e.id, e.sequence, COALESCE(array_agg(d.id) FILTER (WHERE d.id IS NOT NULL), '{}') AS deliveries
FROM new_event e LEFT JOIN new_delivery d ON d.event_id = e.id
GROUP BY e.id, e.sequence
""",
)
assert INSERT_EVENTS_WITH_DELIVERIES_RETURNING_DELIVERIES != INSERT_EVENTS_WITH_DELIVERIES
