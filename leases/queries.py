"""The leader lease's SQL, one named statement per operation, each with the guarantee it gives.

The lease itself is described in docs/reference/roles-and-leases.md.

Every time is PostgreSQL's ``now()``: the database is the one clock authority for who holds
a role and until when. Parameters are named (``%(role)s``, ``%(holder)s``, ``%(token)s``,
``%(ttl_s)s`` in seconds).

Lock modes, which the fence depends on (see :mod:`hardcount.fencing`):

- a fenced transaction holds the lease row ``FOR KEY SHARE`` until it ends (:data:`CHECK_FENCE`);
- heartbeat, stamp and release are plain ``UPDATE``\\ s of non-key columns, which take
  ``FOR NO KEY UPDATE``: compatible with ``FOR KEY SHARE``, so the holder's own fenced work
  never delays its heartbeat;
- :data:`ACQUIRE` locks the row ``FOR UPDATE``, which conflicts with ``FOR KEY SHARE``: a new
  holder waits until every in-flight fenced transaction of the old holder has ended. An
  upsert on its own would only take ``FOR NO KEY UPDATE`` and would *not* wait (a test
  shows it), which is why the statement locks the row explicitly first.
"""

# Take the role if its row is free (no holder), expired, or already ours; create it on first use.
# Returns one row (token, acquired_at, expires_at) when the role is ours, none otherwise.
# Guarantees: one statement, so two replicas racing for a free row cannot both win (the row
# lock serialises them and the loser's WHERE fails on the winner's fresh expires_at); the token
# increases for every new holder (and when our own lease had already expired: a holder that
# let its lease lapse starts a new tenure, so writes of its old tenure stay refused); the
# FOR UPDATE lock makes a takeover wait for the deposed holder's in-flight fenced transactions.
ACQUIRE = """
WITH current_lease AS (
    SELECT role FROM leases_leaderlease WHERE role = %(role)s FOR UPDATE
)
INSERT INTO leases_leaderlease AS lease
    (role, holder, token, acquired_at, heartbeat_at, expires_at, last_stamp_holder)
SELECT %(role)s, %(holder)s, 1, now(), now(), now() + make_interval(secs => %(ttl_s)s), ''
FROM (VALUES (1)) AS one LEFT JOIN current_lease ON true
ON CONFLICT (role) DO UPDATE SET
    token = CASE WHEN lease.holder = EXCLUDED.holder AND lease.expires_at > now()
                 THEN lease.token ELSE lease.token + 1 END,
    acquired_at = CASE WHEN lease.holder = EXCLUDED.holder AND lease.expires_at > now()
                       THEN lease.acquired_at ELSE now() END,
    holder = EXCLUDED.holder,
    heartbeat_at = now(),
    expires_at = EXCLUDED.expires_at
WHERE lease.holder IS NULL OR lease.expires_at <= now() OR lease.holder = EXCLUDED.holder
RETURNING token, acquired_at, expires_at
"""

# A follower's cheap look before trying ACQUIRE: a plain MVCC read that takes no lock, so
# followers polling twice a second never queue behind the holder's fenced transactions.
# Returns (holder, token, free); no row when the role has never been held.
PEEK = """
SELECT holder, token, (holder IS NULL OR expires_at IS NULL OR expires_at <= now()) AS free
FROM leases_leaderlease WHERE role = %(role)s
"""

# Extend the lease by the TTL from now(), only while holder and token are still ours and the
# lease has not expired. Run under SET LOCAL statement_timeout (HEARTBEAT_TIMEOUT) so a slow
# database fails the beat quickly instead of hanging past the abandon threshold.
# Guarantee: once expired, a lease is never revived by its old holder (expiry is one-way), so
# the moment a successor may take over is fixed by the database alone. Returns expires_at, or no row.
HEARTBEAT = """
UPDATE leases_leaderlease
SET heartbeat_at = now(), expires_at = now() + make_interval(secs => %(ttl_s)s)
WHERE role = %(role)s AND holder = %(holder)s AND token = %(token)s AND expires_at > now()
RETURNING expires_at
"""

HEARTBEAT_TIMEOUT = "SET LOCAL statement_timeout = '2s'"

# Give the role up on a graceful stop so a successor takes it at its next poll instead of
# waiting out the TTL. Fenced on holder and token: releasing a lease we no longer hold is a no-op.
# The token is kept, so the next holder's ACQUIRE increments it.
RELEASE = """
UPDATE leases_leaderlease SET holder = NULL, expires_at = now()
WHERE role = %(role)s AND holder = %(holder)s AND token = %(token)s
"""

# The liveness stamp (after every page of the billing drain, and at the end of every tick).
# Fenced like every write under the lease: a deposed holder's stamp changes nothing.
STAMP = """
UPDATE leases_leaderlease SET last_stamp_at = now(), last_stamp_holder = %(holder)s
WHERE role = %(role)s AND holder = %(holder)s AND token = %(token)s AND expires_at > now()
"""

# A completed tick: the liveness stamp plus last_tick_at, from which the next tick is due.
COMPLETE_TICK = """
UPDATE leases_leaderlease SET last_stamp_at = now(), last_stamp_holder = %(holder)s, last_tick_at = now()
WHERE role = %(role)s AND holder = %(holder)s AND token = %(token)s AND expires_at > now()
"""

# The fence, run inside the caller's write transaction: lock the row FOR KEY SHARE where holder
# and token are ours and the lease is unexpired. No row means the lease is lost: the caller
# raises and rolls back. The lock, held to the end of the transaction, makes a successor's
# ACQUIRE wait until this transaction ends; a takeover that committed first changed holder and
# token, so this re-checked WHERE fails. The same statement bounds how long this transaction
# may sit idle (set_config(..., true) is SET LOCAL): a SIGSTOPped holder's open transaction is
# ended by the server and cannot hold a takeover back for longer than that.
CHECK_FENCE = """
SELECT token, set_config('idle_in_transaction_session_timeout', %(idle_timeout_ms)s, true)
FROM leases_leaderlease
WHERE role = %(role)s AND holder = %(holder)s AND token = %(token)s AND expires_at > now()
FOR KEY SHARE
"""

# Seconds until the role's next tick is due: last completed tick + interval, by the database's
# clock, so a new holder keeps the cadence of the old one. 0 when never ticked.
SECONDS_UNTIL_DUE = """
SELECT GREATEST(0, COALESCE(EXTRACT(EPOCH FROM
    (last_tick_at + make_interval(secs => %(interval_s)s)) - now()), 0))::float8
FROM leases_leaderlease WHERE role = %(role)s
"""

# Every lease with its derived state, for /health/ready and /metrics. Read-only, no lock.
STATUS = """
SELECT role, holder, token, acquired_at, heartbeat_at, expires_at,
       (holder IS NOT NULL AND expires_at > now()) AS held,
       last_stamp_at, last_stamp_holder, last_tick_at,
       EXTRACT(EPOCH FROM now() - last_stamp_at)::float8 AS stamp_age_s,
       now() AS db_now
FROM leases_leaderlease ORDER BY role
"""
