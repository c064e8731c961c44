"""The money-invariant sweep behind ``python manage.py doctor`` (docs/reference/guarantees.md).

Each :class:`Check` is one read-only SQL statement that returns the rows violating one
invariant, as ``(ref, detail)``: ``ref`` is the id of the offending object (an invoice,
a subscription, a delivery …) and ``detail`` says what is wrong in words. A clean
database returns no row for any check.

The statements are named SQL, one file per concern under ``ops/sql/`` (:data:`CHECK_FILES`,
loaded by :mod:`ops.sql`): each block's ``-- name:`` is the check's name and the comment
under it the invariant it checks (docs/decisions/0121-kernel-ops-and-devstack.md).

The checks read the tables directly, across every tenant and mode (no tenant scoping:
a cross-tenant reference is itself one of the violations), so they depend only on the
schema and docs/reference/, not on the services that write the rows. They run together in one
``READ ONLY`` transaction (``REPEATABLE READ`` when the sweep opens the transaction
itself), so every check sees the same snapshot and ``now()`` is one instant.

The sweep is meant for a quiescent database (after a scenario, before a release): in the
middle of a drain some invariants are legitimately between their two transactions (an
invoice materialised, its charge not yet recorded), and the sweep would report them.

Every statement is written to stay a few hash joins and one aggregate over each table, so
the whole sweep takes seconds on hundreds of thousands of rows (see ``bench/doctor.py``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connections, transaction

from billing import shards
from hardcount.money import MINIMUM_CHARGE
from ops import sql as named_sql

OK, FAIL, NOT_CHECKED, ERROR = "ok", "fail", "not checked", "error"


@dataclass(frozen=True)
class Check:
    """One invariant and the SQL that finds its violations.

    ``sql`` selects two text columns, ``ref`` (an object id) and ``detail`` (what is wrong),
    one row per violation. It may use the named parameters listed in :func:`run_checks`
    (``%(reaper_interval_s)s`` …); a literal percent sign must be written ``%%``.
    """

    name: str
    invariant: str
    sql: str


@dataclass
class CheckResult:
    """The outcome of one check: ``status`` is ``ok``, ``fail``, ``not checked`` or ``error``.

    ``violations`` counts every violating row; ``examples`` holds the first few as
    ``"<ref>: <detail>"`` (ordered by ref); ``note`` explains ``not checked`` and ``error``.
    """

    name: str
    invariant: str
    status: str
    violations: int = 0
    examples: list[str] = field(default_factory=list)
    note: str = ""
    duration_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the ``--json`` output of the command)."""
        return {
            "name": self.name,
            "invariant": self.invariant,
            "status": self.status,
            "violations": self.violations,
            "examples": self.examples,
            "note": self.note,
            "duration_ms": round(self.duration_ms, 1),
        }


# The minimum charge per currency (hardcount.money), passed to the checks as two parallel arrays
# (``%(minimum_charge_currencies)s``, ``%(minimum_charge_amounts)s``) that they unnest into a
# relation; a currency without a documented minimum has a minimum of 1 minor unit.
_MINIMUM_CHARGE = sorted(MINIMUM_CHARGE.items())

# The files of ops/sql/ that hold the checks, in the order the sweep runs them (and lists them);
# within a file, checks run in the file's order.
CHECK_FILES: tuple[str, ...] = (
    "invoices",
    "items",
    "payments",
    "ledger",
    "tenancy",
    "subscriptions",
    "leases",
    "events",
    "deliveries",
    "dunning",
    "discounts",
    "credit_notes",
)


def load_checks(files: tuple[str, ...] = CHECK_FILES) -> tuple[Check, ...]:
    """The checks of the named SQL files in ``ops/sql/``: each block's name, description (the invariant) and SQL."""
    return tuple(Check(s.name, s.description, s.sql) for file in files for s in named_sql.load(file).values())


CHECKS: tuple[Check, ...] = load_checks()


def default_unknown_after_s() -> float:
    """How long a payment outcome may stay unknown: the in-flight window (5 × the gateway timeout,
    :func:`billing.services.payments.in_flight_window`) plus one billing interval, by which the
    tick's reconciler has re-sent or retrieved it."""
    return 5 * float(getattr(settings, "HARDCOUNT_GATEWAY_TIMEOUT_S", 20.0)) + float(
        getattr(settings, "HARDCOUNT_BILLING_INTERVAL_S", 3600.0)
    )


