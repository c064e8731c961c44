"""Operators' admin for dunning: read-only settings and runs."""

from django.contrib import admin

from dunning.models import DunningRun, DunningSettings
from hardcount.admin import ReadOnlyAdmin


@admin.register(DunningSettings)
class DunningSettingsAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "livemode", "retry_days", "final_action", "updated_at")
    list_filter = ("livemode", "final_action")


@admin.register(DunningRun)
class DunningRunAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "invoice",
        "status",
        "retries_done",
        "next_attempt_at",
        "waiting_for_payment_method",
        "tenant",
    )
    list_filter = ("livemode", "status", "waiting_for_payment_method")
    search_fields = ("id", "invoice__id")
