"""Operators' admin for leader leases: who holds each role, with its fencing token (read-only)."""

from django.contrib import admin

from hardcount.admin import ReadOnlyAdmin
from leases.models import LeaderLease


@admin.register(LeaderLease)
class LeaderLeaseAdmin(ReadOnlyAdmin):
    list_display = ("role", "holder", "token", "acquired_at", "heartbeat_at", "expires_at", "last_stamp_at")
