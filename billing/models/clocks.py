"""Test clocks: a frozen time that test-mode subscriptions are billed by (Stripe's model)."""

from django.db import models

from hardcount.ids import id_field
from hardcount.models import TenantScoped


class TestClock(TenantScoped):
    """A test-mode clock. Subscriptions attached to it are due by ``frozen_time``, not the wall clock.

    ``status`` is ``ready`` or ``advancing`` (an advance runs in the background);
    ``last_failure`` keeps the reason of the latest close that failed on this clock,
    since failures on a clock are not saved on the subscription
    (docs/reference/billing.md#failures-that-are-not-saved).
    """

    __test__ = False  # not a pytest test class despite its name

    READY = "ready"
    ADVANCING = "advancing"
    STATUS_CHOICES = [(READY, READY), (ADVANCING, ADVANCING)]

    id = id_field("test_clock")
    name = models.CharField(max_length=200, blank=True, default="")
    frozen_time = models.DateTimeField()
    status = models.CharField(max_length=16, choices=STATUS_CHOICES, default=READY)
    advance_target = models.DateTimeField(null=True, blank=True)
    last_failure = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.id