def _time_prefix(epoch_ms: int) -> str:
    """The first 10 characters of an id minted at ``epoch_ms`` (see :mod:`hardcount.ids`): its time part."""
    alphabet = "0123456789abcdefghjkmnpqrstvwxyz"
    value = max(epoch_ms, 0) & ((1 << 48) - 1)
    return "".join(alphabet[(value >> (5 * i)) & 31] for i in reversed(range(10)))


def _open_read_only(cursor, *, outermost: bool, statement_timeout_s: float) -> None:
    if outermost:
        # The first statement of the transaction: one snapshot for every check.
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
    else:
        # Inside a caller's transaction (tests): READ ONLY may still be set, the isolation may not.
        cursor.execute("SET TRANSACTION READ ONLY")
    cursor.execute("SET LOCAL TIME ZONE 'UTC'")
    # The checks are hash joins and aggregates over whole tables: let them stay in memory.
    cursor.execute("SET LOCAL work_mem = '64MB'")
    cursor.execute("SELECT set_config('statement_timeout', %s, true)", [f"{int(statement_timeout_s * 1000)}ms"])


@contextmanager
def _read_only_cursor(using: str, *, statement_timeout_s: float):
    """A cursor in a ``READ ONLY`` transaction (``REPEATABLE READ`` when not nested in the caller's)
    that is always rolled back: the doctor never writes, whatever its SQL says."""
    connection = connections[using]
    outermost = not connection.in_atomic_block
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            _open_read_only(cursor, outermost=outermost, statement_timeout_s=statement_timeout_s)
            yield cursor
        transaction.set_rollback(True, using=using)


def run_checks(
    *,
    using: str = "default",
    names: list[str] | None = None,
    reaper_interval_s: float = 60.0,
    retention_days: float | None = None,
    unknown_after_s: float | None = None,
    max_examples: int = 5,
    statement_timeout_s: float = 120.0,
) -> list[CheckResult]:
    """Run the checks (all, or those in ``names``) read-only and return one result per check, in order.

    Parameters available to the SQL: ``reaper_interval_s`` (seconds a delivery claim may stay
    expired before the reaper must have re-queued it; default 60), ``unknown_after_s``
    (seconds a payment attempt may stay ``unknown``; default :func:`default_unknown_after_s`)
    ``unknown_after_prefix`` (the id time prefix of now minus ``unknown_after_s``),
    ``retention_prefix`` (the id time prefix of the oldest event whose deliveries are
    still kept: now minus ``retention_days``, default
    ``settings.HARDCOUNT_OUTBOX_RETENTION_DAYS`` or 30), and ``minimum_charge_currencies`` /
    ``minimum_charge_amounts`` (:data:`hardcount.money.MINIMUM_CHARGE` as two parallel arrays),
    ``billing_shards`` (``HARDCOUNT_BILLING_SHARDS``) and ``tenant_ids`` / ``tenant_shards`` (every
    tenant and its billing shard, :func:`billing.shards.shard_of`, as two parallel arrays).

    Runs in one transaction that is ``READ ONLY`` (and ``REPEATABLE READ`` when not nested in
    the caller's transaction) and always rolled back; a check that errors (e.g. the statement
    timeout) is reported with status ``error`` and the others still run. Raises ``KeyError``
    for an unknown name in ``names``.
    """
    by_name = {c.name: c for c in CHECKS}
    selected = [by_name[n] for n in names] if names else list(CHECKS)
    if retention_days is None:
        retention_days = float(getattr(settings, "HARDCOUNT_OUTBOX_RETENTION_DAYS", 30))
    if unknown_after_s is None:
        unknown_after_s = default_unknown_after_s()
    connection = connections[using]
    if not connection.in_atomic_block:
        # Let Django's connection health check run now, in autocommit, rather than as the
        # first statement of the read-only transaction.
        connection.ensure_connection()
        with connection.cursor():
            pass
    results: list[CheckResult] = []
    with _read_only_cursor(using, statement_timeout_s=statement_timeout_s) as cursor:
        cursor.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        now_ms = cursor.fetchone()[0]
        cursor.execute("SELECT id FROM hardcount_tenant ORDER BY id")
        tenant_ids = [row[0] for row in cursor.fetchall()]
        billing_shards = shards.configured_count()
        params = {
            "billing_shards": billing_shards,
            "tenant_ids": tenant_ids,
            "tenant_shards": [shards.shard_of(tenant_id, billing_shards) for tenant_id in tenant_ids],
            "reaper_interval_s": float(reaper_interval_s),
            "unknown_after_s": float(unknown_after_s),
            "retention_prefix": _time_prefix(now_ms - int(retention_days * 86_400_000)),
            "unknown_after_prefix": _time_prefix(now_ms - int(unknown_after_s * 1000)),
            "max_examples": int(max_examples),
            "minimum_charge_currencies": [code for code, _ in _MINIMUM_CHARGE],
            "minimum_charge_amounts": [amount for _, amount in _MINIMUM_CHARGE],
        }
        for check in selected:
            results.append(_run_one(connection, cursor, check, params))
    return results


