from django.apps import AppConfig


class OutboxConfig(AppConfig):
    name = "outbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the outbox's scrape-time metrics with the kernel's collector (docs/decisions/0121)."""
        from hardcount.metrics import register_metrics

        register_metrics("outbox.metrics.OutboxMetrics")
