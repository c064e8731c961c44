"""The leader lease: one row per singleton role (docs/reference/roles-and-leases.md)."""

from django.db import models


class LeaderLease(models.Model):
    """Who runs ``role`` now. ``token`` is the fencing token: it increases every time a new
    holder takes the row, and every write made under the lease checks it. ``last_stamp_at``
    is the role's liveness stamp (last completed tick, or the billing drain's last page);
    ``last_tick_at`` is when the last tick completed, from which the next one is due.
    All times are the database's ``now()``."""

    role = models.CharField(max_length=64, primary_key=True)
    holder = models.CharField(max_length=200, null=True, blank=True)
    token = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_stamp_at = models.DateTimeField(null=True, blank=True)
    last_stamp_holder = models.CharField(max_length=200, blank=True, default="")
    last_tick_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.role}: {self.holder or '-'} (token {self.token})"
