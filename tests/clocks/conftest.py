"""Test-clock fixtures: the billing suite's localstripe and book (helpers in :mod:`tests.clocks.helpers`).

Advances run on background threads with their own connections, so every test here uses the
``book`` fixture (``transactional_db``: committed rows) and waits for the threads before the
database is flushed.
"""

from __future__ import annotations

import pytest

from tests.billing.conftest import (  # noqa: F401  (fixtures re-exported for this directory)
    book,
    localstripe_base,
    make_card,
    no_doctor,
    proxy_session,
    stripe_client,
    stripe_proxy,
    tenant,
)


@pytest.fixture(autouse=True)
def _advances_finish():
    """No advance thread may outlive its test (the next test flushes the tables under it)."""
    from billing.services.clocks import wait_for_advances

    yield
    assert wait_for_advances(timeout_s=600), "a test clock advance was still running after the test"
