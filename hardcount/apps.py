from django.apps import AppConfig


class HardcountConfig(AppConfig):
    name = "hardcount"
    default_auto_field = "django.db.models.BigAutoField"