def _run_one(connection, cursor, check: Check, params: dict[str, Any]) -> CheckResult:
    wrapped = f"""
        WITH violation AS MATERIALIZED ({check.sql})
        SELECT (SELECT count(*) FROM violation),
               ARRAY(SELECT ref || ': ' || detail FROM violation ORDER BY ref, detail LIMIT %(max_examples)s)
    """
    started = time.perf_counter()
    sid = transaction.savepoint(using=connection.alias)
    try:
        cursor.execute(wrapped, params)
        count, examples = cursor.fetchone()
    except DatabaseError as exc:
        transaction.savepoint_rollback(sid, using=connection.alias)
        return CheckResult(
            check.name,
            check.invariant,
            ERROR,
            note=str(exc).strip().splitlines()[0],
            duration_ms=(time.perf_counter() - started) * 1000,
        )
    transaction.savepoint_commit(sid, using=connection.alias)
    return CheckResult(
        check.name,
        check.invariant,
        FAIL if count else OK,
        violations=count,
        examples=list(examples),
        duration_ms=(time.perf_counter() - started) * 1000,
    )


# ---------------------------------------------------------------- the gateway (optional, --gateway)

_GATEWAY = named_sql.load("gateway")
# Its SQL is not a violation query: it reads the invoices whose PaymentIntents :func:`check_gateway`
# compares with the gateway.
_GATEWAY_ROWS = _GATEWAY["gateway_agrees_with_invoices"]
GATEWAY_CHECK = Check(_GATEWAY_ROWS.name, _GATEWAY_ROWS.description, _GATEWAY_ROWS.sql)
_REFUND_ROWS = _GATEWAY["gateway_agrees_with_refunds"]
REFUND_GATEWAY_CHECK = Check(_REFUND_ROWS.name, _REFUND_ROWS.description, _REFUND_ROWS.sql)
OPTIONAL_CHECKS: tuple[Check, ...] = (GATEWAY_CHECK, REFUND_GATEWAY_CHECK)

# The development default of settings.STRIPE_API_KEY: with no API base either, no gateway is configured.
_DEVELOPMENT_STRIPE_KEY = "sk_test_hardcount_localstripe"
# Metadata key under which billing.gateway records the invoice a PaymentIntent charges.
_INVOICE_METADATA_KEY = "hardcount_invoice"
_TENANT_METADATA_KEY = "hardcount_tenant"


def gateway_configured() -> bool:
    """True when settings name a gateway: an API base (localstripe) or a real, non-development key."""
    api_base = getattr(settings, "STRIPE_API_BASE", "")
    api_key = getattr(settings, "STRIPE_API_KEY", "")
    return bool(api_base) or bool(api_key and api_key != _DEVELOPMENT_STRIPE_KEY)


def _stripe_client(api_key: str = "", stripe_account: str = ""):
    """A read-only client of one gateway account: ``api_key`` (default the platform's), as ``stripe_account``."""
    import stripe

    api_base = getattr(settings, "STRIPE_API_BASE", "")
    return stripe.StripeClient(
        api_key or settings.STRIPE_API_KEY,
        stripe_account=stripe_account or None,
        base_addresses={"api": api_base} if api_base else None,
        max_network_retries=2,
        http_client=stripe.HTTPXClient(
            timeout=float(getattr(settings, "HARDCOUNT_GATEWAY_TIMEOUT_S", 20.0)), allow_sync_methods=True
        ),
    )


