from django.apps import AppConfig


class HardcountConfig(AppConfig):
    name = "hardcount"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the partitions' scrape-time metric with the kernel's collector (docs/reference/partitions.md)."""
        from hardcount.metrics import register_metrics

        register_metrics("hardcount.partitions.PartitionMetrics")
