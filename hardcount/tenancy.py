"""Tenant isolation in the database: PostgreSQL row-level security (docs/decisions/0130-row-level-security.md).

Every tenant-owned table has a policy that shows a row only when its ``tenant_id`` and
``livemode`` match the session settings ``hardcount.tenant_id`` and ``hardcount.livemode``.
Table owners bypass row-level security, so the policies bind only the non-owner role
:data:`TENANT_ROLE`, which an authenticated API request switches to for its duration
(:func:`enter` / :func:`leave`, called by :class:`hardcount.api.ApiView`): each of its
transactions sets the role and the settings with ``SET LOCAL`` (decision 0183), so no session
state is left for a transaction-pooling PgBouncer to hand to another client. Everything else —
the background roles, the admin, management commands, migrations, threads the API starts —
runs as the connecting role, the tables' owner: the cross-tenant role.

The migrations build their SQL with :func:`create_role_sql`, :func:`enable_sql` and
:func:`disable_sql`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connections, transaction

# NOLOGIN, no BYPASSRLS: reachable only by ``SET ROLE`` from the connecting role.
TENANT_ROLE = "hardcount_tenant"
TENANT_SETTING = "hardcount.tenant_id"
LIVEMODE_SETTING = "hardcount.livemode"

# A setting RESET after being SET in the session reads as '' (not NULL): both mean "no tenant",
# which matches no row (NULL comparisons are never true).
_TENANT = f"NULLIF(current_setting('{TENANT_SETTING}', true), '')"
_LIVEMODE = f"NULLIF(current_setting('{LIVEMODE_SETTING}', true), '')::boolean"

#: The policy condition of a table with its own ``tenant_id`` and ``livemode`` columns.
OWN_ROWS = f"tenant_id = {_TENANT} AND livemode = {_LIVEMODE}"
#: The policy condition of ``hardcount_tenant``: the caller's own tenant row only.
OWN_TENANT = f"id = {_TENANT}"
#: The policy condition of a table whose rows carry the tenant but no mode (the audit log).
OWN_TENANT_ROWS = f"tenant_id = {_TENANT}"


def through_parent(table: str, foreign_key: str, parent_table: str) -> str:
    """The policy condition of ``table``, which has no tenant columns: its parent row is visible.

    ``parent_table``'s own policy applies inside the ``EXISTS``, so a row of ``table`` is
    visible (and writable) exactly when the row its ``foreign_key`` column points to is.
    """
    return f"EXISTS (SELECT 1 FROM {parent_table} p WHERE p.id = {table}.{foreign_key})"


def create_role_sql() -> str:
    """SQL creating :data:`TENANT_ROLE` once per cluster and making the migrating role able to ``SET ROLE`` to it.

    The role gets the schema and its sequences (ids of a few tables are serials), now and for
    later migrations' sequences; a table it may touch is granted by :func:`enable_sql` with its
    policy, so every other table (auth, sessions, leases, migrations) is closed to it.
    """
    return f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{TENANT_ROLE}') THEN
        CREATE ROLE {TENANT_ROLE} NOLOGIN NOSUPERUSER NOINHERIT NOBYPASSRLS NOCREATEDB NOCREATEROLE;
    END IF;
    IF NOT pg_has_role(current_user, '{TENANT_ROLE}', 'MEMBER') THEN
        EXECUTE format('GRANT {TENANT_ROLE} TO %I', current_user);
    END IF;
END
$$;
GRANT USAGE ON SCHEMA public TO {TENANT_ROLE};
GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {TENANT_ROLE};
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT USAGE, SELECT, UPDATE ON SEQUENCES TO {TENANT_ROLE};
"""


def drop_grants_sql() -> str:
    """The reverse of :func:`create_role_sql` in this database; the role itself stays (it is cluster-wide)."""
    return f"""
ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE USAGE, SELECT, UPDATE ON SEQUENCES FROM {TENANT_ROLE};
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {TENANT_ROLE};
REVOKE USAGE ON SCHEMA public FROM {TENANT_ROLE};
"""


def enable_sql(table: str, condition: str, check: str | None = None) -> str:
    """SQL turning row-level security on for ``table`` with one policy: rows read, updated and deleted
    must satisfy ``condition`` (``USING``), rows written ``check`` (``WITH CHECK``; default ``condition``)."""
    return f"""
GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {TENANT_ROLE};
ALTER TABLE {table} ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_isolation ON {table} USING ({condition}) WITH CHECK ({check or condition});
"""


def disable_sql(table: str) -> str:
    """The reverse of :func:`enable_sql`."""
    return f"""
DROP POLICY IF EXISTS tenant_isolation ON {table};
ALTER TABLE {table} DISABLE ROW LEVEL SECURITY;
REVOKE ALL ON {table} FROM {TENANT_ROLE};
"""


