"""Template tags of the operators' console: ``{% billing_dashboard as dash %}``, ``{{ seconds|age }}``,
``{{ amount|money:currency }}`` and ``{{ datetime|utc }}`` (the same helpers as every admin page)."""

from django import template

from hardcount.admin import money as format_money
from hardcount.admin import short_time
from ops.dashboard import Dashboard, dashboard, format_age

register = template.Library()


@register.simple_tag
def billing_dashboard() -> Dashboard:
    """The dashboard's figures, read when the admin index renders (see :func:`ops.dashboard.dashboard`)."""
    return dashboard()


@register.filter
def age(seconds: float | None) -> str:
    """A duration in seconds as the dashboard shows it (``5 h 12 min``)."""
    return format_age(seconds)


@register.filter
def money(amount: int | None, currency: str) -> str:
    """Integer minor units of ``currency`` as ``$15.00`` (:func:`hardcount.admin.money`)."""
    return format_money(amount, currency)


@register.filter
def utc(value) -> str:
    """A datetime as ``2026-12-01 14:03 UTC`` (:func:`hardcount.admin.short_time`)."""
    return short_time(value)