def check_gateway(
    *, using: str = "default", limit: int | None = None, max_examples: int = 5, client=None
) -> CheckResult:
    """Compare the invoices' PaymentIntents with the gateway, through the ``stripe`` library (read-only).

    Retrieves the PaymentIntent of every invoice that names one (at most ``limit`` invoices,
    newest first) in the invoice's tenant's own gateway account for its mode, else the
    platform's (:mod:`billing.gateway_accounts`), and lists each account's PaymentIntents (at
    most ``limit`` an account) to find charges the books do not show (a process killed between
    the charge and its record, left unresolved). Returns status ``not checked`` when no gateway
    is configured and ``error`` when the gateway cannot be reached; ``client`` overrides the
    ``stripe.StripeClient`` of every account.
    """
    import stripe

    started = time.perf_counter()
    name, invariant = GATEWAY_CHECK.name, GATEWAY_CHECK.invariant
    if client is None and not gateway_configured():
        return CheckResult(name, invariant, NOT_CHECKED, note="no gateway configured (STRIPE_API_BASE unset)")
    invoices = _read_gateway_rows(using, limit)
    clients = _AccountClients(using, client)
    violations: list[str] = []
    try:
        for inv_id, status, amount_due, currency, invoice_intent, charged_intent, settled, tenant, livemode in invoices:
            intent_id = charged_intent or invoice_intent
            if status == "paid" and settled and not charged_intent:
                continue
            try:
                intent = clients.of(tenant, livemode).v1.payment_intents.retrieve(intent_id)
            except stripe.InvalidRequestError as exc:
                if status == "paid":
                    violations.append(
                        f"{inv_id}: paid, but PaymentIntent {intent_id} is unknown to the gateway ({exc.http_status})"
                    )
                continue
            if status == "paid":
                if intent.status != "succeeded":
                    violations.append(f"{inv_id}: paid, but PaymentIntent {intent.id} is {intent.status}")
                elif intent.amount != amount_due or intent.currency != currency:
                    violations.append(
                        f"{inv_id}: amount_due {amount_due} {currency}, but PaymentIntent {intent.id} charged "
                        f"{intent.amount} {intent.currency}"
                    )
            elif intent.status == "succeeded":
                violations.append(f"{inv_id}: {status}, but PaymentIntent {intent.id} succeeded at the gateway")
        for account_client, tenant_ids in clients.listings():
            violations.extend(_gateway_listing_violations(using, account_client, limit, only_tenants=tenant_ids))
    except stripe.StripeError as exc:
        note = f"gateway unreachable or refused: {type(exc).__name__}: {exc.user_message or exc}"
        return _gateway_result(name, invariant, violations, ERROR, note, started=started, max_examples=max_examples)
    status = FAIL if violations else OK
    note = f"{len(invoices)} invoices compared"
    return _gateway_result(name, invariant, violations, status, note, started=started, max_examples=max_examples)


def _gateway_result(
    name: str, invariant: str, violations: list[str], status: str, note: str, *, started: float, max_examples: int
) -> CheckResult:
    """A gateway check's result: its violations (sorted examples), ``status`` and ``note``, timed from ``started``."""
    return CheckResult(
        name,
        invariant,
        status,
        violations=len(violations),
        examples=sorted(violations)[:max_examples],
        note=note,
        duration_ms=(time.perf_counter() - started) * 1000,
    )


def _read_only_rows(using: str, sql: str, params) -> list[tuple]:
    with _read_only_cursor(using, statement_timeout_s=120.0) as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def _read_gateway_rows(using: str, limit: int | None) -> list[tuple]:
    sql = GATEWAY_CHECK.sql + (" LIMIT %s" if limit is not None else "")
    return _read_only_rows(using, sql, [limit] if limit is not None else [])


