from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        """Register the leader leases as the kernel's lease store (docs/decisions/0121)."""
        from hardcount.scheduler.leadership import register_lease_store
        from leases.leadership import DatabaseLeaseStore

        register_lease_store(DatabaseLeaseStore())
