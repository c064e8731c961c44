from django.apps import AppConfig


class DevstackConfig(AppConfig):
    """The development stack's management commands: ``serve`` and ``seed_demo``."""

    name = "devstack"
    default_auto_field = "django.db.models.BigAutoField"