class _AccountClients:
    """The doctor's client of each gateway account, built once: a tenant's own for its mode, else the platform's."""

    def __init__(self, using: str, override=None):
        # Here, not at the top: the module is imported without Django set up (the SQL file checks).
        from billing import gateway_accounts

        self._accounts = gateway_accounts
        self._override = override
        self._own = {(a.tenant_id, a.livemode): a for a in gateway_accounts.every_account(using)}
        self._clients: dict[tuple[str, str], Any] = {}

    def _client(self, credentials: tuple[str, str]):
        if self._override is not None:
            return self._override
        if credentials not in self._clients:
            self._clients[credentials] = _stripe_client(*credentials)
        return self._clients[credentials]

    def of(self, tenant_id: str, livemode: bool):
        """The client of the account that charges ``tenant_id`` in ``livemode``."""
        return self._client(self._accounts.credentials(self._own.get((tenant_id, livemode))))

    def listings(self) -> list[tuple[Any, set[str] | None]]:
        """``(client, tenants)`` of every account to list: the platform's (every tenant, None), then each
        tenant's own (that tenant only). With an override, the one client (every tenant)."""
        if self._override is not None:
            return [(self._override, None)]
        out: list[tuple[Any, set[str] | None]] = [(self._client(self._accounts.credentials(None)), None)]
        for account in self._own.values():
            out.append((self._client(self._accounts.credentials(account)), {account.tenant_id}))
        return out


def _gateway_listing_violations(
    using: str, client, limit: int | None, *, only_tenants: set[str] | None = None
) -> list[str]:
    """Succeeded PaymentIntents at the gateway, grouped by the invoice in their metadata.

    Only PaymentIntents of tenants this database holds count (their metadata names the
    tenant): a gateway account shared with another deployment or test database is not ours
    to judge.
    """
    tenants = {row[0] for row in _read_only_rows(using, _GATEWAY["gateway_tenants"].sql, [])}
    if only_tenants is not None:
        tenants &= only_tenants
    succeeded: dict[str, list[str]] = {}
    seen = 0
    for intent in client.v1.payment_intents.list(params={"limit": 100}).auto_paging_iter():
        seen += 1
        if limit is not None and seen > limit:
            break
        metadata = intent.metadata.to_dict() if intent.metadata else {}
        invoice_id = metadata.get(_INVOICE_METADATA_KEY)
        tenant_id = metadata.get(_TENANT_METADATA_KEY)
        if tenant_id and tenant_id not in tenants:
            continue
        if invoice_id and intent.status == "succeeded":
            succeeded.setdefault(invoice_id, []).append(intent.id)
    if not succeeded:
        return []
    rows = _read_only_rows(using, _GATEWAY["gateway_invoices_by_id"].sql, [list(succeeded)])
    books = {inv_id: (status, intent_id) for inv_id, status, intent_id in rows}
    violations = []
    for invoice_id, intents in sorted(succeeded.items()):
        if len(intents) > 1:
            violations.append(
                f"{invoice_id}: {len(intents)} succeeded PaymentIntents at the gateway ({', '.join(intents)})"
            )
        status, intent_id = books.get(invoice_id, (None, None))
        if status is None:
            violations.append(f"{invoice_id}: PaymentIntent {intents[0]} succeeded for an invoice that does not exist")
        elif status != "paid":
            violations.append(f"{invoice_id}: {status}, but PaymentIntent {intents[0]} succeeded at the gateway")
        elif intent_id not in intents:
            violations.append(
                f"{invoice_id}: paid under PaymentIntent {intent_id or 'none'}, "
                f"but {intents[0]} succeeded at the gateway"
            )
    return violations


