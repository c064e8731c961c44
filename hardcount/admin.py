"""Operators' admin for tenants, API keys and idempotency records, plus the read-only base every app uses.

Read-mostly for now: objects change through the API and the services (which emit their
events), never by editing rows here. The one write offered is revoking API keys.
"""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Model
from django.utils import timezone

from hardcount.models import ApiKey, IdempotencyRecord, Tenant


class ReadOnlyAdmin(admin.ModelAdmin):
    """View-only admin: no add, change or delete (the view permission still shows every field)."""

    list_per_page = 50
    show_full_result_count = False  # counting big tables on every page is slow

    def has_add_permission(self, request, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request, obj: Model | None = None) -> bool:
        return False


class ReadOnlyInline(admin.TabularInline):
    """View-only inline rows."""

    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request, obj: Model | None = None) -> bool:
        return False


@admin.register(Tenant)
class TenantAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "created_at")
    search_fields = ("id", "name")
    ordering = ("-created_at",)


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    list_display = ("id", "key_hint", "tenant", "livemode", "created_at", "revoked_at")
    list_filter = ("livemode", ("revoked_at", admin.EmptyFieldListFilter))
    search_fields = ("id", "key_hint", "tenant__id", "tenant__name")
    exclude = ("key_hash",)
    actions = ["revoke"]

    @admin.action(description="Revoke selected keys (requests with them get 401 at once)")
    def revoke(self, request, queryset):
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} key(s).")


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    list_display = ("key", "tenant", "livemode", "response_status", "created_at", "completed_at")
    list_filter = ("livemode", "response_status")
    search_fields = ("key", "tenant__id")
