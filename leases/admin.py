"""Operators' admin for leader leases: who holds each role, its fencing token and how fresh it is (read-only).

Ages are computed by the database (``now()`` minus the row's times): the same clock authority
the lease itself uses (docs/reference/roles-and-leases.md).
"""

from django.contrib import admin
from django.db.models import DurationField, ExpressionWrapper, F
from django.db.models.functions import Now

from hardcount.admin import ReadOnlyAdmin
from leases.models import LeaderLease


def _age(name: str) -> ExpressionWrapper:
    return ExpressionWrapper(Now() - F(name), output_field=DurationField())


def _seconds(value) -> str:
    return "—" if value is None else f"{value.total_seconds():.1f} s"


@admin.register(LeaderLease)
class LeaderLeaseAdmin(ReadOnlyAdmin):
    list_display = (
        "role",
        "holder",
        "token",
        "held",
        "heartbeat_age",
        "expires_in",
        "acquired_at",
        "tick_age",
        "last_stamp_holder",
    )
    ordering = ("role",)
    readonly_fields = ("held", "heartbeat_age", "expires_in", "tick_age")

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .annotate(
                heartbeat_age_d=_age("heartbeat_at"),
                stamp_age_d=_age("last_stamp_at"),
                expires_in_d=ExpressionWrapper(F("expires_at") - Now(), output_field=DurationField()),
            )
        )

    @admin.display(description="held", boolean=True)
    def held(self, lease: LeaderLease) -> bool:
        return lease.holder is not None and lease.expires_in_d is not None and lease.expires_in_d.total_seconds() > 0

    @admin.display(description="heartbeat age")
    def heartbeat_age(self, lease: LeaderLease) -> str:
        return _seconds(lease.heartbeat_age_d)

    @admin.display(description="expires in")
    def expires_in(self, lease: LeaderLease) -> str:
        return _seconds(lease.expires_in_d)

    @admin.display(description="tick age (last stamp)")
    def tick_age(self, lease: LeaderLease) -> str:
        return _seconds(lease.stamp_age_d)