# APPLY: the tenant, for the current transaction only (set_config(..., true) is SET LOCAL; the role
# is a setting too). RESET_LOCAL: back to the connecting role and no tenant, also for this transaction.
APPLY = "SELECT set_config('role', %s, true), set_config(%s, %s, true), set_config(%s, %s, true)"
RESET_LOCAL = "SELECT set_config('role', 'none', true), set_config(%s, '', true), set_config(%s, '', true)"


def _apply(connection) -> None:
    tenant_id, livemode = connection.tenant
    connection.tenant_applied = True
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                APPLY,
                [TENANT_ROLE, TENANT_SETTING, tenant_id, LIVEMODE_SETTING, "true" if livemode else "false"],
            )
    except BaseException:
        connection.tenant_applied = False
        raise


def apply_tenant(execute, sql, params, many, context):
    """The execute wrapper of every connection (:mod:`hardcount.db.base`): while the connection acts for a
    tenant, the first statement of each transaction is preceded by :data:`APPLY`.

    A statement outside any transaction (autocommit) gets one of its own, so it runs under the tenant
    too. The backend clears ``tenant_applied`` at every commit, rollback and savepoint rollback.
    """
    connection = context["connection"]
    if getattr(connection, "tenant", None) is None or connection.tenant_applied:
        return execute(sql, params, many, context)
    if connection.get_autocommit():
        with transaction.atomic(using=connection.alias):
            _apply(connection)
            return execute(sql, params, many, context)
    _apply(connection)
    return execute(sql, params, many, context)


def enter(tenant_id: str, livemode: bool, using: str = "default") -> None:
    """Make the connection ``using`` act for one tenant and mode, transaction by transaction.

    Nothing is set on the session: every transaction the connection runs from now on — the
    services' own ``atomic()`` blocks and each statement outside one — starts with ``SET LOCAL``
    of the settings and the role (:func:`apply_tenant`), so the switch holds through a
    transaction-pooling PgBouncer, which hands each transaction whatever server connection is
    free. Inside an open transaction it applies at once. :func:`leave` undoes it.
    """
    connection = connections[using]
    connection.tenant = (tenant_id, livemode)
    connection.tenant_applied = False
    if connection.in_atomic_block:
        _apply(connection)


def leave(using: str = "default") -> None:
    """Give the connection ``using`` back as the connecting role with no tenant settings.

    Safe to call when :func:`enter` was not. Later transactions run as the owner; inside an open
    transaction the settings are reset for its remainder too. When that reset fails (a broken
    connection, an aborted transaction outside any atomic block) the connection is closed; inside
    an atomic block the error is raised, and the rollback of that block undoes the settings made in it.
    """
    connection = connections[using]
    entered = getattr(connection, "tenant", None) is not None
    connection.tenant = None
    connection.tenant_applied = False
    # Outside a transaction nothing is left to reset: every transaction that applied the tenant has ended.
    if not entered or connection.connection is None or connection.get_autocommit():
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute(RESET_LOCAL, [TENANT_SETTING, LIVEMODE_SETTING])
    except DatabaseError:
        if connection.in_atomic_block:
            raise
        connection.close()


@contextmanager
def cross_tenant(using: str = "default") -> Iterator[None]:
    """Run the block as the connecting role (the cross-tenant owner), then as before.

    For the few steps of a request that read or write rows no tenant owns (a manual run's leader
    lease, a claim). Outside a request it changes nothing and runs no statement. The switch is
    ``SET LOCAL ROLE NONE`` in a transaction (the caller's, or one opened here), and the tenant
    role is set back with ``SET LOCAL`` at the end: should that fail, the transaction is aborted,
    and its rollback ends the switch with it. So an error can never leave the request as the owner.
    """
    connection = connections[using]
    if getattr(connection, "tenant", None) is None:
        yield
        return
    with transaction.atomic(using=using):
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL ROLE NONE")
        try:
            yield
        finally:
            if not connection.needs_rollback:
                with connection.cursor() as cursor:
                    cursor.execute(f"SET LOCAL ROLE {TENANT_ROLE}")


def current_role(using: str = "default") -> str:
    """The role the connection ``using`` runs its queries as (``current_user``)."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT current_user")
        return cursor.fetchone()[0]


__all__ = [
    "LIVEMODE_SETTING",
    "OWN_ROWS",
    "OWN_TENANT",
    "OWN_TENANT_ROWS",
    "TENANT_ROLE",
    "TENANT_SETTING",
    "apply_tenant",
    "create_role_sql",
    "cross_tenant",
    "current_role",
    "disable_sql",
    "drop_grants_sql",
    "enable_sql",
    "enter",
    "leave",
    "through_parent",
]
