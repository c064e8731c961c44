"""Tenant isolation in the database: PostgreSQL row-level security (docs/decisions/0130-row-level-security.md).

Every tenant-owned table has a policy that shows a row only when its ``tenant_id`` and
``livemode`` match the session settings ``hardcount.tenant_id`` and ``hardcount.livemode``.
Table owners bypass row-level security, so the policies bind only the non-owner role
:data:`TENANT_ROLE`, which an authenticated API request switches to for its duration
(:func:`enter` / :func:`leave`, called by :class:`hardcount.api.ApiView`). Everything else —
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


def enter(tenant_id: str, livemode: bool, using: str = "default") -> None:
    """Make the connection ``using`` act for one tenant and mode: settings first, then ``SET ROLE``.

    Session-level (not ``SET LOCAL``): a view runs services that open and commit their own
    transactions, and every one of them must stay under the tenant. :func:`leave` undoes it.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT set_config(%s, %s, false), set_config(%s, %s, false)",
            [TENANT_SETTING, tenant_id, LIVEMODE_SETTING, "true" if livemode else "false"],
        )
        cursor.execute(f"SET ROLE {TENANT_ROLE}")


def leave(using: str = "default") -> None:
    """Give the connection ``using`` back as the connecting role with no tenant settings.

    Safe to call when :func:`enter` was not. When the reset itself fails (a broken connection,
    an aborted transaction outside any atomic block) the connection is closed, so it is never
    reused as the tenant; inside an atomic block the error is raised, and the rollback of that
    block undoes the settings made in it.
    """
    connection = connections[using]
    if connection.connection is None:
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"RESET ROLE; RESET {TENANT_SETTING}; RESET {LIVEMODE_SETTING}")
    except DatabaseError:
        if connection.in_atomic_block:
            raise
        connection.close()


@contextmanager
def cross_tenant(using: str = "default") -> Iterator[None]:
    """Run the block as the connecting role (the cross-tenant owner), then as before.

    For the few steps of a request that read or write rows no tenant owns (a manual run's leader
    lease). Outside a request it changes nothing. The switch is ``SET LOCAL ROLE NONE`` in a
    transaction (the caller's, or one opened here), and the tenant role is set back with ``SET
    LOCAL`` at the end: should that fail, the transaction is aborted, and its rollback restores
    the session's tenant role by itself. So an error can never leave the request as the owner.
    """
    connection = connections[using]
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user = %s", [TENANT_ROLE])
        switched = cursor.fetchone()[0]
    if not switched:
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
