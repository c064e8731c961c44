"""Template tags of the operators' console: ``{% billing_dashboard as dash %}`` and ``{{ seconds|age }}``."""

from django import template

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
