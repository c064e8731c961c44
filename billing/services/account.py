"""The calling tenant's business details: what its customers' invoice documents print as the seller."""

from __future__ import annotations

from collections.abc import Mapping

from django.db import transaction

from hardcount.models import Tenant

#: The address fields of ``/v1/account`` (Stripe's address shape) and the tenant columns they set.
ADDRESS_FIELDS = {
    "line1": "address_line1",
    "line2": "address_line2",
    "city": "city",
    "postal_code": "postal_code",
    "state": "state",
    "country": "country",
}


def update_business_details(tenant_id: str, *, business_name: str | None = None, address: Mapping | None = None):
    """Set the tenant's ``business_name`` and the ``address`` fields given (``ADDRESS_FIELDS``' keys); a field left
    out stays, a blank one is cleared. ``country`` must already be an upper-case ISO 3166-1 alpha-2 code. Returns
    the tenant. Documents rendered afterwards print the new details, including those of invoices finalized
    before (docs/decisions/0162)."""
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(pk=tenant_id)
        changed = []
        if business_name is not None:
            tenant.business_name = business_name
            changed.append("business_name")
        for key, column in ADDRESS_FIELDS.items():
            if address is not None and key in address:
                setattr(tenant, column, address[key])
                changed.append(column)
        if changed:
            tenant.save(update_fields=changed)
    return tenant


def account_data(tenant: Tenant) -> dict:
    """The ``account`` object: the tenant's id, name, business name and address (blank fields as null)."""
    return {
        "id": tenant.id,
        "object": "account",
        "name": tenant.name,
        "business_name": tenant.business_name or None,
        "address": {key: getattr(tenant, column) or None for key, column in ADDRESS_FIELDS.items()},
    }
