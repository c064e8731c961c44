"""System-test fixtures: localstripe behind the fault-injecting proxy, and the book builder, from the billing tests."""

from tests.billing.conftest import (  # noqa: F401 - fixtures
    Book,
    localstripe_base,
    make_card,
    proxy_session,
    stripe_client,
    stripe_proxy,
)
