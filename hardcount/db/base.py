"""The ``ENGINE`` of every database alias: django-prometheus's PostgreSQL backend that also applies the tenant.

:class:`DatabaseWrapper` carries the tenant a connection acts for (``tenant``: ``(tenant_id,
livemode)`` or None, set by :func:`hardcount.tenancy.enter`) and runs
:func:`hardcount.tenancy.apply_tenant` around every statement; ``tenant_applied`` says whether the
current transaction has it yet, and is cleared wherever a transaction (or a savepoint's part of
one) ends, so the next statement applies it again.
"""

from __future__ import annotations

from django_prometheus.db.backends.postgresql import base as prometheus_base

from hardcount import tenancy


class DatabaseWrapper(prometheus_base.DatabaseWrapper):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tenant: tuple[str, bool] | None = None
        self.tenant_applied = False
        # Outermost, so the tenant's statement runs before anything the other wrappers do.
        self.execute_wrappers.insert(0, tenancy.apply_tenant)

    # Cleared after the step, not before: a savepoint rollback runs its statement through the wrappers,
    # and applying the tenant inside the aborted part would fail.
    def connect(self):
        try:
            return super().connect()
        finally:
            self.tenant_applied = False

    def _commit(self):
        try:
            return super()._commit()
        finally:
            self.tenant_applied = False

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            self.tenant_applied = False

    def _savepoint_rollback(self, sid):
        # SET LOCALs made after the savepoint are undone with it: apply again rather than guess.
        try:
            return super()._savepoint_rollback(sid)
        finally:
            self.tenant_applied = False

    def _set_autocommit(self, autocommit):
        try:
            return super()._set_autocommit(autocommit)
        finally:
            self.tenant_applied = False

    def _close(self):
        try:
            return super()._close()
        finally:
            self.tenant_applied = False
