from django.apps import AppConfig


class OpsConfig(AppConfig):
    """Read-only observers of every app: the doctor (``manage.py doctor``) and the admin index's dashboard."""

    name = "ops"
    default_auto_field = "django.db.models.BigAutoField"