def check_gateway_refunds(
    *, using: str = "default", limit: int | None = None, max_examples: int = 5, client=None
) -> CheckResult:
    """Compare the refunds with the gateway (read-only): each has its credit note and, unless it was refused
    (outcome ``error``), a gateway refund of its amount on its PaymentIntent, found by ``gateway_refund_id`` or
    by its ``hardcount_refund`` metadata, whose ``succeeded`` agrees with the books. At most ``limit`` refunds,
    newest first. Returns ``not checked`` without a gateway, ``error`` when it cannot be reached."""
    import stripe

    started = time.perf_counter()
    name, invariant = REFUND_GATEWAY_CHECK.name, REFUND_GATEWAY_CHECK.invariant
    if client is None and not gateway_configured():
        return CheckResult(name, invariant, NOT_CHECKED, note="no gateway configured (STRIPE_API_BASE unset)")
    sql = REFUND_GATEWAY_CHECK.sql + (" LIMIT %s" if limit is not None else "")
    rows = _read_only_rows(using, sql, [limit] if limit is not None else [])
    clients = _AccountClients(using, client)
    violations: list[str] = []
    try:
        for refund_id, note_id, intent_id, gateway_id, amount, currency, outcome, tenant, livemode, has_note in rows:
            if not has_note:
                violations.append(f"{refund_id}: its credit note {note_id} does not exist")
            if outcome == "error":
                continue
            account = clients.of(tenant, livemode)
            found = [
                r
                for r in account.v1.refunds.list(params={"payment_intent": intent_id, "limit": 100}).auto_paging_iter()
                if r.id == gateway_id
                or (r.metadata.to_dict() if r.metadata else {}).get("hardcount_refund") == refund_id
            ]
            if not found:
                violations.append(f"{refund_id}: no refund of PaymentIntent {intent_id} at the gateway ({outcome})")
            elif len(found) > 1:
                violations.append(
                    f"{refund_id}: {len(found)} refunds at the gateway ({', '.join(r.id for r in found)})"
                )
            elif found[0].amount != amount or found[0].currency != currency:
                violations.append(
                    f"{refund_id}: {amount} {currency} in the books, {found[0].amount} {found[0].currency} refunded"
                )
            elif outcome in ("succeeded", "failed") and (found[0].status == "succeeded") != (outcome == "succeeded"):
                violations.append(f"{refund_id}: {outcome} in the books, {found[0].status} at the gateway")
    except stripe.StripeError as exc:
        note = f"gateway unreachable or refused: {type(exc).__name__}: {exc.user_message or exc}"
        return _gateway_result(name, invariant, violations, ERROR, note, started=started, max_examples=max_examples)
    status = FAIL if violations else OK
    note = f"{len(rows)} refunds compared"
    return _gateway_result(name, invariant, violations, status, note, started=started, max_examples=max_examples)


# ---------------------------------------------------------------- reporting


def exit_status(results: list[CheckResult]) -> int:
    """0 when every check passed (or was not checked), 1 when any failed, 2 when none failed but one errored."""
    if any(r.status == FAIL for r in results):
        return 1
    if any(r.status == ERROR for r in results):
        return 2
    return 0


def summary(results: list[CheckResult]) -> dict[str, Any]:
    """The JSON document of ``doctor --json``: overall status, counts, and every check's result."""
    failed = [r.name for r in results if r.status == FAIL]
    errored = [r.name for r in results if r.status == ERROR]
    return {
        "status": FAIL if failed else (ERROR if errored else OK),
        "checks": len(results),
        "failed": failed,
        "errored": errored,
        "violations": sum(r.violations for r in results),
        "results": [r.as_dict() for r in results],
    }


def format_table(results: list[CheckResult]) -> str:
    """A plain-text table: check, status, violations, examples (or the note), then a one-line verdict."""
    header = ("check", "status", "violations", "examples")
    rows = [
        (
            r.name,
            r.status.upper() if r.status != OK else r.status,
            str(r.violations),
            "; ".join(r.examples) if r.examples else r.note,
        )
        for r in results
    ]
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(3)]
    lines = [f"{header[0]:<{widths[0]}}  {header[1]:<{widths[1]}}  {header[2]:>{widths[2]}}  {header[3]}"]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[3]))
    for name, status, count, examples in rows:
        lines.append(f"{name:<{widths[0]}}  {status:<{widths[1]}}  {count:>{widths[2]}}  {examples}".rstrip())
    failed = sum(r.status == FAIL for r in results)
    errored = sum(r.status == ERROR for r in results)
    skipped = sum(r.status == NOT_CHECKED for r in results)
    total = sum(r.violations for r in results)
    if failed or errored:
        verdict = f"{failed} of {len(results)} checks failed ({total} violations), {errored} could not run"
    else:
        verdict = f"all {len(results) - skipped} checks passed"
    if skipped:
        verdict += f", {skipped} not checked"
    return "\n".join([*lines, "", verdict]) + "\n"
