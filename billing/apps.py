from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        self._register_metrics()

    @staticmethod
    def _register_metrics() -> None:
        """billing's scrape-time metrics join the kernel's collector (docs/decisions/0121)."""
        from hardcount.metrics import register_metrics

        register_metrics("billing.metrics.BillingMetrics")
